//! Process-level behaviour: graceful shutdown on SIGTERM, load failures, `--check-args`, and the
//! teacher command line of `docker/compose.yaml`.

use crate::common;

use crate::common::{client, ids, request};
use clap::Parser;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;
use xdistill_server::Args;
use xdistill_shared::codec::{self, Format};
use xdistill_shared::protocol::ValuesKind;

fn teacher_bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_teacher"))
}

/// SIGTERM while a request waits in the batcher: the request still completes, then the
/// process exits cleanly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_lets_in_flight_requests_finish() {
    let dir = common::tiny_model("lifecycle-llama", "llama", "llama2", 1);
    let mut child = teacher_bin()
        .arg("--model")
        .arg(&dir)
        .args(["--port", "0", "--max-wait-ms", "2000"])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn");
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let addr = lines
        .find_map(|l| l.ok()?.strip_prefix("listening on ").map(str::to_string))
        .expect("address line");
    let base = format!("http://{addr}");
    let c = client();
    for _ in 0..600 {
        if let Ok(r) = c.get(format!("{base}/health")).send().await {
            if r.status() == 200 {
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let req = request(vec![ids(1, 12, 32_000)], 4);
    let in_flight = {
        let c = c.clone();
        let url = format!("{base}/topk_logits");
        let body = codec::encode_request(Format::Json, &req).unwrap();
        tokio::spawn(async move {
            let r = c
                .post(url)
                .header("content-type", "application/json")
                .body(body)
                .send()
                .await
                .expect("in-flight request failed");
            (r.status().as_u16(), r.bytes().await.unwrap())
        })
    };
    // SIGTERM once the request is queued (it then waits out the 2 s batching window).
    for _ in 0..200 {
        let text = c
            .get(format!("{base}/metrics"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        if xdistill_server::metrics::sample(&text, "xdistill_queue_tokens") == Some(11.0) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let killed = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let (status, body) = in_flight.await.unwrap();
    assert_eq!(status, 200);
    let resp = codec::decode_response(Format::Json, &body).unwrap();
    assert_eq!(resp.results[0].rows, 11);
    let exit = tokio::task::spawn_blocking(move || child.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(exit.success(), "{exit:?}");
}

#[test]
fn missing_model_fails_clearly() {
    let dir = tempfile::tempdir().unwrap();
    let out = teacher_bin()
        .arg("--model")
        .arg(dir.path())
        .args(["--port", "0"])
        .env("RUST_LOG", "warn")
        .env_remove("RUST_BACKTRACE")
        .env_remove("RUST_LIB_BACKTRACE")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("config.json"), "{err}");
    // One line, each cause once (shared::report): the I/O reason is not repeated.
    let line = err.lines().find(|l| l.starts_with("Error: ")).unwrap_or("");
    let reason = "No such file or directory";
    assert!(line.contains(reason), "{err}");
    assert_eq!(err.matches(reason).count(), 1, "{err}");
}

#[test]
fn check_args_accepts_and_refuses() {
    let dir = common::tiny_model("lifecycle-llama", "llama", "llama2", 1);
    let ok = teacher_bin()
        .arg("--model")
        .arg(&dir)
        .arg("--check-args")
        .output()
        .unwrap();
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    // max_position_embeddings of the tiny model is 256.
    let bad = teacher_bin()
        .arg("--model")
        .arg(&dir)
        .args(["--max-seq-len", "257", "--check-args"])
        .output()
        .unwrap();
    assert!(!bad.status.success());
    // --lm-head: both values accepted; another is refused naming the flag and its values.
    for (value, accepted) in [("full", true), ("fused", true), ("tiled", false)] {
        let out = teacher_bin()
            .arg("--model")
            .arg(&dir)
            .args(["--lm-head", value, "--check-args"])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(
            out.status.success(),
            accepted,
            "--lm-head {value}: {stderr}"
        );
        if !accepted {
            assert!(
                stderr.contains("--lm-head") && stderr.contains("fused"),
                "{stderr}"
            );
        }
    }
}

/// No Docker engine runs here: read the compose file and prove each teacher service's command
/// line (with its environment) is accepted by `teacher`: the CPU one, and the GPU one with its
/// NVIDIA device reservation.
#[test]
fn compose_teacher_command_is_accepted() {
    let path = xdistill_testkit::repo_root().join("docker/compose.yaml");
    let text = std::fs::read_to_string(&path).unwrap();
    let doc: serde_yaml::Value = serde_yaml::from_str(&text).unwrap();
    let args = check_compose_service(&doc["services"]["teacher"]);
    assert_eq!(args.device, "cpu");
    let gpu = &doc["services"]["teacher-gpu"];
    let args = check_compose_service(gpu);
    assert_eq!(args.device, "cuda");
    assert_eq!(args.dtype, "bf16");
    assert_eq!(
        gpu["build"]["dockerfile"].as_str(),
        Some("docker/Dockerfile.cuda")
    );
    let dev = &gpu["deploy"]["resources"]["reservations"]["devices"][0];
    assert_eq!(dev["driver"].as_str(), Some("nvidia"));
    assert!(format!("{:?}", dev["capabilities"]).contains("gpu"));
    // Opt-in: a plain `docker compose up` on a machine without a GPU starts the CPU service only.
    assert!(format!("{:?}", gpu["profiles"]).contains("gpu"));
    assert!(doc["services"]["teacher"]["profiles"].is_null());
    // The `scale` profile: replicas that run the same command (no published port) behind
    // HAProxy with the repository's config (its syntax is checked by HAProxy itself in
    // tests/balancer.rs).
    let replica = &doc["services"]["teacher-replica"];
    let args = check_compose_service(replica);
    assert_eq!(args.device, "cpu");
    assert!(replica["ports"].is_null(), "replicas publish no port");
    assert!(format!("{:?}", replica["profiles"]).contains("scale"));
    let lb = &doc["services"]["balancer"];
    assert!(lb["image"].as_str().unwrap().starts_with("haproxy:"));
    assert!(format!("{:?}", lb["volumes"]).contains("./haproxy.cfg:"));
    assert!(format!("{:?}", lb["profiles"]).contains("scale"));
    let cfg =
        std::fs::read_to_string(xdistill_testkit::repo_root().join("docker/haproxy.cfg")).unwrap();
    assert!(
        cfg.contains("teacher-replica:8000"),
        "the config names the compose service"
    );
}

/// The checks of one compose service running `teacher`; returns its parsed arguments.
fn check_compose_service(svc: &serde_yaml::Value) -> Args {
    let command: Vec<String> = svc["command"]
        .as_sequence()
        .expect("command is a list")
        .iter()
        .map(|v| common::compose_defaults(v.as_str().expect("command entries are strings")))
        .collect();
    let env: Vec<(String, String)> = svc["environment"]
        .as_mapping()
        .map(|m| {
            m.iter()
                .map(|(k, v)| {
                    (
                        k.as_str().unwrap().to_string(),
                        common::compose_defaults(v.as_str().unwrap_or("")),
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    // 1. clap accepts it and the flag constraints hold.
    let argv = std::iter::once("teacher".to_string()).chain(command.iter().cloned());
    let args = Args::try_parse_from(argv).expect("compose command rejected by clap");
    args.check().expect("compose command violates a constraint");
    assert_eq!(args.host.to_string(), "0.0.0.0");
    assert_eq!(args.port, 8000);
    // 2. The binary accepts it too, with the model path pointed at a real model (--check-args
    // does not open the device, so the GPU command is checked by a CPU build as well).
    let container_model = args.model.clone();
    let dir = common::tiny_model("lifecycle-llama", "llama", "llama2", 1);
    let argv: Vec<String> = command
        .iter()
        .map(|a| {
            if std::path::Path::new(a) == container_model {
                dir.display().to_string()
            } else {
                a.clone()
            }
        })
        .collect();
    let out = teacher_bin()
        .args(&argv)
        .arg("--check-args")
        .envs(
            env.iter()
                .filter(|(k, _)| k.starts_with("XDISTILL_"))
                .cloned(),
        )
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // 3. The model volume is mounted read-only at the --model path; health is checked.
    let volumes = format!("{:?}", svc["volumes"]);
    assert!(
        volumes.contains(&format!("{}:ro", container_model.display())),
        "{volumes}"
    );
    let health = format!("{:?}", svc["healthcheck"]["test"]);
    assert!(health.contains("/health"), "{health}");
    args
}

/// A checkpoint split into shards with `model.safetensors.index.json` loads to the same model
/// as the single file (Qwen2 here, so all three architectures are exercised by the tests).
#[test]
fn sharded_checkpoint_loads_like_the_single_file() {
    use candle_core::{Device, Tensor};
    let single = common::tiny_model("lifecycle-qwen2", "qwen2", "llama2", 1);
    let sharded = tempfile::tempdir().unwrap();
    let tensors =
        candle_core::safetensors::load(single.join("model.safetensors"), &Device::Cpu).unwrap();
    let mut names: Vec<&String> = tensors.keys().collect();
    names.sort();
    let mut weight_map = serde_json::Map::new();
    for (shard, part) in names.chunks(names.len().div_ceil(2)).enumerate() {
        let file = format!("model-{:05}-of-00002.safetensors", shard + 1);
        let map: std::collections::HashMap<String, Tensor> = part
            .iter()
            .map(|n| ((*n).clone(), tensors[*n].clone()))
            .collect();
        candle_core::safetensors::save(&map, sharded.path().join(&file)).unwrap();
        for n in part {
            weight_map.insert((*n).clone(), file.clone().into());
        }
    }
    std::fs::write(
        sharded.path().join("model.safetensors.index.json"),
        serde_json::to_vec(&serde_json::json!({"metadata": {}, "weight_map": weight_map})).unwrap(),
    )
    .unwrap();
    for f in ["config.json", "tokenizer.json"] {
        std::fs::copy(single.join(f), sharded.path().join(f)).unwrap();
    }
    let (a, fa) = xdistill_server::model::load(&single, "cpu", "f32").unwrap();
    let (b, fb) = xdistill_server::model::load(sharded.path(), "cpu", "f32").unwrap();
    assert_eq!(fa.architecture, "Qwen2ForCausalLM");
    assert_eq!(fa.vocab_size, fb.vocab_size);
    let ids = Tensor::new(&ids(5, 9, 32_000)[..], &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    let (la, lb) = (a.forward(&ids).unwrap(), b.forward(&ids).unwrap());
    let diff: f32 = (la - lb)
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar()
        .unwrap();
    assert_eq!(diff, 0.0);
}

/// A copy of the tiny Llama model with `edit` applied to its directory.
fn broken_copy(edit: impl FnOnce(&std::path::Path)) -> tempfile::TempDir {
    let src = common::tiny_model("lifecycle-llama", "llama", "llama2", 1);
    let dir = tempfile::tempdir().unwrap();
    for f in std::fs::read_dir(&src).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, dir.path().join(f.file_name().unwrap())).unwrap();
    }
    edit(dir.path());
    dir
}

/// Models that would serve wrong or no answers are refused at start, by `--check-args` and by
/// a real start, with a message naming the file and key: a tokenizer with more ids than the
/// embedding has rows, `max_position_embeddings = 0`, an unimplemented RoPE scaling,
/// architecture or feature.
#[test]
fn unservable_models_are_refused_at_start() {
    let qwen_tokenizer = xdistill_testkit::tokenizer_json("qwen3");
    let too_big = broken_copy(|d| {
        std::fs::copy(&qwen_tokenizer, d.join("tokenizer.json")).unwrap();
    });
    let zero_positions = broken_copy(|d| {
        let p = d.join("config.json");
        let mut cfg: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
        cfg["max_position_embeddings"] = serde_json::json!(0);
        std::fs::write(&p, serde_json::to_vec(&cfg).unwrap()).unwrap();
    });
    let edit_config = |edit: fn(&mut serde_json::Value)| {
        broken_copy(move |d| {
            let p = d.join("config.json");
            let mut cfg: serde_json::Value =
                serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
            edit(&mut cfg);
            std::fs::write(&p, serde_json::to_vec(&cfg).unwrap()).unwrap();
        })
    };
    // A scaling, an architecture and a feature the decoder does not implement.
    let mrope = edit_config(|c| {
        c["rope_scaling"] = serde_json::json!({"rope_type": "mrope", "factor": 4.0});
    });
    let gpt2 = edit_config(|c| c["model_type"] = serde_json::json!("gpt2"));
    let softcap = edit_config(|c| c["attn_logit_softcapping"] = serde_json::json!(50.0));
    for (dir, needle) in [
        (&too_big, "tokenizer does not belong to this model"),
        (&zero_positions, "max_position_embeddings is 0"),
        (&mrope, "rope scaling type \"mrope\""),
        (&gpt2, "unsupported model_type \"gpt2\""),
        (&softcap, "attn_logit_softcapping is not implemented"),
    ] {
        for extra in [&["--check-args"][..], &["--port", "0"][..]] {
            let out = teacher_bin()
                .arg("--model")
                .arg(dir.path())
                .args(extra)
                .output()
                .unwrap();
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(!out.status.success(), "{extra:?}: {err}");
            assert!(err.contains(needle), "{extra:?}: {err}");
        }
    }
}

/// A model whose start-up probe is not finite (here every final-norm weight is NaN, so every
/// logit is) does not start: the teacher exits 1 with one line naming the probe and the first
/// non-finite logit (id and position), instead of answering `/health` 200 and then failing
/// every request with 500.
#[test]
fn a_model_whose_probe_is_not_finite_does_not_start() {
    use candle_core::{Device, Tensor};
    let dir = broken_copy(|d| {
        let p = d.join("model.safetensors");
        let mut tensors = candle_core::safetensors::load(&p, &Device::Cpu).unwrap();
        let w = &tensors["model.norm.weight"];
        let nan = Tensor::full(f32::NAN, w.shape(), &Device::Cpu)
            .unwrap()
            .to_dtype(w.dtype())
            .unwrap();
        tensors.insert("model.norm.weight".into(), nan);
        candle_core::safetensors::save(&tensors, &p).unwrap();
    });
    let mut child = teacher_bin()
        .arg("--model")
        .arg(dir.path())
        .args(["--port", "0"])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // The address is printed before the model loads; `/health` must never say 200.
    let mut first = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut first)
        .unwrap();
    let addr = first.trim().trim_start_matches("listening on ").to_string();
    let t0 = std::time::Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        let health = common::get_status(&format!("http://{addr}/health")).ok();
        if health == Some(200) || t0.elapsed() > Duration::from_secs(60) {
            child.kill().unwrap();
            child.wait().unwrap();
            panic!("the teacher kept running (/health {health:?}) with a model whose probe is NaN");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
    assert_eq!(status.code(), Some(1), "{err}");
    let line = err
        .lines()
        .find(|l| l.starts_with("Error: "))
        .unwrap_or_else(|| panic!("no error line: {err}"));
    for needle in [
        "the model cannot score: its start-up probe (32 tokens) failed",
        "the model's logits are not finite (logit of id ",
        " at position 0 is NaN)",
    ] {
        assert!(line.contains(needle), "{needle:?} not in {line:?}");
    }
}

/// A copy of the model directory `src` with `edit` applied to its config.json.
fn copy_with_config(
    src: &std::path::Path,
    edit: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>),
) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for f in std::fs::read_dir(src).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, dir.path().join(f.file_name().unwrap())).unwrap();
    }
    let p = dir.path().join("config.json");
    let mut cfg: serde_json::Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
    edit(cfg.as_object_mut().unwrap());
    std::fs::write(&p, serde_json::to_vec_pretty(&cfg).unwrap()).unwrap();
    dir
}

/// The outcome of `teacher --model DIR` with `extra`: success, and stderr.
fn teacher_on(dir: &std::path::Path, extra: &[&str]) -> (bool, String) {
    let out = teacher_bin()
        .arg("--model")
        .arg(dir)
        .args(extra)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A Qwen3-MoE checkpoint loads whether its expert count is `num_experts` (transformers ≤ 5.23)
/// or `num_local_experts` (5.24 and later). Where config.json and the weights disagree about
/// the experts — the count lost (so dense MLPs would be built, and the load would stop on a
/// missing `mlp.gate_proj.weight`), or a MoE config over dense weights — `--check-args` and a
/// real start refuse it before loading weights, naming the config key and the tensors.
#[test]
fn moe_config_and_weights_must_agree_on_the_experts() {
    let moe = common::tiny_model("lifecycle-qwen3-moe", "qwen3-moe", "llama2", 1);
    let renamed = copy_with_config(&moe, |c| {
        let n = c
            .remove("num_experts")
            .expect("init-model writes num_experts");
        c.insert("num_local_experts".into(), n);
    });
    for dir in [moe.as_path(), renamed.path()] {
        let (ok, err) = teacher_on(dir, &["--check-args"]);
        assert!(ok, "{}: {err}", dir.display());
    }
    let (decoder, facts) = xdistill_server::model::load(renamed.path(), "cpu", "f32").unwrap();
    assert_eq!(facts.architecture, "Qwen3MoeForCausalLM");
    let x = candle_core::Tensor::new(&ids(3, 6, 32_000)[..], &candle_core::Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    let (want, _) = xdistill_server::model::load(&moe, "cpu", "f32").unwrap();
    let diff = (want.forward(&x).unwrap() - decoder.forward(&x).unwrap())
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    assert_eq!(diff, 0.0, "either key gives the same model");

    let lost = copy_with_config(&moe, |c| {
        c.remove("num_experts");
    });
    let dense = common::tiny_model("lifecycle-qwen3", "qwen3", "llama2", 1);
    let moe_over_dense = copy_with_config(&dense, |c| {
        c.insert("model_type".into(), "qwen3_moe".into());
        c.insert("num_local_experts".into(), 4.into());
        c.insert("num_experts_per_tok".into(), 2.into());
        c.insert("moe_intermediate_size".into(), 16.into());
    });
    for (dir, needles) in [
        (
            &lost,
            &[
                "config.json: the config sets no expert count (neither `num_experts` nor \
                 `num_local_experts`)",
                "model.layers.0.mlp.experts.*, e.g. model.layers.0.mlp.experts.0.down_proj.weight",
                "set `num_local_experts`",
                "(8 in the weights)",
            ][..],
        ),
        (
            &moe_over_dense,
            &[
                "config key `num_local_experts` = 4",
                "makes layer 0 a mixture-of-experts layer",
                "e.g. model.layers.0.mlp.down_proj.weight",
                "no model.layers.0.mlp.experts.* tensor",
            ][..],
        ),
    ] {
        for extra in [&["--check-args"][..], &["--port", "0"][..]] {
            let (ok, err) = teacher_on(dir.path(), extra);
            assert!(!ok, "{extra:?}: {err}");
            for needle in needles {
                assert!(err.contains(needle), "{extra:?}: {needle:?} in {err}");
            }
            assert!(
                !err.contains("cannot find tensor"),
                "refused before loading: {err}"
            );
        }
    }
}

/// The API key can come from a file (so it need not show in `ps`), and the `Bearer` scheme is
/// matched case-insensitively.
#[tokio::test]
async fn api_key_from_a_file_and_any_case_of_bearer() {
    let dir = common::tiny_model("lifecycle-llama", "llama", "llama2", 1);
    let keys = tempfile::tempdir().unwrap();
    let key_file = keys.path().join("key");
    std::fs::write(&key_file, "file-secret\n").unwrap();
    let t = common::start_teacher(&dir, &["--api-key-file", key_file.to_str().unwrap()]);
    let c = client();
    for (auth, status) in [
        (None, 401),
        (Some("Bearer wrong"), 401),
        (Some("Bearer file-secret"), 200),
        (Some("bearer file-secret"), 200),
        (Some("BEARER file-secret"), 200),
    ] {
        let mut r = c.get(t.url("/v1/info"));
        if let Some(a) = auth {
            r = r.header("authorization", a);
        }
        assert_eq!(r.send().await.unwrap().status(), status, "{auth:?}");
    }
}

/// A Gemma 3 teacher (local layers with a window shorter than the sequence, global layers with
/// their own RoPE base and linear scaling) reports its architecture, RoPE and window in
/// `/v1/info`, and a sequence longer than `--max-batch-tokens` (scored in chunks over the KV
/// cache) gets the scores it gets in one forward, and those of the decoder run in-process.
#[tokio::test]
async fn gemma3_teacher_reports_its_window_and_scores_in_chunks() {
    let models = tempfile::tempdir().unwrap();
    let dir = models.path().join("gemma3");
    xdistill_shared::init::init_model_dir(&xdistill_shared::init::InitSpec {
        arch: "gemma3".into(),
        tokenizer: xdistill_testkit::tokenizer_json("gemma3"),
        hidden_size: 32,
        layers: 3,
        heads: 4,
        kv_heads: 2,
        intermediate_size: 64,
        head_dim: Some(8),
        pad_vocab_to: 1,
        max_position_embeddings: 128,
        tie_embeddings: true,
        init_std: 0.1,
        seed: 5,
        out: dir.clone(),
        features: xdistill_shared::init::InitFeatures {
            sliding_window: Some(8),
            sliding_window_pattern: Some(3),
            rope_scaling: Some(r#"{"rope_type": "linear", "factor": 2.0}"#.into()),
            ..Default::default()
        },
    })
    .unwrap();
    let whole = common::start_teacher(&dir, &[]);
    let chunked = common::start_teacher(&dir, &["--max-batch-tokens", "16"]);
    let c = client();
    let info = common::info(&c, &whole).await;
    assert_eq!(info.architecture, "Gemma3ForCausalLM");
    assert_eq!(info.model_type, "gemma3_text");
    assert_eq!(
        (info.rope_theta, info.rope_scaling.as_str()),
        (1e6, "linear")
    );
    assert_eq!((info.sliding_window, info.sliding_layers), (Some(8), 2));
    let seq: Vec<u32> = (0..40u32).map(|i| (i * 7919 + 13) % 262_000).collect();
    let req = request(vec![seq.clone()], 4);
    let a = common::score(&c, &whole, &req, Format::Json)
        .await
        .results
        .remove(0);
    let b = common::score(&c, &chunked, &req, Format::Json)
        .await
        .results
        .remove(0);
    let reference = common::Reference::load(&dir);
    for got in [&a, &b] {
        reference.check(got, &seq, 0, 1.0, ValuesKind::Logprobs, 1e-4);
    }
}
