//! The GPU backend of [`Collective`]: NCCL, the production engine of multi-GPU training (the
//! TCP backend of [`super::tcp`] makes the same path run on machines without a GPU).
//!
//! One process per GPU. The group forms over a bootstrap group that already exists (the
//! [`super::TcpGroup`] at `MASTER_ADDR`): rank 0 makes NCCL's unique id and broadcasts its bytes
//! through it, then every rank joins the NCCL communicator, which runs on the stream of the
//! rank's candle [`CudaDevice`](candle_core::CudaDevice).
//!
//! Two ways to sum:
//! - **exact** ([`Collective::all_reduce_sum`], [`Collective::reduce_scatter_sum`]): every
//!   rank's buffer is gathered on every GPU (`ncclAllGather`) and summed by the pairwise tree of
//!   [`super::tree`] in rank order: the same bits on every rank, equal to what
//!   [`super::TcpGroup`] and a single process give. A step's gradients
//!   ([`Collective::all_reduce_sum_tensor`]) stay on the GPU: gathered there and summed by a
//!   kernel with the tree's order (`tree_sum.cu`); host buffers are copied to the host and
//!   summed there. It moves `world ×` the bytes of a buffer to every GPU.
//! - **fast** ([`NcclGroup::all_reduce_sum_fast`]): `ncclAllReduce`, NCCL's ring/tree order.
//!   Every rank gets the same result, but its bits depend on the number of ranks, the topology,
//!   the algorithm NCCL picks and its version: not the exact mode's sums, and not
//!   reproducible across process counts or machines.
//!
//! The [`Collective`] seam's other collectives work on host buffers, so each copies its buffer
//! to the device and back and waits for the stream. NCCL has no deadline: a rank that dies or never
//! arrives makes the others wait (the launcher, torchrun or srun, stops the job); setting
//! `NCCL_DEBUG=WARN` makes NCCL print why a call failed.

use super::tree::tree_sum_in_place;
use super::{check_shares, Collective, CollectiveError};
use candle_core::cuda::cudarc;
use candle_core::{DType, Storage, Tensor};
use cudarc::driver::{CudaSlice, CudaStream, DriverError};
use cudarc::nccl::result::NcclError;
use cudarc::nccl::{Comm, Id, ReduceOp};
use std::ops::Range;
use std::sync::Arc;

/// Elements of one rank's buffer that one exact-mode step gathers: the GPUs and the host hold
/// `world × CHUNK` of them at once (64 MiB per rank).
const CHUNK: usize = 1 << 24;
/// Bytes of an NCCL unique id (`NCCL_UNIQUE_ID_BYTES`).
const ID_BYTES: usize = 128;

/// One process's end of an NCCL group: rank `rank` of `world_size`, one GPU each.
pub struct NcclGroup {
    comm: Comm,
    stream: Arc<CudaStream>,
    rank: usize,
    world_size: usize,
    /// Collectives run so far (for error messages).
    seq: u64,
}

// SAFETY: an NCCL communicator is not tied to the thread that made it; it must not be used
// from two threads at once, which `&mut self` on every collective rules out. Each call binds
// the device's CUDA context to the calling thread first.
unsafe impl Send for NcclGroup {}

impl std::fmt::Debug for NcclGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclGroup")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("gpu", &self.stream.context().ordinal())
            .finish()
    }
}

impl NcclGroup {
    /// Forms the NCCL group of `world` processes, this one being `rank` on `device` (a CUDA
    /// device, one per rank). `bootstrap` is a group of the same ranks that already works (the
    /// TCP rendezvous): rank 0 makes the NCCL unique id and broadcasts it through `bootstrap`,
    /// and every rank checks that every other one is ready before NCCL starts, since NCCL's
    /// own initialization waits for missing ranks forever.
    pub fn new(
        device: &candle_core::Device,
        rank: usize,
        world: usize,
        bootstrap: &mut dyn Collective,
    ) -> Result<NcclGroup, CollectiveError> {
        if world == 0 || rank >= world {
            return Err(CollectiveError::Usage(format!(
                "NCCL rank {rank} is out of range for a world of {world}"
            )));
        }
        if bootstrap.rank() != rank || bootstrap.world_size() != world {
            return Err(CollectiveError::Usage(format!(
                "the bootstrap group is rank {} of {}, NCCL was asked for rank {rank} of {world}",
                bootstrap.rank(),
                bootstrap.world_size()
            )));
        }
        // Whatever fails here, every rank still takes part in the two bootstrap collectives
        // below, so that all of them stop with a message instead of waiting.
        let local: Result<Arc<CudaStream>, String> = match device {
            candle_core::Device::Cuda(cuda) => {
                let stream = cuda.cuda_stream();
                match stream.context().bind_to_thread() {
                    Ok(()) => Ok(stream),
                    Err(e) => Err(format!("cannot use the CUDA device: {e:?}")),
                }
            }
            other => Err(format!(
                "NCCL needs a CUDA device, this rank runs on {other:?} (device \"cuda:N\", one GPU per rank)"
            )),
        };
        let mut id_bytes = Vec::new();
        let mut id_error = None;
        if rank == 0 && local.is_ok() {
            match Id::new() {
                Ok(id) => id_bytes = id.internal().iter().map(|&c| c as u8).collect(),
                Err(e) => id_error = Some(nccl_message("ncclGetUniqueId", &e)),
            }
        }
        // An empty id tells the other ranks that rank 0 could not make one.
        bootstrap.broadcast(&mut id_bytes)?;
        let ready = match (&local, &id_error) {
            (Err(m), _) | (_, Some(m)) => Err(m.clone()),
            _ if id_bytes.len() != ID_BYTES => Err(format!(
                "rank 0 sent an NCCL id of {} bytes, not {ID_BYTES} (rank 0 could not make one: see its log)",
                id_bytes.len()
            )),
            _ => Ok(()),
        };
        let flags = bootstrap.all_gather(&[f32::from(u8::from(ready.is_ok()))])?;
        if let Err(message) = ready {
            return Err(CollectiveError::Rendezvous {
                message: format!("rank {rank} cannot join the NCCL group: {message}"),
            });
        }
        let failed: Vec<String> = flags
            .iter()
            .enumerate()
            .filter(|(_, f)| f.first() != Some(&1.0))
            .map(|(r, _)| r.to_string())
            .collect();
        if !failed.is_empty() {
            return Err(CollectiveError::Rendezvous {
                message: format!(
                    "rank(s) {} cannot join the NCCL group (see their logs)",
                    failed.join(", ")
                ),
            });
        }
        let stream = local.expect("checked above");
        let mut internal = [0 as std::ffi::c_char; ID_BYTES];
        for (d, s) in internal.iter_mut().zip(&id_bytes) {
            *d = *s as std::ffi::c_char;
        }
        // ncclCommInitRank joins on the calling thread's current device: bound above.
        let comm =
            Comm::from_rank(stream.clone(), rank, world, Id::uninit(internal)).map_err(|e| {
                CollectiveError::Rendezvous {
                    message: format!(
                        "rank {rank} of {world}: {}",
                        nccl_message("ncclCommInitRank", &e)
                    ),
                }
            })?;
        tracing::debug!(
            "rank {rank} of {world} joined the NCCL group on GPU {}",
            stream.context().ordinal()
        );
        Ok(NcclGroup {
            comm,
            stream,
            rank,
            world_size: world,
            seq: 0,
        })
    }

    /// The NCCL library's version, e.g. 23007 for 2.30.7.
    pub fn nccl_version() -> Result<i32, CollectiveError> {
        cudarc::nccl::result::get_nccl_version()
            .map_err(|e| CollectiveError::Usage(nccl_message("ncclGetVersion", &e)))
    }

    /// The fast, not bit-reproducible sum: `buf` becomes the element-wise sum over ranks by
    /// `ncclAllReduce`, in the order NCCL picks (ring or tree, over channels). Every rank gets
    /// the same bits, but they differ from the exact mode's ([`Collective::all_reduce_sum`])
    /// and change with the number of ranks, the topology and the NCCL version: runs are not
    /// reproducible across process counts. `buf` must have the same length on every rank
    /// (unchecked: a mismatch hangs or corrupts).
    pub fn all_reduce_sum_fast(&mut self, buf: &mut [f32]) -> Result<(), CollectiveError> {
        self.begin()?;
        if buf.is_empty() {
            return Ok(());
        }
        let mut dev = self.to_device(buf)?;
        self.comm
            .all_reduce_in_place(&mut dev, &ReduceOp::Sum)
            .map_err(|e| self.failed("ncclAllReduce", &e))?;
        let back = self.to_host(&dev)?;
        buf.copy_from_slice(&back);
        Ok(())
    }

    /// Binds this rank's CUDA context to the calling thread; counts the collective.
    fn begin(&mut self) -> Result<(), CollectiveError> {
        self.seq += 1;
        self.stream
            .context()
            .bind_to_thread()
            .map_err(|e| self.cuda_failed("binding the CUDA context", &e))
    }

    fn to_device<T: cudarc::driver::DeviceRepr>(
        &self,
        host: &[T],
    ) -> Result<CudaSlice<T>, CollectiveError> {
        self.stream
            .clone_htod(host)
            .map_err(|e| self.cuda_failed("a copy to the GPU", &e))
    }

    fn alloc<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        len: usize,
    ) -> Result<CudaSlice<T>, CollectiveError> {
        self.stream
            .alloc_zeros(len)
            .map_err(|e| self.cuda_failed("a GPU allocation", &e))
    }

    /// The device buffer on the host, once the stream (and so the collective) has finished.
    fn to_host<T: cudarc::driver::DeviceRepr>(
        &self,
        dev: &CudaSlice<T>,
    ) -> Result<Vec<T>, CollectiveError> {
        let host = self
            .stream
            .clone_dtoh(dev)
            .map_err(|e| self.cuda_failed("a copy from the GPU", &e))?;
        self.stream
            .synchronize()
            .map_err(|e| self.cuda_failed("waiting for the GPU", &e))?;
        Ok(host)
    }

    /// `mine` from every rank, in rank order (the same length on every rank, unchecked).
    fn gather_equal<T>(&self, mine: &[T]) -> Result<Vec<T>, CollectiveError>
    where
        T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits + cudarc::nccl::NcclType,
    {
        let send = self.to_device(mine)?;
        let mut recv = self.alloc::<T>(mine.len() * self.world_size)?;
        self.comm
            .all_gather(&send, &mut recv)
            .map_err(|e| self.failed("ncclAllGather", &e))?;
        self.to_host(&recv)
    }

    /// Checks that every rank passes a buffer of `len` elements (one small all-gather).
    fn check_len(&self, len: usize) -> Result<(), CollectiveError> {
        let lens = self.gather_equal(&[len as u64])?;
        match lens.iter().position(|&l| l != len as u64) {
            None => Ok(()),
            Some(peer) => Err(CollectiveError::Mismatch {
                peer,
                expected: "a buffer of the same length",
                got: "another length",
                seq: self.seq,
            }),
        }
    }

    /// The exact sum of `chunk` over ranks, in place: gathered on the GPU, the pairwise tree
    /// in rank order on the host.
    fn exact_sum_chunk(&self, chunk: &mut [f32]) -> Result<(), CollectiveError> {
        let n = chunk.len();
        let all = self.gather_equal(chunk)?;
        let mut parts: Vec<Vec<f32>> = all.chunks_exact(n).map(<[f32]>::to_vec).collect();
        tree_sum_in_place(&mut parts);
        chunk.copy_from_slice(&parts[0]);
        Ok(())
    }

    fn failed(&self, op: &str, e: &NcclError) -> CollectiveError {
        CollectiveError::Usage(format!(
            "rank {} of {}, collective #{}: {}; every rank stops — resume from the last checkpoint",
            self.rank,
            self.world_size,
            self.seq,
            nccl_message(op, e)
        ))
    }

    fn kernel_failed(&self, e: &candle_core::Error) -> CollectiveError {
        CollectiveError::Usage(format!(
            "rank {} of {}, collective #{}: {e}",
            self.rank, self.world_size, self.seq
        ))
    }

    fn cuda_failed(&self, what: &str, e: &DriverError) -> CollectiveError {
        CollectiveError::Usage(format!(
            "rank {} of {}, collective #{}: CUDA error in {what}: {e:?}",
            self.rank, self.world_size, self.seq
        ))
    }
}

fn nccl_message(op: &str, e: &NcclError) -> String {
    // SAFETY: ncclGetErrorString returns a static NUL-terminated string for any result code.
    let text = unsafe {
        let p = cudarc::nccl::sys::ncclGetErrorString(e.0);
        if p.is_null() {
            String::new()
        } else {
            std::ffi::CStr::from_ptr(p).to_string_lossy().into_owned()
        }
    };
    format!(
        "NCCL {op} failed: {:?} ({text}; NCCL_DEBUG=WARN prints NCCL's reason)",
        e.0
    )
}

impl Collective for NcclGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    /// `ncclAllReduce` (`policy.data_parallel.all_reduce = "fast"`): the inherent method.
    fn all_reduce_sum_fast(&mut self, buf: &mut [f32]) -> Result<(), CollectiveError> {
        NcclGroup::all_reduce_sum_fast(self, buf)
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    /// The exact sum: every rank's buffer gathered (`ncclAllGather`, `CHUNK` elements at a
    /// time) and summed on the host by the pairwise tree in rank order, the bits
    /// [`super::TcpGroup`] gives. Costs `world ×` the buffer in traffic and host work per
    /// rank; [`NcclGroup::all_reduce_sum_fast`] is the fast, inexact alternative.
    fn all_reduce_sum(&mut self, buf: &mut [f32]) -> Result<(), CollectiveError> {
        self.begin()?;
        self.check_len(buf.len())?;
        for chunk in buf.chunks_mut(CHUNK) {
            self.exact_sum_chunk(chunk)?;
        }
        Ok(())
    }

    /// The exact all-reduce of the whole buffer, then this rank's share kept: correct and
    /// simple, but it costs what the exact all-reduce costs (every rank gathers every rank's
    /// whole buffer), not the `1 / world` of a true reduce-scatter. The cheaper exact form
    /// (each rank receives only its share from every rank by grouped `ncclSend`/`ncclRecv`,
    /// then the tree) is left to do.
    fn reduce_scatter_sum(
        &mut self,
        buf: &[f32],
        shares: &[Range<usize>],
    ) -> Result<Vec<f32>, CollectiveError> {
        check_shares(shares, buf.len(), self.world_size)?;
        let mut all = buf.to_vec();
        self.all_reduce_sum(&mut all)?;
        Ok(all[shares[self.rank].clone()].to_vec())
    }

    /// Every rank's `mine`, in rank order: the lengths first (one small all-gather), then
    /// the buffers padded to the longest (`ncclAllGather`).
    fn all_gather(&mut self, mine: &[f32]) -> Result<Vec<Vec<f32>>, CollectiveError> {
        self.begin()?;
        let lens = self.gather_equal(&[mine.len() as u64])?;
        let longest = lens.iter().copied().max().unwrap_or(0) as usize;
        if longest == 0 {
            return Ok(vec![Vec::new(); self.world_size]);
        }
        let mut padded = mine.to_vec();
        padded.resize(longest, 0.0);
        let all = self.gather_equal(&padded)?;
        Ok(all
            .chunks_exact(longest)
            .zip(&lens)
            .map(|(part, &len)| part[..len as usize].to_vec())
            .collect())
    }

    /// Rank 0's `bytes` on every rank: the length, then the bytes (`ncclBroadcast`).
    fn broadcast(&mut self, bytes: &mut Vec<u8>) -> Result<(), CollectiveError> {
        self.begin()?;
        let mut len = self.to_device(&[bytes.len() as u64])?;
        self.comm
            .broadcast_in_place(&mut len, 0)
            .map_err(|e| self.failed("ncclBroadcast", &e))?;
        let len = self.to_host(&len)?[0] as usize;
        if len == 0 {
            bytes.clear();
            return Ok(());
        }
        if self.rank != 0 {
            bytes.clear();
            bytes.resize(len, 0);
        }
        let mut dev = self.to_device(bytes.as_slice())?;
        self.comm
            .broadcast_in_place(&mut dev, 0)
            .map_err(|e| self.failed("ncclBroadcast", &e))?;
        *bytes = self.to_host(&dev)?;
        Ok(())
    }

    /// Every rank has reached it once a one-element all-reduce has come back.
    fn barrier(&mut self) -> Result<(), CollectiveError> {
        self.all_reduce_sum_fast(&mut [0.0])
    }

    /// The sum over ranks of `flat` without leaving the GPU (with the project's kernels, on
    /// unless `XDISTILL_CUDA_KERNELS=off`; else through the host):
    /// exact, the ranks' buffers gathered `CHUNK` elements at a time (`ncclAllGather`) and each
    /// chunk summed by the pairwise tree in rank order in one kernel (`tree_sum.cu`, the host
    /// tree's bits); with `fast`, `ncclAllReduce`. Nothing is copied to the host and nothing
    /// waits for the stream.
    fn all_reduce_sum_tensor(
        &mut self,
        flat: &Tensor,
        fast: bool,
    ) -> Result<Tensor, CollectiveError> {
        if !xdistill_shared::device::cuda_kernels() {
            return super::sum_through_host(self, flat, fast);
        }
        self.begin()?;
        let candle_core::Device::Cuda(dev) = flat.device() else {
            return Err(CollectiveError::Usage(format!(
                "rank {}: NCCL sums tensors on the GPU, this one is on {:?}",
                self.rank,
                flat.device()
            )));
        };
        if flat.dtype() != DType::F32 || flat.rank() != 1 || !flat.is_contiguous() {
            return Err(CollectiveError::Usage(format!(
                "rank {}: NCCL sums contiguous [n] f32 tensors, not {:?} {:?}",
                self.rank,
                flat.dtype(),
                flat.dims()
            )));
        }
        let n = flat.elem_count();
        self.check_len(n)?;
        let world = self.world_size;
        let mut out = self.alloc::<f32>(n)?;
        {
            let (storage, layout) = flat.storage_and_layout();
            let Storage::Cuda(s) = &*storage else {
                unreachable!("a tensor on a CUDA device has CUDA storage")
            };
            let src = s
                .as_cuda_slice::<f32>()
                .map_err(|e| self.kernel_failed(&e))?;
            let at = layout.start_offset();
            if fast {
                self.comm
                    .all_reduce(&src.slice(at..at + n), &mut out, &ReduceOp::Sum)
                    .map_err(|e| self.failed("ncclAllReduce", &e))?;
            } else {
                let mut gathered = self.alloc::<f32>(CHUNK.min(n) * world)?;
                for start in (0..n).step_by(CHUNK) {
                    let len = CHUNK.min(n - start);
                    let send = src.slice(at + start..at + start + len);
                    self.comm
                        .all_gather(&send, &mut gathered.slice_mut(..len * world))
                        .map_err(|e| self.failed("ncclAllGather", &e))?;
                    xdistill_cuda_kernels::tree_sum_f32(
                        dev,
                        &gathered.slice(..len * world),
                        &mut out.slice_mut(start..start + len),
                        world,
                    )
                    .map_err(|e| self.kernel_failed(&e))?;
                }
            }
        }
        let storage = candle_core::CudaStorage::wrap_cuda_slice(out, dev.clone());
        Ok(Tensor::from_storage(
            Storage::Cuda(storage),
            n,
            candle_core::op::BackpropOp::none(),
            false,
        ))
    }
}
