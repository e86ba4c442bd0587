//! Reading, skipping, splitting, shuffling and batching records, and resuming batches.

use super::*;
use crate::config::DataConfig;
use std::io::Write;
use std::path::{Path, PathBuf};

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

/// Lines over the limit are passed over unheld (`None`) and reading goes on after them; a line
/// exactly at the limit (its `\r\n` and a byte order mark not counted) is read.
#[test]
fn lines_over_the_limit_are_passed_over() {
    let lines = |bytes: &[u8], max: usize| {
        let mut got = vec![];
        read::for_each_line(bytes, max, |n, b| {
            got.push((n, b.map(|b| String::from_utf8(b.to_vec()).unwrap())))
        })
        .unwrap();
        got
    };
    let long = "x".repeat(1 << 20);
    let text = format!("\u{feff}0123456789\r\n{long}\nafter\n01234567890\n{long}");
    let s = |t: &str| Some(t.to_string());
    assert_eq!(
        lines(text.as_bytes(), 10),
        [
            (1, s("0123456789")),
            (2, None),
            (3, s("after")),
            (4, None),
            (5, None)
        ]
    );
    // At a limit of the long line's length, it is read whole.
    assert_eq!(lines(text.as_bytes(), 1 << 20)[1], (2, s(&long)));

    // In files: a JSONL line past the line limit and a text document past max_record_bytes
    // are skipped as too long, and the records after them read.
    let dir = tempfile::tempdir().unwrap();
    let huge = "y".repeat(20 << 20);
    let jsonl = format!("{{\"text\": \"a\"}}\n{{\"text\": \"{huge}\"}}\n{{\"text\": \"b\"}}\n");
    let ds = Dataset::load(&write(dir.path(), "l.jsonl", jsonl.as_bytes()), &opts(100)).unwrap();
    assert_eq!(
        ds.records.iter().map(Record::text).collect::<Vec<_>>(),
        ["a", "b"]
    );
    assert_eq!(
        ds.records.iter().map(|r| r.line).collect::<Vec<_>>(),
        [1, 3]
    );
    assert_eq!(ds.skipped.too_long_bytes, 1);
    let o = LoadOptions {
        format: crate::config::DataFormat::Text,
        ..opts(12)
    };
    let text = "one\n\n0123456789ab\n\n0123\n4567\n89\n\nlong line over twelve\nand more\n\nlast";
    let ds = Dataset::load(&write(dir.path(), "d.txt", text.as_bytes()), &o).unwrap();
    // A document of three lines takes exactly 12 bytes with its newlines; the one from line 9
    // takes 30.
    assert_eq!(
        ds.records.iter().map(Record::text).collect::<Vec<_>>(),
        ["one", "0123456789ab", "0123\n4567\n89", "last"]
    );
    assert_eq!(
        ds.records.iter().map(|r| r.line).collect::<Vec<_>>(),
        [1, 3, 5, 12]
    );
    assert_eq!(ds.skipped.too_long_bytes, 1);
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
    // A position read from an edited state file, at the last epoch there is: the end, not an
    // overflow (epochs unlimited, or not).
    for max_epochs in [3, u64::MAX] {
        let mut b = Batcher::new(numbered(8), BatchOptions { max_epochs, ..opts });
        b.seek(DataPosition {
            epoch: u64::MAX,
            index: 8,
        })
        .unwrap();
        assert_eq!(b.next(), None);
    }
}
