//! Every vocabulary id → the bytes of text it stands for, decoded from the vocabulary strings
//! (byte-level BPE: inverse GPT-2 byte-to-unicode map; SentencePiece: `▁` → space, `<0xNN>` → byte).

use serde_json::Value;
use std::borrow::Cow;
use tokenizers::{ModelWrapper, NormalizedString, Tokenizer};

use super::AlignError;

/// How a tokenizer writes bytes into its vocabulary strings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenizerKind {
    /// GPT-2 style byte-level BPE (Qwen, Llama 3, DeepSeek): every byte is one printable char.
    ByteLevel,
    /// SentencePiece style (Llama 2, Gemma): `▁` is a space, `<0xNN>` a raw byte (byte fallback).
    SentencePiece,
}

/// Whether the tokenizer adds a space that is not in the text (the SentencePiece dummy prefix).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DummyPrefix {
    /// No added space.
    None,
    /// `Prepend("▁")` normalizer: every non-empty piece of text (the whole input, and each run
    /// between added tokens) gets one leading `▁`. Exact: the first token of a piece always carries it.
    EveryPiece,
    /// `Metaspace` pre-tokenizer with `prepend_scheme = first`: only the first piece, and only when
    /// it does not already start with a space (assumed not to: verified against the text in `pair`).
    FirstPiece,
    /// `Metaspace` with `prepend_scheme = always`: like `EveryPiece`, unless the piece starts with a
    /// space (assumed not to: verified against the text in `pair`).
    EveryPieceIfMissing,
}

/// Unicode normalization a tokenizer applies before tokenizing (it changes the bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UnicodeNorm {
    Nfc,
    Nfd,
    Nfkc,
    Nfkd,
}

const SPECIAL: u8 = 1;
const ADDED: u8 = 2;
const BYTE_FALLBACK: u8 = 4;
const PRESENT: u8 = 8;

/// Per-id byte table of one tokenizer, built once and shared (read-only) by alignment and projection.
#[derive(Debug, Clone)]
pub struct TokenBytes {
    kind: TokenizerKind,
    dummy_prefix: DummyPrefix,
    norm: Option<UnicodeNorm>,
    /// `offsets[id]..offsets[id + 1]` indexes `data`; `[V + 1]`.
    offsets: Vec<u32>,
    data: Vec<u8>,
    /// Bit flags per id: special, added, byte-fallback, present; `[V]`.
    flags: Vec<u8>,
}

/// One token as alignment sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Piece<'a> {
    /// Text bytes (dummy prefix already removed).
    Text(&'a [u8]),
    /// A special token: a unit, with its content string (used only to recognise it when the
    /// other tokenizer read the same characters as text).
    Special(&'a [u8]),
}

impl<'a> Piece<'a> {
    /// The bytes this token covers when it is read as text.
    pub fn bytes(self) -> &'a [u8] {
        match self {
            Piece::Text(b) | Piece::Special(b) => b,
        }
    }
}

/// GPT-2's byte → printable char table, inverted: `char as usize` → byte, for chars below 324.
fn byte_level_inverse() -> [i16; 324] {
    let mut inv = [-1i16; 324];
    let mut n = 0u32;
    for b in 0u32..256 {
        let printable =
            (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
        let c = if printable {
            b
        } else {
            n += 1;
            255 + n
        };
        inv[c as usize] = b as i16;
    }
    inv
}

/// `<0xNN>` → the byte NN.
fn parse_byte_token(s: &str) -> Option<u8> {
    let hex = s.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

/// What the normalizer, pre-tokenizer and decoder JSON tell us.
#[derive(Default)]
struct Facts {
    byte_level: bool,
    sentencepiece: bool,
    byte_fallback: bool,
    prepend_every: bool,
    metaspace_scheme: Option<String>,
    norm: Option<UnicodeNorm>,
    unsupported: Vec<String>,
}

impl Facts {
    fn normalizer(&mut self, v: &Value) {
        match v.get("type").and_then(Value::as_str).unwrap_or("") {
            "Sequence" => {
                for n in v
                    .get("normalizers")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                {
                    self.normalizer(n);
                }
            }
            "NFC" => self.set_norm(UnicodeNorm::Nfc),
            "NFD" => self.set_norm(UnicodeNorm::Nfd),
            "NFKC" => self.set_norm(UnicodeNorm::Nfkc),
            "NFKD" => self.set_norm(UnicodeNorm::Nfkd),
            "Prepend" if v.get("prepend").and_then(Value::as_str) == Some("\u{2581}") => {
                self.prepend_every = true;
                self.sentencepiece = true;
            }
            "Replace"
                if v.pointer("/pattern/String").and_then(Value::as_str) == Some(" ")
                    && v.get("content").and_then(Value::as_str) == Some("\u{2581}") =>
            {
                self.sentencepiece = true
            }
            other => self.unsupported.push(format!("normalizer {other}")),
        }
    }

    fn set_norm(&mut self, n: UnicodeNorm) {
        if self.norm.is_some_and(|m| m != n) {
            self.unsupported
                .push("two different Unicode normalizations".into());
        }
        self.norm = Some(n);
    }

    fn pre_tokenizer(&mut self, v: &Value) {
        match v.get("type").and_then(Value::as_str).unwrap_or("") {
            "Sequence" => {
                for p in v
                    .get("pretokenizers")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                {
                    self.pre_tokenizer(p);
                }
            }
            "ByteLevel" => {
                self.byte_level = true;
                if v.get("add_prefix_space").and_then(Value::as_bool) == Some(true) {
                    self.unsupported
                        .push("ByteLevel pre-tokenizer with add_prefix_space".into());
                }
            }
            "Metaspace" => {
                self.sentencepiece = true;
                let scheme = v
                    .get("prepend_scheme")
                    .and_then(Value::as_str)
                    .map(str::to_string)
                    .or_else(
                        || match v.get("add_prefix_space").and_then(Value::as_bool) {
                            Some(false) => Some("never".into()),
                            _ => Some("always".into()),
                        },
                    );
                self.metaspace_scheme = scheme;
            }
            "Split" => {
                if v.get("behavior").and_then(Value::as_str) == Some("Removed") {
                    self.unsupported
                        .push("Split pre-tokenizer that removes text".into());
                }
            }
            "Digits" | "Punctuation" | "UnicodeScripts" => {}
            other => self.unsupported.push(format!("pre-tokenizer {other}")),
        }
    }

    fn decoder(&mut self, v: &Value) {
        match v.get("type").and_then(Value::as_str).unwrap_or("") {
            "Sequence" => {
                for d in v
                    .get("decoders")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                {
                    self.decoder(d);
                }
            }
            "ByteLevel" => self.byte_level = true,
            "ByteFallback" => self.byte_fallback = true,
            "Metaspace" => self.sentencepiece = true,
            "Replace"
                if v.pointer("/pattern/String").and_then(Value::as_str) == Some("\u{2581}") =>
            {
                self.sentencepiece = true
            }
            _ => {}
        }
    }
}

impl TokenBytes {
    /// Builds the table from a loaded tokenizer; unsupported pipelines give a typed error.
    pub fn from_tokenizer(tok: &Tokenizer) -> Result<TokenBytes, AlignError> {
        let mut f = Facts::default();
        let to_json = |x: Result<Value, serde_json::Error>| {
            x.map_err(|e| AlignError::UnsupportedTokenizer(format!("cannot inspect: {e}")))
        };
        if let Some(n) = tok.get_normalizer() {
            f.normalizer(&to_json(serde_json::to_value(n))?);
        }
        if let Some(p) = tok.get_pre_tokenizer() {
            f.pre_tokenizer(&to_json(serde_json::to_value(p))?);
        }
        if let Some(d) = tok.get_decoder() {
            f.decoder(&to_json(serde_json::to_value(d))?);
        }
        match tok.get_model() {
            ModelWrapper::BPE(b) => f.byte_fallback |= b.byte_fallback,
            ModelWrapper::Unigram(u) => f.byte_fallback |= u.byte_fallback(),
            _ => f.unsupported.push("model other than BPE or Unigram".into()),
        }
        let kind = match (f.byte_level, f.sentencepiece) {
            (true, false) => TokenizerKind::ByteLevel,
            (false, true) => TokenizerKind::SentencePiece,
            (true, true) => {
                return Err(AlignError::UnsupportedTokenizer(
                    "both byte-level and SentencePiece markers".into(),
                ))
            }
            (false, false) => {
                return Err(AlignError::UnsupportedTokenizer(
                    "neither byte-level BPE nor SentencePiece".into(),
                ))
            }
        };
        if !f.unsupported.is_empty() {
            return Err(AlignError::UnsupportedTokenizer(f.unsupported.join(", ")));
        }
        let dummy_prefix = if f.prepend_every {
            DummyPrefix::EveryPiece
        } else {
            match f.metaspace_scheme.as_deref() {
                Some("first") => DummyPrefix::FirstPiece,
                Some("always") => DummyPrefix::EveryPieceIfMissing,
                _ => DummyPrefix::None,
            }
        };

        let vocab = tok.get_vocab(false);
        let added = tok.get_added_tokens_decoder();
        let size = vocab
            .values()
            .chain(added.keys())
            .map(|&i| i as usize + 1)
            .max()
            .unwrap_or(0);
        let mut strings: Vec<Option<&str>> = vec![None; size];
        for (s, &id) in &vocab {
            strings[id as usize] = Some(s.as_str());
        }
        let inv = byte_level_inverse();
        let mut offsets = Vec::with_capacity(size + 1);
        let mut data = Vec::with_capacity(size * 8);
        let mut flags = vec![0u8; size];
        offsets.push(0u32);
        for id in 0..size {
            if let Some(a) = added.get(&(id as u32)) {
                flags[id] = PRESENT | ADDED | if a.special { SPECIAL } else { 0 };
                // Added tokens are text, not vocabulary encoding; SentencePiece ones may still
                // spell spaces as `▁` (Gemma's "▁▁" matches two spaces), and a literal `▁` in
                // the text is read as a space anyway (see `canonicalize`).
                if kind == TokenizerKind::SentencePiece {
                    data.extend_from_slice(a.content.replace('\u{2581}', " ").as_bytes());
                } else {
                    data.extend_from_slice(a.content.as_bytes());
                }
            } else if let Some(s) = strings[id] {
                flags[id] = PRESENT;
                match kind {
                    TokenizerKind::ByteLevel => {
                        for c in s.chars() {
                            let b = inv.get(c as usize).copied().unwrap_or(-1);
                            if b < 0 {
                                return Err(AlignError::UnsupportedTokenizer(format!(
                                    "byte-level token {id} {s:?} has char {c:?} outside the byte map"
                                )));
                            }
                            data.push(b as u8);
                        }
                    }
                    TokenizerKind::SentencePiece => match parse_byte_token(s) {
                        Some(b) if f.byte_fallback => {
                            flags[id] |= BYTE_FALLBACK;
                            data.push(b);
                        }
                        _ => data.extend_from_slice(s.replace('\u{2581}', " ").as_bytes()),
                    },
                }
            }
            let end = u32::try_from(data.len()).map_err(|_| {
                AlignError::UnsupportedTokenizer("vocabulary bytes exceed 4 GiB".into())
            })?;
            offsets.push(end);
        }
        Ok(TokenBytes {
            kind,
            dummy_prefix,
            norm: f.norm,
            offsets,
            data,
            flags,
        })
    }

    /// Builds a table from explicit entries `(bytes, special)`; for tests and synthetic vocabularies.
    pub fn from_entries(
        kind: TokenizerKind,
        dummy_prefix: DummyPrefix,
        entries: &[(&[u8], bool)],
    ) -> TokenBytes {
        let mut offsets = vec![0u32];
        let mut data = Vec::new();
        let mut flags = Vec::new();
        for (b, special) in entries {
            data.extend_from_slice(b);
            offsets.push(data.len() as u32);
            flags.push(PRESENT | if *special { SPECIAL | ADDED } else { 0 });
        }
        TokenBytes {
            kind,
            dummy_prefix,
            norm: None,
            offsets,
            data,
            flags,
        }
    }

    pub fn kind(&self) -> TokenizerKind {
        self.kind
    }

    pub fn dummy_prefix(&self) -> DummyPrefix {
        self.dummy_prefix
    }

    pub fn unicode_norm(&self) -> Option<UnicodeNorm> {
        self.norm
    }

    /// Number of id slots (highest id + 1).
    pub fn vocab_size(&self) -> usize {
        self.flags.len()
    }

    /// The token's bytes as written in the vocabulary (specials: their content); `None` if the id
    /// is out of range or unused.
    pub fn raw_bytes(&self, id: u32) -> Option<&[u8]> {
        let i = id as usize;
        if self.flags.get(i).is_none_or(|f| f & PRESENT == 0) {
            return None;
        }
        Some(&self.data[self.offsets[i] as usize..self.offsets[i + 1] as usize])
    }

    pub fn is_special(&self, id: u32) -> bool {
        self.flags
            .get(id as usize)
            .is_some_and(|f| f & SPECIAL != 0)
    }

    /// Added tokens (special or not) split the input into pieces before normalization.
    pub fn is_added(&self, id: u32) -> bool {
        self.flags.get(id as usize).is_some_and(|f| f & ADDED != 0)
    }

    /// `<0xNN>` byte-fallback tokens.
    pub fn is_byte_fallback(&self, id: u32) -> bool {
        self.flags
            .get(id as usize)
            .is_some_and(|f| f & BYTE_FALLBACK != 0)
    }

    /// Token `k` of `ids` as alignment sees it: specials as units; text with the dummy prefix
    /// space removed where the tokenizer added one. `None` for an unknown id.
    #[inline]
    pub fn piece(&self, ids: &[u32], k: usize) -> Option<Piece<'_>> {
        let id = ids[k];
        let b = self.raw_bytes(id)?;
        if self.flags[id as usize] & SPECIAL != 0 {
            return Some(Piece::Special(b));
        }
        let starts_piece = match self.dummy_prefix {
            DummyPrefix::None => false,
            DummyPrefix::EveryPiece | DummyPrefix::EveryPieceIfMissing => {
                k == 0 || self.is_added(ids[k - 1])
            }
            DummyPrefix::FirstPiece => ids[..k].iter().all(|&p| self.is_special(p)),
        };
        if starts_piece && b.first() == Some(&b' ') {
            Some(Piece::Text(&b[1..]))
        } else {
            Some(Piece::Text(b))
        }
    }

    /// The text bytes of `ids` (dummy prefix removed; special tokens' content kept when
    /// `keep_special`, else dropped). Errors on unknown ids.
    pub fn decode(&self, ids: &[u32], keep_special: bool) -> Result<Vec<u8>, AlignError> {
        let mut out = Vec::with_capacity(ids.len() * 4);
        for k in 0..ids.len() {
            match self.piece(ids, k) {
                Some(Piece::Text(b)) => out.extend_from_slice(b),
                Some(Piece::Special(b)) if keep_special => out.extend_from_slice(b),
                Some(Piece::Special(_)) => {}
                None => {
                    return Err(AlignError::UnknownToken {
                        index: k,
                        id: ids[k],
                    })
                }
            }
        }
        Ok(out)
    }

    /// The text as this tokenizer's tokens will spell it: its Unicode normalization applied, and
    /// for SentencePiece, literal `▁` read as a space (the tokenizer cannot tell them apart).
    pub fn canonicalize<'t>(&self, text: &'t str) -> Cow<'t, str> {
        let mut out = Cow::Borrowed(text);
        if let Some(n) = self.norm {
            let mut ns = NormalizedString::from(text);
            match n {
                UnicodeNorm::Nfc => ns.nfc(),
                UnicodeNorm::Nfd => ns.nfd(),
                UnicodeNorm::Nfkc => ns.nfkc(),
                UnicodeNorm::Nfkd => ns.nfkd(),
            };
            if ns.get() != text {
                out = Cow::Owned(ns.get().to_string());
            }
        }
        if self.kind == TokenizerKind::SentencePiece && out.contains('\u{2581}') {
            out = Cow::Owned(out.replace('\u{2581}', " "));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_level_table_is_gpt2s() {
        let inv = byte_level_inverse();
        // Reference values from GPT-2's bytes_to_unicode: 'Ġ' (U+0120) is a space, 'Ċ' (U+010A) a
        // newline, 'ĉ' (U+0109) a tab, printable ASCII maps to itself.
        assert_eq!(inv['Ġ' as usize], b' ' as i16);
        assert_eq!(inv['Ċ' as usize], b'\n' as i16);
        assert_eq!(inv['ĉ' as usize], b'\t' as i16);
        assert_eq!(inv['A' as usize], b'A' as i16);
        let mut seen = [false; 256];
        for &b in inv.iter().filter(|&&b| b >= 0) {
            assert!(!seen[b as usize]);
            seen[b as usize] = true;
        }
        assert!(seen.iter().all(|&s| s), "all 256 bytes reachable");
    }

    #[test]
    fn parses_byte_tokens() {
        assert_eq!(parse_byte_token("<0x0A>"), Some(10));
        assert_eq!(parse_byte_token("<0xFF>"), Some(255));
        assert_eq!(parse_byte_token("<0x0>"), None);
        assert_eq!(parse_byte_token("<s>"), None);
    }

    #[test]
    fn dummy_prefix_dropped_at_piece_starts_only() {
        let tb = TokenBytes::from_entries(
            TokenizerKind::SentencePiece,
            DummyPrefix::EveryPiece,
            &[(b"<s>", true), (b" Hi", false), (b" there", false)],
        );
        let ids = [0, 1, 2, 0, 1];
        assert_eq!(tb.decode(&ids, false).unwrap(), b"Hi thereHi");
        assert_eq!(tb.decode(&ids, true).unwrap(), b"<s>Hi there<s>Hi");
        assert!(tb.decode(&[7], false).is_err());
    }
}
