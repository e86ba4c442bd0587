//! Gradient accumulation over a step's virtual shards and their micro-batches.
//!
//! Within a shard, micro-batch gradients are summed in order (in f32; a shard of one
//! micro-batch keeps its gradients as they came, in the compute dtype, which the norm and the
//! optimiser widen as they read: the same values); each finished shard is a leaf of the
//! pairwise tree of [`crate::dist::tree`], so a step's gradient is the same sum whether one
//! process computes every shard or N processes a contiguous share each (the ranks' subtrees
//! then meet in the same tree, see [`crate::dist::shards`]).
//!
//! With every micro-batch loss divided by the *global* unit count (the losses' `normalizer`
//! argument), the sum equals the gradient of one big batch's mean.

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};

use super::Result;
use crate::dist::tree::{Summand, TreeAccumulator};
use xdistill_shared::profiling;

/// One value per parameter, in the accumulator's parameter order (`[n_i]` shaped like var i);
/// and, where those are consecutive views of one f32 buffer `[Σ n_i]` (a shard summed in place,
/// [`GradAccumulator`]), that buffer: [`Grads::flatten_tensor`] then hands it over, no copy.
#[derive(Debug, Clone)]
pub struct Grads(pub Vec<Tensor>, Option<Tensor>);

impl Summand for Grads {
    type Error = candle_core::Error;
    fn add_assign(&mut self, rhs: &Self) -> candle_core::Result<()> {
        // A shard's leaf may hold its compute copies' gradients as they came (bf16): widened
        // first, so the sum is the one of their f32 values.
        for (l, r) in self.0.iter_mut().zip(&rhs.0) {
            *l = (widened(l)? + widened(r)?)?;
        }
        // The sums are new tensors, no longer views of a buffer.
        self.1 = None;
        Ok(())
    }
}

impl Grads {
    /// One value per parameter, as given.
    pub fn new(parts: Vec<Tensor>) -> Grads {
        Grads(parts, None)
    }

    /// The gradients as a `GradStore` of `vars` (clipping and the optimiser read that).
    pub fn into_store(self, vars: &[Var]) -> GradStore {
        let mut out = GradStore::default();
        for (v, g) in vars.iter().zip(self.0) {
            out.insert(v.as_tensor(), g);
        }
        out
    }

    /// Every value in order as one host buffer (what a collective moves).
    pub fn flatten(&self) -> Result<Vec<f32>> {
        let mut out = Vec::with_capacity(self.0.iter().map(|t| t.elem_count()).sum());
        for t in &self.0 {
            out.extend(t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?);
        }
        Ok(out)
    }

    /// Every value in order as one `[n]` f32 tensor on the gradients' device (what
    /// [`crate::dist::Collective::all_reduce_sum_tensor`] sums): the host buffer of
    /// [`Grads::flatten`] without leaving the device. Held compute-copy gradients are widened
    /// into it in one launch where the in-place kernel runs (no f32 copy of each beside it).
    pub fn flatten_tensor(&self) -> Result<Tensor> {
        if let Some(flat) = &self.1 {
            return Ok(flat.clone());
        }
        if let Some(first) = self.0.first() {
            let parts: Vec<Option<&Tensor>> = self.0.iter().map(Some).collect();
            let shapes: Vec<&[usize]> = self.0.iter().map(|t| t.dims()).collect();
            if let Some((flat, _)) = widen_into_buffer(&parts, &shapes, first.device())? {
                return Ok(flat);
            }
        }
        let parts = self
            .0
            .iter()
            .map(|t| t.flatten_all()?.to_dtype(DType::F32))
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok(Tensor::cat(&parts, 0)?)
    }

    /// The gradients of `vars` as views of `flat` (`[n]`, [`Grads::flatten_tensor`]'s layout):
    /// no copy.
    pub fn from_flat_tensor(flat: &Tensor, vars: &[Var]) -> Result<Grads> {
        let mut at = 0;
        let mut out = Vec::with_capacity(vars.len());
        for v in vars {
            let n = v.elem_count();
            out.push(flat.narrow(0, at, n)?.reshape(v.shape())?);
            at += n;
        }
        let whole = at == flat.elem_count() && flat.rank() == 1 && flat.dtype() == DType::F32;
        Ok(Grads(out, whole.then(|| flat.clone())))
    }

    /// The tensors of `vars[i]` shapes (f32) read back from a flat buffer starting at `from`.
    pub fn from_flat(flat: &[f32], vars: &[Var], device: &Device) -> Result<Grads> {
        let mut at = 0;
        let mut out = Vec::with_capacity(vars.len());
        for v in vars {
            let n = v.elem_count();
            out.push(Tensor::from_slice(&flat[at..at + n], v.shape(), device)?);
            at += n;
        }
        Ok(Grads::new(out))
    }
}

/// One f32 buffer `[Σ n_i]` on `device` holding `parts` (part i of shape `shapes[i]` at the sum
/// of the sizes before it, widened exactly; zeros where `None`), written in one launch, and its
/// views shaped as `shapes`; `None` (nothing done) where the in-place kernel does not apply
/// (a part not contiguous, not f32, bf16 or f16, or on another device).
fn widen_into_buffer(
    parts: &[Option<&Tensor>],
    shapes: &[&[usize]],
    device: &Device,
) -> Result<Option<(Tensor, Vec<Tensor>)>> {
    let fits = parts.iter().zip(shapes).all(|(p, shape)| {
        p.is_none_or(|p| {
            p.dims() == *shape
                && p.is_contiguous()
                && p.device().same_device(device)
                && matches!(p.dtype(), DType::F32 | DType::BF16 | DType::F16)
        })
    });
    if !fits || !xdistill_kernels::grad_accumulate::applies(device) {
        return Ok(None);
    }
    let total = shapes
        .iter()
        .map(|s| s.iter().product::<usize>())
        .sum::<usize>();
    let flat = Tensor::zeros(total, DType::F32, device)?;
    let mut views = Vec::with_capacity(shapes.len());
    let mut at = 0;
    for shape in shapes {
        let n = shape.iter().product::<usize>();
        views.push(flat.narrow(0, at, n)?.reshape(*shape)?);
        at += n;
    }
    let entries: Vec<_> = parts
        .iter()
        .zip(&views)
        .filter_map(|(p, dst)| {
            p.map(|src| xdistill_kernels::GradSum {
                src,
                dst,
                add: false,
            })
        })
        .collect();
    xdistill_kernels::grad_accumulate(&entries)?;
    Ok(Some((flat, views)))
}

/// A gradient in f32 where it is bf16 or f16 (exact).
fn widened(g: &Tensor) -> candle_core::Result<Tensor> {
    crate::optim::clip::widened(g)
}

/// The dtype gradients are summed in: f32, or f64 for f64 parameters (the tests' references).
fn sum_dtype(v: &Var) -> DType {
    if v.dtype() == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

/// A step's gradient: the running micro-batch sum of the open shard, and the tree over the
/// shards closed so far.
pub struct GradAccumulator {
    vars: Vec<Var>,
    /// What a backward pass keys each var's gradient by: the var, or the compute copy the
    /// decoder reads in its place (`Student::grad_keys`).
    keys: Vec<Tensor>,
    /// The open shard's sums (f32, or f64 for f64 vars), one per var with a gradient so far.
    open: Vec<Option<Tensor>>,
    /// When the open shard is summed in place ([`GradAccumulator::add_in_place`]): the one f32
    /// buffer `[Σ n_i]` whose views (var i's at the sum of the sizes before it) are its sums.
    flat: Option<Tensor>,
    micro_batches: usize,
    tree: TreeAccumulator<Grads>,
}

impl GradAccumulator {
    /// An accumulator for `vars`, whose gradients a backward pass keys by the vars themselves.
    pub fn new(vars: Vec<Var>) -> Self {
        let keys = vars.iter().map(|v| v.as_tensor().clone()).collect();
        Self::with_keys(vars, keys)
    }

    /// An accumulator for `vars` whose gradients are found under `keys` (one per var, e.g. its
    /// bf16 compute copy: summed in f32 here, as the var's).
    pub fn with_keys(vars: Vec<Var>, keys: Vec<Tensor>) -> Self {
        let open = vars.iter().map(|_| None).collect();
        Self {
            vars,
            keys,
            open,
            flat: None,
            micro_batches: 0,
            tree: TreeAccumulator::new(),
        }
    }

    /// Adds the parameter gradients of one micro-batch's `backward()` to the open shard.
    pub fn add(&mut self, grads: &GradStore) -> Result<()> {
        let _region = self.region();
        if self.add_in_place(grads)? {
            self.micro_batches += 1;
            return Ok(());
        }
        // The sums below are new tensors: the shard's sums are no longer all views of `flat`.
        self.flat = None;
        let each = self.vars.iter().zip(&self.keys).zip(self.open.iter_mut());
        for ((v, key), slot) in each {
            let Some(g) = grads.get(key) else {
                continue;
            };
            let g = g.detach().to_dtype(sum_dtype(v))?;
            *slot = Some(match slot.take() {
                // A held compute-copy gradient is widened first.
                Some(s) => (s.to_dtype(sum_dtype(v))? + g)?,
                None => g,
            });
        }
        self.micro_batches += 1;
        Ok(())
    }

    /// Takes the gradients of `grads` now, where [`GradAccumulator::add`] would take them in
    /// place (held, in a shard's first micro-batch; else summed into the f32 buffer), and
    /// removes them from `grads`; the rest stay for `add`, which ends the micro-batch. The
    /// training pass calls it after each layer's backward
    /// ([`xdistill_shared::model::TrainPass::backward_with`]), so from a shard's second
    /// micro-batch on a layer's compute-dtype gradients are freed once summed instead of living
    /// until the whole backward is done (all of them, 3.4 GB of bf16 at Qwen3-1.7B, beside the
    /// f32 sums). Each var's gradient is held, widened into or added to its sum exactly as `add`
    /// would: the same bits. Where the in-place path does not apply (the kernels off on CUDA)
    /// `grads` is left as it is.
    pub fn absorb(&mut self, grads: &mut GradStore) -> Result<()> {
        let _region = self.region();
        if !self.keys.iter().any(|k| grads.get(k).is_some()) || !self.add_in_place(grads)? {
            return Ok(());
        }
        for key in &self.keys {
            grads.remove(key);
        }
        Ok(())
    }

    /// The profiler's region of a sum ([`xdistill_shared::profiling`]), on the vars' device.
    fn region(&self) -> Option<profiling::Region> {
        let v = self.vars.first()?;
        Some(profiling::region(v.device(), profiling::Phase::Accumulate))
    }

    /// [`GradAccumulator::add`] in place, where it applies: every var f32 on one device where
    /// [`xdistill_kernels::grad_accumulate`] runs (the CPU; CUDA with the project's kernels),
    /// every gradient, and every sum the shard has so far, contiguous in the var's shape (f32,
    /// bf16 or f16). A var's first gradient in the shard is held as it is, no copy and no cast:
    /// a step of one micro-batch hands its compute copies' bf16 gradients to the norm and the
    /// optimiser, which widen them as they read (2 bytes a parameter where an f32 sum takes 4:
    /// 3.4 GB less at Qwen3-1.7B, and none of it allocated while the backward's activations
    /// are). The first var to get a second gradient moves the shard's sums into one f32 buffer
    /// (each held gradient widened into its view), into which every later gradient is widened
    /// or added, one launch per call on CUDA instead of a cast and an add per parameter: the
    /// same bits. False (nothing done) where it does not apply.
    fn add_in_place(&mut self, grads: &GradStore) -> Result<bool> {
        let Some(device) = self.vars.first().map(|v| v.device().clone()) else {
            return Ok(false);
        };
        let found: Vec<Option<&Tensor>> = self.keys.iter().map(|k| grads.get(k)).collect();
        let fits_var = |v: &Var, g: &Tensor| {
            g.dims() == v.dims()
                && g.is_contiguous()
                && g.device().same_device(&device)
                && matches!(g.dtype(), DType::F32 | DType::BF16 | DType::F16)
        };
        let fits = self
            .vars
            .iter()
            .zip(&found)
            .zip(&self.open)
            .all(|((v, g), s)| {
                v.dtype() == DType::F32
                    && v.device().same_device(&device)
                    && g.is_none_or(|g| fits_var(v, g))
                    && s.as_ref().is_none_or(|s| fits_var(v, s))
            });
        if !fits || !xdistill_kernels::grad_accumulate::applies(&device) {
            return Ok(false);
        }
        let flat = match &self.flat {
            Some(f) => f.clone(),
            None => {
                let again = found
                    .iter()
                    .zip(&self.open)
                    .any(|(g, s)| g.is_some() && s.is_some());
                if !again {
                    // Each var's first gradient of the shard: held.
                    for (g, slot) in found.iter().zip(self.open.iter_mut()) {
                        if let Some(g) = g {
                            *slot = Some((*g).clone());
                        }
                    }
                    return Ok(true);
                }
                match self.move_into_buffer(&device)? {
                    Some(f) => f,
                    None => return Ok(false),
                }
            }
        };
        let mut dsts = Vec::with_capacity(self.vars.len());
        let mut at = 0;
        for ((v, g), slot) in self.vars.iter().zip(&found).zip(&self.open) {
            let n = v.elem_count();
            if let Some(g) = g {
                let (dst, add) = match slot {
                    Some(s) => (s.clone(), true),
                    None => (flat.narrow(0, at, n)?.reshape(v.shape())?, false),
                };
                dsts.push((*g, dst, add));
            }
            at += n;
        }
        let entries: Vec<_> = dsts
            .iter()
            .map(|(src, dst, add)| xdistill_kernels::GradSum {
                src,
                dst,
                add: *add,
            })
            .collect();
        xdistill_kernels::grad_accumulate(&entries)?;
        let mut written = dsts.into_iter().map(|(_, dst, _)| dst);
        for (g, slot) in found.iter().zip(self.open.iter_mut()) {
            if g.is_some() {
                *slot = written.next();
            }
        }
        Ok(true)
    }

    /// The open shard's sums (held gradients, or sums made out of place) moved into one f32
    /// buffer, each widened into its view in one launch, which becomes the shard's `flat`;
    /// `None` (nothing done) where the in-place kernel does not apply.
    fn move_into_buffer(&mut self, device: &Device) -> Result<Option<Tensor>> {
        let held: Vec<Option<&Tensor>> = self.open.iter().map(Option::as_ref).collect();
        let shapes: Vec<&[usize]> = self.vars.iter().map(|v| v.dims()).collect();
        if self.vars.iter().any(|v| v.dtype() != DType::F32) {
            return Ok(None);
        }
        let Some((flat, views)) = widen_into_buffer(&held, &shapes, device)? else {
            return Ok(None);
        };
        for (slot, view) in self.open.iter_mut().zip(views) {
            if slot.is_some() {
                *slot = Some(view);
            }
        }
        self.flat = Some(flat.clone());
        Ok(Some(flat))
    }

    /// Call before a micro-batch's forward. Where the open shard holds its first micro-batch's
    /// gradients as they came, they move into the shard's f32 buffer now, while no activation
    /// is alive, rather than at the first gradient of this micro-batch's backward, when the
    /// held gradients, the buffer and every activation would exist at once (3.4 GB more at
    /// Qwen3-1.7B than summing in f32 from the start). Nothing to do otherwise.
    pub fn before_micro_batch(&mut self) -> Result<()> {
        if self.flat.is_some() || self.open.iter().all(Option::is_none) {
            return Ok(());
        }
        let _region = self.region();
        if let Some(device) = self.vars.first().map(|v| v.device().clone()) {
            self.move_into_buffer(&device)?;
        }
        Ok(())
    }

    /// Closes the open shard (an empty one is a leaf of zeros: the tree's shape never
    /// depends on what a shard held).
    pub fn end_shard(&mut self) -> Result<()> {
        let flat = self.flat.take();
        let mut leaf = Vec::with_capacity(self.vars.len());
        let mut at = 0;
        for (v, slot) in self.vars.iter().zip(self.open.iter_mut()) {
            let n = v.elem_count();
            leaf.push(match (slot.take(), &flat) {
                (Some(s), _) => s,
                // Summed in place: a var no micro-batch reached keeps its zeros in the buffer.
                (None, Some(f)) => f.narrow(0, at, n)?.reshape(v.shape())?,
                (None, None) => Tensor::zeros(v.shape(), sum_dtype(v), v.device())?,
            });
            at += n;
        }
        self.tree.push(Grads(leaf, flat))?;
        Ok(())
    }

    /// Micro-batches added since the last [`GradAccumulator::take`].
    pub fn micro_batches(&self) -> usize {
        self.micro_batches
    }

    /// Shards closed so far.
    pub fn shards(&self) -> usize {
        self.tree.leaves()
    }

    pub fn vars(&self) -> &[Var] {
        &self.vars
    }

    /// The tree's sum over the closed shards (an open shard with gradients is closed first);
    /// zeros when nothing was added. Resets the accumulator.
    pub fn finish(&mut self) -> Result<Grads> {
        if self.open.iter().any(Option::is_some) {
            self.end_shard()?;
        }
        self.micro_batches = 0;
        match std::mem::take(&mut self.tree).finish()? {
            Some(g) => Ok(g),
            None => Ok(Grads::new(
                self.vars
                    .iter()
                    .map(|v| Tensor::zeros(v.shape(), sum_dtype(v), v.device()))
                    .collect::<candle_core::Result<_>>()?,
            )),
        }
    }

    /// [`GradAccumulator::finish`] as a `GradStore` for clipping and the optimiser.
    pub fn take(&mut self) -> Result<GradStore> {
        let g = self.finish()?;
        Ok(g.into_store(&self.vars))
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
        let loss = |rows: std::ops::Range<usize>, norm: Option<crate::loss::Normalizer>| {
            let n = rows.len();
            let xs = x.narrow(0, rows.start, n).unwrap();
            let logits = xs
                .reshape((n * t, h))
                .unwrap()
                .matmul(w.as_tensor())
                .unwrap()
                .reshape((n, t, v))
                .unwrap();
            let part = tg.batch_rows(rows.start, n).unwrap();
            let (kd, _) = topk_divergence(
                &logits,
                &part,
                Divergence::Jsd { beta: 0.5 },
                TailMode::Bucket,
                crate::loss::Temperature::new(2.0).unwrap(),
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
        let big = flat(acc.take().unwrap().get(w.as_tensor()).unwrap());

        for rows in [0..1, 1..2] {
            acc.add(
                &loss(rows, Some(crate::loss::Normalizer::new(5.0).unwrap()))
                    .backward()
                    .unwrap(),
            )
            .unwrap();
        }
        assert_eq!(acc.micro_batches(), 2);
        let summed = flat(acc.take().unwrap().get(w.as_tensor()).unwrap());
        assert_close(&summed, &big, 1e-12, "accumulated gradient");
        assert_eq!(acc.micro_batches(), 0);
    }

    /// Bits of a tensor, in order.
    fn bits(t: &Tensor) -> Vec<u32> {
        t.flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
            .iter()
            .map(|x| x.to_bits())
            .collect()
    }

    /// Compute-copy gradients (bf16, f16) are held as they come until a var gets a second one,
    /// then summed in place in one f32 buffer per shard, with the bits of a cast and an add per
    /// parameter (what the accumulator did before, computed here with candle's ops): a var
    /// missing from a shard's first micro-batch, one missing from a whole shard, two shards
    /// through the tree (one summed in place, one held), a step's result untouched by the next
    /// step's sums, and a step of one micro-batch handing its gradients over as they came.
    #[test]
    fn compute_copy_gradients_sum_in_place_with_the_bits_of_cast_and_add() {
        let dev = Device::Cpu;
        let shapes: [&[usize]; 3] = [&[3, 5], &[70], &[2, 2, 2]];
        let mut r = rng(7);
        let vars: Vec<Var> = shapes
            .iter()
            .map(|s| {
                let n = s.iter().product();
                Var::from_tensor(&tensor(&uniform(&mut r, n, 1.0), s, DType::F32)).unwrap()
            })
            .collect();
        // The keys a backward pass files gradients under: the vars' bf16 compute copies.
        let keys: Vec<Tensor> = vars
            .iter()
            .map(|v| v.to_dtype(DType::BF16).unwrap())
            .collect();
        let mut grad = |i: usize, dt: DType| {
            let n = shapes[i].iter().product();
            tensor(&uniform(&mut r, n, 0.3), shapes[i], DType::F32)
                .to_dtype(dt)
                .unwrap()
        };
        let store = |gs: &[(usize, &Tensor)]| {
            let mut g = GradStore::default();
            for (i, t) in gs {
                g.insert(&keys[*i], (*t).clone());
            }
            g
        };
        let f32_of = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
        let (a0, a1) = (grad(0, DType::BF16), grad(1, DType::BF16));
        let (b1, b2) = (grad(1, DType::BF16), grad(2, DType::F16));
        let (c0, c2) = (grad(0, DType::BF16), grad(2, DType::BF16));
        let kept = [&a0, &a1, &b1, &b2, &c0, &c2].map(bits_any);

        let mut acc = GradAccumulator::with_keys(vars.clone(), keys.clone());
        acc.add(&store(&[(0, &a0), (1, &a1)])).unwrap();
        assert!(acc.flat.is_none(), "a shard's first gradients are held");
        assert_eq!(acc.open[1].as_ref().map(|t| t.dtype()), Some(DType::BF16));
        acc.add(&store(&[(1, &b1), (2, &b2)])).unwrap();
        assert!(
            acc.flat.is_some(),
            "a var's second gradient: summed in place"
        );
        acc.end_shard().unwrap();
        acc.add(&store(&[(0, &c0), (2, &c2)])).unwrap();
        let got = acc.finish().unwrap();

        let zeros = |i: usize| Tensor::zeros(shapes[i], DType::F32, &dev).unwrap();
        let shard1 = [
            f32_of(&a0),
            (f32_of(&a1) + f32_of(&b1)).unwrap(),
            f32_of(&b2),
        ];
        let shard2 = [f32_of(&c0), zeros(1), f32_of(&c2)];
        for i in 0..3 {
            let want = (&shard1[i] + &shard2[i]).unwrap();
            assert_eq!(bits(&got.0[i]), bits(&want), "var {i}");
            assert_eq!(got.0[i].dims(), shapes[i]);
        }
        // The gradients handed in are read, never written.
        assert_eq!([&a0, &a1, &b1, &b2, &c0, &c2].map(bits_any), kept);

        // The next step sums into a buffer of its own: the first step's result stays as it was.
        let before: Vec<Vec<u32>> = got.0.iter().map(bits).collect();
        acc.add(&store(&[(0, &a0), (1, &a1)])).unwrap();
        acc.add(&store(&[(0, &c0), (2, &b2)])).unwrap();
        let next = acc.finish().unwrap();
        assert_eq!(got.0.iter().map(bits).collect::<Vec<_>>(), before);
        assert_eq!(bits(&next.0[1]), bits(&f32_of(&a1)));
        assert_eq!(
            bits(&next.0[0]),
            bits(&(f32_of(&a0) + f32_of(&c0)).unwrap())
        );
        // One shard summed in place hands its buffer over as the flat gradient (what the
        // data-parallel sum reads): the parts in order; two shards' sums are concatenated.
        assert!(next.1.is_some() && got.1.is_none());
        for g in [&got, &next] {
            let cat: Vec<u32> = g.0.iter().flat_map(bits).collect();
            assert_eq!(bits(&g.flatten_tensor().unwrap()), cat);
        }

        // A step of one micro-batch: its gradients handed over as they came (the same storage:
        // no copy), a var without one as f32 zeros; flattened, their f32 widening in order.
        acc.add(&store(&[(0, &a0), (2, &b2)])).unwrap();
        let one = acc.finish().unwrap();
        assert!(one.1.is_none());
        assert!(one.0[0].id() == a0.id() && one.0[2].id() == b2.id());
        assert_eq!(
            (one.0[0].dtype(), one.0[2].dtype()),
            (DType::BF16, DType::F16)
        );
        assert_eq!(bits(&one.0[1]), bits(&zeros(1)));
        let cat: Vec<u32> = one.0.iter().flat_map(bits_any).collect();
        assert_eq!(bits(&one.flatten_tensor().unwrap()), cat);

        // f32 gradients first: held as they are (no copy); a second one for the var moves the
        // shard's sums in place.
        let f = grad(0, DType::F32);
        acc.add(&store(&[(0, &f)])).unwrap();
        assert!(acc.flat.is_none() && acc.open[0].as_ref().map(Tensor::id) == Some(f.id()));
        acc.add(&store(&[(0, &a0)])).unwrap();
        assert!(acc.flat.is_some());
        let g = acc.finish().unwrap();
        assert_eq!(bits(&g.0[0]), bits(&(f + f32_of(&a0)).unwrap()));
    }

    /// Before a shard's second micro-batch, its first one's held gradients move into the f32
    /// buffer (no activation alive then); before its first, nothing happens. The sums are
    /// those of summing in f32 from the start.
    #[test]
    fn held_gradients_move_into_the_buffer_before_the_next_micro_batch() {
        let shapes: [&[usize]; 2] = [&[4, 3], &[9]];
        let mut r = rng(5);
        let vars: Vec<Var> = shapes
            .iter()
            .map(|s| {
                let t = tensor(&uniform(&mut r, s.iter().product(), 1.0), s, DType::F32);
                Var::from_tensor(&t).unwrap()
            })
            .collect();
        let keys: Vec<Tensor> = vars
            .iter()
            .map(|v| v.to_dtype(DType::BF16).unwrap())
            .collect();
        let mut grad = |i: usize| {
            let n = shapes[i].iter().product();
            tensor(&uniform(&mut r, n, 0.3), shapes[i], DType::F32)
                .to_dtype(DType::BF16)
                .unwrap()
        };
        let (a0, a1, b1) = (grad(0), grad(1), grad(1));
        let f32_of = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
        let mut acc = GradAccumulator::with_keys(vars, keys.clone());
        acc.before_micro_batch().unwrap();
        assert!(acc.flat.is_none() && acc.open.iter().all(Option::is_none));
        let mut g = GradStore::default();
        g.insert(&keys[0], a0.clone());
        g.insert(&keys[1], a1.clone());
        acc.add(&g).unwrap();
        assert!(acc.flat.is_none());
        acc.before_micro_batch().unwrap();
        assert!(acc.flat.is_some());
        let open: Vec<Vec<u32>> = acc.open.iter().map(|t| bits(t.as_ref().unwrap())).collect();
        assert_eq!(open, [bits(&f32_of(&a0)), bits(&f32_of(&a1))]);
        let mut g = GradStore::default();
        g.insert(&keys[1], b1.clone());
        acc.add(&g).unwrap();
        let got = acc.finish().unwrap();
        assert_eq!(bits(&got.0[0]), bits(&f32_of(&a0)));
        assert_eq!(bits(&got.0[1]), bits(&(f32_of(&a1) + f32_of(&b1)).unwrap()));
    }

    /// A step of one micro-batch hands the optimiser its bf16 gradients as they came: the
    /// global norm, the clipping and an AdamW step from them give every bit of those from their
    /// f32 widening (the f32 sums the accumulator handed over before).
    #[test]
    fn held_compute_copy_gradients_update_with_the_bits_of_their_f32_sums() {
        use crate::optim::{clip_scale, grad_norm, AdamW, AdamWConfig};
        let shapes: [&[usize]; 3] = [&[33, 7], &[70], &[5]];
        let mut r = rng(11);
        let weights: Vec<Tensor> = shapes
            .iter()
            .map(|s| tensor(&uniform(&mut r, s.iter().product(), 1.0), s, DType::F32))
            .collect();
        let grads_bf16: Vec<Tensor> = shapes
            .iter()
            .map(|s| {
                tensor(&uniform(&mut r, s.iter().product(), 3.0), s, DType::F32)
                    .to_dtype(DType::BF16)
                    .unwrap()
            })
            .collect();
        // Two optimisers on equal weights: one fed the accumulator's held gradients, one their
        // f32 widening; a norm over 1 so that the step clips.
        let run = |held: bool| {
            let vars: Vec<Var> = weights
                .iter()
                .map(|w| Var::from_tensor(w).unwrap())
                .collect();
            let keys: Vec<Tensor> = vars
                .iter()
                .map(|v| v.to_dtype(DType::BF16).unwrap())
                .collect();
            let mut store = GradStore::default();
            for (k, g) in keys.iter().zip(&grads_bf16) {
                let g = if held {
                    g.clone()
                } else {
                    g.to_dtype(DType::F32).unwrap()
                };
                store.insert(k, g);
            }
            let mut acc = GradAccumulator::with_keys(vars.clone(), keys);
            acc.add(&store).unwrap();
            let got = acc.finish().unwrap();
            assert_eq!(
                got.0[0].dtype(),
                if held { DType::BF16 } else { DType::F32 }
            );
            let mut store = got.into_store(&vars);
            let norm = grad_norm(&store, &vars).unwrap();
            let named = vars
                .iter()
                .enumerate()
                .map(|(i, v)| (format!("w{i}"), v.clone()))
                .collect();
            let config = AdamWConfig {
                lr: 1e-2,
                weight_decay: 0.1,
                ..AdamWConfig::default()
            };
            let mut opt = AdamW::with_names(named, config).unwrap();
            let clip = clip_scale(norm, 1.0);
            assert!(clip.is_some(), "norm {norm}: the step should clip");
            opt.step_clipped(&mut store, clip).unwrap();
            let after: Vec<Vec<u32>> = vars.iter().map(|v| bits(v.as_tensor())).collect();
            (norm.to_bits(), after)
        };
        assert_eq!(run(true), run(false));
    }

    /// The bits of a tensor of any float dtype, widened to f32 (exact).
    fn bits_any(t: &Tensor) -> Vec<u32> {
        bits(&t.to_dtype(DType::F32).unwrap())
    }
}
