//! Every parameter of a decoder with its Hugging Face name, shape and initialisation.

use crate::hf::{Arch, ModelConfig};

/// How `init-model` fills a parameter (transformers' `_init_weights` for these models).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Init {
    /// Normal(0, std).
    Normal(f64),
    Ones,
    Zeros,
}

#[derive(Debug, Clone, PartialEq)]
pub struct ParamSpec {
    pub name: String,
    pub shape: Vec<usize>,
    pub init: Init,
}

/// All parameters of `cfg`, in a stable order, named as transformers names them.
pub fn param_specs(cfg: &ModelConfig, init_std: f64) -> Vec<ParamSpec> {
    let arch = cfg.arch().unwrap_or(Arch::Llama);
    let (h, i, v) = (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size);
    let (hq, hkv, d) = (cfg.num_attention_heads, cfg.kv_heads(), cfg.head_dim());
    let mut out = Vec::new();
    let mut p =
        |name: String, shape: Vec<usize>, init: Init| out.push(ParamSpec { name, shape, init });
    let w = Init::Normal(init_std);
    p("model.embed_tokens.weight".into(), vec![v, h], w);
    let qkv_bias = arch == Arch::Qwen2 || (arch == Arch::Llama && cfg.attention_bias);
    let o_bias = arch == Arch::Llama && cfg.attention_bias;
    for l in 0..cfg.num_hidden_layers {
        let pre = format!("model.layers.{l}");
        p(format!("{pre}.input_layernorm.weight"), vec![h], Init::Ones);
        for (name, rows) in [("q_proj", hq * d), ("k_proj", hkv * d), ("v_proj", hkv * d)] {
            p(format!("{pre}.self_attn.{name}.weight"), vec![rows, h], w);
            if qkv_bias {
                p(
                    format!("{pre}.self_attn.{name}.bias"),
                    vec![rows],
                    Init::Zeros,
                );
            }
        }
        p(format!("{pre}.self_attn.o_proj.weight"), vec![h, hq * d], w);
        if o_bias {
            p(format!("{pre}.self_attn.o_proj.bias"), vec![h], Init::Zeros);
        }
        if arch == Arch::Qwen3 {
            p(
                format!("{pre}.self_attn.q_norm.weight"),
                vec![d],
                Init::Ones,
            );
            p(
                format!("{pre}.self_attn.k_norm.weight"),
                vec![d],
                Init::Ones,
            );
        }
        p(
            format!("{pre}.post_attention_layernorm.weight"),
            vec![h],
            Init::Ones,
        );
        p(format!("{pre}.mlp.gate_proj.weight"), vec![i, h], w);
        p(format!("{pre}.mlp.up_proj.weight"), vec![i, h], w);
        p(format!("{pre}.mlp.down_proj.weight"), vec![h, i], w);
    }
    p("model.norm.weight".into(), vec![h], Init::Ones);
    if !cfg.tie_word_embeddings {
        p("lm_head.weight".into(), vec![v, h], w);
    }
    out
}
