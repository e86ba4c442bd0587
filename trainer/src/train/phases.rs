//! Where a step's time goes — the decoder's training forward, the LM head and loss in row
//! chunks (with each chunk's backward), the decoder's backward (with the recompute of
//! checkpointed layers), the end of the gradients' accumulation, the global norm and the
//! update — for `trainer bench-step` and profiling.
//!
//! Off unless a thread turns it on ([`start`]): then each phase ends with a device
//! synchronisation, so asynchronous GPU work is counted in the phase that launched it. Training
//! never turns it on, so it adds no synchronisation to a real step. The first three phases run
//! in `train::head` (every pairing and SFT go through it), the norm and the update in
//! `Runner::apply`, which is where they are timed: bench-step runs the training loop's own
//! code. Each phase is also a profiler's region ([`xdistill_shared::profiling`]), whether timed
//! or not.

use candle_core::Device;
use std::cell::RefCell;
use std::time::Instant;
use xdistill_shared::profiling;

/// Seconds per phase since [`start`].
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub struct StepPhases {
    /// `HeadOpts::forward`: ids to final hidden states (activations kept or checkpointed).
    pub forward: f64,
    /// `head_chunks::run`: per chunk of rows the head's logits, the loss and its backward to the
    /// chunk's hidden rows and the head.
    pub head_loss: f64,
    /// `HeadOut::finish`: the hidden-state gradient pulled through the decoder.
    pub backward: f64,
    /// The gradients still to sum after the backward (what the layers' own sums leave), up to
    /// the step's gradient: the caller's, around `GradAccumulator::add` and `finish`.
    pub accumulate: f64,
    /// `Runner::apply`: the gradients' global norm (one copy back).
    pub clip: f64,
    /// `Runner::apply`: the update (the clipping factor applied inside it) and the compute
    /// copies written or refreshed.
    pub optimizer: f64,
}

impl StepPhases {
    pub fn total(&self) -> f64 {
        self.forward + self.head_loss + self.backward + self.accumulate + self.clip + self.optimizer
    }
}

/// A phase of [`StepPhases`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    Forward,
    HeadLoss,
    Backward,
    Accumulate,
    Clip,
    Optimizer,
}

impl Phase {
    /// The profiler's name for it ([`profiling::region`]).
    fn profiled(self) -> profiling::Phase {
        match self {
            Phase::Forward => profiling::Phase::Forward,
            Phase::HeadLoss => profiling::Phase::HeadLoss,
            Phase::Backward => profiling::Phase::Backward,
            Phase::Accumulate => profiling::Phase::Accumulate,
            Phase::Clip => profiling::Phase::Clip,
            Phase::Optimizer => profiling::Phase::Optimizer,
        }
    }
}

thread_local! {
    static CLOCK: RefCell<Option<StepPhases>> = const { RefCell::new(None) };
}

/// Starts timing this thread's phases from zero.
pub fn start() {
    CLOCK.with(|c| *c.borrow_mut() = Some(StepPhases::default()));
}

/// The phases timed since [`start`] (zero if it was not called); timing stops.
pub fn take() -> StepPhases {
    CLOCK.with(|c| c.borrow_mut().take()).unwrap_or_default()
}

/// Runs `f` as `phase` on `device`: timed, up to the device's completion of it, when this
/// thread's clock runs; just run otherwise.
pub fn time<R>(
    phase: Phase,
    device: &Device,
    f: impl FnOnce() -> anyhow::Result<R>,
) -> anyhow::Result<R> {
    // For a profiler: an NVTX range and phase marks where asked (nothing otherwise).
    let _region = profiling::region(device, phase.profiled());
    if CLOCK.with(|c| c.borrow().is_none()) {
        return f();
    }
    let t0 = Instant::now();
    let r = f()?;
    device.synchronize()?;
    let seconds = t0.elapsed().as_secs_f64();
    CLOCK.with(|c| {
        if let Some(p) = c.borrow_mut().as_mut() {
            *match phase {
                Phase::Forward => &mut p.forward,
                Phase::HeadLoss => &mut p.head_loss,
                Phase::Backward => &mut p.backward,
                Phase::Accumulate => &mut p.accumulate,
                Phase::Clip => &mut p.clip,
                Phase::Optimizer => &mut p.optimizer,
            } += seconds;
        }
    });
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Off by default: nothing is recorded; on: each phase's time lands in its own field and
    /// no other; `take` stops it. (Only lower bounds on the times: a busy machine may preempt a
    /// spin, so no comparison between two phases' times.)
    #[test]
    fn phases_are_recorded_only_while_the_clock_runs() {
        let dev = Device::Cpu;
        let spin = |ms: u64| {
            let t0 = Instant::now();
            while t0.elapsed().as_millis() < ms as u128 {}
            Ok(())
        };
        time(Phase::Forward, &dev, || spin(2)).unwrap();
        assert_eq!(take(), StepPhases::default());
        for (phase, ms) in [
            (Phase::Forward, 3),
            (Phase::HeadLoss, 1),
            (Phase::Backward, 2),
            (Phase::Accumulate, 1),
            (Phase::Clip, 1),
            (Phase::Optimizer, 2),
        ] {
            start();
            time(phase, &dev, || spin(ms)).unwrap();
            time(phase, &dev, || spin(ms)).unwrap();
            let p = take();
            let got = match phase {
                Phase::Forward => p.forward,
                Phase::HeadLoss => p.head_loss,
                Phase::Backward => p.backward,
                Phase::Accumulate => p.accumulate,
                Phase::Clip => p.clip,
                Phase::Optimizer => p.optimizer,
            };
            // Both calls summed into the phase's field; every other field untouched.
            assert!(got >= 2.0 * ms as f64 / 1e3, "{phase:?}: {p:?}");
            assert_eq!(p.total(), got, "{phase:?}: {p:?}");
        }
        time(Phase::HeadLoss, &dev, || spin(1)).unwrap();
        assert_eq!(take(), StepPhases::default());
    }
}
