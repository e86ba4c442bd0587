//! Training text: reading JSONL or plain-text files into [`Record`]s (skipping and counting bad
//! ones), a deterministic validation split, per-epoch shuffling from a seed, and a [`Batcher`]
//! whose [`DataPosition`] goes into checkpoints so that a resumed run sees the same batches.
//!
//! Data stays text here: tokenization and alignment happen downstream.

use crate::config::{DataConfig, DataFormat};
use rand::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use std::io::BufRead;
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: no usable records ({skipped})")]
    NoRecords { path: PathBuf, skipped: SkipCounts },
    #[error("validation split of {val} records leaves no training records (of {total})")]
    SplitTooLarge { val: usize, total: usize },
    #[error("data position {position:?} is past the end of an epoch of {len} records")]
    BadPosition { position: DataPosition, len: usize },
}

/// What a record holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Content {
    /// One text; loss on every token.
    Text { text: String },
    /// A prompt (separator already appended) and its completion.
    Pair { prompt: String, completion: String },
}

/// One training example.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    /// 1-based line of the source file where the record starts (for messages).
    pub line: usize,
    pub content: Content,
    /// With [`Content::Pair`]: the loss covers only the completion's tokens.
    pub completion_only_loss: bool,
    /// The teacher this record names (`data.teacher_field`), when it names one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub teacher: Option<String>,
}

impl Record {
    /// The full text to tokenize (prompt followed by completion).
    pub fn text(&self) -> String {
        match &self.content {
            Content::Text { text } => text.clone(),
            Content::Pair { prompt, completion } => format!("{prompt}{completion}"),
        }
    }
    /// Byte offset in [`Record::text`] where the loss starts: tokens that end at or before it
    /// are not trained on.
    pub fn loss_start_byte(&self) -> usize {
        match &self.content {
            Content::Pair { prompt, .. } if self.completion_only_loss => prompt.len(),
            _ => 0,
        }
    }
    pub fn len_bytes(&self) -> usize {
        match &self.content {
            Content::Text { text } => text.len(),
            Content::Pair { prompt, completion } => prompt.len() + completion.len(),
        }
    }
}

/// Why a record was skipped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SkipReason {
    Empty,
    InvalidUtf8,
    BadJson,
    MissingField,
    TooLongBytes,
    TooLongTokens,
}

/// Counts of skipped records, by reason; reported by the training loop.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct SkipCounts {
    pub empty: u64,
    pub invalid_utf8: u64,
    pub bad_json: u64,
    /// The field is absent or not a string.
    pub missing_field: u64,
    pub too_long_bytes: u64,
    pub too_long_tokens: u64,
}

impl SkipCounts {
    pub fn total(&self) -> u64 {
        self.empty
            + self.invalid_utf8
            + self.bad_json
            + self.missing_field
            + self.too_long_bytes
            + self.too_long_tokens
    }
    pub fn add(&mut self, r: SkipReason) {
        match r {
            SkipReason::Empty => self.empty += 1,
            SkipReason::InvalidUtf8 => self.invalid_utf8 += 1,
            SkipReason::BadJson => self.bad_json += 1,
            SkipReason::MissingField => self.missing_field += 1,
            SkipReason::TooLongBytes => self.too_long_bytes += 1,
            SkipReason::TooLongTokens => self.too_long_tokens += 1,
        }
    }
}

impl std::fmt::Display for SkipCounts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} skipped: {} empty, {} invalid UTF-8, {} bad JSON, {} missing field, \
             {} too long (bytes), {} too long (tokens)",
            self.total(),
            self.empty,
            self.invalid_utf8,
            self.bad_json,
            self.missing_field,
            self.too_long_bytes,
            self.too_long_tokens
        )
    }
}

/// How to read a data file.
#[derive(Debug, Clone, PartialEq)]
pub struct LoadOptions {
    /// `Jsonl` or `Text` (`Auto` is resolved from the extension when loading).
    pub format: DataFormat,
    pub text_field: String,
    /// Prompt and completion fields (both or neither).
    pub pair_fields: Option<(String, String)>,
    /// Read only the prompt field: every record is a prompt with an empty completion.
    pub prompts_only: bool,
    pub separator: String,
    pub completion_only_loss: bool,
    pub max_record_bytes: usize,
    /// JSONL field naming the record's teacher.
    pub teacher_field: Option<String>,
}

impl LoadOptions {
    pub fn from_config(d: &DataConfig) -> LoadOptions {
        LoadOptions {
            format: d.format,
            text_field: d.text_field.clone(),
            pair_fields: d.prompt_field.clone().zip(
                d.completion_field
                    .clone()
                    .or_else(|| d.prompts_only.then(String::new)),
            ),
            prompts_only: d.prompts_only,
            separator: d.separator.clone(),
            completion_only_loss: d.completion_only_loss,
            max_record_bytes: d.max_record_bytes,
            teacher_field: d.teacher_field.clone(),
        }
    }
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions::from_config(&DataConfig::default())
    }
}

/// Records read from one file, and what was skipped.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Dataset {
    pub records: Vec<Record>,
    pub skipped: SkipCounts,
}

/// How many skipped records are reported individually in the log.
const SKIP_LOG_LIMIT: u64 = 5;

impl Dataset {
    /// Reads `path`; bad records are skipped and counted, never fatal. Fails only on I/O errors
    /// or when no record is usable.
    pub fn load(path: &Path, opts: &LoadOptions) -> Result<Dataset, DataError> {
        let io = |source| DataError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = std::fs::File::open(path).map_err(io)?;
        let reader = std::io::BufReader::new(file);
        let format = opts.format.resolve(path);
        let mut ds = Dataset::default();
        let skip = |ds: &mut Dataset, line: usize, r: SkipReason| {
            ds.skipped.add(r);
            if ds.skipped.total() <= SKIP_LOG_LIMIT {
                tracing::warn!("{}:{line}: skipping record ({r:?})", path.display());
            }
        };
        match format {
            DataFormat::Jsonl | DataFormat::Auto => {
                for_each_line(reader, |line_no, bytes| {
                    match parse_jsonl(bytes, line_no, opts) {
                        Ok(rec) => ds.records.push(rec),
                        Err(r) => skip(&mut ds, line_no, r),
                    }
                })
                .map_err(io)?;
            }
            DataFormat::Text => {
                let mut doc: Vec<u8> = Vec::new();
                let mut doc_line = 0usize;
                let finish = |ds: &mut Dataset, doc: &mut Vec<u8>, line: usize| {
                    if !doc.is_empty() {
                        match text_record(doc, line, opts) {
                            Ok(rec) => ds.records.push(rec),
                            Err(r) => skip(ds, line, r),
                        }
                        doc.clear();
                    }
                };
                for_each_line(reader, |line_no, bytes| {
                    if bytes.iter().all(u8::is_ascii_whitespace) {
                        finish(&mut ds, &mut doc, doc_line);
                    } else {
                        if doc.is_empty() {
                            doc_line = line_no;
                        } else {
                            doc.push(b'\n');
                        }
                        doc.extend_from_slice(bytes);
                    }
                })
                .map_err(io)?;
                finish(&mut ds, &mut doc, doc_line);
            }
        }
        if ds.skipped.total() > 0 {
            tracing::warn!("{}: {}", path.display(), ds.skipped);
        }
        if ds.records.is_empty() {
            return Err(DataError::NoRecords {
                path: path.to_path_buf(),
                skipped: ds.skipped,
            });
        }
        Ok(ds)
    }

    /// Skips (and counts) records whose token count exceeds `max_tokens`; `count` tokenizes.
    pub fn drop_too_long_tokens(
        &mut self,
        max_tokens: usize,
        count: impl Fn(&Record) -> usize + Sync,
    ) {
        self.drop_where(&|r: &Record| count(r) > max_tokens);
    }

    /// Skips (and counts as too long in tokens) the records `too_long` picks, tested in
    /// parallel; the first few are logged with their line numbers.
    pub fn drop_where(&mut self, too_long: &(dyn Fn(&Record) -> bool + Sync)) {
        use rayon::prelude::*;
        let drop: Vec<bool> = self.records.par_iter().map(too_long).collect();
        for r in self
            .records
            .iter()
            .zip(&drop)
            .filter(|x| *x.1)
            .take(SKIP_LOG_LIMIT as usize)
        {
            tracing::warn!("line {}: skipping record (TooLongTokens)", r.0.line);
        }
        let mut it = drop.iter();
        let before = self.records.len();
        self.records.retain(|_| !*it.next().unwrap_or(&false));
        self.skipped.too_long_tokens += (before - self.records.len()) as u64;
    }

    /// Splits off `val_count` records chosen by a seeded permutation; both parts keep file order.
    /// The split depends only on the record count and the seed, so it is the same on resume.
    pub fn split_validation(
        self,
        val_count: usize,
        seed: u64,
    ) -> Result<(Dataset, Dataset), DataError> {
        let n = self.records.len();
        if val_count == 0 {
            return Ok((self, Dataset::default()));
        }
        if val_count >= n {
            return Err(DataError::SplitTooLarge {
                val: val_count,
                total: n,
            });
        }
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        rng.set_stream(VAL_SPLIT_STREAM);
        let mut perm: Vec<usize> = (0..n).collect();
        shuffle(&mut perm, &mut rng);
        let mut is_val = vec![false; n];
        for &i in &perm[..val_count] {
            is_val[i] = true;
        }
        let (mut train, mut val) = (
            Vec::with_capacity(n - val_count),
            Vec::with_capacity(val_count),
        );
        for (r, v) in self.records.into_iter().zip(is_val) {
            if v {
                val.push(r)
            } else {
                train.push(r)
            }
        }
        Ok((
            Dataset {
                records: train,
                skipped: self.skipped,
            },
            Dataset {
                records: val,
                skipped: SkipCounts::default(),
            },
        ))
    }
}

/// Reads the training data and its validation part as `[data]` describes: `val_path` when set,
/// else `val_count` / `val_fraction` records held out of `train_path` by `seed`.
/// Returns (train, validation); the validation set may be empty.
pub fn load_train_val(d: &DataConfig, seed: u64) -> Result<(Dataset, Dataset), DataError> {
    let opts = LoadOptions::from_config(d);
    let all = Dataset::load(&d.train_path, &opts)?;
    match &d.val_path {
        Some(vp) => Ok((all, Dataset::load(vp, &opts)?)),
        None => {
            let n = val_size(all.records.len(), d.val_fraction, d.val_count);
            all.split_validation(n, seed)
        }
    }
}

impl BatchOptions {
    /// Training batches as the config describes them.
    pub fn from_config(c: &crate::config::Config) -> BatchOptions {
        BatchOptions {
            batch_size: c.distillation.num_prompts_per_step,
            seed: c.distillation.seed,
            shuffle: c.data.shuffle,
            drop_last: c.data.drop_last,
            max_epochs: c.distillation.max_num_epochs,
        }
    }
}

/// Validation size: `count` when given, else `round(fraction · n)`.
pub fn val_size(n: usize, fraction: f64, count: Option<usize>) -> usize {
    count.unwrap_or_else(|| (fraction * n as f64).round() as usize)
}

/// The RNG stream used for the validation split (epochs use streams 0, 1, 2, ...).
const VAL_SPLIT_STREAM: u64 = u64::MAX;

const UTF8_BOM: &[u8] = b"\xEF\xBB\xBF";

/// Calls `f(line_number, bytes)` for each line, without the trailing `\n` / `\r\n` (and
/// without a UTF-8 byte order mark at the start of the file).
fn for_each_line(mut reader: impl BufRead, mut f: impl FnMut(usize, &[u8])) -> std::io::Result<()> {
    let mut buf = Vec::new();
    let mut line_no = 0;
    loop {
        buf.clear();
        if reader.read_until(b'\n', &mut buf)? == 0 {
            return Ok(());
        }
        line_no += 1;
        let mut end = buf.len();
        if end > 0 && buf[end - 1] == b'\n' {
            end -= 1;
        }
        if end > 0 && buf[end - 1] == b'\r' {
            end -= 1;
        }
        // A UTF-8 byte order mark (written by some editors) is not part of the first record.
        let begin = if line_no == 1 && buf[..end].starts_with(UTF8_BOM) {
            UTF8_BOM.len()
        } else {
            0
        };
        f(line_no, &buf[begin..end]);
    }
}

fn parse_jsonl(bytes: &[u8], line: usize, opts: &LoadOptions) -> Result<Record, SkipReason> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Err(SkipReason::Empty);
    }
    let text = std::str::from_utf8(bytes).map_err(|_| SkipReason::InvalidUtf8)?;
    let obj: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(text).map_err(|_| SkipReason::BadJson)?;
    let field = |name: &str| -> Result<&str, SkipReason> {
        obj.get(name)
            .and_then(|v| v.as_str())
            .ok_or(SkipReason::MissingField)
    };
    let content = match &opts.pair_fields {
        Some((p, _)) if opts.prompts_only => {
            let prompt = field(p)?;
            if prompt.trim().is_empty() {
                return Err(SkipReason::Empty);
            }
            Content::Pair {
                prompt: format!("{prompt}{}", opts.separator),
                completion: String::new(),
            }
        }
        Some((p, c)) => {
            let (prompt, completion) = (field(p)?, field(c)?);
            if completion.trim().is_empty()
                || (prompt.trim().is_empty() && !opts.completion_only_loss)
            {
                return Err(SkipReason::Empty);
            }
            Content::Pair {
                prompt: format!("{prompt}{}", opts.separator),
                completion: completion.to_string(),
            }
        }
        None => {
            let t = field(&opts.text_field)?;
            if t.trim().is_empty() {
                return Err(SkipReason::Empty);
            }
            Content::Text {
                text: t.to_string(),
            }
        }
    };
    let teacher = match opts.teacher_field.as_deref().and_then(|f| obj.get(f)) {
        None | Some(serde_json::Value::Null) => None,
        Some(serde_json::Value::String(name)) => Some(name.clone()),
        Some(_) => return Err(SkipReason::MissingField),
    };
    let rec = Record {
        line,
        content,
        completion_only_loss: opts.completion_only_loss && opts.pair_fields.is_some(),
        teacher,
    };
    if rec.len_bytes() > opts.max_record_bytes {
        return Err(SkipReason::TooLongBytes);
    }
    Ok(rec)
}

fn text_record(doc: &[u8], line: usize, opts: &LoadOptions) -> Result<Record, SkipReason> {
    if doc.len() > opts.max_record_bytes {
        return Err(SkipReason::TooLongBytes);
    }
    let text = std::str::from_utf8(doc).map_err(|_| SkipReason::InvalidUtf8)?;
    Ok(Record {
        line,
        content: Content::Text {
            text: text.to_string(),
        },
        completion_only_loss: false,
        teacher: None,
    })
}

/// Uniform integer in `[0, bound)` by rejection (independent of `rand`'s version-specific
/// algorithms, so the order of a seed never changes under a dependency update).
fn below(rng: &mut ChaCha8Rng, bound: u64) -> u64 {
    debug_assert!(bound > 0);
    // Largest multiple of `bound` that fits in u64; reject draws at or above it.
    let zone = u64::MAX - (u64::MAX % bound);
    loop {
        let x = rng.next_u64();
        if x < zone {
            return x % bound;
        }
    }
}

/// Fisher–Yates shuffle.
fn shuffle<T>(v: &mut [T], rng: &mut ChaCha8Rng) {
    for i in (1..v.len()).rev() {
        let j = below(rng, i as u64 + 1) as usize;
        v.swap(i, j);
    }
}

/// The order in which epoch `epoch` visits `n` records: a permutation seeded by `(seed, epoch)`,
/// or `0..n` without shuffling.
pub fn epoch_order(n: usize, seed: u64, epoch: u64, shuffled: bool) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n).collect();
    if shuffled {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        rng.set_stream(epoch);
        shuffle(&mut order, &mut rng);
    }
    order
}

/// Where the next batch starts: the epoch and the index into that epoch's order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct DataPosition {
    pub epoch: u64,
    pub index: usize,
}

/// One step's records.
#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    pub records: Vec<Record>,
    /// Position of this batch's first record.
    pub start: DataPosition,
    /// Position of the batch after this one: save this in the checkpoint of the step that
    /// trained on this batch.
    pub next: DataPosition,
}

/// Batching options.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BatchOptions {
    pub batch_size: usize,
    pub seed: u64,
    pub shuffle: bool,
    pub drop_last: bool,
    /// The iterator ends after this many epochs.
    pub max_epochs: u64,
}

/// Yields batches of `batch_size` records, epoch after epoch. Batches never span two epochs:
/// an epoch's last batch may be smaller (or dropped with `drop_last`).
#[derive(Debug, Clone)]
pub struct Batcher {
    records: Vec<Record>,
    opts: BatchOptions,
    pos: DataPosition,
    order: Vec<usize>,
    order_epoch: Option<u64>,
}

impl Batcher {
    pub fn new(records: Vec<Record>, opts: BatchOptions) -> Batcher {
        Batcher {
            records,
            opts: BatchOptions {
                batch_size: opts.batch_size.max(1),
                ..opts
            },
            pos: DataPosition::default(),
            order: Vec::new(),
            order_epoch: None,
        }
    }

    /// Continues from `pos` (from a checkpoint's `Batch::next`).
    pub fn seek(&mut self, pos: DataPosition) -> Result<(), DataError> {
        if pos.index > self.records.len() {
            return Err(DataError::BadPosition {
                position: pos,
                len: self.records.len(),
            });
        }
        self.pos = pos;
        Ok(())
    }

    pub fn position(&self) -> DataPosition {
        self.pos
    }

    pub fn len_records(&self) -> usize {
        self.records.len()
    }

    /// Batches per epoch.
    pub fn steps_per_epoch(&self) -> usize {
        let (n, b) = (self.records.len(), self.opts.batch_size);
        if self.opts.drop_last {
            n / b
        } else {
            n.div_ceil(b)
        }
    }

    /// Moves to the next epoch when the current one has no (full enough) batch left.
    fn normalize(&mut self) {
        let (n, b) = (self.records.len(), self.opts.batch_size);
        let left = n.saturating_sub(self.pos.index);
        if left == 0 || (self.opts.drop_last && left < b) {
            self.pos = DataPosition {
                epoch: self.pos.epoch + 1,
                index: 0,
            };
        }
    }
}

impl Iterator for Batcher {
    type Item = Batch;

    fn next(&mut self) -> Option<Batch> {
        let (n, b) = (self.records.len(), self.opts.batch_size);
        if n == 0 || (self.opts.drop_last && n < b) {
            return None;
        }
        self.normalize();
        if self.pos.epoch >= self.opts.max_epochs {
            return None;
        }
        if self.order_epoch != Some(self.pos.epoch) {
            self.order = epoch_order(n, self.opts.seed, self.pos.epoch, self.opts.shuffle);
            self.order_epoch = Some(self.pos.epoch);
        }
        let start = self.pos;
        let end = (start.index + b).min(n);
        let records = self.order[start.index..end]
            .iter()
            .map(|&i| self.records[i].clone())
            .collect();
        self.pos.index = end;
        self.normalize();
        Some(Batch {
            records,
            start,
            next: self.pos,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
        let p = dir.join(name);
        std::fs::File::create(&p).unwrap().write_all(bytes).unwrap();
        p
    }

    fn opts(max: usize) -> LoadOptions {
        LoadOptions {
            max_record_bytes: max,
            ..LoadOptions::default()
        }
    }

    #[test]
    fn teacher_field_names_each_records_teacher() {
        let dir = tempfile::tempdir().unwrap();
        let f = b"{\"text\": \"a\", \"domain\": \"math\"}\n{\"text\": \"b\"}\n{\"text\": \"c\", \"domain\": null}\n{\"text\": \"d\", \"domain\": 3}\n";
        let p = write(dir.path(), "d.jsonl", f);
        let o = LoadOptions {
            teacher_field: Some("domain".into()),
            ..opts(100)
        };
        let ds = Dataset::load(&p, &o).unwrap();
        let got: Vec<_> = ds
            .records
            .iter()
            .map(|r| (r.text(), r.teacher.clone()))
            .collect();
        // A missing or null field names no teacher; a non-string one skips the record.
        assert_eq!(
            got,
            [
                ("a".to_string(), Some("math".to_string())),
                ("b".to_string(), None),
                ("c".to_string(), None)
            ]
        );
        assert_eq!(ds.skipped.missing_field, 1);
        // Without teacher_field the field is not read.
        let ds = Dataset::load(&p, &opts(100)).unwrap();
        assert!(ds.records.iter().all(|r| r.teacher.is_none()) && ds.records.len() == 4);
    }

    #[test]
    fn jsonl_bad_records_are_skipped_and_counted() {
        let dir = tempfile::tempdir().unwrap();
        let mut f = Vec::new();
        f.extend_from_slice(b"{\"text\": \"good one\"}\n"); // 1 ok
        f.extend_from_slice(b"\n"); // 2 empty line
        f.extend_from_slice(b"   \r\n"); // 3 empty line (CRLF)
        f.extend_from_slice(b"{\"text\": \"\"}\n"); // 4 empty text
        f.extend_from_slice(b"{\"text\": \"bad \xff\xfe utf8\"}\n"); // 5 invalid UTF-8
        f.extend_from_slice(b"{\"text\": \"unterminated\n"); // 6 bad JSON
        f.extend_from_slice(b"[1, 2]\n"); // 7 not an object: bad JSON
        f.extend_from_slice(b"{\"other\": \"x\"}\n"); // 8 missing field
        f.extend_from_slice(b"{\"text\": 5}\n"); // 9 not a string: missing field
        f.extend_from_slice(b"{\"text\": \"0123456789abcdefghij-too-long\"}\n"); // 10 too long
        f.extend_from_slice("{\"text\": \"caf\u{e9} \u{1F600}\"}\r\n".as_bytes()); // 11 ok, CRLF
        f.extend_from_slice(b"{\"text\": \"last, no newline\"}"); // 12 ok
        let p = write(dir.path(), "d.jsonl", &f);
        let ds = Dataset::load(&p, &opts(20)).unwrap();
        let texts: Vec<String> = ds.records.iter().map(Record::text).collect();
        assert_eq!(
            texts,
            ["good one", "caf\u{e9} \u{1F600}", "last, no newline"]
        );
        assert_eq!(
            ds.records.iter().map(|r| r.line).collect::<Vec<_>>(),
            [1, 11, 12]
        );
        let expect = SkipCounts {
            empty: 3,
            invalid_utf8: 1,
            bad_json: 2,
            missing_field: 2,
            too_long_bytes: 1,
            too_long_tokens: 0,
        };
        assert_eq!(ds.skipped, expect);
        assert_eq!(ds.skipped.total() as usize + ds.records.len(), 12);
    }

    #[test]
    fn utf8_bom_does_not_cost_the_first_record() {
        let dir = tempfile::tempdir().unwrap();
        let p = write(
            dir.path(),
            "bom.jsonl",
            b"\xEF\xBB\xBF{\"text\": \"first\"}\r\n{\"text\": \"second\"}\n",
        );
        let ds = Dataset::load(&p, &LoadOptions::default()).unwrap();
        let texts: Vec<String> = ds.records.iter().map(Record::text).collect();
        assert_eq!(texts, ["first", "second"]);
        assert_eq!(ds.skipped.total(), 0);
        // Plain text: the BOM is not part of the first document either.
        let p = write(dir.path(), "bom.txt", b"\xEF\xBB\xBFone\n\ntwo\n");
        let ds = Dataset::load(&p, &LoadOptions::default()).unwrap();
        let texts: Vec<String> = ds.records.iter().map(Record::text).collect();
        assert_eq!(texts, ["one", "two"]);
    }

    #[test]
    fn prompts_only_records_never_carry_the_completion() {
        let dir = tempfile::tempdir().unwrap();
        let p = write(
            dir.path(),
            "p.jsonl",
            b"{\"q\": \"2+2?\", \"a\": \"4\"}\n{\"q\": \"3+3?\"}\n{\"q\": \" \"}\n{\"a\": \"5\"}\n",
        );
        let o = LoadOptions {
            pair_fields: Some(("q".into(), "a".into())),
            prompts_only: true,
            separator: "\n".into(),
            ..LoadOptions::default()
        };
        let ds = Dataset::load(&p, &o).unwrap();
        // The answer of line 1 is not read; line 2 has none and still counts; line 3 is an
        // empty prompt, line 4 has no prompt.
        let contents: Vec<&Content> = ds.records.iter().map(|r| &r.content).collect();
        let pair = |prompt: &str| Content::Pair {
            prompt: prompt.into(),
            completion: String::new(),
        };
        assert_eq!(contents, [&pair("2+2?\n"), &pair("3+3?\n")]);
        assert_eq!((ds.skipped.empty, ds.skipped.missing_field), (1, 1));
        // The same file read with completions keeps only the labelled record.
        let labelled = Dataset::load(
            &p,
            &LoadOptions {
                prompts_only: false,
                ..o
            },
        )
        .unwrap();
        assert_eq!(labelled.records.len(), 1);
    }

    #[test]
    fn prompt_completion_records_mark_the_loss_start() {
        let dir = tempfile::tempdir().unwrap();
        let p = write(
            dir.path(),
            "qa.jsonl",
            b"{\"question\": \"2+2?\", \"answer\": \"4\"}\n{\"question\": \"x\"}\n{\"question\": \"q\", \"answer\": \" \"}\n",
        );
        let o = LoadOptions {
            pair_fields: Some(("question".into(), "answer".into())),
            separator: "\n".into(),
            ..LoadOptions::default()
        };
        let ds = Dataset::load(&p, &o).unwrap();
        assert_eq!(ds.records.len(), 1);
        let r = &ds.records[0];
        assert_eq!(r.text(), "2+2?\n4");
        assert_eq!(&r.text()[r.loss_start_byte()..], "4");
        assert_eq!(ds.skipped.missing_field, 1);
        assert_eq!(ds.skipped.empty, 1);
        let all = LoadOptions {
            completion_only_loss: false,
            ..o
        };
        let ds = Dataset::load(&p, &all).unwrap();
        assert_eq!(ds.records[0].loss_start_byte(), 0);
    }

    #[test]
    fn plain_text_documents_split_on_blank_lines() {
        let dir = tempfile::tempdir().unwrap();
        let mut f = Vec::new();
        f.extend_from_slice(b"\n\nfirst doc\nsecond line\n\n \t\n");
        f.extend_from_slice(b"bad \xc3\x28 doc\n\n");
        f.extend_from_slice(b"a very very long document here\n\nlast");
        let p = write(dir.path(), "d.txt", &f);
        let ds = Dataset::load(&p, &opts(25)).unwrap();
        let texts: Vec<String> = ds.records.iter().map(Record::text).collect();
        assert_eq!(texts, ["first doc\nsecond line", "last"]);
        assert_eq!(ds.records[0].line, 3);
        assert_eq!(ds.records[1].line, 11);
        assert_eq!(ds.skipped.invalid_utf8, 1);
        assert_eq!(ds.skipped.too_long_bytes, 1);
        assert_eq!(ds.skipped.total(), 2);
    }

    #[test]
    fn a_file_with_nothing_usable_is_an_error_and_a_missing_one_too() {
        let dir = tempfile::tempdir().unwrap();
        let p = write(dir.path(), "e.jsonl", b"\n\n{\"x\":1}\n");
        assert!(matches!(
            Dataset::load(&p, &LoadOptions::default()),
            Err(DataError::NoRecords { .. })
        ));
        assert!(matches!(
            Dataset::load(&dir.path().join("nope.jsonl"), &LoadOptions::default()),
            Err(DataError::Io { .. })
        ));
    }

    #[test]
    fn token_filter_counts_what_it_drops() {
        let mut ds = Dataset {
            records: ["a b c", "a", "a b c d e", "a b"]
                .iter()
                .map(|t| Record {
                    line: 1,
                    content: Content::Text {
                        text: t.to_string(),
                    },
                    completion_only_loss: false,
                    teacher: None,
                })
                .collect(),
            skipped: SkipCounts::default(),
        };
        ds.drop_too_long_tokens(3, |r| r.text().split(' ').count());
        let texts: Vec<String> = ds.records.iter().map(Record::text).collect();
        assert_eq!(texts, ["a b c", "a", "a b"]);
        assert_eq!(ds.skipped.too_long_tokens, 1);
    }

    fn numbered(n: usize) -> Vec<Record> {
        (0..n)
            .map(|i| Record {
                line: i + 1,
                content: Content::Text {
                    text: format!("r{i}"),
                },
                completion_only_loss: false,
                teacher: None,
            })
            .collect()
    }

    #[test]
    fn shuffle_is_a_seeded_permutation_and_unbiased() {
        let a = epoch_order(100, 7, 0, true);
        let mut sorted = a.clone();
        sorted.sort();
        assert_eq!(sorted, (0..100).collect::<Vec<_>>());
        assert_eq!(a, epoch_order(100, 7, 0, true));
        assert_ne!(a, epoch_order(100, 7, 1, true));
        assert_ne!(a, epoch_order(100, 8, 0, true));
        assert_eq!(epoch_order(5, 7, 0, false), [0, 1, 2, 3, 4]);
        // Uniformity: the 6 permutations of 3 items over 6000 seeds, each expected 1000 times;
        // a binomial sd is ~29, so ±150 (5 sd) fails only for a biased shuffle.
        let mut counts = std::collections::HashMap::new();
        for seed in 0..6000 {
            *counts.entry(epoch_order(3, seed, 0, true)).or_insert(0) += 1;
        }
        assert_eq!(counts.len(), 6);
        for (perm, c) in counts {
            assert!((850..=1150).contains(&c), "{perm:?} appeared {c} times");
        }
    }

    #[test]
    fn validation_split_is_deterministic_and_disjoint() {
        let ds = Dataset {
            records: numbered(50),
            skipped: SkipCounts::default(),
        };
        let n = val_size(50, 0.1, None);
        assert_eq!(n, 5);
        let (t1, v1) = ds.clone().split_validation(n, 3).unwrap();
        let (t2, v2) = ds.clone().split_validation(n, 3).unwrap();
        assert_eq!((&t1, &v1), (&t2, &v2));
        assert_eq!(v1.records.len(), 5);
        assert_eq!(t1.records.len(), 45);
        let mut lines: Vec<usize> = t1
            .records
            .iter()
            .chain(&v1.records)
            .map(|r| r.line)
            .collect();
        lines.sort();
        assert_eq!(lines, (1..=50).collect::<Vec<_>>());
        // File order is kept within each part.
        assert!(v1.records.windows(2).all(|w| w[0].line < w[1].line));
        let (_, v3) = ds.clone().split_validation(n, 4).unwrap();
        assert_ne!(v1, v3);
        assert!(matches!(
            ds.split_validation(50, 3),
            Err(DataError::SplitTooLarge { .. })
        ));
    }

    #[test]
    fn train_val_from_config() {
        let dir = tempfile::tempdir().unwrap();
        let lines: String = (0..20)
            .map(|i| format!("{{\"text\": \"doc {i}\"}}\n"))
            .collect();
        let train = write(dir.path(), "t.jsonl", lines.as_bytes());
        let mut d = DataConfig {
            train_path: train,
            val_fraction: 0.25,
            ..DataConfig::default()
        };
        let (t, v) = load_train_val(&d, 1).unwrap();
        assert_eq!((t.records.len(), v.records.len()), (15, 5));
        d.val_count = Some(2);
        let (t, v) = load_train_val(&d, 1).unwrap();
        assert_eq!((t.records.len(), v.records.len()), (18, 2));
        d.val_path = Some(write(dir.path(), "v.txt", b"one\n\ntwo\n\nthree"));
        let (t, v) = load_train_val(&d, 1).unwrap();
        assert_eq!((t.records.len(), v.records.len()), (20, 3));
    }

    fn texts(b: &Batch) -> Vec<String> {
        b.records.iter().map(Record::text).collect()
    }

    #[test]
    fn batches_cover_each_epoch_once() {
        let opts = BatchOptions {
            batch_size: 4,
            seed: 1,
            shuffle: true,
            drop_last: false,
            max_epochs: 2,
        };
        let batches: Vec<Batch> = Batcher::new(numbered(10), opts).collect();
        // 10 records / 4 = 3 batches per epoch (4, 4, 2), 2 epochs.
        assert_eq!(
            batches.iter().map(|b| b.records.len()).collect::<Vec<_>>(),
            [4, 4, 2, 4, 4, 2]
        );
        for epoch in 0..2 {
            let mut seen: Vec<String> = batches[3 * epoch..3 * epoch + 3]
                .iter()
                .flat_map(texts)
                .collect();
            seen.sort();
            let mut all: Vec<String> = (0..10).map(|i| format!("r{i}")).collect();
            all.sort();
            assert_eq!(seen, all, "epoch {epoch}");
        }
        // Order follows epoch_order for each epoch.
        let order0 = epoch_order(10, 1, 0, true);
        assert_eq!(texts(&batches[0])[0], format!("r{}", order0[0]));
        assert_eq!(batches[2].next, DataPosition { epoch: 1, index: 0 });
        assert_eq!(batches[3].start, DataPosition { epoch: 1, index: 0 });

        let dropped: Vec<Batch> = Batcher::new(
            numbered(10),
            BatchOptions {
                drop_last: true,
                ..opts
            },
        )
        .collect();
        assert_eq!(
            dropped.iter().map(|b| b.records.len()).collect::<Vec<_>>(),
            [4, 4, 4, 4]
        );
        assert_eq!(
            Batcher::new(
                numbered(10),
                BatchOptions {
                    drop_last: true,
                    ..opts
                }
            )
            .steps_per_epoch(),
            2
        );
    }

    #[test]
    fn resuming_from_a_position_continues_exactly() {
        let opts = BatchOptions {
            batch_size: 3,
            seed: 9,
            shuffle: true,
            drop_last: false,
            max_epochs: 3,
        };
        let full: Vec<Batch> = Batcher::new(numbered(8), opts).collect();
        for cut in 0..full.len() {
            let pos = if cut == 0 {
                DataPosition::default()
            } else {
                full[cut - 1].next
            };
            // The position goes through a checkpoint as JSON.
            let pos: DataPosition =
                serde_json::from_str(&serde_json::to_string(&pos).unwrap()).unwrap();
            let mut b = Batcher::new(numbered(8), opts);
            b.seek(pos).unwrap();
            let rest: Vec<Batch> = b.collect();
            assert_eq!(rest, full[cut..], "resumed after batch {cut}");
        }
        let mut b = Batcher::new(numbered(8), opts);
        assert!(b.seek(DataPosition { epoch: 0, index: 9 }).is_err());
    }
}
