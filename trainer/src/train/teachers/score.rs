//! Scoring on the [`TeacherPool`](crate::client::TeacherPool): a source's answers to a request,
//! a group's answers, and a step's groups all at once. The `async` forms compose (a step's
//! groups, and an ensemble's teachers within a group, are awaited together in one `block_on`);
//! the blocking forms are for the synchronous loop and its prefetch thread.

use super::Group;
use super::{ScoreError, Source, Teachers};
use crate::client::join_in_order;
use xdistill_shared::protocol::{SequenceScores, TopkRequest, ValuesKind};

/// Answers to one request, one per sequence, or the failure naming the teacher.
pub type Scores = std::result::Result<Vec<SequenceScores>, ScoreError>;

impl Teachers {
    /// A source's request for `sequences` (`start = 0`, the source's k and temperature; the
    /// mixture asks each teacher with its own k).
    pub fn request(
        &self,
        s: Source,
        sequences: Vec<Vec<u32>>,
        starts: Option<Vec<usize>>,
    ) -> TopkRequest {
        let t = self.of(s);
        TopkRequest {
            sequences,
            k: t.cfg.k,
            temperature: t.cfg.temperature,
            start: 0,
            starts,
            values: ValuesKind::Logprobs,
            ids: None,
        }
    }

    /// A source's answers to `req`, one per sequence: one teacher's, or the mixture (each
    /// teacher's top-k together, then each teacher's log-probs at the union together,
    /// [`super::ensemble`]). A one-teacher mixture is that teacher's answer itself.
    pub async fn score_async(&self, s: Source, req: &TopkRequest) -> Scores {
        if req.sequences.is_empty() {
            return Ok(vec![]);
        }
        match s {
            Source::One(i) => self.pool.ask(i, req).await,
            Source::Mixture if self.list.len() == 1 => self.pool.ask(0, req).await,
            Source::Mixture => self.score_mixture(req).await,
        }
    }

    /// A group's answers, one per item: its teacher's, or the ensemble's target
    /// ([`Self::score_async`] for the same-tokenizer mixture; the chunk-level mixture from each
    /// teacher's answers for its own tokenization of the records).
    pub async fn score_group_async(&self, g: &Group) -> Scores {
        if g.items.is_empty() {
            return Ok(vec![]);
        }
        if g.parts.is_empty() {
            let seqs = g.items.iter().map(|i| i.teacher_ids().to_vec()).collect();
            return self
                .score_async(g.source, &self.request(g.source, seqs, None))
                .await;
        }
        self.score_chunk_mixture(g).await
    }

    /// Several groups' answers, every group's requests awaited together (a step waits for the
    /// slowest teacher, not the sum); the first error in group order.
    pub async fn score_all_async(
        &self,
        groups: &[&Group],
    ) -> std::result::Result<Vec<Vec<SequenceScores>>, ScoreError> {
        join_in_order(groups.iter().map(|g| self.score_group_async(g))).await
    }

    /// [`Self::score_async`], blocking on the pool.
    pub fn score(&self, s: Source, req: &TopkRequest) -> Scores {
        self.pool.block_on(self.score_async(s, req))
    }

    /// [`Self::score_group_async`], blocking on the pool.
    pub fn score_group(&self, g: &Group) -> Scores {
        self.pool.block_on(self.score_group_async(g))
    }

    /// [`Self::score_all_async`], blocking on the pool.
    pub fn score_all(
        &self,
        groups: &[&Group],
    ) -> std::result::Result<Vec<Vec<SequenceScores>>, ScoreError> {
        self.pool.block_on(self.score_all_async(groups))
    }
}
