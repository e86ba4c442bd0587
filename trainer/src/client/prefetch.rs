//! Overlapping teacher requests with training: a producer thread walks the batches and fetches
//! each one's teacher result ahead of the step that needs it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, RecvError};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// A batch with its fetched result.
#[derive(Debug)]
pub struct Fetched<B, R> {
    pub batch: B,
    pub result: R,
    /// How long the fetch took (teacher latency, retries included).
    pub fetch_time: Duration,
    /// How long [`Prefetcher::next`] blocked: the part of the fetch that prefetching did not
    /// hide behind the previous step.
    pub wait_time: Duration,
}

#[derive(Debug, thiserror::Error)]
pub enum PrefetchError<B: std::fmt::Debug, E: std::error::Error + 'static> {
    /// Fetching this batch's result failed (after the client's own retries); no later batch
    /// is fetched.
    #[error("teacher request failed: {error}")]
    Fetch {
        batch: B,
        #[source]
        error: E,
    },
    /// The producer thread panicked (in the batch iterator or the fetch closure).
    #[error("prefetch thread panicked: {0}")]
    Panicked(String),
}

type Msg<B, R, E> = Result<(B, R, Duration), (B, E)>;

/// Keeps up to `depth` batches' results fetched ahead of the consumer.
///
/// With `depth = 1`, while the loop trains on batch `n` the request for batch `n + 1` is in
/// flight (or done and waiting); batch `n + 2` is not started until `n + 1` is taken.
pub struct Prefetcher<B, R, E> {
    rx: Option<Receiver<Msg<B, R, E>>>,
    handle: Option<JoinHandle<()>>,
    stop: Arc<AtomicBool>,
    finished: bool,
}

impl<B, R, E> Prefetcher<B, R, E>
where
    B: Send + std::fmt::Debug + 'static,
    R: Send + 'static,
    E: Send + std::error::Error + 'static,
{
    /// Starts the producer thread. `fetch` runs on that thread, one batch at a time, in order
    /// (e.g. blocking on a shared [`super::TeacherPool`]).
    pub fn spawn<I, F>(batches: I, depth: usize, mut fetch: F) -> Prefetcher<B, R, E>
    where
        I: IntoIterator<Item = B>,
        I::IntoIter: Send + 'static,
        F: FnMut(&B) -> Result<R, E> + Send + 'static,
    {
        // A rendezvous channel already holds one finished fetch (the producer blocks in send),
        // so capacity depth - 1 gives `depth` batches fetched ahead.
        let (tx, rx) = mpsc::sync_channel::<Msg<B, R, E>>(depth.max(1) - 1);
        let stop = Arc::new(AtomicBool::new(false));
        let stop_flag = stop.clone();
        let iter = batches.into_iter();
        let handle = std::thread::Builder::new()
            .name("teacher-prefetch".into())
            .spawn(move || {
                for batch in iter {
                    if stop_flag.load(Ordering::Relaxed) {
                        return;
                    }
                    let t0 = Instant::now();
                    let msg = match fetch(&batch) {
                        Ok(r) => Ok((batch, r, t0.elapsed())),
                        Err(e) => Err((batch, e)),
                    };
                    let failed = msg.is_err();
                    if tx.send(msg).is_err() || failed {
                        return; // consumer gone, or nothing sensible to do after a failure
                    }
                }
            });
        match handle {
            Ok(h) => Prefetcher {
                rx: Some(rx),
                handle: Some(h),
                stop,
                finished: false,
            },
            Err(e) => {
                // Could not start a thread: report it on the first `next`.
                tracing::error!("cannot start the prefetch thread: {e}");
                Prefetcher {
                    rx: None,
                    handle: None,
                    stop,
                    finished: false,
                }
            }
        }
    }

    /// The next batch with its result, blocking until it is fetched. `None` when the batches
    /// are exhausted; an error when a fetch failed or the producer panicked (then `None`).
    #[allow(clippy::should_implement_trait)]
    pub fn next(&mut self) -> Option<Result<Fetched<B, R>, PrefetchError<B, E>>> {
        if self.finished {
            return None;
        }
        let Some(rx) = &self.rx else {
            self.finished = true;
            return Some(Err(PrefetchError::Panicked(
                "the prefetch thread could not be started".into(),
            )));
        };
        let t0 = Instant::now();
        match rx.recv() {
            Ok(Ok((batch, result, fetch_time))) => Some(Ok(Fetched {
                batch,
                result,
                fetch_time,
                wait_time: t0.elapsed(),
            })),
            Ok(Err((batch, error))) => {
                self.finished = true;
                Some(Err(PrefetchError::Fetch { batch, error }))
            }
            Err(RecvError) => {
                self.finished = true;
                // The producer ended: normally, or by a panic.
                match self.handle.take().map(|h| h.join()) {
                    Some(Err(panic)) => {
                        let msg = panic
                            .downcast_ref::<String>()
                            .cloned()
                            .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                            .unwrap_or_else(|| "unknown panic".into());
                        Some(Err(PrefetchError::Panicked(msg)))
                    }
                    _ => None,
                }
            }
        }
    }
}

impl<B, R, E> Drop for Prefetcher<B, R, E> {
    fn drop(&mut self) {
        // Stop after the fetch in flight (not joined: it may be waiting on a teacher).
        self.stop.store(true, Ordering::Relaxed);
        self.rx.take();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Condvar, Mutex};

    #[derive(Debug, thiserror::Error)]
    #[error("fetch of {0} failed")]
    struct Boom(u32);

    /// Highest batch whose fetch has started, with a condvar to wait on it.
    struct Started {
        max: Mutex<Option<u32>>,
        cv: Condvar,
    }

    impl Started {
        fn wait_for(&self, b: u32) -> bool {
            let g = self.max.lock().unwrap();
            let (g, _) = self
                .cv
                .wait_timeout_while(g, Duration::from_secs(20), |m| m.is_none_or(|m| m < b))
                .unwrap();
            g.is_some_and(|m| m >= b)
        }
        fn max(&self) -> Option<u32> {
            *self.max.lock().unwrap()
        }
    }

    #[test]
    fn the_next_fetch_runs_while_the_current_step_trains() {
        for depth in [1usize, 2] {
            let started = Arc::new(Started {
                max: Mutex::new(None),
                cv: Condvar::new(),
            });
            let s = started.clone();
            let mut p: Prefetcher<u32, u32, Boom> = Prefetcher::spawn(0..6u32, depth, move |&b| {
                *s.max.lock().unwrap() = Some(b);
                s.cv.notify_all();
                Ok(b * 10)
            });
            let mut seen = Vec::new();
            while let Some(item) = p.next() {
                let f = item.unwrap();
                assert_eq!(f.result, f.batch * 10);
                seen.push(f.batch);
                // "Training" on batch b: the fetch of b + 1 starts without us asking...
                if f.batch < 5 {
                    assert!(
                        started.wait_for(f.batch + 1),
                        "no prefetch of {}",
                        f.batch + 1
                    );
                }
                // ...but never more than `depth` batches ahead.
                std::thread::sleep(Duration::from_millis(5));
                let ahead = started.max().unwrap() - f.batch;
                assert!(
                    ahead as usize <= depth,
                    "depth {depth}: fetched {ahead} ahead"
                );
            }
            assert_eq!(seen, [0, 1, 2, 3, 4, 5]);
            assert!(p.next().is_none());
        }
    }

    #[test]
    fn a_failed_fetch_is_reported_with_its_batch_and_ends_the_stream() {
        let mut p: Prefetcher<u32, u32, Boom> =
            Prefetcher::spawn(0..10u32, 1, |&b| if b == 2 { Err(Boom(b)) } else { Ok(b) });
        assert_eq!(p.next().unwrap().unwrap().batch, 0);
        assert_eq!(p.next().unwrap().unwrap().batch, 1);
        match p.next() {
            Some(Err(PrefetchError::Fetch { batch: 2, error })) => assert_eq!(error.0, 2),
            other => panic!("expected a fetch error, got {other:?}"),
        }
        assert!(p.next().is_none());
    }

    #[test]
    fn a_panicking_producer_is_an_error_not_a_silent_end() {
        let mut p: Prefetcher<u32, u32, Boom> = Prefetcher::spawn(0..10u32, 1, |&b| {
            if b == 1 {
                panic!("tokenizer exploded");
            }
            Ok(b)
        });
        assert!(p.next().unwrap().is_ok());
        match p.next() {
            Some(Err(PrefetchError::Panicked(m))) => assert!(m.contains("tokenizer exploded")),
            other => panic!("expected a panic report, got {other:?}"),
        }
        assert!(p.next().is_none());
    }
}
