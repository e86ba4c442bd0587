//! `trainer align` (align a corpus, print totals and speed) and `trainer build-projection`.

use anyhow::{bail, Context, Result};
use serde::Serialize;
use std::io::{BufRead, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::pair::{align_text, canonical_text, AlignTokenizer, TokenizedPair};
use super::projection::ProjectionMaps;

#[derive(clap::Args, Debug, Clone)]
pub struct AlignArgs {
    /// Student tokenizer.json.
    #[arg(long)]
    pub student_tokenizer: PathBuf,
    /// Teacher tokenizer.json.
    #[arg(long)]
    pub teacher_tokenizer: PathBuf,
    /// JSONL (one object per line) or plain text (documents separated by blank lines).
    #[arg(long)]
    pub input: PathBuf,
    /// JSONL field(s) holding the text; several comma-separated fields are joined with "\n"
    /// (e.g. `question,answer`).
    #[arg(long, default_value = "text")]
    pub text_field: String,
    /// Write one JSON line per document: student_ids, teacher_ids, chunks `[[s0,s1,t0,t1],...]`.
    #[arg(long)]
    pub output: Option<PathBuf>,
    /// Do not let the tokenizers add their BOS/EOS.
    #[arg(long)]
    pub no_special_tokens: bool,
    /// Truncate both sides at a common chunk boundary within these limits.
    #[arg(long)]
    pub max_student_tokens: Option<usize>,
    #[arg(long)]
    pub max_teacher_tokens: Option<usize>,
    /// Stop after this many documents.
    #[arg(long)]
    pub limit: Option<usize>,
}

#[derive(clap::Args, Debug, Clone)]
pub struct BuildProjectionArgs {
    #[arg(long)]
    pub student_tokenizer: PathBuf,
    #[arg(long)]
    pub teacher_tokenizer: PathBuf,
    /// Output file (safetensors, see docs/alignment.md).
    #[arg(long)]
    pub out: PathBuf,
    /// Entries per row.
    #[arg(long, default_value_t = 4)]
    pub max_entries: usize,
}

/// Documents of a JSONL file (text in `fields`) or of a plain-text file (blank-line separated).
pub fn read_documents(path: &Path, fields: &[&str]) -> Result<Vec<String>> {
    let file = std::fs::File::open(path).with_context(|| format!("{}", path.display()))?;
    let lines: Vec<String> = std::io::BufReader::new(file)
        .lines()
        .collect::<std::io::Result<_>>()
        .with_context(|| format!("reading {}", path.display()))?;
    let jsonl = lines
        .iter()
        .find(|l| !l.trim().is_empty())
        .is_some_and(|l| l.trim_start().starts_with('{'));
    let mut docs = Vec::new();
    if jsonl {
        for (n, line) in lines.iter().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            let v: serde_json::Value = serde_json::from_str(line)
                .with_context(|| format!("{}:{}: invalid JSON", path.display(), n + 1))?;
            let mut parts = Vec::with_capacity(fields.len());
            for f in fields {
                match v.get(f) {
                    Some(serde_json::Value::String(s)) => parts.push(s.as_str()),
                    _ => bail!("{}:{}: no string field {f:?}", path.display(), n + 1),
                }
            }
            docs.push(parts.join("\n"));
        }
    } else {
        let mut cur: Vec<&str> = Vec::new();
        for line in lines.iter().chain(std::iter::once(&String::new())) {
            if line.trim().is_empty() {
                if !cur.is_empty() {
                    docs.push(cur.join("\n"));
                    cur.clear();
                }
            } else {
                cur.push(line);
            }
        }
    }
    Ok(docs)
}

#[derive(Serialize)]
struct OutLine<'a> {
    student_ids: &'a [u32],
    teacher_ids: &'a [u32],
    chunks: Vec<[usize; 4]>,
}

/// Totals of an alignment run.
#[derive(Debug, Default, Clone)]
pub struct AlignTotals {
    pub documents: usize,
    pub failed: usize,
    pub student_tokens: usize,
    pub teacher_tokens: usize,
    pub chunks: usize,
    pub one_to_one: usize,
    pub masked: usize,
    pub tokenize: Duration,
    pub align: Duration,
}

pub fn run_align(a: AlignArgs) -> Result<()> {
    let t0 = Instant::now();
    let student = AlignTokenizer::from_file(&a.student_tokenizer)?;
    let teacher = AlignTokenizer::from_file(&a.teacher_tokenizer)?;
    let fields: Vec<&str> = a.text_field.split(',').map(str::trim).collect();
    let mut docs = read_documents(&a.input, &fields)?;
    if let Some(l) = a.limit {
        docs.truncate(l);
    }
    tracing::info!(
        "loaded tokenizers and {} documents in {:.2}s",
        docs.len(),
        t0.elapsed().as_secs_f64()
    );
    let mut out = match &a.output {
        Some(p) => Some(BufWriter::new(
            std::fs::File::create(p).with_context(|| format!("{}", p.display()))?,
        )),
        None => None,
    };
    let bar = indicatif::ProgressBar::new(docs.len() as u64);
    let mut tot = AlignTotals::default();
    for (n, text) in docs.iter().enumerate() {
        bar.inc(1);
        tot.documents += 1;
        // Tokenization (timed): both sides, exactly what a data loader does.
        let t = Instant::now();
        let text = canonical_text(text, &student.bytes, &teacher.bytes)?;
        let s_ids = student.encode(&text, !a.no_special_tokens)?;
        let t_ids = teacher.encode(&text, !a.no_special_tokens)?;
        tot.tokenize += t.elapsed();
        // Alignment (timed): the spelling check against the text and the walk.
        let t = Instant::now();
        let chunks = align_text(&text, &s_ids, &t_ids, &student, &teacher);
        tot.align += t.elapsed();
        let chunks = match chunks {
            Ok(c) => c,
            Err(e) => {
                tot.failed += 1;
                bar.suspend(|| tracing::warn!("document {n}: {e}"));
                continue;
            }
        };
        let mut pair = TokenizedPair {
            text: text.into_owned(),
            student_ids: s_ids,
            teacher_ids: t_ids,
            chunks,
            truncated: false,
        };
        pair.truncate(a.max_student_tokens, a.max_teacher_tokens);
        tot.student_tokens += pair.student_ids.len();
        tot.teacher_tokens += pair.teacher_ids.len();
        tot.chunks += pair.chunks.len();
        tot.one_to_one += pair.chunks.iter().filter(|c| c.is_one_to_one()).count();
        let covered_s: usize = pair.chunks.iter().map(|c| c.student.len()).sum();
        let covered_t: usize = pair.chunks.iter().map(|c| c.teacher.len()).sum();
        tot.masked += pair.student_ids.len() - covered_s + pair.teacher_ids.len() - covered_t;
        if let Some(w) = out.as_mut() {
            let line = OutLine {
                student_ids: &pair.student_ids,
                teacher_ids: &pair.teacher_ids,
                chunks: pair
                    .chunks
                    .iter()
                    .map(|c| {
                        [
                            c.student.start,
                            c.student.end,
                            c.teacher.start,
                            c.teacher.end,
                        ]
                    })
                    .collect(),
            };
            serde_json::to_writer(&mut *w, &line)?;
            w.write_all(b"\n")?;
        }
    }
    bar.finish_and_clear();
    if let Some(mut w) = out {
        w.flush()?;
    }
    print_totals(&tot);
    if tot.failed > 0 {
        bail!(
            "{} of {} documents could not be aligned",
            tot.failed,
            tot.documents
        );
    }
    Ok(())
}

fn print_totals(t: &AlignTotals) {
    let toks = (t.student_tokens + t.teacher_tokens) as f64;
    let rate = |d: Duration| toks / d.as_secs_f64().max(1e-12);
    println!("documents           {}", t.documents);
    println!("failed              {}", t.failed);
    println!("student tokens      {}", t.student_tokens);
    println!("teacher tokens      {}", t.teacher_tokens);
    println!("chunks              {}", t.chunks);
    println!(
        "one-to-one chunks   {} ({:.1}%)",
        t.one_to_one,
        100.0 * t.one_to_one as f64 / t.chunks.max(1) as f64
    );
    println!("masked specials     {}", t.masked);
    println!(
        "tokenization        {:.3} s  {:.0} tokens/s (both sides)",
        t.tokenize.as_secs_f64(),
        rate(t.tokenize)
    );
    println!(
        "alignment           {:.3} s  {:.0} tokens/s (both sides)",
        t.align.as_secs_f64(),
        rate(t.align)
    );
    println!(
        "alignment / tokenization time  {:.3}",
        t.align.as_secs_f64() / t.tokenize.as_secs_f64().max(1e-12)
    );
}

pub fn run_build_projection(a: BuildProjectionArgs) -> Result<()> {
    let t0 = Instant::now();
    let student = AlignTokenizer::from_file(&a.student_tokenizer)?;
    let teacher = AlignTokenizer::from_file(&a.teacher_tokenizer)?;
    let sh = xdistill_shared::hf::file_sha256(&a.student_tokenizer)?;
    let th = xdistill_shared::hf::file_sha256(&a.teacher_tokenizer)?;
    let load = t0.elapsed();
    let t1 = Instant::now();
    let p = ProjectionMaps::build(&student, &teacher, a.max_entries, sh, th)?;
    let build = t1.elapsed();
    p.save(&a.out)?;
    for (name, m, exact) in [
        ("student->teacher", &p.student_to_teacher, p.s2t_exact),
        ("teacher->student", &p.teacher_to_student, p.t2s_exact),
    ] {
        println!(
            "{name}: rows {}  entries {}  exact {} ({:.1}%)",
            m.rows(),
            m.nnz(),
            exact,
            100.0 * exact as f64 / m.rows().max(1) as f64
        );
    }
    println!(
        "load {:.2} s  build {:.2} s  wrote {}",
        load.as_secs_f64(),
        build.as_secs_f64(),
        a.out.display()
    );
    Ok(())
}
