"""An independent float64 numpy forward pass of a small Llama/Qwen2/Qwen3 model directory.

Written from the transformers model definitions (and checked against the details of
``shared/src/model/decoder.rs`` and ``shared/src/hf.rs``), sharing no code with the server:

- embedding ``model.embed_tokens``;
- per layer: RMSNorm (``x / sqrt(mean(x^2) + eps) * w``), q/k/v projections (biases when
  present), Qwen3's per-head RMSNorm of q and k over ``head_dim`` (before RoPE), RoPE in the
  rotate-half form with ``inv_freq_i = rope_theta^(-2i/head_dim)``, causal grouped-query
  attention (kv head ``h // (n_heads / n_kv)`` for query head ``h``) scaled by
  ``1/sqrt(head_dim)``, ``o_proj``, residual; RMSNorm, SwiGLU MLP
  ``down(silu(gate(x)) * up(x))``, residual;
- final RMSNorm, ``lm_head`` (or the tied embedding);
- only the first ``n_valid`` logits are kept: the tokenizer's vocabulary including added tokens
  (the LM head may have padding rows beyond it, which the server never reports).

Everything runs in float64 from the checkpoint's float32 weights, so the server's float32
computation should agree to about 1e-6 in log-prob.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Dict, Sequence

import numpy as np
from safetensors.numpy import load_file
from tokenizers import Tokenizer


def _rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm over the last axis."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def _log_softmax(z: np.ndarray) -> np.ndarray:
    """log_softmax over the last axis."""
    m = z.max(axis=-1, keepdims=True)
    return z - (m + np.log(np.exp(z - m).sum(axis=-1, keepdims=True)))


class Reference:
    """The f64 forward of the model in ``model_dir`` (``config.json``, ``model.safetensors``,
    ``tokenizer.json``)."""

    def __init__(self, model_dir: Path):
        model_dir = Path(model_dir)
        self.cfg = json.loads((model_dir / "config.json").read_text())
        raw = load_file(str(model_dir / "model.safetensors"))
        self.w: Dict[str, np.ndarray] = {k: v.astype(np.float64) for k, v in raw.items()}
        tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        #: Valid token ids are < n_valid (the tokenizer's vocabulary with added tokens).
        self.n_valid = tok.get_vocab_size(with_added_tokens=True)
        c = self.cfg
        self.model_type = c["model_type"]
        self.hidden = c["hidden_size"]
        self.n_heads = c["num_attention_heads"]
        self.n_kv = c.get("num_key_value_heads") or self.n_heads
        self.head_dim = c.get("head_dim") or self.hidden // self.n_heads
        self.eps = c.get("rms_norm_eps", 1e-6)
        self.theta = c.get("rope_theta", 10000.0)
        assert not c.get("rope_scaling"), "rope_scaling is not implemented in the reference"
        assert c.get("hidden_act", "silu") == "silu"
        self.lm_head = self.w["model.embed_tokens.weight"] if c.get("tie_word_embeddings") \
            else self.w["lm_head.weight"]
        assert self.lm_head.shape[0] == c["vocab_size"] >= self.n_valid

    def _linear(self, x: np.ndarray, name: str) -> np.ndarray:
        y = x @ self.w[f"{name}.weight"].T
        bias = self.w.get(f"{name}.bias")
        return y if bias is None else y + bias

    def _rope(self, x: np.ndarray) -> np.ndarray:
        """RoPE, rotate-half form. ``x``: [heads, S, D]."""
        s, d = x.shape[1], x.shape[2]
        inv = 1.0 / self.theta ** (np.arange(0, d // 2, dtype=np.float64) * 2.0 / d)
        ang = np.arange(s, dtype=np.float64)[:, None] * inv[None, :]  # [S, D/2]
        cos = np.concatenate([np.cos(ang)] * 2, axis=-1)
        sin = np.concatenate([np.sin(ang)] * 2, axis=-1)
        x1, x2 = x[..., : d // 2], x[..., d // 2:]
        return x * cos + np.concatenate([-x2, x1], axis=-1) * sin

    def _attention(self, x: np.ndarray, pre: str) -> np.ndarray:
        """Causal GQA self-attention of one layer. ``x``: [S, H] → [S, H]."""
        s = x.shape[0]
        d, hq, hkv = self.head_dim, self.n_heads, self.n_kv
        # 1. Project and split heads: [S, heads, D].
        q = self._linear(x, f"{pre}.q_proj").reshape(s, hq, d)
        k = self._linear(x, f"{pre}.k_proj").reshape(s, hkv, d)
        v = self._linear(x, f"{pre}.v_proj").reshape(s, hkv, d)
        if self.model_type == "qwen3":
            q = _rms_norm(q, self.w[f"{pre}.q_norm.weight"], self.eps)
            k = _rms_norm(k, self.w[f"{pre}.k_norm.weight"], self.eps)
        # 2. Heads first, RoPE: [heads, S, D].
        q = self._rope(q.transpose(1, 0, 2))
        k = self._rope(k.transpose(1, 0, 2))
        v = v.transpose(1, 0, 2)
        # 3. Each query head h reads kv head h // rep.
        rep = hq // hkv
        k = np.repeat(k, rep, axis=0)
        v = np.repeat(v, rep, axis=0)
        # 4. Scores [heads, S, S], causal mask, softmax, weighted sum.
        att = q @ k.transpose(0, 2, 1) / np.sqrt(d)
        att = np.where(np.tril(np.ones((s, s), dtype=bool)), att, -np.inf)
        att = np.exp(att - att.max(axis=-1, keepdims=True))
        att /= att.sum(axis=-1, keepdims=True)
        out = (att @ v).transpose(1, 0, 2).reshape(s, hq * d)
        return self._linear(out, f"{pre}.o_proj")

    @lru_cache(maxsize=64)
    def _logits(self, ids: tuple) -> np.ndarray:
        assert all(0 <= i < self.n_valid for i in ids), "token id out of the vocabulary"
        x = self.w["model.embed_tokens.weight"][list(ids)]  # [S, H]
        for layer in range(self.cfg["num_hidden_layers"]):
            pre = f"model.layers.{layer}"
            h = _rms_norm(x, self.w[f"{pre}.input_layernorm.weight"], self.eps)
            x = x + self._attention(h, f"{pre}.self_attn")
            h = _rms_norm(x, self.w[f"{pre}.post_attention_layernorm.weight"], self.eps)
            mlp = f"{pre}.mlp"
            x = x + self._linear(
                _silu(self._linear(h, f"{mlp}.gate_proj")) * self._linear(h, f"{mlp}.up_proj"),
                f"{mlp}.down_proj",
            )
        x = _rms_norm(x, self.w["model.norm.weight"], self.eps)
        logits = x @ self.lm_head.T  # [S, vocab_size (padded)]
        logits = logits[:, : self.n_valid]
        logits.setflags(write=False)
        return logits

    def logits(self, ids: Sequence[int]) -> np.ndarray:
        """Raw logits ``[S, n_valid]`` (row p predicts token p + 1), float64, read-only."""
        return self._logits(tuple(int(i) for i in ids))

    def logprobs(self, ids: Sequence[int], temperature: float = 1.0) -> np.ndarray:
        """``log_softmax(logits / temperature)`` rows ``[S, n_valid]``, float64; row p is the
        distribution over token p + 1 (the last row predicts the token after the sequence)."""
        return _log_softmax(self.logits(ids) / temperature)

    def logsumexp(self, ids: Sequence[int], temperature: float = 1.0) -> np.ndarray:
        """``log sum_v exp(z_v / temperature)`` per row, ``[S]``."""
        z = self.logits(ids) / temperature
        m = z.max(axis=-1)
        return m + np.log(np.exp(z - m[:, None]).sum(axis=-1))

    def targets(self, ids: Sequence[int], temperature: float = 1.0) -> np.ndarray:
        """``[S - 1]`` log-probs of the actual next tokens: ``lp[p, ids[p + 1]]``."""
        lp = self.logprobs(ids, temperature)
        return lp[np.arange(len(ids) - 1), np.asarray(ids[1:])]
