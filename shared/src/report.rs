//! Errors as people read them: one line, each cause once. Both binaries end a failed run with
//! [`exit_report`]; the trainer's HTTP client names a transport failure with [`error_chain`].

use std::backtrace::BacktraceStatus;
use std::process::ExitCode;

/// `e` and its causes on one line, `outer: cause: root`, leaving out a cause whose text the
/// line already holds: an error that writes its source into its own message (`"{path}:
/// {source}"`) would otherwise say it twice, and reqwest's terse "error sending request" gets
/// the reason after it.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut line = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        let text = c.to_string();
        if !line.contains(&text) {
            line.push_str(": ");
            line.push_str(&text);
        }
        cause = c.source();
    }
    line
}

/// What a binary's `main` returns for its run's `result`: success, or the error on stderr as
/// one line `Error: …` ([`error_chain`]; with `RUST_BACKTRACE=1` or `RUST_LIB_BACKTRACE=1` the
/// backtrace after it) and exit status 1.
pub fn exit_report(result: anyhow::Result<()>) -> ExitCode {
    let Err(e) = result else {
        return ExitCode::SUCCESS;
    };
    eprintln!("Error: {}", error_chain(e.as_ref()));
    if e.backtrace().status() == BacktraceStatus::Captured {
        eprintln!("\nStack backtrace:\n{}", e.backtrace());
    }
    ExitCode::FAILURE
}

#[cfg(test)]
mod tests {
    use super::*;
    use anyhow::Context;

    #[derive(Debug, thiserror::Error)]
    #[error("{path}: {source}")]
    struct Io {
        path: String,
        source: std::io::Error,
    }

    /// A source the message already holds is said once; other causes follow in order; an
    /// error without causes is its message.
    #[test]
    fn each_cause_is_said_once() {
        let missing = || std::io::Error::new(std::io::ErrorKind::NotFound, "no such file");
        let e = anyhow::Error::new(Io {
            path: "/x.toml".into(),
            source: missing(),
        });
        assert_eq!(error_chain(e.as_ref()), "/x.toml: no such file");
        let e = Err::<(), _>(missing())
            .context("reading the config")
            .context("starting the run")
            .unwrap_err();
        assert_eq!(
            error_chain(e.as_ref()),
            "starting the run: reading the config: no such file"
        );
        assert_eq!(error_chain(&missing()), "no such file");
    }
}
