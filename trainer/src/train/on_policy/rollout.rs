//! Rollouts: the prompts of a batch, the student's samples of them, and (same tokenizer) the
//! samples as training items.

use crate::collate::Encoded;
use crate::data::{Content, Record};
use crate::generate::{generate, Generation};
use crate::train::distill::Setup;
use crate::train::pairing::sampled::Sample;
use crate::train::pairing::Item;
use anyhow::Result;
use rand_chacha::ChaCha8Rng;

/// The prompt part of a record (the whole text for plain-text records).
pub(super) fn prompt_of(r: &Record) -> String {
    match &r.content {
        Content::Pair { prompt, .. } => prompt.clone(),
        Content::Text { text } => text.clone(),
    }
}

/// Generates for `records`, returns the generations and the time it took.
pub(super) fn sample(
    s: &Setup,
    model: &xdistill_shared::model::Decoder,
    tok: &tokenizers::Tokenizer,
    records: &[Record],
    rng: &mut ChaCha8Rng,
) -> Result<Vec<Generation>> {
    let prompts: Vec<Vec<u32>> = records
        .iter()
        .map(|r| crate::eval::encode_prompt(tok, &prompt_of(r)))
        .collect::<Result<_, _>>()?;
    let gen = &s.cfg.on_policy.generation;
    Ok(generate(model, tok, &prompts, gen, rng)?)
}

/// Same tokenizer: the non-empty samples with the student's own ids.
pub(super) fn same_samples<'a>(gens: impl Iterator<Item = &'a Generation>) -> Vec<Sample> {
    gens.filter(|g| !g.completion_ids.is_empty())
        .map(|g| {
            let mut ids = g.prompt_ids.clone();
            ids.extend_from_slice(&g.completion_ids);
            Sample {
                ids,
                completion_from: g.prompt_ids.len(),
                old_lp: g.sampled_logprobs.clone(),
            }
        })
        .collect()
}

/// Same tokenizer, a top-k loss: the samples as items (completion only unless `include_prompt`).
pub(super) fn same_items(s: &Setup, samples: &[Sample]) -> Vec<Item> {
    let include_prompt = s.cfg.on_policy.include_prompt;
    samples
        .iter()
        .map(|x| {
            Item::Same(Encoded {
                ids: x.ids.clone(),
                loss_from: if include_prompt { 1 } else { x.completion_from },
            })
        })
        .collect()
}
