//! Gradient accumulation over micro-batches: sums the parameters' gradients of several
//! `backward` calls (and drops the activations' gradients at once).
//!
//! With every micro-batch loss divided by the *global* valid-token count (the losses'
//! `normalizer` argument), the sum equals the gradient of one big batch's mean.

use std::collections::HashMap;

use candle_core::backprop::GradStore;
use candle_core::{Tensor, TensorId, Var};

use super::Result;

/// Running sum of the gradients of `vars`.
pub struct GradAccumulator {
    vars: Vec<Var>,
    sums: HashMap<TensorId, Tensor>,
    micro_batches: usize,
}

impl GradAccumulator {
    pub fn new(vars: Vec<Var>) -> Self {
        Self {
            vars,
            sums: HashMap::new(),
            micro_batches: 0,
        }
    }

    /// Adds the parameter gradients of one micro-batch's `backward()`.
    pub fn add(&mut self, grads: &GradStore) -> Result<()> {
        for v in &self.vars {
            let Some(g) = grads.get(v.as_tensor()) else {
                continue;
            };
            let g = g.detach();
            let sum = match self.sums.remove(&v.id()) {
                Some(s) => (s + g)?,
                None => g,
            };
            self.sums.insert(v.id(), sum);
        }
        self.micro_batches += 1;
        Ok(())
    }

    /// Micro-batches added since the last [`GradAccumulator::take`].
    pub fn micro_batches(&self) -> usize {
        self.micro_batches
    }

    /// The summed gradients as a `GradStore` for clipping and the optimiser; resets the sum.
    pub fn take(&mut self) -> GradStore {
        let mut out = GradStore::default();
        for v in &self.vars {
            if let Some(g) = self.sums.remove(&v.id()) {
                out.insert(v.as_tensor(), g);
            }
        }
        self.sums.clear();
        self.micro_batches = 0;
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::loss::testutil::{assert_close, flat, rng, tensor, uniform};
    use crate::loss::{cross_entropy, topk_divergence, Divergence, TailMode, TopkTargets};
    use candle_core::{DType, Device};

    #[test]
    fn two_micro_batches_equal_one_big_batch() {
        // A shared linear head W [H, V]: logits = x W, loss = JSD top-k + CE, both divided by
        // the global valid count (unequal counts per micro-batch: 3 and 2).
        let (b, t, h, v, k) = (2, 3, 4, 9, 3);
        let mut r = rng(61);
        let w =
            Var::from_tensor(&tensor(&uniform(&mut r, h * v, 1.0), &[h, v], DType::F64)).unwrap();
        let x = tensor(&uniform(&mut r, b * t * h, 1.0), &[b, t, h], DType::F64);
        let ids: Vec<u32> = (0..b * t * k).map(|i| ((i * 7) % v) as u32).collect();
        let lps: Vec<f32> = (0..b * t * k).map(|i| -1.5 - (i % k) as f32).collect();
        let mask = [1.0f32, 1.0, 1.0, 1.0, 0.0, 1.0];
        let tg = TopkTargets::from_host(b, t, k, &ids, &lps, &mask, v, &Device::Cpu).unwrap();
        let y = Tensor::from_vec(
            (0..b * t).map(|i| (i % v) as u32).collect(),
            (b, t),
            &Device::Cpu,
        )
        .unwrap();
        let loss = |rows: std::ops::Range<usize>, norm: Option<f64>| {
            let n = rows.len();
            let xs = x.narrow(0, rows.start, n).unwrap();
            let logits = xs
                .reshape((n * t, h))
                .unwrap()
                .matmul(w.as_tensor())
                .unwrap()
                .reshape((n, t, v))
                .unwrap();
            let part = TopkTargets {
                ids: tg.ids.narrow(0, rows.start, n).unwrap(),
                logprobs: tg.logprobs.narrow(0, rows.start, n).unwrap(),
                mask: tg.mask.narrow(0, rows.start, n).unwrap(),
            };
            let (kd, _) = topk_divergence(
                &logits,
                &part,
                Divergence::Jsd { beta: 0.5 },
                TailMode::Bucket,
                2.0,
                norm,
            )
            .unwrap();
            let (ce, _) = cross_entropy(
                &logits,
                &y.narrow(0, rows.start, n).unwrap(),
                &part.mask,
                norm,
            )
            .unwrap();
            (kd + ce).unwrap()
        };
        let mut acc = GradAccumulator::new(vec![w.clone()]);
        acc.add(&loss(0..b, None).backward().unwrap()).unwrap();
        let big = flat(acc.take().get(w.as_tensor()).unwrap());

        for rows in [0..1, 1..2] {
            acc.add(&loss(rows, Some(5.0)).backward().unwrap()).unwrap();
        }
        assert_eq!(acc.micro_batches(), 2);
        let summed = flat(acc.take().get(w.as_tensor()).unwrap());
        assert_close(&summed, &big, 1e-12, "accumulated gradient");
        assert_eq!(acc.micro_batches(), 0);
    }
}
