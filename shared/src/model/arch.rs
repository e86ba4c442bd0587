//! The decoder families we implement, in one table: each architecture's file holds its
//! [`ArchFacts`] (the types: `facts.rs`), and [`Arch::facts`] is the only place that maps an
//! [`Arch`] to them. `config`, `init`, `hf`, `gguf`, the decoder and the trainer's student ask
//! the facts; none of them matches on `Arch`. The architectures' files import the facts' types
//! and build a layer from its resolved `spec::LayerSpec`, never this table or the configuration
//! (no import cycle: `testkit/src/structure.rs`).
//!
//! Adding an architecture touches exactly these files:
//! 1. its own file, `shared/src/model/<name>.rs`: a `pub(crate) const FACTS: ArchFacts`
//!    (starting from `llama::BASE`) and, when its layer differs from the ones already written,
//!    the `block` function the facts name (`fn(&LayerSpec, &VarBuilder) -> Result<Block>`; a
//!    Llama-shaped family instead adds a const to `llama.rs`);
//! 2. `shared/src/model/mod.rs`: `mod <name>;` (not for a const in an existing file);
//! 3. this file: one line in the `registry!` call below;
//! 4. tests: a transformers parity case in `trainer/tests/fixtures/hf/make_fixtures.py` (rerun
//!    it to refresh `fixtures.json`), a tiny model of it in `shared/tests/model.rs` and, when it
//!    may be a student, in `trainer/tests/student.rs`;
//! 5. docs: its row in `docs/models.md`'s table.
//!
//! `init-model --arch`, `teacher --help`, the refusals of unknown `model_type`s and GGUF
//! architectures, and the student's list of dense architectures all read this table.

use super::error::ModelConfigError;
use super::{gemma3, llama, phi3, qwen3_moe};
use serde::{Deserialize, Serialize};

pub use super::facts::{
    ActivationDefault, ArchFacts, AttentionBias, AttentionFacts, GgufFacts, InitDefaults,
    RopeFacts, SlidingLayers, WindowFacts, WindowSwitch,
};

/// Declares [`Arch`], [`Arch::ALL`] and [`Arch::facts`] from one line per architecture.
macro_rules! registry {
    ($($(#[$doc:meta])* $variant:ident => $facts:path,)*) => {
        /// The decoder families we implement (the facts of each: [`Arch::facts`]).
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
        #[serde(rename_all = "lowercase")]
        pub enum Arch {
            $($(#[$doc])* $variant,)*
        }

        impl Arch {
            /// Every architecture, in the order help and messages list them.
            pub const ALL: [Arch; [$(stringify!($variant)),*].len()] = [$(Arch::$variant),*];

            /// The facts of this architecture.
            pub fn facts(self) -> &'static ArchFacts {
                match self {
                    $(Arch::$variant => &$facts,)*
                }
            }
        }
    };
}

registry! {
    Llama => llama::LLAMA,
    Mistral => llama::MISTRAL,
    Ministral => llama::MINISTRAL,
    Qwen2 => llama::QWEN2,
    Qwen3 => llama::QWEN3,
    Qwen3Moe => qwen3_moe::FACTS,
    Gemma3 => gemma3::FACTS,
    Phi3 => phi3::FACTS,
}

impl Arch {
    /// From `config.json`'s `model_type` (or the `init-model --arch` name).
    pub fn parse(s: &str) -> Result<Arch, ModelConfigError> {
        Arch::ALL
            .into_iter()
            .find(|a| {
                let f = a.facts();
                f.model_types.contains(&s) || f.cli_name == s
            })
            .ok_or_else(|| {
                let supported = list_names(|f| Some(f.model_types[0].into()));
                ModelConfigError::UnsupportedArch(s.to_string(), supported)
            })
    }
    /// The architecture a GGUF `general.architecture` maps onto.
    pub fn from_gguf(name: &str) -> Option<Arch> {
        Arch::ALL
            .into_iter()
            .find(|a| a.facts().gguf.is_some_and(|g| g.name == name))
    }
    /// The architecture whose multimodal checkpoints have the top-level `model_type` `wrapper`.
    pub fn from_multimodal(wrapper: &str) -> Option<Arch> {
        Arch::ALL
            .into_iter()
            .find(|a| a.facts().multimodal_model_type == Some(wrapper))
    }
    /// The `model_type` transformers writes.
    pub fn model_type(self) -> &'static str {
        self.facts().model_types[0]
    }
    /// The name `init-model --arch` takes.
    pub fn cli_name(self) -> &'static str {
        self.facts().cli_name
    }
    /// The `architectures[0]` transformers expects.
    pub fn hf_class(self) -> &'static str {
        self.facts().hf_class
    }
}

/// What `name` says of each architecture it names, joined by `", "` in [`Arch::ALL`]'s order:
/// the lists in help and messages.
pub fn list_names(name: impl Fn(&ArchFacts) -> Option<String>) -> String {
    Arch::ALL
        .iter()
        .filter_map(|a| name(a.facts()))
        .collect::<Vec<_>>()
        .join(", ")
}
