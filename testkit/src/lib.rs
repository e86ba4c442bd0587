//! The one test kit of the xdistill workspace: what the server's, the trainer's and the
//! cross-process tests share.
//!
//! - [`binaries`]: the `teacher` and `trainer` binaries of this build.
//! - [`process`]: a running `teacher` on loopback (started, waited for, stopped), std-only HTTP
//!   probes and free ports.
//! - [`http`]: an async client for a running teacher's `/topk_logits` and `/v1/info`.
//! - [`assets`]: the real tokenizers and data of the checkout (panicking with the fix when
//!   absent), and a byte-level tokenizer made on the fly.
//! - [`models`]: tiny random models, as model directories or as in-memory decoders.
//! - [`reference`](mod@reference): the f64 reference a teacher's answers are checked against.
//! - [`structure`]: checks of the source tree's shape (import cycles, the paths docs name).
//!
//! Production code never depends on this crate; what production needs (`TeacherProcess`, the
//! tokenizer search) stays in `xdistill_shared` and is re-exported here.

pub mod assets;
pub mod binaries;
pub mod compose;
pub mod http;
pub mod models;
pub mod process;
pub mod reference;
pub mod structure;

pub use assets::{
    byte_tokenizer_json, data_file, load_tokenizer, repo_root, tokenizer_json, BYTE_EOS,
};
pub use binaries::{teacher_binary, trainer_binary};
pub use compose::compose_defaults;
pub use models::{tiny_decoder, tiny_spec, tiny_teacher_model};
pub use process::{free_port, get_body, http_status, start_teacher, TeacherProcess};
