//! The sparse student → teacher vocabulary projection W the cross-tokenizer losses read.

use crate::loss::{LossError, Result};

/// Sparse projection W from the student vocabulary to the teacher's (≤ 4 entries per row,
/// weights of a row summing to 1), stored both ways.
#[derive(Debug, Clone)]
pub struct Projection {
    student_vocab: usize,
    teacher_vocab: usize,
    // Student → teacher (CSR rows).
    indptr: Vec<usize>,
    indices: Vec<u32>,
    weights: Vec<f32>,
    // Teacher → student (the transpose, CSR over teacher ids).
    t_indptr: Vec<usize>,
    t_indices: Vec<u32>,
    t_weights: Vec<f32>,
    /// Student id → teacher id when the row is one-hot with weight 1 (an exact counterpart).
    exact_teacher: Vec<Option<u32>>,
    /// Teacher id → the lowest student id exactly mapped to it.
    exact_student: Vec<Option<u32>>,
    /// Teacher id → the first student token of its re-tokenisation by the student (`None`:
    /// not set, or no student token starts it). Read by [`first_kl_loss`](super::first_kl_loss).
    pub(super) teacher_first: Vec<Option<u32>>,
}

impl Projection {
    /// From CSR slices: row `s` holds `indices[indptr[s]..indptr[s+1]]` (teacher ids) with
    /// `weights[..]`. `indptr` has `student_vocab + 1` entries.
    pub fn from_csr(
        student_vocab: usize,
        teacher_vocab: usize,
        indptr: &[usize],
        indices: &[u32],
        weights: &[f32],
    ) -> Result<Self> {
        let bad = |m: String| Err(LossError::input("projection", m));
        if indptr.len() != student_vocab + 1 || indptr[0] != 0 {
            return bad(format!(
                "indptr must have student_vocab + 1 = {} entries starting at 0",
                student_vocab + 1
            ));
        }
        if indptr.windows(2).any(|w| w[0] > w[1]) {
            return bad("indptr must be non-decreasing".into());
        }
        let nnz = indptr[student_vocab];
        if indices.len() != nnz || weights.len() != nnz {
            return bad(format!(
                "indptr ends at {nnz} but there are {} indices and {} weights",
                indices.len(),
                weights.len()
            ));
        }
        if let Some(&u) = indices.iter().find(|&&u| u as usize >= teacher_vocab) {
            return bad(format!("teacher id {u} >= teacher vocab {teacher_vocab}"));
        }
        if let Some(w) = weights.iter().find(|w| !(w.is_finite() && **w >= 0.0)) {
            return bad(format!("weight {w} is not a finite non-negative number"));
        }
        // Transpose by counting.
        let mut t_indptr = vec![0usize; teacher_vocab + 1];
        for &u in indices {
            t_indptr[u as usize + 1] += 1;
        }
        for u in 0..teacher_vocab {
            t_indptr[u + 1] += t_indptr[u];
        }
        let mut fill = t_indptr.clone();
        let mut t_indices = vec![0u32; nnz];
        let mut t_weights = vec![0f32; nnz];
        let mut exact_teacher = vec![None; student_vocab];
        let mut exact_student = vec![None; teacher_vocab];
        for s in 0..student_vocab {
            let row = indptr[s]..indptr[s + 1];
            for e in row.clone() {
                let u = indices[e] as usize;
                t_indices[fill[u]] = s as u32;
                t_weights[fill[u]] = weights[e];
                fill[u] += 1;
            }
            if row.len() == 1 && weights[row.start] == 1.0 {
                let u = indices[row.start];
                exact_teacher[s] = Some(u);
                exact_student[u as usize].get_or_insert(s as u32);
            }
        }
        Ok(Self {
            student_vocab,
            teacher_vocab,
            indptr: indptr.to_vec(),
            indices: indices.to_vec(),
            weights: weights.to_vec(),
            t_indptr,
            t_indices,
            t_weights,
            exact_teacher,
            exact_student,
            teacher_first: Vec::new(),
        })
    }

    /// Sets the teacher → first-student-token map (one entry per teacher id; ids checked).
    pub fn with_teacher_first(mut self, first: Vec<Option<u32>>) -> Result<Self> {
        if first.len() != self.teacher_vocab {
            return Err(LossError::input(
                "projection",
                format!(
                    "teacher_first has {} entries for a teacher vocabulary of {}",
                    first.len(),
                    self.teacher_vocab
                ),
            ));
        }
        if let Some(s) = first
            .iter()
            .flatten()
            .find(|&&s| s as usize >= self.student_vocab)
        {
            return Err(LossError::input(
                "projection",
                format!("teacher_first: student id {s} out of range"),
            ));
        }
        self.teacher_first = first;
        Ok(self)
    }

    /// Whether the teacher → first-student-token map is set ([`Self::with_teacher_first`]).
    pub fn has_teacher_first(&self) -> bool {
        !self.teacher_first.is_empty()
    }

    /// The first student token of teacher token `u`'s re-tokenisation, if known.
    pub fn teacher_first(&self, u: usize) -> Option<u32> {
        self.teacher_first.get(u).copied().flatten()
    }

    pub fn student_vocab(&self) -> usize {
        self.student_vocab
    }

    pub fn teacher_vocab(&self) -> usize {
        self.teacher_vocab
    }

    /// Row `s` of W: (teacher ids, weights).
    pub fn row(&self, s: usize) -> (&[u32], &[f32]) {
        let r = self.indptr[s]..self.indptr[s + 1];
        (&self.indices[r.clone()], &self.weights[r])
    }

    /// Column `u` of W: (student ids, weights).
    pub fn column(&self, u: usize) -> (&[u32], &[f32]) {
        let r = self.t_indptr[u]..self.t_indptr[u + 1];
        (&self.t_indices[r.clone()], &self.t_weights[r])
    }

    /// The teacher id a student id maps to exactly (one-hot row of weight 1).
    pub fn exact_teacher(&self, s: usize) -> Option<u32> {
        self.exact_teacher.get(s).copied().flatten()
    }

    /// The (lowest) student id that maps exactly to teacher id `u`.
    pub fn exact_student(&self, u: usize) -> Option<u32> {
        self.exact_student.get(u).copied().flatten()
    }
}
