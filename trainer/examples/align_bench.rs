//! Alignment speed on one long sample, the case NeMo RL's aligner takes 5.5 s for: GSM8K text
//! concatenated to 2048 student tokens (both sides truncated at a common chunk boundary), then
//! alignment, repeated. Prints figures; not a test.
//!
//! `cargo run --release -p xdistill-trainer --example align_bench [-- STUDENT TEACHER]`

use std::time::Instant;
use xdistill_shared::paths::shared_data_dir;
use xdistill_testkit::tokenizer_json;
use xdistill_trainer::align::{align, align_text, tokenize_pair, AlignTokenizer, PairOptions};

// The allocator of every xdistill binary: jemalloc with transparent huge pages.
xdistill_shared::global_allocator!();

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let sn = args.first().map_or("qwen3", String::as_str);
    let tn = args.get(1).map_or("llama3", String::as_str);
    let s = AlignTokenizer::from_file(&tokenizer_json(sn))?;
    let t = AlignTokenizer::from_file(&tokenizer_json(tn))?;
    let data = shared_data_dir()
        .ok_or_else(|| {
            anyhow::anyhow!(
                "no real text found: set XDISTILL_DATA to a folder holding gsm8k/train.jsonl"
            )
        })?
        .join("gsm8k/train.jsonl");
    let docs = xdistill_trainer::align::cli::read_documents(&data, &["question", "answer"])?;
    let text = docs[..40].join("\n\n");
    let max = 2048;
    let opts = PairOptions {
        add_special_tokens: true,
        max_student_tokens: Some(max),
        max_teacher_tokens: Some(max),
    };
    let p = tokenize_pair(&text, &s, &t, opts)?;
    let (ns, nt) = (p.student_ids.len(), p.teacher_ids.len());
    println!(
        "{sn} -> {tn}: one sample, {ns} student / {nt} teacher tokens, {} chunks",
        p.chunks.len()
    );
    let reps = 2000;
    let t0 = Instant::now();
    for _ in 0..reps {
        std::hint::black_box(align_text(&p.text, &p.student_ids, &p.teacher_ids, &s, &t)?);
    }
    let per = t0.elapsed().as_secs_f64() / reps as f64;
    println!(
        "align_text: {:.1} us per sample ({:.1} M tokens/s, both sides)",
        per * 1e6,
        (ns + nt) as f64 / per / 1e6
    );
    let t0 = Instant::now();
    for _ in 0..reps {
        std::hint::black_box(align(&p.student_ids, &p.teacher_ids, &s.bytes, &t.bytes)?);
    }
    let per = t0.elapsed().as_secs_f64() / reps as f64;
    println!("align (ids only): {:.1} us per sample", per * 1e6);
    let t0 = Instant::now();
    let reps_tok = 50;
    for _ in 0..reps_tok {
        std::hint::black_box(s.encode(&p.text, true)?);
        std::hint::black_box(t.encode(&p.text, true)?);
    }
    let per = t0.elapsed().as_secs_f64() / reps_tok as f64;
    println!(
        "tokenizing the same text with both: {:.1} us per sample",
        per * 1e6
    );
    Ok(())
}
