//! Generation with the KV cache against the no-cache reference, sampling reproducibility and
//! stop rules, on tiny random models with the real Qwen3 tokenizer.

use tokenizers::Tokenizer;
use xdistill_shared::model::Decoder;
use xdistill_testkit::{
    byte_tokenizer_json, load_tokenizer as load, tiny_decoder as tiny, tokenizer_json,
};
use xdistill_trainer::generate::{
    decode_after, generate, generate_no_cache, generate_seeded, GenerateError, Generation,
    GenerationConfig, StopReason,
};

/// The fast fixture: a tiny qwen3 over the 257-token byte tokenizer.
fn byte_model(max_pos: usize) -> (Decoder, &'static Tokenizer) {
    let tok = byte_tokenizer_json();
    (tiny("qwen3", &tok, max_pos, true), load(&tok))
}

/// Prompts of different lengths (1 to ~15 tokens), so batches are left-padded.
fn prompts(tok: &Tokenizer) -> Vec<Vec<u32>> {
    [
        "Q: 47+38=?\nA:",
        "Hi",
        "The quick brown fox jumps over the lazy dog, twice.",
        "x",
        "Q: 9-4=?\nA: 9-4=5.",
    ]
    .iter()
    .map(|s| tok.encode(*s, false).unwrap().get_ids().to_vec())
    .collect()
}

fn ids(g: &[Generation]) -> Vec<Vec<u32>> {
    g.iter().map(|g| g.completion_ids.clone()).collect()
}

fn cfg(temperature: f64, max_new_tokens: usize) -> GenerationConfig {
    GenerationConfig {
        temperature,
        max_new_tokens,
        eos_ids: Some(vec![]),
        ..Default::default()
    }
}

fn assert_logprobs_close(a: &[Generation], b: &[Generation]) {
    for (x, y) in a.iter().zip(b) {
        for (p, q) in x.sampled_logprobs.iter().zip(&y.sampled_logprobs) {
            assert!((p - q).abs() < 1e-3, "logprob {p} vs {q}");
        }
    }
}

#[test]
fn kv_cache_matches_no_cache_greedy_with_left_padding() {
    // The real Qwen3 tokenizer (150k vocabulary) once, the byte tokenizer for untied Llama.
    for (arch, tok_path, tie) in [
        ("qwen3", tokenizer_json("qwen3"), true),
        ("llama", byte_tokenizer_json(), false),
    ] {
        let tok = load(&tok_path);
        let model = tiny(arch, &tok_path, 256, tie);
        let ps = prompts(tok);
        assert!(ps.iter().map(Vec::len).min() < ps.iter().map(Vec::len).max());
        let c = cfg(0.0, 10);
        let reference = generate_no_cache(&model, tok, &ps, &c, &mut c.rng()).unwrap();
        for bs in [0, 1, 3] {
            let c = GenerationConfig {
                batch_size: bs,
                ..c.clone()
            };
            let got = generate_seeded(&model, tok, &ps, &c).unwrap();
            assert_eq!(ids(&got), ids(&reference), "{arch}, batch_size {bs}");
            assert_logprobs_close(&got, &reference);
            for (g, r) in got.iter().zip(&reference) {
                assert_eq!(g.completion_text, r.completion_text);
                assert_eq!(g.completion_ids.len(), 10);
                assert_eq!(g.stop, StopReason::MaxNewTokens);
            }
        }
        // Padded vocabulary rows (beyond the tokenizer) are never sampled.
        let support = tok.get_vocab_size(true) as u32;
        assert!(model.config().vocab_size as u32 > support);
        assert!(reference
            .iter()
            .flat_map(|g| &g.completion_ids)
            .all(|&id| id < support));
    }
}

#[test]
fn sampling_is_seeded_and_independent_of_batching_and_cache() {
    let (model, tok) = byte_model(256);
    let ps = prompts(tok);
    let c = GenerationConfig {
        num_generations: 3,
        top_k: 50,
        top_p: 0.95,
        temperature: 1.0,
        seed: 42,
        ..cfg(1.0, 8)
    };
    let a = generate_seeded(&model, tok, &ps, &c).unwrap();
    let b = generate_seeded(&model, tok, &ps, &c).unwrap();
    assert_eq!(a, b);
    let small = GenerationConfig {
        batch_size: 2,
        ..c.clone()
    };
    assert_eq!(
        ids(&generate_seeded(&model, tok, &ps, &small).unwrap()),
        ids(&a)
    );
    let nc = generate_no_cache(&model, tok, &ps, &c, &mut c.rng()).unwrap();
    assert_eq!(ids(&nc), ids(&a));
    assert_logprobs_close(&nc, &a);
    let other = GenerationConfig { seed: 43, ..c };
    assert_ne!(
        ids(&generate_seeded(&model, tok, &ps, &other).unwrap()),
        ids(&a)
    );
    // The generations of one prompt differ from each other too.
    assert_ne!(a[0].completion_ids, a[1].completion_ids);
}

#[test]
fn num_generations_yields_that_many_in_order() {
    let (model, tok) = byte_model(256);
    let ps = prompts(tok);
    let c = GenerationConfig {
        num_generations: 4,
        ..cfg(1.0, 3)
    };
    let g = generate_seeded(&model, tok, &ps, &c).unwrap();
    assert_eq!(g.len(), ps.len() * 4);
    for (i, g) in g.iter().enumerate() {
        assert_eq!((g.prompt_index, g.sample_index), (i / 4, i % 4));
        assert_eq!(g.prompt_ids, ps[i / 4]);
        assert_eq!(g.completion_ids.len(), 3);
        assert_eq!(g.sampled_logprobs.len(), 3);
        assert!(g
            .sampled_logprobs
            .iter()
            .all(|l| *l <= 0.0 && l.is_finite()));
    }
}

#[test]
fn top_k_one_and_tiny_top_p_equal_greedy() {
    let (model, tok) = byte_model(256);
    let ps = prompts(tok);
    let greedy = ids(&generate_seeded(&model, tok, &ps, &cfg(0.0, 6)).unwrap());
    let k1 = GenerationConfig {
        top_k: 1,
        ..cfg(1.3, 6)
    };
    assert_eq!(
        ids(&generate_seeded(&model, tok, &ps, &k1).unwrap()),
        greedy
    );
    let p0 = GenerationConfig {
        top_p: 1e-6,
        ..cfg(1.3, 6)
    };
    assert_eq!(
        ids(&generate_seeded(&model, tok, &ps, &p0).unwrap()),
        greedy
    );
}

#[test]
fn stops_at_eos_and_at_stop_strings() {
    let (model, tok) = byte_model(256);
    let ps = prompts(tok)[..1].to_vec();
    let free = generate_seeded(&model, tok, &ps, &cfg(0.0, 16)).unwrap();
    let g = &free[0].completion_ids;

    // EOS: declare the first token not seen before position 2 an EOS id.
    let k = (2..g.len()).find(|&k| !g[..k].contains(&g[k])).unwrap();
    let c = GenerationConfig {
        eos_ids: Some(vec![g[k]]),
        ..cfg(0.0, 16)
    };
    for out in [
        generate_seeded(&model, tok, &ps, &c).unwrap(),
        generate_no_cache(&model, tok, &ps, &c, &mut c.rng()).unwrap(),
    ] {
        assert_eq!(out[0].completion_ids, g[..=k].to_vec());
        assert!(out[0].hit_eos);
        assert_eq!(out[0].stop, StopReason::Eos);
        assert_eq!(out[0].completion_text, tok.decode(&g[..k], true).unwrap());
        assert_eq!(out[0].sampled_logprobs.len(), k + 1);
    }

    // Stop string: the last two characters of the text after token t (with t chosen where the
    // text grew). Reference: the first prefix whose decoded text contains it.
    let texts: Vec<String> = (1..=g.len())
        .map(|n| tok.decode(&g[..n], true).unwrap())
        .collect();
    let t = (3..g.len())
        .find(|&t| texts[t].chars().count() >= 2 && texts[t] != texts[t - 1])
        .unwrap();
    let stop: String = {
        let chars: Vec<char> = texts[t].chars().collect();
        chars[chars.len() - 2..].iter().collect()
    };
    let first = texts.iter().position(|s| s.contains(&stop)).unwrap();
    assert!(first <= t);
    let c = GenerationConfig {
        stop_strings: vec!["never appears \u{1F600}".into(), stop.clone()],
        ..cfg(0.0, 16)
    };
    let out = generate_seeded(&model, tok, &ps, &c).unwrap();
    assert_eq!(out[0].stop, StopReason::StopString);
    assert!(!out[0].hit_eos);
    assert_eq!(out[0].completion_ids, g[..=first].to_vec());
    let cut = texts[first].find(&stop).unwrap();
    assert_eq!(out[0].completion_text, texts[first][..cut]);
    assert!(!out[0].completion_text.contains(&stop));
    // The matched stop string completes the text the model produced.
    assert_eq!(out[0].matched_stop.as_deref(), Some(stop.as_str()));
    assert!(texts[first].starts_with(&format!("{}{stop}", out[0].completion_text)));
}

#[test]
fn max_new_tokens_and_context_limit() {
    // max_position_embeddings 16: a 12-token prompt may grow by 4 tokens at most.
    let (model, tok) = byte_model(16);
    let long: Vec<u32> = tok
        .encode("abcdefghijkl", false)
        .unwrap()
        .get_ids()
        .to_vec();
    assert_eq!(long.len(), 12);
    let short = long[..3].to_vec();
    let ps = vec![long.clone(), short.clone()];
    let c = cfg(0.0, 10);
    let reference = generate_no_cache(&model, tok, &ps, &c, &mut c.rng()).unwrap();
    assert_eq!(reference[0].completion_ids.len(), 4);
    assert_eq!(reference[0].stop, StopReason::ContextFull);
    assert_eq!(reference[1].completion_ids.len(), 10);
    assert_eq!(reference[1].stop, StopReason::MaxNewTokens);
    // Batched alone, each row matches the reference exactly.
    let one = GenerationConfig {
        batch_size: 1,
        ..c.clone()
    };
    assert_eq!(
        ids(&generate_seeded(&model, tok, &ps, &one).unwrap()),
        ids(&reference)
    );
    // Batched together, the padded cache (12 + steps keys) may stop the short row early, but
    // what it generated is a prefix of the reference.
    let both = generate_seeded(&model, tok, &ps, &c).unwrap();
    assert_eq!(both[0].completion_ids, reference[0].completion_ids);
    assert!(reference[1]
        .completion_ids
        .starts_with(&both[1].completion_ids));
    assert_eq!(both[1].completion_ids.len(), 5);
    assert_eq!(both[1].stop, StopReason::ContextFull);

    // max_new_tokens = 0: empty completions.
    let zero = generate_seeded(&model, tok, &ps, &cfg(0.0, 0)).unwrap();
    assert!(zero.iter().all(|g| g.completion_ids.is_empty()));
}

#[test]
fn bad_inputs_are_errors() {
    let (model, tok) = byte_model(16);
    let c = cfg(1.0, 4);
    let run = |ps: Vec<Vec<u32>>, c: &GenerationConfig| generate_seeded(&model, tok, &ps, c);
    assert!(matches!(
        run(vec![vec![1], vec![]], &c),
        Err(GenerateError::EmptyPrompt(1))
    ));
    assert!(matches!(
        run(vec![vec![u32::MAX]], &c),
        Err(GenerateError::TokenOutOfRange { index: 0, .. })
    ));
    assert!(matches!(
        run(vec![vec![1; 16]], &c),
        Err(GenerateError::PromptTooLong { index: 0, .. })
    ));
    for bad in [
        GenerationConfig {
            temperature: -1.0,
            ..c.clone()
        },
        GenerationConfig {
            top_p: 0.0,
            ..c.clone()
        },
        GenerationConfig {
            num_generations: 0,
            ..c.clone()
        },
        // A billion rows (once an allocation past memory, an abort); usize::MAX overflowed.
        GenerationConfig {
            num_generations: 1_000_000_000,
            ..c.clone()
        },
        GenerationConfig {
            num_generations: usize::MAX,
            ..c.clone()
        },
        GenerationConfig {
            stop_strings: vec![String::new()],
            ..c.clone()
        },
    ] {
        assert!(matches!(
            run(vec![vec![1]], &bad),
            Err(GenerateError::Config(_))
        ));
    }
    // No prompts: no generations.
    assert!(run(vec![], &c).unwrap().is_empty());
    // Unknown config fields are rejected (serde), known ones default.
    assert!(serde_json::from_str::<GenerationConfig>(r#"{"temprature": 1}"#).is_err());
    let parsed: GenerationConfig = serde_json::from_str(r#"{"top_k": 5}"#).unwrap();
    assert_eq!(parsed.top_k, 5);
    assert_eq!(
        parsed.max_new_tokens,
        GenerationConfig::default().max_new_tokens
    );
}

#[test]
fn generate_takes_the_callers_rng() {
    // One RNG for a whole training run: consecutive calls give fresh samples, and the run is
    // reproducible from the seed.
    let (model, tok) = byte_model(256);
    let ps = prompts(tok);
    let c = cfg(1.0, 5);
    let mut r1 = c.rng();
    let a1 = ids(&generate(&model, tok, &ps, &c, &mut r1).unwrap());
    let a2 = ids(&generate(&model, tok, &ps, &c, &mut r1).unwrap());
    assert_ne!(a1, a2);
    let mut r2 = c.rng();
    assert_eq!(ids(&generate(&model, tok, &ps, &c, &mut r2).unwrap()), a1);
    assert_eq!(ids(&generate(&model, tok, &ps, &c, &mut r2).unwrap()), a2);
}

#[test]
fn sampled_logprobs_are_untruncated_tempered_log_softmax() {
    // Reference: one full forward over prompt + completion, log_softmax(z / τ) in f64 over the
    // tokenizer's vocabulary, read at each sampled id (top-k truncation not applied).
    let (model, tok) = byte_model(256);
    let ps = prompts(tok);
    let tau = 0.7;
    let c = GenerationConfig {
        top_k: 20,
        num_generations: 2,
        ..cfg(tau, 6)
    };
    let support = tok.get_vocab_size(true);
    for g in generate_seeded(&model, tok, &ps, &c).unwrap() {
        let all: Vec<u32> = g
            .prompt_ids
            .iter()
            .chain(&g.completion_ids)
            .copied()
            .collect();
        let n = all.len();
        let ids = candle_core::Tensor::from_vec(all, (1, n), model.device()).unwrap();
        let logits = model.forward(&ids).unwrap().squeeze(0).unwrap();
        let rows: Vec<Vec<f32>> = logits.to_vec2().unwrap();
        let l = g.prompt_ids.len();
        for (t, (&x, &lp)) in g.completion_ids.iter().zip(&g.sampled_logprobs).enumerate() {
            let row: Vec<f64> = rows[l - 1 + t][..support]
                .iter()
                .map(|&z| z as f64 / tau)
                .collect();
            let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let lse = m + row.iter().map(|z| (z - m).exp()).sum::<f64>().ln();
            let want = row[x as usize] - lse;
            assert!((lp as f64 - want).abs() < 1e-3, "t {t}: {lp} vs {want}");
        }
    }
}

#[test]
fn completion_text_keeps_the_space_its_left_context_gives_it() {
    // Llama 2's SentencePiece decoder drops the leading space of a sequence's first token:
    // "▁8" alone decodes to "8". After the prompt it is " 8", and that is the text a teacher with
    // another tokenizer must score.
    let tok = Tokenizer::from_file(tokenizer_json("llama2")).unwrap();
    let enc = |s: &str| tok.encode(s, false).unwrap().get_ids().to_vec();
    let prompt = enc("Q: 47+38=?\nA:");
    let full = enc("Q: 47+38=?\nA: 7+8=15");
    assert_eq!(
        full[..prompt.len()],
        prompt[..],
        "the prompt tokenizes the same inside the text"
    );
    let completion = &full[prompt.len()..];
    assert_eq!(
        tok.decode(completion, true).unwrap(),
        "7+8=15",
        "decoded alone: space lost"
    );
    assert_eq!(decode_after(&tok, &prompt, completion).unwrap(), " 7+8=15");
    // A byte-level tokenizer (Qwen3) decodes the same either way.
    let q = Tokenizer::from_file(tokenizer_json("qwen3")).unwrap();
    let qe = |s: &str| q.encode(s, false).unwrap().get_ids().to_vec();
    let (qp, qf) = (qe("Q: 47+38=?\nA:"), qe("Q: 47+38=?\nA: 7+8=15"));
    assert_eq!(decode_after(&q, &qp, &qf[qp.len()..]).unwrap(), " 7+8=15");
}
