//! A running `teacher` on loopback for tests: started on port 0, waited for until `/health`
//! answers, stopped when dropped ([`TeacherProcess`], shared with the demo), plus std-only HTTP
//! probes and free ports.

use std::path::Path;

pub use xdistill_shared::process::{http_status, TeacherProcess};

/// Starts this build's `teacher` ([`crate::teacher_binary`]) on `model` (port 0, `extra` flags)
/// and waits until it is healthy; it is stopped when dropped.
pub fn start_teacher(model: &Path, extra: &[&str]) -> TeacherProcess {
    let bin = crate::teacher_binary();
    TeacherProcess::start(&bin, model, extra)
        .unwrap_or_else(|e| panic!("starting the teacher {}: {e}", bin.display()))
}

/// The response (status line, headers and body) of `GET url` on an `http://` URL (std only).
pub fn get_body(url: &str) -> String {
    use std::io::{Read, Write};
    let rest = url.trim_start_matches("http://");
    let (host, path) = rest.split_once('/').unwrap_or((rest, ""));
    let mut s = std::net::TcpStream::connect(host).expect("connecting");
    write!(
        s,
        "GET /{path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
    )
    .expect("writing");
    let mut buf = String::new();
    s.read_to_string(&mut buf).expect("reading");
    buf
}

/// A loopback port that was free a moment ago (bound to port 0, then released).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}
