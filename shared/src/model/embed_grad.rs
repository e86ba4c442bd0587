//! The embedding's gradient without a scatter-add: each token's rows of the incoming gradient
//! summed by one matmul against a 0/1 matrix, the sums placed by one gather.
//!
//! candle's backward of `index_select` is `zeros + index_add`, whose CUDA kernel runs one thread
//! per column and walks every position in turn (an H200: 1.1 ms for 2,048 positions of
//! Qwen3-0.6B, linear in the positions). Here the positions are grouped by token on the host,
//! `S · g` (`S` `[m, n]`: row i marks the positions of the i-th token) sums each token's rows in
//! one GEMM (f32 accumulation, one rounding: more accurate than a chain of adds in bf16), and
//! an `index_select` writes the whole `[V, H]` gradient, zero where no position read a row.
//! Deterministic: the same ids give the same bits.

use candle_core::{bail, Result, Tensor};

/// The most elements of one group's 0/1 matrix (tokens × positions): 16 Mi, 32 MiB in bf16.
/// Tokens are grouped in ascending order until the next would pass it.
const GROUP_ELEMS: usize = 16 << 20;

/// The gradient `[vocab, H]` of an embedding whose rows `ids` (`n`, on the host) were read,
/// given the gradient `g` `[n, H]` that arrived at them: row v is the sum of g's rows whose id
/// is v (zero where there is none), in g's dtype.
pub(super) fn embedding_grad(ids: &[u32], g: &Tensor, vocab: usize) -> Result<Tensor> {
    in_groups(ids, g, vocab, GROUP_ELEMS)
}

/// [`embedding_grad`] with groups of at most `budget` matrix elements (a token with more
/// positions takes a group of its own).
fn in_groups(ids: &[u32], g: &Tensor, vocab: usize, budget: usize) -> Result<Tensor> {
    let (n, h) = g.dims2()?;
    if ids.len() != n {
        bail!("embedding gradient: {} ids for {n} rows", ids.len());
    }
    if let Some(&bad) = ids.iter().find(|&&t| t as usize >= vocab) {
        bail!("embedding gradient: id {bad} is not below the vocabulary {vocab}");
    }
    let (dev, dt) = (g.device(), g.dtype());
    // Positions by token, ascending within a token (a stable sort).
    let mut order: Vec<u32> = (0..n as u32).collect();
    order.sort_by_key(|&p| ids[p as usize]);
    // source[v]: 1 + the row of token v's sum among the groups' results; 0: no position.
    let mut source = vec![0u32; vocab];
    let mut sums = vec![Tensor::zeros((1, h), dt, dev)?];
    let mut done = 0u32;
    let mut i = 0;
    while i < n {
        let (mut positions, mut token_of) = (Vec::new(), Vec::new());
        let mut m = 0u32;
        while i < n {
            let tok = ids[order[i] as usize];
            let run = order[i..]
                .iter()
                .take_while(|&&p| ids[p as usize] == tok)
                .count();
            if m > 0 && (m as usize + 1) * (positions.len() + run) > budget {
                break;
            }
            positions.extend_from_slice(&order[i..i + run]);
            token_of.extend(std::iter::repeat_n(m, run));
            source[tok as usize] = done + m + 1;
            m += 1;
            i += run;
        }
        let len = positions.len();
        let rows = g.index_select(&Tensor::from_vec(positions, len, dev)?, 0)?;
        let marks = Tensor::arange(0u32, m, dev)?
            .reshape((m as usize, 1))?
            .broadcast_eq(&Tensor::from_vec(token_of, (1, len), dev)?)?
            .to_dtype(dt)?;
        sums.push(marks.matmul(&rows)?); // [m, H]
        done += m;
    }
    let from = Tensor::from_vec(source, vocab, dev)?;
    Tensor::cat(&sums, 0)?.index_select(&from, 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::test_tensors::data;
    use candle_core::{DType, Device, Var};

    /// Against candle's backward of `index_select` (f64, to rounding): repeated ids, ids never
    /// read, one token over many positions; in one group and in groups of a few tokens (one
    /// token alone past the budget); and an id past the vocabulary is an error.
    #[test]
    fn equals_the_scatter_add() {
        let (vocab, h) = (50, 6);
        for ids in [
            vec![3u32, 17, 3, 8, 49, 0, 3, 17],
            (0..200u32).map(|i| (i * 7 + i / 3) % 50).collect(),
            vec![5; 33],
        ] {
            let n = ids.len();
            let table = Var::from_tensor(&data(1, &[vocab, h], 1.0)).unwrap();
            let g = data(2, &[n, h], 1.0);
            let idx = Tensor::from_vec(ids.clone(), n, &Device::Cpu).unwrap();
            let read = table.as_tensor().index_select(&idx, 0).unwrap();
            let want = crate::model::autograd::seed(&[(&read, &g)]).unwrap();
            let want = want.get(table.as_tensor()).unwrap();
            for budget in [GROUP_ELEMS, 40] {
                let got = in_groups(&ids, &g, vocab, budget).unwrap();
                assert_eq!(got.dims(), [vocab, h]);
                let d = (got - want)
                    .unwrap()
                    .abs()
                    .unwrap()
                    .max_all()
                    .unwrap()
                    .to_scalar::<f64>()
                    .unwrap();
                assert!(d < 1e-12, "{n} ids, groups of {budget}: off by {d:e}");
            }
        }
        let g = data(3, &[2, h], 1.0).to_dtype(DType::F32).unwrap();
        assert!(embedding_grad(&[1, 50], &g, vocab).is_err());
        assert!(embedding_grad(&[1], &g, vocab).is_err());
    }
}
