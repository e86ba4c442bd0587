//! Command line of `teacher` (every flag also reads an `XDISTILL_*` environment variable).

use crate::scoring::{LmHead, TopkPath};
use clap::Parser;
use std::net::IpAddr;
use std::path::PathBuf;
use xdistill_shared::model::arch::list_names;

/// How a GGUF file's weights are held (`--gguf-weights`); see
/// [`xdistill_shared::gguf::WeightMode`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum GgufWeights {
    /// Every weight dequantized at load to the serving dtype.
    #[default]
    Dequantize,
    /// The projections kept quantized, scored with quantized matmuls.
    Quantized,
}

impl From<GgufWeights> for xdistill_shared::gguf::WeightMode {
    fn from(w: GgufWeights) -> Self {
        match w {
            GgufWeights::Dequantize => xdistill_shared::gguf::WeightMode::Dequantize,
            GgufWeights::Quantized => xdistill_shared::gguf::WeightMode::Quantized,
        }
    }
}

/// `teacher --help`'s description, naming every architecture served (as their facts name them).
fn long_about() -> String {
    let hf = list_names(|f| Some(format!("{} ({})", f.name, f.model_types.join(", "))));
    let gguf = list_names(|f| f.gguf.map(|g| g.name.to_string()));
    format!(
        "xdistill teacher server: batched, cached per-position top-k log-probs over HTTP (its \
         own /topk_logits, and vLLM's and SGLang's scoring routes).\n\n\
         Serves a Hugging Face model directory of these architectures (config.json's \
         model_type): {hf}; or a GGUF file ({gguf}; weights dequantized at load, tokenizer \
         rebuilt from its metadata: docs/gguf.md)."
    )
}

/// `--packed-forward`: how the batch-invariant mode runs a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Packing {
    /// On a GPU, off on the CPU.
    Auto,
    On,
    Off,
}

#[derive(Parser, Debug, Clone)]
#[command(
    name = "teacher",
    version,
    about = "xdistill teacher server: batched, cached per-position top-k log-probs over HTTP",
    long_about = long_about()
)]
pub struct Args {
    /// Hugging Face model directory (config.json, model.safetensors or sharded + index,
    /// tokenizer.json), or a GGUF file (FILE.gguf).
    #[arg(long, env = "XDISTILL_MODEL")]
    pub model: PathBuf,
    /// Address to bind. Loopback by default; use 0.0.0.0 only behind a firewall or with --api-key.
    #[arg(long, env = "XDISTILL_HOST", default_value = "127.0.0.1")]
    pub host: IpAddr,
    /// Port to bind (0 picks a free one; the bound address is printed as `listening on ADDR`).
    #[arg(long, env = "XDISTILL_PORT", default_value_t = 8000)]
    pub port: u16,
    /// auto (the default: the first GPU where this binary has CUDA and the machine a GPU, else
    /// the CPU), cpu, cuda or cuda:N. `auto` is resolved here, once: the field holds the device
    /// chosen.
    #[arg(long, env = "XDISTILL_DEVICE", default_value = "auto",
          value_parser = |s: &str| Ok::<_, std::convert::Infallible>(xdistill_shared::device::resolve_device(s)))]
    pub device: String,
    /// Compute dtype of the weights: auto (bf16 on a GPU, f32 on the CPU), f32, bf16 or f16
    /// (top-k is always computed in f32/f64).
    #[arg(long, env = "XDISTILL_DTYPE", default_value = "auto")]
    pub dtype: String,
    /// Where top-k runs: auto (on the GPU when the model is on one, else on the host), device or
    /// host.
    #[arg(long, env = "XDISTILL_TOPK", value_enum, default_value_t = TopkPath::Auto)]
    pub topk: TopkPath,
    /// On the host path: fused (the LM head a vocabulary tile at a time, each tile scored while
    /// in cache; the `[N, V]` logits never exist) or full (the logits of a chunk of positions,
    /// then scored). The same scores to f32 rounding; bit for bit where candle makes the fused
    /// tiles (CPUs without AVX2, `XDISTILL_SIMD=baseline`, a head that is not f32), while the
    /// head kernel (AVX-512 or AVX2) sums each dot product in its own fixed order. Fused is
    /// faster and smaller.
    #[arg(long, env = "XDISTILL_LM_HEAD", value_enum, default_value_t = LmHead::Fused)]
    pub lm_head: LmHead,
    /// A GGUF file's weights: dequantize (every weight dequantized at load to --dtype: the
    /// scores of the dequantized weights, as transformers gives them) or quantized (the
    /// attention and MLP projections kept in their block format and run through candle's
    /// quantized matmuls, activations quantized per block as llama.cpp does: the quantized
    /// model's own scores; the embedding, LM head and norms stay dequantized). docs/models.md.
    #[arg(long, env = "XDISTILL_GGUF_WEIGHTS", value_enum, default_value_t = GgufWeights::Dequantize)]
    pub gguf_weights: GgufWeights,
    /// Most padded tokens (batch size × longest input) per forward pass.
    #[arg(long, env = "XDISTILL_MAX_BATCH_TOKENS", default_value_t = 8192)]
    pub max_batch_tokens: usize,
    /// Run each sequence of a batch through its own forward (no padding, no neighbours), so
    /// its scores are bit-identical whatever it is batched with (`false`: one padded forward
    /// per batch; scores then vary with the batch at ~1e-6). Its cost on the CPU: none measurable
    /// on the bench model, 4–14% on deeper ones (bench/teacher.md).
    #[arg(long, env = "XDISTILL_BATCH_INVARIANT", default_value_t = true,
          action = clap::ArgAction::Set, value_name = "BOOL")]
    pub batch_invariant: bool,
    /// In the batch-invariant mode, how a batch's sequences run: `on`, in one packed forward
    /// whose every matmul multiplies blocks of exactly `--packed-rows` rows (the same kernels
    /// whatever the batch, so each sequence's scores stay bit-identical whatever it is batched
    /// with; attention per sequence); `off`, a forward per sequence. `auto` (default): on for a
    /// GPU, where a forward per sequence leaves it idle; off on the CPU, whose row kernel makes
    /// a forward per sequence as fast. Sparse-MoE and quantized models, sequences longer than
    /// `--max-batch-tokens`, sequences of at least `--packed-rows` inputs (they fill a block by
    /// themselves and run faster alone) and requests for a next row always run on their own.
    #[arg(long, env = "XDISTILL_PACKED_FORWARD", value_enum, default_value_t = Packing::Auto)]
    pub packed_forward: Packing,
    /// Rows per matmul of the packed forward (a batch's tokens are padded to a multiple of it):
    /// larger makes faster matmuls, smaller wastes less on short batches.
    #[arg(long, env = "XDISTILL_PACKED_ROWS", default_value_t = xdistill_shared::model::PACKED_ROWS,
          value_parser = clap::value_parser!(usize))]
    pub packed_rows: usize,
    /// How long the batcher waits for more work before running a batch that is not full.
    /// Default: 0 with `--batch-invariant true` and a forward per sequence (company saves
    /// nothing and waiting is only latency), 5 otherwise (a batch shares one forward).
    /// Either way, work that arrives while the worker is busy joins the next batch.
    #[arg(long, env = "XDISTILL_MAX_WAIT_MS")]
    pub max_wait_ms: Option<u64>,
    /// Most tokens admitted (queued or running) at once; beyond it requests get 503 + Retry-After.
    #[arg(long, env = "XDISTILL_MAX_QUEUE_TOKENS", default_value_t = 262_144)]
    pub max_queue_tokens: usize,
    /// Most sequences in one request (each also costs at least one token of the queue budget,
    /// even with no rows to score).
    #[arg(long, env = "XDISTILL_MAX_SEQUENCES", default_value_t = 16_384)]
    pub max_sequences: usize,
    /// Most bytes of scores one answer may hold (4 bytes per id or value; JSON encodings are
    /// larger); beyond it requests get 413.
    #[arg(long, env = "XDISTILL_MAX_ANSWER_BYTES", default_value_t = 1 << 30)]
    pub max_answer_bytes: usize,
    /// Seconds a connection may take to send a request's headers, counted from when the server
    /// waits for them (so also the longest a keep-alive connection may sit idle).
    #[arg(long, env = "XDISTILL_HEADER_TIMEOUT_SECS", default_value_t = 10.0)]
    pub header_timeout_secs: f64,
    /// Seconds a request may take to send its whole body (beyond it: 408).
    #[arg(long, env = "XDISTILL_BODY_TIMEOUT_SECS", default_value_t = 60.0)]
    pub body_timeout_secs: f64,
    /// Slowest a body may arrive, in bytes per second averaged from its start, once
    /// `--min-rate-grace-secs` have passed (slower: 408 and the connection closed), so a client
    /// trickling bytes holds its slot seconds, not the whole body timeout (0: no minimum).
    #[arg(long, env = "XDISTILL_MIN_BODY_RATE", default_value_t = 1024)]
    pub min_body_rate: u64,
    /// Seconds a body may take before `--min-body-rate` applies.
    #[arg(long, env = "XDISTILL_MIN_RATE_GRACE_SECS", default_value_t = 5.0)]
    pub min_rate_grace_secs: f64,
    /// Seconds a connection's writes may make no progress (a client that stops reading an
    /// answer, e.g. a `/v1/head` download) before it is closed.
    #[arg(long, env = "XDISTILL_WRITE_TIMEOUT_SECS", default_value_t = 60.0)]
    pub write_timeout_secs: f64,
    /// Most connections open at once (also capped by the open-files limit, which is raised to
    /// its hard limit at start); beyond it new connections wait until one closes.
    #[arg(long, env = "XDISTILL_MAX_CONNECTIONS", default_value_t = 4096)]
    pub max_connections: usize,
    /// Most connections open at once from one client address; past it a new connection gets 503
    /// and is closed (0: no limit). Behind a load balancer or proxy every connection comes from
    /// its address: raise this (or set 0) there.
    #[arg(
        long,
        env = "XDISTILL_MAX_CONNECTIONS_PER_CLIENT",
        default_value_t = 512
    )]
    pub max_connections_per_client: usize,
    /// Size of the result cache in bytes (0 disables it).
    #[arg(long, env = "XDISTILL_CACHE_BYTES", default_value_t = 1 << 30)]
    pub cache_bytes: u64,
    /// Largest k a request may ask for.
    #[arg(long, env = "XDISTILL_MAX_K", default_value_t = 256)]
    pub max_k: usize,
    /// Longest sequence accepted (default: the model's max_position_embeddings).
    #[arg(long, env = "XDISTILL_MAX_SEQ_LEN")]
    pub max_seq_len: Option<usize>,
    /// Largest request body in bytes (larger bodies get 413).
    #[arg(long, env = "XDISTILL_MAX_BODY_BYTES", default_value_t = 64 << 20)]
    pub max_body_bytes: usize,
    /// Model name of the vLLM-compatible routes (`/v1/models`, the `model` field of
    /// `/v1/completions`). Default: the model directory's name.
    #[arg(long, env = "XDISTILL_SERVED_MODEL_NAME")]
    pub served_model_name: Option<String>,
    /// When set, every route but /health needs `Authorization: Bearer KEY`. Prefer
    /// `--api-key-file` or the environment variable: a flag's value shows in `ps`.
    #[arg(long, env = "XDISTILL_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// A file holding the API key (surrounding whitespace ignored), e.g. a mounted secret.
    #[arg(long, env = "XDISTILL_API_KEY_FILE", conflicts_with = "api_key")]
    pub api_key_file: Option<PathBuf>,
    /// Parse and check the arguments and the model, then exit: every check a start runs up to
    /// the first weight allocation (GGUF magic, header bounds, duplicate keys or tensors, data
    /// past the end of the file; safetensors headers, dtypes and offsets; every size of the
    /// config against the tensors and the limits; the tokenizer). Not checked: the weights'
    /// values (NaN or infinite weights) and the start-up probe, which need the weights loaded.
    #[arg(long)]
    pub check_args: bool,
}

impl Args {
    /// The API key from `--api-key` (or its variable) or `--api-key-file`.
    pub fn resolve_api_key(&self) -> Result<Option<String>, String> {
        match (&self.api_key, &self.api_key_file) {
            (Some(k), _) => Ok(Some(k.clone())),
            (None, Some(path)) => {
                let key = std::fs::read_to_string(path)
                    .map_err(|e| format!("--api-key-file {}: {e}", path.display()))?;
                let key = key.trim();
                if key.is_empty() {
                    return Err(format!("--api-key-file {} is empty", path.display()));
                }
                Ok(Some(key.to_string()))
            }
            (None, None) => Ok(None),
        }
    }

    /// `--max-wait-ms`, or its default for the batch mode.
    pub fn max_wait_ms(&self) -> u64 {
        let alone = self.batch_invariant && self.packed_rows().is_none();
        self.max_wait_ms.unwrap_or(if alone { 0 } else { 5 })
    }

    /// Rows per matmul of the packed forward when the batch-invariant mode packs (see
    /// `--packed-forward`; the model may still refuse), `None` for a forward per sequence.
    pub fn packed_rows(&self) -> Option<usize> {
        let on = match self.packed_forward {
            Packing::On => true,
            Packing::Off => false,
            Packing::Auto => self.device.starts_with("cuda"),
        };
        (self.batch_invariant && on).then_some(self.packed_rows.max(1))
    }

    /// `--served-model-name`, or the model directory's name.
    pub fn model_name(&self) -> String {
        self.served_model_name.clone().unwrap_or_else(|| {
            let abs = std::path::absolute(&self.model).unwrap_or_else(|_| self.model.clone());
            abs.file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| "teacher".into())
        })
    }

    /// Constraints between flags that clap cannot express.
    pub fn check(&self) -> Result<(), String> {
        if self.max_batch_tokens == 0 {
            return Err("--max-batch-tokens must be at least 1".into());
        }
        if self.max_queue_tokens < self.max_batch_tokens {
            return Err(format!(
                "--max-queue-tokens ({}) must be at least --max-batch-tokens ({})",
                self.max_queue_tokens, self.max_batch_tokens
            ));
        }
        for (name, secs) in [
            ("--header-timeout-secs", self.header_timeout_secs),
            ("--body-timeout-secs", self.body_timeout_secs),
            ("--min-rate-grace-secs", self.min_rate_grace_secs),
            ("--write-timeout-secs", self.write_timeout_secs),
        ] {
            if !(secs.is_finite() && secs > 0.0 && secs <= 86_400.0) {
                return Err(format!("{name} must be in (0, 86400], got {secs}"));
            }
        }
        if self.max_connections == 0 {
            return Err("--max-connections must be at least 1".into());
        }
        if self.max_sequences == 0 || self.max_answer_bytes == 0 {
            return Err("--max-sequences and --max-answer-bytes must be at least 1".into());
        }
        if self.max_k == 0 {
            return Err("--max-k must be at least 1".into());
        }
        if self.max_seq_len == Some(0) {
            return Err("--max-seq-len must be at least 1".into());
        }
        if self.max_body_bytes == 0 {
            return Err("--max-body-bytes must be at least 1".into());
        }
        if matches!(&self.served_model_name, Some(n) if n.trim().is_empty()) {
            return Err("--served-model-name must not be empty".into());
        }
        if matches!(&self.api_key, Some(k) if k.trim().is_empty()) {
            return Err("--api-key must not be empty".into());
        }
        xdistill_shared::device::check_dtype(&self.dtype).map_err(|e| e.to_string())?;
        self.resolve_api_key()?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;
    use xdistill_shared::model::config::Arch;

    /// `teacher --help` names every architecture the decoders serve, with the `model_type` that
    /// reads as it.
    #[test]
    fn help_names_every_architecture() {
        let help = Args::command().render_long_help().to_string();
        for arch in Arch::ALL {
            let (name, model_type) = (arch.facts().name, arch.model_type());
            assert!(
                help.contains(&format!("{name} ({model_type}")),
                "--help lacks {name} ({model_type}):\n{help}"
            );
            assert_eq!(Arch::parse(model_type).ok(), Some(arch), "{model_type}");
        }
    }

    #[test]
    fn defaults_and_constraints() {
        let a = Args::try_parse_from(["teacher", "--model", "m"]).unwrap();
        assert_eq!(a.host.to_string(), "127.0.0.1");
        assert_eq!(a.port, 8000);
        assert_eq!(a.write_timeout_secs, 60.0);
        assert!(a.batch_invariant);
        assert_eq!(
            a.max_wait_ms(),
            0,
            "invariant batches gain nothing by waiting"
        );
        a.check().unwrap();
        let a = Args::try_parse_from(["teacher", "--model", "m", "--batch-invariant", "false"])
            .unwrap();
        assert!(!a.batch_invariant);
        assert_eq!(a.max_wait_ms(), 5);
        let a = Args::try_parse_from(["teacher", "--model", "m", "--max-wait-ms", "7"]).unwrap();
        assert_eq!(a.max_wait_ms(), 7);
        // The packed forward: auto packs on a GPU only (and then batches are worth waiting
        // for), never in the padded mode; `on` packs anywhere.
        let parse = |extra: &[&str]| {
            let mut argv = vec!["teacher", "--model", "m"];
            argv.extend_from_slice(extra);
            Args::try_parse_from(argv).unwrap()
        };
        // `--device auto` (the default) is resolved when parsed: the CPU in a build without
        // CUDA, where nothing packs by default.
        if !cfg!(feature = "cuda") {
            assert_eq!(parse(&[]).device, "cpu");
            assert_eq!(parse(&["--device", "AUTO"]).device, "cpu");
            assert_eq!(parse(&[]).packed_rows(), None);
        }
        assert_eq!(parse(&["--device", "cpu"]).packed_rows(), None);
        let gpu = parse(&["--device", "cuda"]);
        assert_eq!(gpu.packed_rows(), Some(xdistill_shared::model::PACKED_ROWS));
        assert_eq!(gpu.max_wait_ms(), 5);
        assert_eq!(
            parse(&["--device", "cuda:1", "--packed-forward", "off"]).packed_rows(),
            None
        );
        assert_eq!(
            parse(&["--packed-forward", "on", "--packed-rows", "64"]).packed_rows(),
            Some(64)
        );
        assert_eq!(
            parse(&["--device", "cuda", "--batch-invariant", "false"]).packed_rows(),
            None
        );
        assert!(
            Args::try_parse_from(["teacher", "--model", "m", "--packed-forward", "x"]).is_err()
        );
        assert!(
            Args::try_parse_from(["teacher", "--model", "m", "--batch-invariant", "x"]).is_err()
        );
        let bad = Args::try_parse_from([
            "teacher",
            "--model",
            "m",
            "--max-batch-tokens",
            "10",
            "--max-queue-tokens",
            "5",
        ])
        .unwrap();
        assert!(bad.check().is_err());
        let bad = Args::try_parse_from(["teacher", "--model", "m", "--dtype", "int4"]).unwrap();
        assert!(bad.check().is_err());
        assert!(Args::try_parse_from(["teacher", "--model", "m", "--port", "x"]).is_err());
        // The served name defaults to the directory's name.
        let a = Args::try_parse_from(["teacher", "--model", "/models/Qwen3-8B/"]).unwrap();
        assert_eq!(a.model_name(), "Qwen3-8B");
        let a =
            Args::try_parse_from(["teacher", "--model", "m", "--served-model-name", "t"]).unwrap();
        assert_eq!(a.model_name(), "t");
        // Limits and timeouts out of range are refused, naming the flag.
        for bad in [
            ["--header-timeout-secs", "0"],
            ["--header-timeout-secs", "nan"],
            ["--body-timeout-secs", "-1"],
            ["--body-timeout-secs", "1e9"],
            ["--write-timeout-secs", "0"],
            ["--max-connections", "0"],
            ["--max-sequences", "0"],
            ["--max-answer-bytes", "0"],
        ] {
            let flag = format!("{}={}", bad[0], bad[1]);
            let a = Args::try_parse_from(["teacher", "--model", "m", &flag]).unwrap();
            let e = a.check().unwrap_err();
            assert!(e.contains(bad[0]), "{bad:?}: {e}");
        }
        assert!(
            Args::try_parse_from(["teacher", "--model", "m", "--served-model-name", " "])
                .unwrap()
                .check()
                .is_err()
        );
        // The key from a file, trimmed; an empty or missing file is refused.
        let dir = std::env::temp_dir().join(format!("xd-args-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("key");
        std::fs::write(&f, "  s3cret\n").unwrap();
        let fs = f.to_str().unwrap();
        let a = Args::try_parse_from(["teacher", "--model", "m", "--api-key-file", fs]).unwrap();
        assert_eq!(a.resolve_api_key().unwrap().as_deref(), Some("s3cret"));
        std::fs::write(&f, "\n").unwrap();
        assert!(a.check().is_err());
        let gone = dir.join("none");
        let a = Args::try_parse_from([
            "teacher",
            "--model",
            "m",
            "--api-key-file",
            gone.to_str().unwrap(),
        ])
        .unwrap();
        assert!(a.check().unwrap_err().contains("--api-key-file"));
        assert!(Args::try_parse_from([
            "teacher",
            "--model",
            "m",
            "--api-key",
            "a",
            "--api-key-file",
            fs
        ])
        .is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
