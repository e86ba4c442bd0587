//! llama.cpp's tensor names → transformers' names, and the undoing of the q/k row permutation
//! llama.cpp's converter applies to Llama-architecture models.

use candle_core::{Result, Tensor};

/// The transformers name of GGUF tensor `name` (`blk.3.attn_q.weight` →
/// `model.layers.3.self_attn.q_proj.weight`), or `None` for a name no implemented decoder has.
pub fn hf_name(name: &str) -> Option<String> {
    match name {
        "token_embd.weight" => return Some("model.embed_tokens.weight".into()),
        "output_norm.weight" => return Some("model.norm.weight".into()),
        "output.weight" => return Some("lm_head.weight".into()),
        _ => {}
    }
    let rest = name.strip_prefix("blk.")?;
    let (layer, rest) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (part, kind) = rest.rsplit_once('.')?;
    if kind != "weight" && kind != "bias" {
        return None;
    }
    let hf = match part {
        "attn_norm" => "input_layernorm",
        "ffn_norm" => "post_attention_layernorm",
        "attn_q" => "self_attn.q_proj",
        "attn_k" => "self_attn.k_proj",
        "attn_v" => "self_attn.v_proj",
        "attn_output" => "self_attn.o_proj",
        "attn_q_norm" => "self_attn.q_norm",
        "attn_k_norm" => "self_attn.k_norm",
        "ffn_gate" => "mlp.gate_proj",
        "ffn_up" => "mlp.up_proj",
        "ffn_down" => "mlp.down_proj",
        _ => return None,
    };
    Some(format!("model.layers.{layer}.{hf}.{kind}"))
}

/// Which RoPE permutation a tensor carries: llama.cpp reorders the rows of Llama's q and k
/// projections (weights and biases) per head from transformers' half-split layout to
/// interleaved pairs. `Some(heads)` for such a tensor of a `llama` file: q uses the attention
/// heads, k the key/value heads.
pub fn permuted_heads(gguf_arch: &str, name: &str, heads: usize, kv_heads: usize) -> Option<usize> {
    if gguf_arch != "llama" {
        return None;
    }
    if name.contains(".attn_q.") {
        Some(heads)
    } else if name.contains(".attn_k.") {
        Some(kv_heads)
    } else {
        None
    }
}

/// Undoes llama.cpp's `permute(w, n_head)` as transformers' `_reverse_permute_weights` does:
/// rows viewed as `[n_head, dim, 2, rest]`, the middle two axes swapped back to
/// `[n_head, 2, dim, rest]`, flattened to the original shape.
pub fn reverse_permute(w: &Tensor, n_head: usize) -> Result<Tensor> {
    let dims = w.dims().to_vec();
    let rows = dims.first().copied().unwrap_or(0);
    let rest: usize = dims.iter().skip(1).product();
    if n_head == 0 || rows % (2 * n_head) != 0 {
        candle_core::bail!(
            "{rows} rows cannot be split into {n_head} heads of rotary pairs (the q/k permutation)"
        );
    }
    let dim = rows / n_head / 2;
    w.reshape((n_head, dim, 2, rest))?
        .transpose(1, 2)?
        .contiguous()?
        .reshape(dims)
}

/// [`reverse_permute`] as a row order: row `r` of the result is row `order[r]` of the stored
/// tensor. Quantized weights are undone with it block row by block row (a row permutation moves
/// whole rows of blocks, so the stored blocks stay exact).
pub fn reverse_permute_rows(rows: usize, n_head: usize) -> Result<Vec<usize>> {
    if n_head == 0 || !rows.is_multiple_of(2 * n_head) {
        candle_core::bail!(
            "{rows} rows cannot be split into {n_head} heads of rotary pairs (the q/k permutation)"
        );
    }
    let dim = rows / n_head / 2;
    // Result row (h, j, d) of [n_head, 2, dim] is stored row (h, d, j) of [n_head, dim, 2].
    Ok((0..rows)
        .map(|r| {
            let (h, j, d) = (r / (2 * dim), (r / dim) % 2, r % dim);
            h * 2 * dim + d * 2 + j
        })
        .collect())
}

/// llama.cpp's converter permutation (`LlamaModel.permute`), the inverse of
/// [`reverse_permute`]: tests write GGUF files with it as llama.cpp would.
pub fn permute(w: &Tensor, n_head: usize) -> Result<Tensor> {
    let dims = w.dims().to_vec();
    let rows = dims.first().copied().unwrap_or(0);
    let rest: usize = dims.iter().skip(1).product();
    if n_head == 0 || rows % (2 * n_head) != 0 {
        candle_core::bail!("{rows} rows cannot be split into {n_head} heads of rotary pairs");
    }
    let dim = rows / n_head / 2;
    w.reshape((n_head, 2, dim, rest))?
        .transpose(1, 2)?
        .contiguous()?
        .reshape(dims)
}

/// The GGUF name of transformers parameter `name`, the inverse of [`hf_name`] (tests and
/// converters write files with it).
pub fn gguf_name(name: &str) -> Option<String> {
    match name {
        "model.embed_tokens.weight" => return Some("token_embd.weight".into()),
        "model.norm.weight" => return Some("output_norm.weight".into()),
        "lm_head.weight" => return Some("output.weight".into()),
        _ => {}
    }
    let rest = name.strip_prefix("model.layers.")?;
    let (layer, rest) = rest.split_once('.')?;
    let (part, kind) = rest.rsplit_once('.')?;
    let g = match part {
        "input_layernorm" => "attn_norm",
        "post_attention_layernorm" => "ffn_norm",
        "self_attn.q_proj" => "attn_q",
        "self_attn.k_proj" => "attn_k",
        "self_attn.v_proj" => "attn_v",
        "self_attn.o_proj" => "attn_output",
        "self_attn.q_norm" => "attn_q_norm",
        "self_attn.k_norm" => "attn_k_norm",
        "mlp.gate_proj" => "ffn_gate",
        "mlp.up_proj" => "ffn_up",
        "mlp.down_proj" => "ffn_down",
        _ => return None,
    };
    Some(format!("blk.{layer}.{g}.{kind}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for n in [
            "token_embd.weight",
            "output.weight",
            "output_norm.weight",
            "blk.12.attn_q.bias",
            "blk.0.ffn_down.weight",
            "blk.3.attn_k_norm.weight",
        ] {
            let hf = hf_name(n).unwrap();
            assert_eq!(gguf_name(&hf).as_deref(), Some(n));
        }
        assert_eq!(hf_name("rope_freqs.weight"), None);
        assert_eq!(hf_name("blk.x.attn_q.weight"), None);
    }

    #[test]
    fn reverse_permute_rows_is_reverse_permute() {
        let dev = candle_core::Device::Cpu;
        for (rows, heads) in [(16usize, 2usize), (16, 4), (24, 3), (8, 1)] {
            let w = Tensor::arange(0f32, (rows * 3) as f32, &dev)
                .unwrap()
                .reshape((rows, 3))
                .unwrap();
            let want = reverse_permute(&w, heads)
                .unwrap()
                .to_vec2::<f32>()
                .unwrap();
            let stored = w.to_vec2::<f32>().unwrap();
            let order = reverse_permute_rows(rows, heads).unwrap();
            let got: Vec<Vec<f32>> = order.iter().map(|&r| stored[r].clone()).collect();
            assert_eq!(got, want, "{rows} rows, {heads} heads");
        }
        assert!(reverse_permute_rows(10, 3).is_err());
        assert!(reverse_permute_rows(8, 0).is_err());
    }

    #[test]
    fn reverse_permute_inverts_permute() {
        let dev = candle_core::Device::Cpu;
        let w = Tensor::arange(0f32, 96.0, &dev)
            .unwrap()
            .reshape((16, 6))
            .unwrap();
        let p = permute(&w, 2).unwrap();
        assert_ne!(p.to_vec2::<f32>().unwrap(), w.to_vec2::<f32>().unwrap());
        let back = reverse_permute(&p, 2).unwrap();
        assert_eq!(back.to_vec2::<f32>().unwrap(), w.to_vec2::<f32>().unwrap());
        // A bias: one dimension.
        let b = Tensor::arange(0f32, 16.0, &dev).unwrap();
        let pb = permute(&b, 4).unwrap();
        assert_eq!(
            pb.to_vec1::<f32>().unwrap()[..4],
            [0.0, 2.0, 1.0, 3.0],
            "pairs interleaved: row i of a head goes to 2i, row i+dim to 2i+1"
        );
        assert_eq!(
            reverse_permute(&pb, 4).unwrap().to_vec1::<f32>().unwrap(),
            b.to_vec1::<f32>().unwrap()
        );
    }
}
