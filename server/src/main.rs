//! `teacher`: serve a model's per-position top-k log-probs (see docs/protocol.md).

use anyhow::Result;
use clap::Parser;
use xdistill_server::{launch, Args};

// The allocator of every xdistill binary: jemalloc with transparent huge pages.
xdistill_shared::global_allocator!();

fn main() -> std::process::ExitCode {
    xdistill_shared::report::exit_report(run())
}

fn run() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    // `$XDISTILL_SIMD` caps the SIMD level of the hot loops: refuse a bad value up front.
    let simd = xdistill_cpu_kernels::simd::Simd::from_env()?;
    tracing::debug!(simd = simd.name(), "host SIMD level");
    if args.check_args {
        launch::check_args(&args)?;
        println!("arguments ok");
        return Ok(());
    }
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(launch::run(args))
}
