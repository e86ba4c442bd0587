//! `trainer init-model` arguments of the trainer tests' tiny decoders
//! ([`xdistill_testkit::tiny_spec`]); the byte tokenizer and the decoders themselves are in
//! `xdistill_testkit`.
#![allow(dead_code)]

use std::path::Path;
use xdistill_trainer::init_model::Args;

/// [`xdistill_testkit::tiny_spec`] as `init-model` flags (`out` left empty).
pub fn model_args(arch: &str, tokenizer: &Path, tie: bool) -> Args {
    let s = xdistill_testkit::tiny_spec(arch, tokenizer, tie);
    Args {
        arch: s.arch,
        tokenizer: s.tokenizer,
        hidden_size: s.hidden_size,
        layers: s.layers,
        heads: s.heads,
        kv_heads: s.kv_heads,
        intermediate_size: s.intermediate_size,
        head_dim: s.head_dim,
        pad_vocab_to: s.pad_vocab_to,
        max_position_embeddings: s.max_position_embeddings,
        tie_embeddings: s.tie_embeddings,
        init_std: s.init_std,
        seed: s.seed,
        out: s.out,
        features: Default::default(),
    }
}
