//! A synthetic arithmetic task with worked, digit-by-digit steps (written by `trainer make-task`).
//!
//! ```text
//! prompt:     "Q: 47+38=?\nA:"
//! completion: " 7+8=15, carry 1. 4+3+1=8. #### 85"
//! answer:     "85"
//! ```
//!
//! Why this format: a tiny model trained for minutes on a CPU cannot do multi-digit arithmetic
//! "in its head", but it can learn one-digit facts and a fixed procedure. Each step is a short,
//! regular pattern (one column, right to left, carry/borrow spelled out) whose inputs are digits
//! already in the context, and the answer after `#### ` is read off the steps, so every token is
//! derivable from the tokens before it. The answer follows `#### ` as in GSM8K, so one extractor
//! ([`xdistill_trainer::eval::answer`]) serves both.
//!
//! Splits are disjoint by construction: test problems are drawn first, then train problems are
//! drawn excluding every test problem *and its commutative twin* (`38+47` is the same problem as
//! `47+38`), so no test sum is seen in training in either order.

use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use std::collections::HashSet;
use std::path::{Path, PathBuf};

/// Largest supported operand length (products stay far inside u64).
pub const MAX_DIGITS: u32 = 9;

#[derive(Debug, thiserror::Error)]
pub enum TaskError {
    #[error("digits must be between 1 and {MAX_DIGITS}, got {0}")]
    Digits(u32),
    #[error("at least one operation is needed")]
    NoOps,
    #[error(
        "asked for {asked} distinct problems (train + test) but digits={digits} with ops {ops} \
         has only {capacity}: ask for fewer or raise --digits"
    )]
    TooSmall {
        asked: usize,
        capacity: u128,
        digits: u32,
        ops: String,
    },
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// An operation of the task.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
    Serialize,
    Deserialize,
    clap::ValueEnum,
)]
#[serde(rename_all = "lowercase")]
pub enum Op {
    /// `a+b`, both operands with `digits` digits.
    Add,
    /// `a-b` with `a ≥ b` (results never negative), both with `digits` digits.
    Sub,
    /// `a*b`, `a` with `digits` digits and `b` a single digit 2..=9.
    Mul,
}

impl Op {
    fn symbol(self) -> char {
        match self {
            Op::Add => '+',
            Op::Sub => '-',
            Op::Mul => '*',
        }
    }
}

/// One problem `a op b`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Problem {
    pub op: Op,
    pub a: u64,
    pub b: u64,
}

/// A JSONL record: what the model sees, the worked completion, and the bare answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskRecord {
    pub prompt: String,
    pub completion: String,
    pub answer: String,
}

/// Digits of `x` from least significant, padded with zeros to `n`.
fn digits_lsb(x: u64, n: usize) -> Vec<u64> {
    let mut out = Vec::with_capacity(n);
    let mut x = x;
    for _ in 0..n {
        out.push(x % 10);
        x /= 10;
    }
    out
}

impl Problem {
    /// `Q: 47+38=?\nA:`
    pub fn prompt(&self) -> String {
        format!("Q: {}{}{}=?\nA:", self.a, self.op.symbol(), self.b)
    }

    /// The exact result (never negative: subtraction problems have `a ≥ b`).
    pub fn result(&self) -> u64 {
        match self.op {
            Op::Add => self.a + self.b,
            Op::Sub => self.a - self.b,
            Op::Mul => self.a * self.b,
        }
    }

    /// The split key: commutative twins share one.
    fn key(&self) -> (Op, u64, u64) {
        match self.op {
            Op::Add => (self.op, self.a.min(self.b), self.a.max(self.b)),
            _ => (self.op, self.a, self.b),
        }
    }

    /// The worked solution, starting with a space: one step per column, right to left, then
    /// ` #### N`. The steps compute the result digit by digit (checked in the tests).
    pub fn worked(&self) -> String {
        let n = self.a.max(self.b).max(1).ilog10() as usize + 1;
        let (da, db) = (digits_lsb(self.a, n), digits_lsb(self.b, n));
        let mut steps = Vec::with_capacity(n);
        match self.op {
            Op::Add => {
                let mut carry = 0;
                for i in 0..n {
                    let s = da[i] + db[i] + carry;
                    let mut step = if carry > 0 {
                        format!("{}+{}+{carry}={s}", da[i], db[i])
                    } else {
                        format!("{}+{}={s}", da[i], db[i])
                    };
                    carry = s / 10;
                    if carry > 0 && i + 1 < n {
                        step.push_str(&format!(", carry {carry}"));
                    }
                    steps.push(step);
                }
            }
            Op::Sub => {
                let mut borrow = 0;
                for i in 0..n {
                    let minus_borrow = if borrow > 0 { "-1" } else { "" };
                    let step = if da[i] >= db[i] + borrow {
                        let d = da[i] - borrow - db[i];
                        borrow = 0;
                        format!("{}{minus_borrow}-{}={d}", da[i], db[i])
                    } else {
                        // Borrow ten from the next column: "12-8=4, borrow 1".
                        let d = da[i] + 10 - borrow - db[i];
                        borrow = 1;
                        format!("1{}{minus_borrow}-{}={d}, borrow 1", da[i], db[i])
                    };
                    steps.push(step);
                }
            }
            Op::Mul => {
                let da = digits_lsb(self.a, self.a.max(1).ilog10() as usize + 1);
                let mut carry = 0;
                for (i, &d) in da.iter().enumerate() {
                    let p = d * self.b + carry;
                    let mut step = if carry > 0 {
                        format!("{d}*{}+{carry}={p}", self.b)
                    } else {
                        format!("{d}*{}={p}", self.b)
                    };
                    carry = p / 10;
                    if carry > 0 && i + 1 < da.len() {
                        step.push_str(&format!(", carry {carry}"));
                    }
                    steps.push(step);
                }
            }
        }
        format!(" {}. #### {}", steps.join(". "), self.result())
    }

    pub fn record(&self) -> TaskRecord {
        TaskRecord {
            prompt: self.prompt(),
            completion: self.worked(),
            answer: self.result().to_string(),
        }
    }
}

/// What `make-task` generates.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskConfig {
    /// Digits of each operand (the multiplier of `mul` is always one digit).
    pub digits: u32,
    pub ops: Vec<Op>,
    pub train: usize,
    pub test: usize,
    pub seed: u64,
}

impl Default for TaskConfig {
    fn default() -> Self {
        TaskConfig {
            digits: 2,
            ops: vec![Op::Add],
            train: 2000,
            test: 200,
            seed: 0,
        }
    }
}

/// Train and test records, disjoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Splits {
    pub train: Vec<TaskRecord>,
    pub test: Vec<TaskRecord>,
}

/// Operands with exactly `digits` digits (0..=9 for one digit): `[lo, hi)`.
fn operand_range(digits: u32) -> (u64, u64) {
    let hi = 10u64.pow(digits);
    let lo = if digits == 1 { 0 } else { hi / 10 };
    (lo, hi)
}

/// Number of distinct split keys for `op`.
fn capacity(op: Op, digits: u32) -> u128 {
    let (lo, hi) = operand_range(digits);
    let n = (hi - lo) as u128;
    match op {
        Op::Add | Op::Sub => n * (n + 1) / 2,
        Op::Mul => n * 8,
    }
}

fn random_problem(op: Op, digits: u32, rng: &mut ChaCha8Rng) -> Problem {
    let (lo, hi) = operand_range(digits);
    let a = rng.random_range(lo..hi);
    match op {
        Op::Add => Problem {
            op,
            a,
            b: rng.random_range(lo..hi),
        },
        Op::Sub => {
            let b = rng.random_range(lo..hi);
            Problem {
                op,
                a: a.max(b),
                b: a.min(b),
            }
        }
        Op::Mul => Problem {
            op,
            a,
            b: rng.random_range(2..10),
        },
    }
}

/// Every problem of `op` once per split key, in a seeded random order.
fn all_problems(op: Op, digits: u32, rng: &mut ChaCha8Rng) -> Vec<Problem> {
    let (lo, hi) = operand_range(digits);
    let mut out = Vec::new();
    for a in lo..hi {
        match op {
            Op::Add => {
                for b in a..hi {
                    // Show the two orders equally often.
                    let (a, b) = if rng.random::<bool>() { (a, b) } else { (b, a) };
                    out.push(Problem { op, a, b });
                }
            }
            Op::Sub => out.extend((lo..=a).map(|b| Problem { op, a, b })),
            Op::Mul => out.extend((2..10).map(|b| Problem { op, a, b })),
        }
    }
    out
}

/// Generates disjoint train/test splits: test first, then train excluding test keys. The same
/// config always gives the same records.
pub fn make_splits(cfg: &TaskConfig) -> Result<Splits, TaskError> {
    if !(1..=MAX_DIGITS).contains(&cfg.digits) {
        return Err(TaskError::Digits(cfg.digits));
    }
    let mut ops = cfg.ops.clone();
    ops.sort();
    ops.dedup();
    if ops.is_empty() {
        return Err(TaskError::NoOps);
    }
    let cap: u128 = ops.iter().map(|&op| capacity(op, cfg.digits)).sum();
    let asked = cfg.train + cfg.test;
    if asked as u128 > cap {
        return Err(TaskError::TooSmall {
            asked,
            capacity: cap,
            digits: cfg.digits,
            ops: format!("{ops:?}"),
        });
    }
    let mut rng = ChaCha8Rng::seed_from_u64(cfg.seed);
    let mut seen = HashSet::new();
    let mut take = |n: usize, problems: &mut dyn FnMut() -> Option<Problem>| {
        let mut out = Vec::with_capacity(n);
        while out.len() < n {
            let Some(p) = problems() else { break };
            if seen.insert(p.key()) {
                out.push(p.record());
            }
        }
        out
    };
    let (test, train) = if (asked as u128) * 2 > cap {
        // Dense: enumerate and shuffle, so drawing close to the whole space stays fast.
        let mut all: Vec<Problem> = ops
            .iter()
            .flat_map(|&op| all_problems(op, cfg.digits, &mut rng))
            .collect();
        all.shuffle(&mut rng);
        let mut it = all.into_iter();
        let test = take(cfg.test, &mut || it.next());
        let train = take(cfg.train, &mut || it.next());
        (test, train)
    } else {
        // Sparse: rejection-sample unique keys (at least half the space stays free).
        let mut draw = || {
            let op = ops[rng.random_range(0..ops.len())];
            Some(random_problem(op, cfg.digits, &mut rng))
        };
        let test = take(cfg.test, &mut draw);
        let train = take(cfg.train, &mut draw);
        (test, train)
    };
    Ok(Splits { train, test })
}

fn write_jsonl(path: &Path, records: &[TaskRecord]) -> Result<(), TaskError> {
    let io = |source| TaskError::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut text = String::new();
    for r in records {
        // Serialising plain strings cannot fail.
        text.push_str(&serde_json::to_string(r).unwrap_or_default());
        text.push('\n');
    }
    std::fs::write(path, text).map_err(io)
}

/// Writes `train.jsonl`, `test.jsonl` and `task.json` (the config, for provenance) into `dir`.
pub fn write_splits(dir: &Path, cfg: &TaskConfig, splits: &Splits) -> Result<(), TaskError> {
    std::fs::create_dir_all(dir).map_err(|source| TaskError::Io {
        path: dir.to_path_buf(),
        source,
    })?;
    write_jsonl(&dir.join("train.jsonl"), &splits.train)?;
    write_jsonl(&dir.join("test.jsonl"), &splits.test)?;
    let meta = dir.join("task.json");
    std::fs::write(&meta, serde_json::to_string_pretty(cfg).unwrap_or_default()).map_err(|source| {
        TaskError::Io {
            path: meta.clone(),
            source,
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use xdistill_trainer::eval::answer::extract_answer;

    /// Independent reference: parse `Q: a?b=?` and compute with i128.
    fn solve_prompt(prompt: &str) -> i128 {
        let body = prompt
            .strip_prefix("Q: ")
            .and_then(|s| s.strip_suffix("=?\nA:"))
            .unwrap();
        let pos = body.find(['+', '-', '*']).unwrap();
        let a: i128 = body[..pos].parse().unwrap();
        let b: i128 = body[pos + 1..].parse().unwrap();
        match &body[pos..pos + 1] {
            "+" => a + b,
            "-" => a - b,
            _ => a * b,
        }
    }

    /// Replays the worked steps: each `x op y [op z]=r` must be arithmetically true, and the
    /// column results read right to left must spell the answer.
    fn check_steps(rec: &TaskRecord) {
        let (steps, ans) = rec.completion.split_once(" #### ").unwrap();
        let mut digits = Vec::new();
        let steps: Vec<&str> = steps.trim().trim_end_matches('.').split(". ").collect();
        for (i, step) in steps.iter().enumerate() {
            let expr = step.split(',').next().unwrap();
            let (lhs, rhs) = expr.split_once('=').unwrap();
            let r: i64 = rhs.parse().unwrap();
            // Evaluate lhs left to right (only + - * of small numbers; * binds first here
            // because it only appears as the first operator).
            let mut val: Option<i64> = None;
            let mut op = '+';
            let mut num = String::new();
            for c in lhs.chars().chain(std::iter::once('+')) {
                if c.is_ascii_digit() {
                    num.push(c);
                } else {
                    let n: i64 = num.parse().unwrap();
                    num.clear();
                    val = Some(match (val, op) {
                        (None, _) => n,
                        (Some(v), '+') => v + n,
                        (Some(v), '-') => v - n,
                        (Some(v), _) => v * n,
                    });
                    op = c;
                }
            }
            assert_eq!(val.unwrap(), r, "false step {step:?} in {rec:?}");
            if i + 1 == steps.len() {
                digits.push(r.to_string());
            } else {
                digits.push((r % 10).to_string());
            }
        }
        digits.reverse();
        let spelled: String = digits.concat();
        let spelled = spelled.trim_start_matches('0');
        let spelled = if spelled.is_empty() { "0" } else { spelled };
        assert_eq!(spelled, ans, "steps do not spell the answer in {rec:?}");
    }

    fn cfg(digits: u32, ops: Vec<Op>, train: usize, test: usize, seed: u64) -> TaskConfig {
        TaskConfig {
            digits,
            ops,
            train,
            test,
            seed,
        }
    }

    #[test]
    fn example_from_the_docs() {
        let p = Problem {
            op: Op::Add,
            a: 47,
            b: 38,
        };
        assert_eq!(p.prompt(), "Q: 47+38=?\nA:");
        assert_eq!(p.worked(), " 7+8=15, carry 1. 4+3+1=8. #### 85");
        let p = Problem {
            op: Op::Sub,
            a: 52,
            b: 38,
        };
        assert_eq!(p.worked(), " 12-8=4, borrow 1. 5-1-3=1. #### 14");
        let p = Problem {
            op: Op::Mul,
            a: 47,
            b: 3,
        };
        assert_eq!(p.worked(), " 7*3=21, carry 2. 4*3+2=14. #### 141");
    }

    #[test]
    fn answers_are_true_and_extractable() {
        // One digit: 55 + 55 + 80 = 190 problems, all of them drawn.
        for (digits, train) in [(1, 140), (2, 150), (4, 150)] {
            let ops = vec![Op::Add, Op::Sub, Op::Mul];
            let s = make_splits(&cfg(digits, ops, train, 50, 7)).unwrap();
            assert_eq!((s.train.len(), s.test.len()), (train, 50));
            for r in s.train.iter().chain(&s.test) {
                let truth = solve_prompt(&r.prompt);
                assert_eq!(r.answer, truth.to_string(), "{r:?}");
                let full = format!("{}{}", r.prompt, r.completion);
                assert_eq!(extract_answer(&full), Some(truth.to_string()));
                check_steps(r);
            }
        }
    }

    #[test]
    fn splits_are_disjoint_even_up_to_commutation() {
        // Dense (enumeration) and sparse (rejection) paths.
        for (digits, train, test) in [(1, 40, 15), (2, 300, 100)] {
            let s = make_splits(&cfg(digits, vec![Op::Add, Op::Sub], train, test, 3)).unwrap();
            let key = |r: &TaskRecord| {
                let v = solve_prompt(&r.prompt); // value is commutation invariant for +
                let body = &r.prompt[3..r.prompt.len() - 5];
                let pos = body.find(['+', '-']).unwrap();
                let (a, b) = (&body[..pos], &body[pos + 1..]);
                let op = &body[pos..pos + 1];
                let (a, b) = if op == "+" && a > b { (b, a) } else { (a, b) };
                (op.to_string(), a.to_string(), b.to_string(), v)
            };
            let test_keys: HashSet<_> = s.test.iter().map(key).collect();
            let train_keys: HashSet<_> = s.train.iter().map(key).collect();
            assert_eq!(test_keys.len(), test, "duplicates in test");
            assert_eq!(train_keys.len(), train, "duplicates in train");
            assert!(test_keys.is_disjoint(&train_keys));
        }
    }

    #[test]
    fn deterministic_per_seed() {
        let a = make_splits(&cfg(3, vec![Op::Add, Op::Mul], 50, 20, 11)).unwrap();
        let b = make_splits(&cfg(3, vec![Op::Add, Op::Mul], 50, 20, 11)).unwrap();
        let c = make_splits(&cfg(3, vec![Op::Add, Op::Mul], 50, 20, 12)).unwrap();
        assert_eq!(a, b);
        assert_ne!(a.test, c.test);
    }

    #[test]
    fn bad_configs_are_errors() {
        assert!(matches!(
            make_splits(&cfg(0, vec![Op::Add], 1, 1, 0)),
            Err(TaskError::Digits(0))
        ));
        assert!(matches!(
            make_splits(&cfg(2, vec![], 1, 1, 0)),
            Err(TaskError::NoOps)
        ));
        // One-digit addition has 55 unordered problems.
        assert!(matches!(
            make_splits(&cfg(1, vec![Op::Add], 50, 6, 0)),
            Err(TaskError::TooSmall { capacity: 55, .. })
        ));
        let s = make_splits(&cfg(1, vec![Op::Add], 50, 5, 0)).unwrap();
        assert_eq!(s.train.len() + s.test.len(), 55);
    }

    #[test]
    fn writes_jsonl() {
        let dir = tempfile::tempdir().unwrap();
        let c = cfg(2, vec![Op::Add], 10, 5, 0);
        let s = make_splits(&c).unwrap();
        write_splits(dir.path(), &c, &s).unwrap();
        let text = std::fs::read_to_string(dir.path().join("test.jsonl")).unwrap();
        let back: Vec<TaskRecord> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(back, s.test);
    }
}
