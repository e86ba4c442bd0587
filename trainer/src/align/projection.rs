//! Sparse vocabulary projection between two tokenizers (student→teacher and teacher→student).
//!
//! Row r of the student→teacher map says which teacher tokens spell student token r: identical
//! byte strings map with weight 1.0; otherwise the token's bytes are re-tokenized by the teacher
//! into [t1..tn] and weighted ∝ 0.9·0.1^i (first `max_entries` tokens, duplicates summed,
//! normalized to 1). Special tokens map to the other side's special with the same content, or
//! nowhere (empty row). Built without any dense V_s × V_t matrix.
//!
//! File format: safetensors with tensors `{s2t,t2s}.{indptr (U64 [rows+1]), indices (U32
//! [nnz]), weights (F32 [nnz])}` and metadata `format = xdistill-projection`, `version = 1`,
//! `student_sha256`, `teacher_sha256`, `max_entries`, `s2t_exact`, `t2s_exact`.

use rayon::prelude::*;
use safetensors::{tensor::TensorView, Dtype, SafeTensors};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use tokenizers::Tokenizer;

use super::{AlignError, AlignTokenizer, TokenBytes};

#[derive(Debug, thiserror::Error)]
pub enum ProjectionError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: not a projection file: {reason}")]
    Format { path: PathBuf, reason: String },
    #[error(transparent)]
    Align(#[from] AlignError),
    #[error(transparent)]
    Hf(#[from] xdistill_shared::hf::HfError),
    #[error("max_entries must be at least 1")]
    NoEntries,
}

/// A sparse matrix in compressed rows: row r is `indices[indptr[r]..indptr[r+1]]` with
/// `weights` alongside (in the order of the re-tokenization, first token first).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Csr {
    /// `[rows + 1]`.
    pub indptr: Vec<u64>,
    /// `[nnz]` column (target vocabulary) ids.
    pub indices: Vec<u32>,
    /// `[nnz]` each row sums to 1 (or is empty).
    pub weights: Vec<f32>,
}

impl Csr {
    pub fn rows(&self) -> usize {
        self.indptr.len().saturating_sub(1)
    }

    pub fn nnz(&self) -> usize {
        self.indices.len()
    }

    /// Row `r`'s (ids, weights); empty when out of range.
    pub fn row(&self, r: usize) -> (&[u32], &[f32]) {
        match (self.indptr.get(r), self.indptr.get(r + 1)) {
            (Some(&a), Some(&b)) => (
                &self.indices[a as usize..b as usize],
                &self.weights[a as usize..b as usize],
            ),
            _ => (&[], &[]),
        }
    }

    /// Adds empty rows up to `n` (a padded LM head: Qwen3 has 151,936 logits for 151,669
    /// tokens; the extra rows map nowhere).
    pub fn pad_rows(&mut self, n: usize) {
        let last = self.indptr.last().copied().unwrap_or(0);
        if self.indptr.is_empty() {
            self.indptr.push(0);
        }
        while self.rows() < n {
            self.indptr.push(last);
        }
    }

    fn from_rows(rows: Vec<Vec<(u32, f32)>>) -> Csr {
        let mut m = Csr {
            indptr: Vec::with_capacity(rows.len() + 1),
            indices: Vec::new(),
            weights: Vec::new(),
        };
        m.indptr.push(0);
        for r in rows {
            for (i, w) in r {
                m.indices.push(i);
                m.weights.push(w);
            }
            m.indptr.push(m.indices.len() as u64);
        }
        m
    }
}

/// Both directions of the projection and what they were built from.
#[derive(Debug, Clone, PartialEq)]
pub struct ProjectionMaps {
    /// `[V_s, V_t]` sparse.
    pub student_to_teacher: Csr,
    /// `[V_t, V_s]` sparse.
    pub teacher_to_student: Csr,
    pub student_sha256: String,
    pub teacher_sha256: String,
    pub max_entries: usize,
    /// Rows that are an identical byte string on the other side (or the same special).
    pub s2t_exact: usize,
    pub t2s_exact: usize,
}

/// Weights ∝ 0.9·0.1^i over the first `max` of `ids`, duplicates summed, normalized.
pub fn decay_weights(ids: &[u32], max: usize) -> Vec<(u32, f32)> {
    let mut row: Vec<(u32, f64)> = Vec::with_capacity(max.min(ids.len()));
    let mut w = 0.9f64;
    for &id in ids.iter().take(max) {
        match row.iter_mut().find(|(i, _)| *i == id) {
            Some(e) => e.1 += w,
            None => row.push((id, w)),
        }
        w *= 0.1;
    }
    let sum: f64 = row.iter().map(|e| e.1).sum();
    row.into_iter()
        .map(|(i, w)| (i, (w / sum) as f32))
        .collect()
}

/// A copy of `tok` that adds no dummy-prefix space and no BOS/EOS: it spells exactly the bytes
/// it is given, so a token's bytes re-tokenize to tokens with the same bytes.
fn raw_tokenizer(tok: &Tokenizer) -> Result<Tokenizer, AlignError> {
    let bad = |e: serde_json::Error| AlignError::UnsupportedTokenizer(e.to_string());
    let mut raw = tok.clone();
    if let Some(n) = tok.get_normalizer() {
        let mut v = serde_json::to_value(n).map_err(bad)?;
        strip_prepend(&mut v);
        let n: tokenizers::NormalizerWrapper = serde_json::from_value(v).map_err(bad)?;
        raw.with_normalizer(Some(n))
            .map_err(|e| AlignError::Tokenizer(e.to_string()))?;
    }
    if let Some(p) = tok.get_pre_tokenizer() {
        let mut v = serde_json::to_value(p).map_err(bad)?;
        never_prepend(&mut v);
        let p: tokenizers::PreTokenizerWrapper = serde_json::from_value(v).map_err(bad)?;
        raw.with_pre_tokenizer(Some(p));
    }
    Ok(raw)
}

fn strip_prepend(v: &mut serde_json::Value) {
    if let Some(list) = v.get_mut("normalizers").and_then(|l| l.as_array_mut()) {
        list.retain(|n| n.get("type").and_then(|t| t.as_str()) != Some("Prepend"));
        list.iter_mut().for_each(strip_prepend);
    } else if v.get("type").and_then(|t| t.as_str()) == Some("Prepend") {
        *v = serde_json::json!({"type": "Sequence", "normalizers": []});
    }
}

fn never_prepend(v: &mut serde_json::Value) {
    if let Some(list) = v.get_mut("pretokenizers").and_then(|l| l.as_array_mut()) {
        list.iter_mut().for_each(never_prepend);
    } else if v.get("type").and_then(|t| t.as_str()) == Some("Metaspace") {
        v["prepend_scheme"] = "never".into();
    }
}

/// One direction: rows over `src`'s ids, columns in `dst`'s vocabulary.
fn build_direction(
    src: &TokenBytes,
    dst: &AlignTokenizer,
    max_entries: usize,
) -> Result<(Csr, usize), AlignError> {
    let raw = raw_tokenizer(&dst.tokenizer)?;
    let db = &dst.bytes;
    // Exact byte string → dst id (ordinary tokens before byte-fallback ones, then lowest id).
    let mut exact: HashMap<&[u8], u32> = HashMap::with_capacity(db.vocab_size());
    let mut specials: HashMap<&[u8], u32> = HashMap::new();
    let mut single: [Option<u32>; 256] = [None; 256];
    for pass_fallback in [false, true] {
        for id in 0..db.vocab_size() as u32 {
            let Some(b) = db.raw_bytes(id) else { continue };
            if db.is_special(id) {
                if !pass_fallback {
                    specials.entry(b).or_insert(id);
                }
                continue;
            }
            if b.is_empty() || db.is_byte_fallback(id) != pass_fallback {
                continue;
            }
            exact.entry(b).or_insert(id);
            if b.len() == 1 && single[b[0] as usize].is_none() {
                single[b[0] as usize] = Some(id);
            }
        }
    }
    let rows: Vec<(Vec<(u32, f32)>, bool)> = (0..src.vocab_size() as u32)
        .into_par_iter()
        .map(|id| {
            let Some(b) = src.raw_bytes(id) else {
                return (Vec::new(), false);
            };
            if src.is_special(id) {
                return match specials.get(b) {
                    Some(&t) => (vec![(t, 1.0)], true),
                    None => (Vec::new(), false),
                };
            }
            if b.is_empty() {
                return (Vec::new(), false);
            }
            if let Some(&t) = exact.get(b) {
                return (vec![(t, 1.0)], true);
            }
            // Re-tokenize: valid UTF-8 runs through the tokenizer, stray bytes as byte tokens.
            let mut ids = Vec::with_capacity(8);
            for run in b.utf8_chunks() {
                if !run.valid().is_empty() {
                    if let Ok(e) = raw.encode_fast(run.valid(), false) {
                        ids.extend_from_slice(e.get_ids());
                    }
                }
                ids.extend(run.invalid().iter().filter_map(|&x| single[x as usize]));
                if ids.len() >= max_entries {
                    break;
                }
            }
            (decay_weights(&ids, max_entries), false)
        })
        .collect();
    let n_exact = rows.iter().filter(|r| r.1).count();
    Ok((
        Csr::from_rows(rows.into_iter().map(|r| r.0).collect()),
        n_exact,
    ))
}

fn meta_get<'a>(
    meta: &'a HashMap<String, String>,
    key: &str,
    path: &Path,
) -> Result<&'a String, ProjectionError> {
    meta.get(key).ok_or_else(|| ProjectionError::Format {
        path: path.to_path_buf(),
        reason: format!("metadata has no {key}"),
    })
}

impl ProjectionMaps {
    /// Builds both directions from two tokenizers (`max_entries` per row, 4 by default).
    pub fn build(
        student: &AlignTokenizer,
        teacher: &AlignTokenizer,
        max_entries: usize,
        student_sha256: String,
        teacher_sha256: String,
    ) -> Result<ProjectionMaps, ProjectionError> {
        if max_entries == 0 {
            return Err(ProjectionError::NoEntries);
        }
        let (s2t, s2t_exact) = build_direction(&student.bytes, teacher, max_entries)?;
        let (t2s, t2s_exact) = build_direction(&teacher.bytes, student, max_entries)?;
        Ok(ProjectionMaps {
            student_to_teacher: s2t,
            teacher_to_student: t2s,
            student_sha256,
            teacher_sha256,
            max_entries,
            s2t_exact,
            t2s_exact,
        })
    }

    /// Loads both `tokenizer.json` files and builds.
    pub fn build_from_files(
        student_tokenizer: &Path,
        teacher_tokenizer: &Path,
        max_entries: usize,
    ) -> Result<ProjectionMaps, ProjectionError> {
        let s = AlignTokenizer::from_file(student_tokenizer)?;
        let t = AlignTokenizer::from_file(teacher_tokenizer)?;
        let sh = xdistill_shared::hf::file_sha256(student_tokenizer)?;
        let th = xdistill_shared::hf::file_sha256(teacher_tokenizer)?;
        ProjectionMaps::build(&s, &t, max_entries, sh, th)
    }

    /// Writes the safetensors file (to a temporary name, then renamed into place).
    pub fn save(&self, path: &Path) -> Result<(), ProjectionError> {
        let io = |source| ProjectionError::Io {
            path: path.to_path_buf(),
            source,
        };
        let fmt = |e: safetensors::SafeTensorError| ProjectionError::Format {
            path: path.to_path_buf(),
            reason: e.to_string(),
        };
        let le64 = |v: &[u64]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        let le32 = |v: &[u32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        let lef = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        let mut bufs = Vec::new();
        for (name, m) in [
            ("s2t", &self.student_to_teacher),
            ("t2s", &self.teacher_to_student),
        ] {
            bufs.push((format!("{name}.indptr"), Dtype::U64, le64(&m.indptr)));
            bufs.push((format!("{name}.indices"), Dtype::U32, le32(&m.indices)));
            bufs.push((format!("{name}.weights"), Dtype::F32, lef(&m.weights)));
        }
        let mut views = Vec::new();
        for (name, dtype, data) in &bufs {
            let n = data.len() * 8 / dtype.bitsize();
            views.push((
                name.clone(),
                TensorView::new(*dtype, vec![n], data).map_err(fmt)?,
            ));
        }
        let meta: HashMap<String, String> = [
            ("format", "xdistill-projection".to_string()),
            ("version", "1".into()),
            ("student_sha256", self.student_sha256.clone()),
            ("teacher_sha256", self.teacher_sha256.clone()),
            ("max_entries", self.max_entries.to_string()),
            ("s2t_exact", self.s2t_exact.to_string()),
            ("t2s_exact", self.t2s_exact.to_string()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        let bytes = safetensors::serialize(views, Some(meta)).map_err(fmt)?;
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(io)?;
        }
        // Unique to this writer: runs sharing a cache may build the same map at once (the
        // last rename wins; the files are equal).
        let tmp = path.with_extension(format!(
            "tmp.{}.{:016x}",
            std::process::id(),
            rand::random::<u64>()
        ));
        std::fs::write(&tmp, bytes).map_err(io)?;
        std::fs::rename(&tmp, path).map_err(io)
    }

    /// Reads a file written by [`ProjectionMaps::save`], checking its structure.
    pub fn load(path: &Path) -> Result<ProjectionMaps, ProjectionError> {
        let bytes = std::fs::read(path).map_err(|source| ProjectionError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let bad = |reason: String| ProjectionError::Format {
            path: path.to_path_buf(),
            reason,
        };
        let (_, md) = SafeTensors::read_metadata(&bytes).map_err(|e| bad(e.to_string()))?;
        let st = SafeTensors::deserialize(&bytes).map_err(|e| bad(e.to_string()))?;
        let meta = md.metadata().clone().unwrap_or_default();
        if meta.get("format").map(String::as_str) != Some("xdistill-projection")
            || meta.get("version").map(String::as_str) != Some("1")
        {
            return Err(bad("format/version is not xdistill-projection 1".into()));
        }
        let num = |k: &str| -> Result<usize, ProjectionError> {
            meta_get(&meta, k, path)?
                .parse()
                .map_err(|_| bad(format!("{k} is not a number")))
        };
        let tensor = |name: &str, dtype: Dtype| -> Result<Vec<u8>, ProjectionError> {
            let t = st.tensor(name).map_err(|e| bad(format!("{name}: {e}")))?;
            if t.dtype() != dtype || t.shape().len() != 1 {
                return Err(bad(format!("{name}: expected 1-D {dtype:?}")));
            }
            Ok(t.data().to_vec())
        };
        let mut dirs = Vec::new();
        for name in ["s2t", "t2s"] {
            let p = tensor(&format!("{name}.indptr"), Dtype::U64)?;
            let i = tensor(&format!("{name}.indices"), Dtype::U32)?;
            let w = tensor(&format!("{name}.weights"), Dtype::F32)?;
            let m = Csr {
                indptr: p
                    .chunks_exact(8)
                    .map(|c| u64::from_le_bytes(c.try_into().unwrap_or_default()))
                    .collect(),
                indices: i
                    .chunks_exact(4)
                    .map(|c| u32::from_le_bytes(c.try_into().unwrap_or_default()))
                    .collect(),
                weights: w
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes(c.try_into().unwrap_or_default()))
                    .collect(),
            };
            let ok = !m.indptr.is_empty()
                && m.indptr[0] == 0
                && m.indptr.windows(2).all(|x| x[0] <= x[1])
                && m.indptr.last().copied() == Some(m.indices.len() as u64)
                && m.indices.len() == m.weights.len();
            if !ok {
                return Err(bad(format!("{name}: inconsistent CSR arrays")));
            }
            dirs.push(m);
        }
        let t2s = dirs.pop().unwrap_or_default();
        let s2t = dirs.pop().unwrap_or_default();
        Ok(ProjectionMaps {
            student_to_teacher: s2t,
            teacher_to_student: t2s,
            student_sha256: meta_get(&meta, "student_sha256", path)?.clone(),
            teacher_sha256: meta_get(&meta, "teacher_sha256", path)?.clone(),
            max_entries: num("max_entries")?,
            s2t_exact: num("s2t_exact")?,
            t2s_exact: num("t2s_exact")?,
        })
    }

    /// The cache file name for two tokenizer hashes and a row size.
    pub fn cache_path(
        cache_dir: &Path,
        student_sha: &str,
        teacher_sha: &str,
        max: usize,
    ) -> PathBuf {
        let short = |s: &str| s.chars().take(16).collect::<String>();
        cache_dir.join(format!(
            "projection-{}-{}-k{max}.safetensors",
            short(student_sha),
            short(teacher_sha)
        ))
    }

    /// Loads the cached projection for two tokenizers, each given with the `tokenizer.json` it
    /// was read from, when both files' sha256 match, else builds it from the parsed tokenizers
    /// and saves it in `cache_dir`. Returns whether it was built. (The caller parses each file
    /// once: a 151k-token `tokenizer.json` takes about half a second.)
    pub fn load_or_build(
        cache_dir: &Path,
        student: (&Path, &AlignTokenizer),
        teacher: (&Path, &AlignTokenizer),
        max_entries: usize,
    ) -> Result<(ProjectionMaps, bool), ProjectionError> {
        let sh = xdistill_shared::hf::file_sha256(student.0)?;
        let th = xdistill_shared::hf::file_sha256(teacher.0)?;
        let path = ProjectionMaps::cache_path(cache_dir, &sh, &th, max_entries);
        if path.is_file() {
            match ProjectionMaps::load(&path) {
                Ok(p)
                    if p.student_sha256 == sh
                        && p.teacher_sha256 == th
                        && p.max_entries == max_entries =>
                {
                    return Ok((p, false))
                }
                Ok(_) => {
                    tracing::warn!("{}: built for other tokenizers; rebuilding", path.display())
                }
                Err(e) => tracing::warn!("{e}; rebuilding"),
            }
        }
        let p = ProjectionMaps::build(student.1, teacher.1, max_entries, sh, th)?;
        p.save(&path)?;
        Ok((p, true))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decay_weights_follow_the_formula() {
        // Reference: w_i = 0.9·0.1^i for i < 4, normalized by their sum 0.9999 (in f64).
        let w = decay_weights(&[5, 6, 7, 8, 9], 4);
        let raw = [0.9, 0.09, 0.009, 0.0009];
        let sum: f64 = raw.iter().sum();
        assert_eq!(w.len(), 4);
        for (k, (id, x)) in w.iter().enumerate() {
            assert_eq!(*id, 5 + k as u32);
            assert!((*x as f64 - raw[k] / sum).abs() < 1e-7);
        }
        // Duplicates add up: [a, a] → a with weight 1.
        assert_eq!(decay_weights(&[3, 3], 4), vec![(3, 1.0)]);
        assert!(decay_weights(&[], 4).is_empty());
    }

    #[test]
    fn padded_rows_are_empty() {
        let mut m = Csr::from_rows(vec![vec![(1, 1.0)], vec![]]);
        m.pad_rows(5);
        assert_eq!(m.rows(), 5);
        assert_eq!(m.row(0), (&[1u32][..], &[1.0f32][..]));
        assert_eq!(m.row(4), (&[][..], &[][..]));
        assert_eq!(m.row(9), (&[][..], &[][..]));
    }

    #[test]
    fn strips_the_dummy_prefix() {
        let mut v = serde_json::json!({"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "\u{2581}"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "\u{2581}"}]});
        strip_prepend(&mut v);
        assert_eq!(v["normalizers"].as_array().map(Vec::len), Some(1));
        let mut m = serde_json::json!({"type": "Metaspace", "replacement": "\u{2581}",
            "prepend_scheme": "always", "split": true});
        never_prepend(&mut m);
        assert_eq!(m["prepend_scheme"], "never");
    }
}
