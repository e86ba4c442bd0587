//! The CPU backend of [`Collective`]: every rank holds one TCP connection to rank 0, which
//! combines what the ranks send in rank order and sends the results back. It makes the whole
//! data-parallel path run (and be tested) on machines without a GPU; on GPUs NCCL is the
//! production engine.
//!
//! Frames are `[op u8][seq u64][len u64][payload]` (little-endian); rank 0 checks that every
//! rank is in the same collective (`op`, `seq`), so ranks that diverge fail at once instead of
//! exchanging the wrong buffers. Every read and write has a deadline: a rank that dies closes
//! its socket (the others fail at their next collective) and a rank that hangs fails them when
//! the deadline passes.

use super::tree::tree_sum_in_place;
use super::{check_shares, Collective, CollectiveError};
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::ops::Range;
use std::time::{Duration, Instant};

const MAGIC: &[u8; 8] = b"XDDP\x00\x00\x00\x01";
/// Elements per frame of a reduction: rank 0 holds `world × CHUNK` of them at once.
const CHUNK: usize = 1 << 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
enum Op {
    Hello = 1,
    Welcome = 2,
    Reject = 3,
    Reduce = 4,
    Gather = 5,
    Broadcast = 6,
}

impl Op {
    fn name(code: u8) -> &'static str {
        match code {
            1 => "hello",
            2 => "welcome",
            3 => "reject",
            4 => "reduce",
            5 => "gather",
            6 => "broadcast",
            _ => "unknown",
        }
    }
}

/// How a group is formed.
#[derive(Debug, Clone)]
pub struct GroupOptions {
    /// How long rank 0 waits for every rank to arrive, a rank waits for rank 0 to listen, and
    /// any collective waits for its peers.
    pub timeout: Duration,
    /// A digest of everything that must agree between ranks (the run's config); rank 0
    /// refuses a rank whose digest differs.
    pub config_hash: [u8; 32],
}

/// One process's end of a TCP group.
pub struct TcpGroup {
    rank: usize,
    world_size: usize,
    /// Rank 0: the streams of ranks 1..N, in rank order. Other ranks: the stream to rank 0.
    links: Vec<TcpStream>,
    seq: u64,
}

impl TcpGroup {
    /// Forms the group: rank 0 listens on `addr` (host:port) and waits for the others, each
    /// other rank connects to it (retrying until rank 0 listens).
    pub fn connect(
        rank: usize,
        world_size: usize,
        addr: &str,
        opts: &GroupOptions,
    ) -> Result<TcpGroup, CollectiveError> {
        if rank == 0 {
            let listener = TcpListener::bind(addr).map_err(|e| CollectiveError::Rendezvous {
                message: format!(
                    "rank 0 cannot listen on {addr}: {e} (set XDISTILL_DIST_PORT to a free port)"
                ),
            })?;
            TcpGroup::accept(listener, world_size, opts)
        } else {
            TcpGroup::join(rank, world_size, addr, opts)
        }
    }

    /// Rank 0 on an already bound listener (tests bind port 0 and pass the address on).
    pub fn accept(
        listener: TcpListener,
        world_size: usize,
        opts: &GroupOptions,
    ) -> Result<TcpGroup, CollectiveError> {
        let deadline = Instant::now() + opts.timeout;
        let mut slots: Vec<Option<TcpStream>> = (1..world_size).map(|_| None).collect();
        listener
            .set_nonblocking(true)
            .map_err(|e| CollectiveError::io("listen", 0, e))?;
        while slots.iter().any(Option::is_none) {
            let (mut stream, peer) = match listener.accept() {
                Ok(s) => s,
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        let missing: Vec<String> = slots
                            .iter()
                            .enumerate()
                            .filter(|(_, s)| s.is_none())
                            .map(|(i, _)| (i + 1).to_string())
                            .collect();
                        return Err(CollectiveError::Rendezvous {
                            message: format!(
                                "rank(s) {} of {world_size} never arrived within {:?} (were all ranks launched, e.g. by srun or torchrun, and can they reach rank 0?)",
                                missing.join(", "),
                                opts.timeout
                            ),
                        });
                    }
                    std::thread::sleep(Duration::from_millis(5));
                    continue;
                }
                Err(e) => return Err(CollectiveError::io("accept", 0, e)),
            };
            configure(&stream, opts.timeout).map_err(|e| CollectiveError::io("accept", 0, e))?;
            let hello = match read_frame(&mut stream, 0) {
                Ok(f) => f,
                // A stray connection (a port scanner, a health check): not a rank.
                Err(_) => continue,
            };
            let verdict = check_hello(&hello, world_size, opts, &slots);
            match verdict {
                Ok(rank) => {
                    tracing::debug!("rank {rank} joined from {peer}");
                    slots[rank - 1] = Some(stream);
                }
                Err(message) => {
                    let _ = write_frame(&mut stream, Op::Reject, 0, message.as_bytes());
                    return Err(CollectiveError::Rendezvous { message });
                }
            }
        }
        let mut links: Vec<TcpStream> = slots.into_iter().flatten().collect();
        for (i, s) in links.iter_mut().enumerate() {
            write_frame(s, Op::Welcome, 0, &[])
                .map_err(|e| CollectiveError::io("welcome", i + 1, e))?;
        }
        Ok(TcpGroup {
            rank: 0,
            world_size,
            links,
            seq: 0,
        })
    }

    fn join(
        rank: usize,
        world_size: usize,
        addr: &str,
        opts: &GroupOptions,
    ) -> Result<TcpGroup, CollectiveError> {
        let deadline = Instant::now() + opts.timeout;
        let mut stream = loop {
            let last = match connect_once(addr, opts.timeout) {
                Ok(s) => break s,
                Err(e) => e,
            };
            if Instant::now() >= deadline {
                return Err(CollectiveError::Rendezvous {
                    message: format!(
                        "rank {rank} could not reach rank 0 at {addr} within {:?}: {last}",
                        opts.timeout
                    ),
                });
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        configure(&stream, opts.timeout).map_err(|e| CollectiveError::io("connect", 0, e))?;
        let mut hello = Vec::with_capacity(56);
        hello.extend_from_slice(MAGIC);
        hello.extend_from_slice(&(rank as u64).to_le_bytes());
        hello.extend_from_slice(&(world_size as u64).to_le_bytes());
        hello.extend_from_slice(&opts.config_hash);
        write_frame(&mut stream, Op::Hello, 0, &hello)
            .map_err(|e| CollectiveError::io("hello", 0, e))?;
        let (op, _, body) = read_frame(&mut stream, 0)?;
        match op {
            x if x == Op::Welcome as u8 => Ok(TcpGroup {
                rank,
                world_size,
                links: vec![stream],
                seq: 0,
            }),
            x if x == Op::Reject as u8 => Err(CollectiveError::Rendezvous {
                message: format!(
                    "rank 0 refused rank {rank}: {}",
                    String::from_utf8_lossy(&body)
                ),
            }),
            other => Err(CollectiveError::Mismatch {
                peer: 0,
                expected: "welcome",
                got: Op::name(other),
                seq: 0,
            }),
        }
    }

    /// Rank 0: one frame from every other rank, checked to be this collective.
    fn gather_frames(&mut self, op: Op) -> Result<Vec<Vec<u8>>, CollectiveError> {
        let seq = self.seq;
        let mut out = Vec::with_capacity(self.links.len());
        for (i, s) in self.links.iter_mut().enumerate() {
            out.push(expect(s, i + 1, op, seq)?);
        }
        Ok(out)
    }

    fn exchange(&mut self, op: Op, payload: &[u8]) -> Result<Vec<u8>, CollectiveError> {
        let seq = self.seq;
        let s = &mut self.links[0];
        write_frame(s, op, seq, payload)
            .map_err(|e| CollectiveError::io(Op::name(op as u8), 0, e))?;
        expect(s, 0, op, seq)
    }

    /// Sum of `buf` over ranks for `[lo, hi)`, by the tree in rank order; every rank in
    /// `receivers` gets the result.
    fn reduce_chunk(
        &mut self,
        buf: &mut [f32],
        receivers: Receivers,
    ) -> Result<(), CollectiveError> {
        if self.rank == 0 {
            let frames = self.gather_frames(Op::Reduce)?;
            let mut parts = Vec::with_capacity(self.world_size);
            parts.push(buf.to_vec());
            for (i, f) in frames.iter().enumerate() {
                if f.len() != buf.len() * 4 {
                    return Err(CollectiveError::Mismatch {
                        peer: i + 1,
                        expected: "a buffer of the same length",
                        got: "another length",
                        seq: self.seq,
                    });
                }
                parts.push(from_bytes(f));
            }
            tree_sum_in_place(&mut parts);
            let sum = to_bytes(&parts[0]);
            let seq = self.seq;
            for (i, s) in self.links.iter_mut().enumerate() {
                let payload: &[u8] = if receivers.includes(i + 1) { &sum } else { &[] };
                write_frame(s, Op::Reduce, seq, payload)
                    .map_err(|e| CollectiveError::io("reduce", i + 1, e))?;
            }
            if receivers.includes(0) {
                buf.copy_from_slice(&parts[0]);
            }
        } else {
            let back = self.exchange(Op::Reduce, &to_bytes(buf))?;
            if receivers.includes(self.rank) {
                if back.len() != buf.len() * 4 {
                    return Err(CollectiveError::Mismatch {
                        peer: 0,
                        expected: "the reduced buffer",
                        got: "another length",
                        seq: self.seq,
                    });
                }
                buf.copy_from_slice(&from_bytes(&back));
            }
        }
        self.seq += 1;
        Ok(())
    }
}

/// Who receives a reduced chunk.
#[derive(Clone, Copy)]
enum Receivers {
    All,
    Only(usize),
}

impl Receivers {
    fn includes(self, rank: usize) -> bool {
        match self {
            Receivers::All => true,
            Receivers::Only(r) => r == rank,
        }
    }
}

impl Collective for TcpGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn all_reduce_sum(&mut self, buf: &mut [f32]) -> Result<(), CollectiveError> {
        if buf.is_empty() {
            return self.reduce_chunk(buf, Receivers::All);
        }
        for chunk in buf.chunks_mut(CHUNK) {
            self.reduce_chunk(chunk, Receivers::All)?;
        }
        Ok(())
    }

    fn reduce_scatter_sum(
        &mut self,
        buf: &[f32],
        shares: &[Range<usize>],
    ) -> Result<Vec<f32>, CollectiveError> {
        check_shares(shares, buf.len(), self.world_size)?;
        let mut mine = Vec::new();
        for (owner, range) in shares.iter().enumerate() {
            let mut part = buf[range.clone()].to_vec();
            for chunk in part.chunks_mut(CHUNK) {
                self.reduce_chunk(chunk, Receivers::Only(owner))?;
            }
            if owner == self.rank {
                mine = part;
            }
        }
        Ok(mine)
    }

    fn all_gather(&mut self, mine: &[f32]) -> Result<Vec<Vec<f32>>, CollectiveError> {
        let all = if self.rank == 0 {
            let mut all = vec![mine.to_vec()];
            all.extend(
                self.gather_frames(Op::Gather)?
                    .iter()
                    .map(|f| from_bytes(f)),
            );
            let mut packed = Vec::new();
            for part in &all {
                packed.extend_from_slice(&(part.len() as u64).to_le_bytes());
                packed.extend_from_slice(&to_bytes(part));
            }
            let seq = self.seq;
            for (i, s) in self.links.iter_mut().enumerate() {
                write_frame(s, Op::Gather, seq, &packed)
                    .map_err(|e| CollectiveError::io("gather", i + 1, e))?;
            }
            all
        } else {
            let packed = self.exchange(Op::Gather, &to_bytes(mine))?;
            unpack(&packed, self.world_size).ok_or(CollectiveError::Mismatch {
                peer: 0,
                expected: "one buffer per rank",
                got: "a malformed gather",
                seq: self.seq,
            })?
        };
        self.seq += 1;
        Ok(all)
    }

    fn broadcast(&mut self, bytes: &mut Vec<u8>) -> Result<(), CollectiveError> {
        if self.rank == 0 {
            let seq = self.seq;
            // Every rank announces itself first, so that ranks in another collective fail.
            self.gather_frames(Op::Broadcast)?;
            for (i, s) in self.links.iter_mut().enumerate() {
                write_frame(s, Op::Broadcast, seq, bytes)
                    .map_err(|e| CollectiveError::io("broadcast", i + 1, e))?;
            }
        } else {
            *bytes = self.exchange(Op::Broadcast, &[])?;
        }
        self.seq += 1;
        Ok(())
    }
}

fn check_hello(
    frame: &(u8, u64, Vec<u8>),
    world_size: usize,
    opts: &GroupOptions,
    slots: &[Option<TcpStream>],
) -> Result<usize, String> {
    let (op, _, body) = frame;
    if *op != Op::Hello as u8 || body.len() != 56 || &body[..8] != MAGIC {
        return Err(
            "a connection that is not an xdistill rank (or another protocol version)".into(),
        );
    }
    let rank = u64::from_le_bytes(body[8..16].try_into().expect("8 bytes")) as usize;
    let world = u64::from_le_bytes(body[16..24].try_into().expect("8 bytes")) as usize;
    if world != world_size {
        return Err(format!(
            "rank {rank} says the world has {world} ranks, rank 0 says {world_size}"
        ));
    }
    if rank == 0 || rank >= world_size {
        return Err(format!("rank {rank} is out of range 1..{world_size}"));
    }
    if slots[rank - 1].is_some() {
        return Err(format!("two processes claim rank {rank}"));
    }
    if body[24..56] != opts.config_hash {
        return Err(format!(
            "rank {rank}'s config differs from rank 0's (config hash {} vs {}); every rank must run the same config",
            hex::encode(&body[24..32]),
            hex::encode(&opts.config_hash[..8])
        ));
    }
    Ok(rank)
}

fn connect_once(addr: &str, timeout: Duration) -> std::io::Result<TcpStream> {
    let addrs: Vec<SocketAddr> = addr.to_socket_addrs()?.collect();
    let mut last = std::io::Error::new(ErrorKind::NotFound, format!("{addr} resolves to nothing"));
    for a in addrs {
        match TcpStream::connect_timeout(&a, timeout.min(Duration::from_secs(5))) {
            Ok(s) => return Ok(s),
            Err(e) => last = e,
        }
    }
    Err(last)
}

fn configure(s: &TcpStream, timeout: Duration) -> std::io::Result<()> {
    s.set_nonblocking(false)?;
    s.set_nodelay(true)?;
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))
}

fn expect(s: &mut TcpStream, peer: usize, op: Op, seq: u64) -> Result<Vec<u8>, CollectiveError> {
    let (got, got_seq, body) = read_frame(s, peer)?;
    if got == Op::Reject as u8 {
        return Err(CollectiveError::Rendezvous {
            message: String::from_utf8_lossy(&body).into_owned(),
        });
    }
    if got != op as u8 || got_seq != seq {
        return Err(CollectiveError::Mismatch {
            peer,
            expected: Op::name(op as u8),
            got: Op::name(got),
            seq,
        });
    }
    Ok(body)
}

fn write_frame(s: &mut TcpStream, op: Op, seq: u64, payload: &[u8]) -> std::io::Result<()> {
    let mut head = [0u8; 17];
    head[0] = op as u8;
    head[1..9].copy_from_slice(&seq.to_le_bytes());
    head[9..17].copy_from_slice(&(payload.len() as u64).to_le_bytes());
    s.write_all(&head)?;
    s.write_all(payload)?;
    s.flush()
}

/// Larger frames than this are a corrupt stream, not a buffer (1 GiB).
const MAX_FRAME: u64 = 1 << 30;

fn read_frame(s: &mut TcpStream, peer: usize) -> Result<(u8, u64, Vec<u8>), CollectiveError> {
    let mut head = [0u8; 17];
    s.read_exact(&mut head)
        .map_err(|e| CollectiveError::io("read", peer, e))?;
    let seq = u64::from_le_bytes(head[1..9].try_into().expect("8 bytes"));
    let len = u64::from_le_bytes(head[9..17].try_into().expect("8 bytes"));
    if len > MAX_FRAME {
        return Err(CollectiveError::Mismatch {
            peer,
            expected: "a frame below 1 GiB",
            got: "a larger frame",
            seq,
        });
    }
    let mut body = vec![0u8; len as usize];
    s.read_exact(&mut body)
        .map_err(|e| CollectiveError::io("read", peer, e))?;
    Ok((head[0], seq, body))
}

/// `v` as little-endian bytes: the wire's order, and the machine's on every target the
/// project builds for, so one copy of the slice's bytes.
#[cfg(target_endian = "little")]
fn to_bytes(v: &[f32]) -> Vec<u8> {
    bytemuck::cast_slice(v).to_vec()
}

/// Little-endian `f32`s from `b`, one copy into an aligned buffer however `b` is aligned.
/// Bytes past the last whole value are not read (callers check a frame's length first).
#[cfg(target_endian = "little")]
fn from_bytes(b: &[u8]) -> Vec<f32> {
    let n = b.len() / 4;
    let mut out = vec![0f32; n];
    bytemuck::cast_slice_mut::<f32, u8>(&mut out).copy_from_slice(&b[..n * 4]);
    out
}

#[cfg(target_endian = "big")]
fn to_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

#[cfg(target_endian = "big")]
fn from_bytes(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn unpack(mut b: &[u8], world: usize) -> Option<Vec<Vec<f32>>> {
    let mut out = Vec::with_capacity(world);
    for _ in 0..world {
        let n = u64::from_le_bytes(b.get(..8)?.try_into().ok()?) as usize;
        let bytes = b.get(8..8 + n.checked_mul(4)?)?;
        out.push(from_bytes(bytes));
        b = &b[8 + n * 4..];
    }
    b.is_empty().then_some(out)
}

#[cfg(test)]
mod codec_tests {
    use super::*;

    /// The wire is little-endian f32s: the bulk casts equal the per-value encoding, and decoding
    /// reads a buffer at any alignment (a frame's payload starts where its header ends).
    #[test]
    fn floats_round_trip_as_little_endian_bytes_at_any_alignment() {
        let v: Vec<f32> = (0..37)
            .map(|i| (i as f32 - 18.5) * 0.37)
            .chain([f32::MIN_POSITIVE, -0.0, f32::INFINITY, f32::MAX])
            .collect();
        let naive: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        assert_eq!(to_bytes(&v), naive);
        for shift in 0..4 {
            let mut framed = vec![0xAAu8; shift];
            framed.extend_from_slice(&naive);
            let back = from_bytes(&framed[shift..]);
            assert_eq!(back.len(), v.len());
            assert!(back.iter().zip(&v).all(|(a, b)| a.to_bits() == b.to_bits()));
        }
        assert!(from_bytes(&[]).is_empty());
        assert_eq!(from_bytes(&naive[..9]), v[..2]);
    }
}
