//! How activations and gradients travel between stages: channels between threads of one process, or a
//! process group's send/recv between processes. Both are keyed by (kind, microbatch, receiving virtual
//! stage), so the runtime does not care which it has.
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use tch::{Device, Kind, Tensor};

use crate::error::{Error, Result};
use crate::group::{tensor_meta, ProcessGroup};
use crate::work::Work;

/// What travels.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Payload {
    Activation,
    Grad,
}

/// (payload, microbatch, virtual stage that receives it)
pub type Key = (Payload, usize, usize);

pub trait Transport {
    /// Sends without blocking the caller.
    fn send(&mut self, to_rank: usize, key: Key, t: &Tensor) -> Result<()>;
    /// Blocks until the tensor for `key` arrives from `from_rank`.
    fn recv(&mut self, from_rank: usize, key: Key) -> Result<Tensor>;
    /// Posts the receive of `key` from `from_rank` ahead of [`Transport::recv`], where that helps.
    fn prepost(&mut self, _from_rank: usize, _key: Key) -> Result<()> {
        Ok(())
    }
    /// Completes outstanding sends (end of a step).
    fn flush(&mut self) -> Result<()>;
    /// This rank failed (`origin` is the rank where the failure began, this one or an earlier one whose
    /// failure reached it): tells `to_rank`, which waits for `key` from it, instead of sending it, so
    /// that it fails at once with `msg` rather than waiting for its timeout.
    fn abort(&mut self, to_rank: usize, key: Key, origin: usize, msg: &str) -> Result<()>;
}

/// The header dtype code that means "no tensor comes: the sender failed".
const ABORT: i64 = -2;

/// Channels between stage threads. A failing stage raises `abort`, so the others stop waiting.
pub struct ChannelTransport {
    pub(crate) rank: usize,
    pub(crate) senders: Vec<Sender<(Key, Tensor)>>, // indexed by destination rank
    pub(crate) inbox: Receiver<(Key, Tensor)>,
    pub(crate) mailbox: HashMap<Key, Tensor>,
    pub(crate) abort: Arc<AtomicBool>,
    pub(crate) timeout: Duration,
}

/// One transport per stage thread, all connected.
pub fn channels(ranks: usize, abort: Arc<AtomicBool>, timeout: Duration) -> Vec<ChannelTransport> {
    let (txs, rxs): (Vec<_>, Vec<_>) = (0..ranks).map(|_| crossbeam_channel::unbounded()).unzip();
    rxs.into_iter()
        .enumerate()
        .map(|(rank, inbox)| ChannelTransport {
            rank,
            senders: txs.clone(),
            inbox,
            mailbox: HashMap::new(),
            abort: abort.clone(),
            timeout,
        })
        .collect()
}

impl Transport for ChannelTransport {
    fn send(&mut self, to_rank: usize, key: Key, t: &Tensor) -> Result<()> {
        self.senders[to_rank].send((key, t.shallow_clone())).map_err(|_| Error::PeerGone {
            op: format!("stage {} send {key:?}", self.rank),
            msg: "stage thread ended".into(),
        })
    }

    fn recv(&mut self, from_rank: usize, key: Key) -> Result<Tensor> {
        let start = Instant::now();
        loop {
            if let Some(t) = self.mailbox.remove(&key) {
                return Ok(t);
            }
            if self.abort.load(Ordering::SeqCst) {
                return Err(Error::PeerGone {
                    op: format!("stage {} waiting for {key:?} from stage {from_rank}", self.rank),
                    msg: "another stage failed".into(),
                });
            }
            match self.inbox.recv_timeout(Duration::from_millis(50)) {
                Ok((k, t)) => {
                    self.mailbox.insert(k, t);
                }
                Err(RecvTimeoutError::Timeout) if start.elapsed() < self.timeout => {}
                Err(_) => {
                    return Err(Error::Timeout {
                        op: format!("stage {} waiting for {key:?} from stage {from_rank}", self.rank),
                        timeout: self.timeout,
                        msg: "nothing arrived".into(),
                    })
                }
            }
        }
    }

    fn flush(&mut self) -> Result<()> {
        Ok(())
    }

    fn abort(&mut self, _to_rank: usize, _key: Key, _origin: usize, _msg: &str) -> Result<()> {
        // threads share an abort flag, raised by the runner
        Ok(())
    }
}

/// Send/recv over a process group (one process per stage). Each tensor travels as one message: a
/// header with its dtype and shape, then its bytes, so receivers need not know shapes in advance and a
/// transfer costs one message, as torch.distributed.pipelining's body-only sends do (a separate header
/// message doubled the latency of a 64 KB transfer over Gloo here: `scripts/bench_gloo_p2p.py`).
///
/// Receives are posted ahead of the schedule ([`Transport::prepost`]), sized from the key's previous
/// step, as torch.distributed.pipelining posts its receives early: Gloo moves a message only once its
/// receive is posted, so a receive posted late costs a round trip through the sender's I/O thread, which
/// on a busy machine waits for a core (about 4 ms per message measured here). A message must match its
/// receive's size, so a tensor of another size (the first step, a smaller last batch) is preceded by a
/// header-only message of the size posted, which tells the receiver what to post next. A failing stage
/// sends an abort header the same way, so the receiver fails at once.
/// Keep one transport for a rank's steps: both sides' size caches must see the same history. A step
/// that fails can leave receives posted in the group; recover with a new group, as after any failed
/// collective.
pub struct GroupTransport {
    pub(crate) pg: Arc<ProcessGroup>,
    pub(crate) microbatches: usize,
    pub(crate) virtual_stages: usize,
    /// Where received tensors are put.
    pub(crate) device: Device,
    /// Sends in flight, by destination and key; each keeps its message alive until it is waited for.
    pending: Vec<((usize, Key), Work)>,
    /// Body bytes of the last tensor sent to each (rank, key): the size its receiver posts next.
    sent: HashMap<(usize, Key), i64>,
    /// Body bytes of the last tensor received from each (rank, key).
    expected: HashMap<(usize, Key), i64>,
    /// Receives posted ahead.
    posted: HashMap<(usize, Key), Posted>,
}

/// Header integers: the tensor's encoding, what the message holds, padding. 16 of them (128 bytes)
/// keep the body aligned for every dtype, so the received tensor is a view of the message.
const HEADER: usize = 16;
const HEADER_BYTES: i64 = (HEADER * 8) as i64;
/// `header[tensor_meta::LEN]`: the tensor's bytes follow the header.
const BODY: i64 = 0;
/// `header[tensor_meta::LEN]`: nothing follows; the tensor comes next in a message of its own size.
const RESIZE: i64 = 1;

struct Posted {
    message: Tensor,
    work: Work,
}

impl GroupTransport {
    pub fn new(pg: Arc<ProcessGroup>, microbatches: usize, virtual_stages: usize, device: Device) -> Self {
        GroupTransport {
            pg,
            microbatches,
            virtual_stages,
            device,
            pending: Vec::new(),
            sent: HashMap::new(),
            expected: HashMap::new(),
            posted: HashMap::new(),
        }
    }

    fn tag(&self, key: Key) -> i32 {
        let kind = match key.0 {
            Payload::Activation => 0,
            Payload::Grad => 1,
        };
        ((kind * self.microbatches + key.1) * self.virtual_stages + key.2) as i32
    }

    /// A message of `header` and `body_bytes` more bytes on `device`, holding `body` when given.
    fn message(header: &[i64; HEADER], body_bytes: i64, body: Option<&Tensor>, device: Device) -> Result<Tensor> {
        let msg = Tensor::f_empty([HEADER_BYTES + body_bytes], (Kind::Uint8, device))?;
        msg.f_narrow(0, 0, HEADER_BYTES)?.f_copy_(&Tensor::from_slice(header).f_view_dtype(Kind::Uint8)?)?;
        if let Some(t) = body {
            Self::body(&msg, t.kind(), &t.size())?.f_copy_(t)?;
        } else {
            // the bytes after a header-only message's header are never read; keep them defined
            let _ = msg.f_narrow(0, HEADER_BYTES, body_bytes)?.f_zero_()?;
        }
        Ok(msg)
    }

    /// The tensor a message holds after its header: a view of it.
    fn body(msg: &Tensor, kind: Kind, shape: &[i64]) -> Result<Tensor> {
        let bytes = msg.size()[0] - HEADER_BYTES;
        Ok(msg.f_narrow(0, HEADER_BYTES, bytes)?.f_view_dtype(kind)?.f_view(shape)?)
    }

    fn header(msg: &Tensor) -> Result<Vec<i64>> {
        let h = msg.f_narrow(0, 0, HEADER_BYTES)?.f_to_device(Device::Cpu)?.f_view_dtype(Kind::Int64)?;
        Ok(Vec::<i64>::try_from(h)?)
    }

    fn post(&mut self, from_rank: usize, key: Key, body_bytes: i64) -> Result<()> {
        let mut message = Tensor::f_empty([HEADER_BYTES + body_bytes], (Kind::Uint8, self.device))?;
        let work = self.pg.recv_raw(&mut message, from_rank, self.tag(key))?;
        self.posted.insert((from_rank, key), Posted { message, work });
        Ok(())
    }

    /// A gradient for virtual stage `v` of microbatch `mb` came from `rank`, so `rank` has received the
    /// activation it was computed from: that send is over, and waiting for it frees its message now
    /// rather than at the end of the step. (Gloo's sends report completion only when waited for.)
    fn acknowledged(&mut self, rank: usize, key: Key) -> Result<()> {
        let (Payload::Grad, mb, v) = key else {
            return Ok(());
        };
        let sent = (rank, (Payload::Activation, mb, v + 1));
        let (done, open): (Vec<_>, Vec<_>) = self.pending.drain(..).partition(|(k, _)| *k == sent);
        self.pending = open;
        for (_, w) in done {
            w.wait()?;
        }
        Ok(())
    }

    /// The failure a stage announced instead of its tensor.
    fn aborted(&self, h: &[i64], key: Key) -> Error {
        let origin = h[1].max(0) as usize;
        let msg = self
            .pg
            .store()
            .get(&abort_key(origin))
            .map(|m| String::from_utf8_lossy(&m).to_string())
            .unwrap_or_else(|e| format!("(its message could not be read: {e})"));
        Error::RankFailed {
            op: format!("pipeline stage {} waiting for {:?} of microbatch {}", self.pg.rank(), key.0, key.1),
            rank: origin,
            msg,
        }
    }
}

/// The bytes of a tensor of encoding `m`, when it can be rebuilt from it.
fn body_bytes(m: &[i64]) -> Option<(Kind, Vec<i64>, i64)> {
    let (kind, shape) = tensor_meta::decode(m)?;
    let bytes = shape.iter().product::<i64>() * kind.elt_size_in_bytes() as i64;
    Some((kind, shape, bytes))
}

fn header_of(meta: &[i64; tensor_meta::LEN], holds: i64) -> [i64; HEADER] {
    let mut h = [0i64; HEADER];
    h[..tensor_meta::LEN].copy_from_slice(meta);
    h[tensor_meta::LEN] = holds;
    h
}

impl Transport for GroupTransport {
    fn send(&mut self, to_rank: usize, key: Key, t: &Tensor) -> Result<()> {
        let m = tensor_meta::encode(t);
        let Some((_, _, bytes)) = body_bytes(&m) else {
            return Err(Error::invalid(
                "pipeline send",
                format!("{}: at most {} dims of a known dtype", tensor_meta::render(&m), tensor_meta::MAX_DIMS),
            ));
        };
        let tag = self.tag(key);
        let _l = crate::flight::label(format!(
            "pipeline send {:?} of microbatch {} to virtual stage {}",
            key.0, key.1, key.2
        ));
        let device = t.device();
        let posted = self.sent.get(&(to_rank, key)).copied().unwrap_or(0);
        // Our header already tells the receiver what comes, so the group's own checks are skipped.
        if posted != bytes {
            let resize = Self::message(&header_of(&m, RESIZE), posted, None, device)?;
            self.pending.push(((to_rank, key), self.pg.send_raw(&resize, to_rank, tag)?));
        }
        let msg = Self::message(&header_of(&m, BODY), bytes, Some(t), device)?;
        self.pending.push(((to_rank, key), self.pg.send_raw(&msg, to_rank, tag)?));
        self.sent.insert((to_rank, key), bytes);
        Ok(())
    }

    fn prepost(&mut self, from_rank: usize, key: Key) -> Result<()> {
        if self.posted.contains_key(&(from_rank, key)) {
            return Ok(());
        }
        let bytes = self.expected.get(&(from_rank, key)).copied().unwrap_or(0);
        self.post(from_rank, key, bytes)
    }

    fn recv(&mut self, from_rank: usize, key: Key) -> Result<Tensor> {
        let _l = crate::flight::label(format!(
            "pipeline recv {:?} of microbatch {} for virtual stage {}",
            key.0, key.1, key.2
        ));
        self.prepost(from_rank, key)?;
        loop {
            let Some(Posted { message, work }) = self.posted.remove(&(from_rank, key)) else {
                return Err(Error::invalid("pipeline recv", format!("no receive posted for {key:?}")));
            };
            work.wait()?;
            let h = Self::header(&message)?;
            if h[0] == ABORT {
                return Err(self.aborted(&h, key));
            }
            let meta = &h[..tensor_meta::LEN];
            let Some((kind, shape, bytes)) = body_bytes(meta) else {
                return Err(Error::invalid(
                    "pipeline recv",
                    format!("stage {from_rank} announced {} for {key:?}", tensor_meta::render(meta)),
                ));
            };
            match h[tensor_meta::LEN] {
                RESIZE => self.post(from_rank, key, bytes)?,
                BODY if message.size()[0] == HEADER_BYTES + bytes => {
                    self.expected.insert((from_rank, key), bytes);
                    self.acknowledged(from_rank, key)?;
                    return Self::body(&message, kind, &shape);
                }
                holds => {
                    return Err(Error::invalid(
                        "pipeline recv",
                        format!(
                            "stage {from_rank} sent {} for {key:?} in a message of {} bytes (holds = {holds})",
                            tensor_meta::render(meta),
                            message.size()[0]
                        ),
                    ))
                }
            }
        }
    }

    fn flush(&mut self) -> Result<()> {
        for (_, w) in self.pending.drain(..) {
            w.wait()?;
        }
        Ok(())
    }

    fn abort(&mut self, to_rank: usize, key: Key, origin: usize, msg: &str) -> Result<()> {
        if origin == self.pg.rank() {
            self.pg.store().set(&abort_key(origin), msg.as_bytes())?;
        }
        let mut h = [0i64; HEADER];
        h[0] = ABORT;
        h[1] = origin as i64;
        // sized for the receive the other side posted for this key
        let posted = self.sent.get(&(to_rank, key)).copied().unwrap_or(0);
        let message = Self::message(&h, posted, None, self.device)?;
        let _l = crate::flight::label(format!("pipeline abort to rank {to_rank}"));
        // out within moments, whether or not the other side still listens
        let work = self.pg.send_raw(&message, to_rank, self.tag(key))?;
        let _ = work.wait_timeout(Duration::from_secs(2));
        Ok(())
    }
}

fn abort_key(origin: usize) -> String {
    format!("pipeline/abort/{origin}")
}
