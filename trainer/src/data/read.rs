//! Reading a JSONL or plain-text file into records, skipping and counting bad ones.

use super::{Content, DataError, Record, SkipCounts, SkipReason};
use crate::config::{DataConfig, DataFormat};
use std::io::{BufRead, Read};
use std::path::Path;

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
                for_each_line(reader, jsonl_line_limit(opts), |line_no, bytes| match bytes
                    .ok_or(SkipReason::TooLongBytes)
                {
                    Ok(bytes) => match parse_jsonl(bytes, line_no, opts) {
                        Ok(rec) => ds.records.push(rec),
                        Err(r) => skip(&mut ds, line_no, r),
                    },
                    Err(r) => skip(&mut ds, line_no, r),
                })
                .map_err(io)?;
            }
            DataFormat::Text => {
                // A document is held up to `max_record_bytes`; past that only its end is looked
                // for (`too_long`), and it is skipped.
                let mut doc: Vec<u8> = Vec::new();
                let mut doc_line = 0usize;
                let mut too_long = false;
                let finish =
                    |ds: &mut Dataset, doc: &mut Vec<u8>, too_long: &mut bool, line: usize| {
                        if std::mem::take(too_long) {
                            skip(ds, line, SkipReason::TooLongBytes);
                        } else if !doc.is_empty() {
                            match text_record(doc, line, opts) {
                                Ok(rec) => ds.records.push(rec),
                                Err(r) => skip(ds, line, r),
                            }
                        }
                        doc.clear();
                    };
                let max = opts.max_record_bytes;
                for_each_line(reader, max, |line_no, bytes| match bytes {
                    Some(b) if b.iter().all(u8::is_ascii_whitespace) => {
                        finish(&mut ds, &mut doc, &mut too_long, doc_line);
                    }
                    _ => {
                        if doc.is_empty() && !too_long {
                            doc_line = line_no;
                        }
                        let sep = usize::from(!doc.is_empty());
                        match bytes {
                            Some(b) if !too_long && doc.len() + sep + b.len() <= max => {
                                if sep == 1 {
                                    doc.push(b'\n');
                                }
                                doc.extend_from_slice(b);
                            }
                            _ => {
                                too_long = true;
                                doc.clear();
                            }
                        }
                    }
                })
                .map_err(io)?;
                finish(&mut ds, &mut doc, &mut too_long, doc_line);
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
}

const UTF8_BOM: &[u8] = b"\xEF\xBB\xBF";

/// The longest JSONL line read: the record's text may take up to `max_record_bytes`, and its
/// JSON (escapes, other fields) several times that; a longer line is skipped unread.
fn jsonl_line_limit(opts: &LoadOptions) -> usize {
    opts.max_record_bytes.saturating_mul(8).max(16 << 20)
}

/// Calls `f(line_number, Some(bytes))` for each line, without the trailing `\n` / `\r\n` (and
/// without a UTF-8 byte order mark at the start of the file); `f(line_number, None)` for a line
/// of more than `max_line` bytes, which is passed over without being held in memory (a
/// multi-gigabyte file without a newline is one record too long, not an out-of-memory kill).
pub(super) fn for_each_line(
    mut reader: impl BufRead,
    max_line: usize,
    mut f: impl FnMut(usize, Option<&[u8]>),
) -> std::io::Result<()> {
    let mut buf = Vec::new();
    let mut line_no = 0;
    // The line's bytes, its `\r\n` and a byte order mark before it.
    let keep = max_line.saturating_add(8) as u64;
    loop {
        buf.clear();
        if reader.by_ref().take(keep).read_until(b'\n', &mut buf)? == 0 {
            return Ok(());
        }
        line_no += 1;
        if buf.len() as u64 == keep && buf.last() != Some(&b'\n') {
            skip_line(&mut reader)?;
            f(line_no, None);
            continue;
        }
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
        if end - begin > max_line {
            f(line_no, None);
        } else {
            f(line_no, Some(&buf[begin..end]));
        }
    }
}

/// Consumes the rest of the current line (through its `\n`, or to the end of the file).
fn skip_line(reader: &mut impl BufRead) -> std::io::Result<()> {
    loop {
        let avail = reader.fill_buf()?;
        if avail.is_empty() {
            return Ok(());
        }
        match avail.iter().position(|&b| b == b'\n') {
            Some(i) => {
                reader.consume(i + 1);
                return Ok(());
            }
            None => {
                let n = avail.len();
                reader.consume(n);
            }
        }
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
