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

/// Send/recv over a process group (one process per stage). Each tensor is preceded by a small header
/// with its dtype and shape, so receivers need not know shapes in advance; headers travel where the
/// group's metadata does, tensors go to the engine for their device (through the CPU for Gloo).
///
/// Receives are posted ahead of the schedule ([`Transport::prepost`]), header and body together once a
/// key's shape is known from the step before, as torch.distributed.pipelining posts its receives early:
/// Gloo moves a message only once its receive is posted, so a receive posted late costs a round trip
/// through the sender's I/O thread, which on a busy machine waits for a core (about 4 ms per message
/// measured here). A shape that changes between steps (a smaller last batch) is announced in its header,
/// and the sender first sends a placeholder of the old shape to complete the receive posted for it.
/// Keep one transport for a rank's steps: both sides' shape caches must see the same history. A step
/// that fails can leave receives posted in the group; recover with a new group, as after any failed
/// collective.
pub struct GroupTransport {
    pub(crate) pg: Arc<ProcessGroup>,
    pub(crate) microbatches: usize,
    pub(crate) virtual_stages: usize,
    /// Where received tensors are put.
    pub(crate) device: Device,
    // The engine keeps the sent tensors alive until their work completes.
    pending: Vec<Work>,
    /// Header last sent to each (rank, key), and last received from each.
    sent: HashMap<(usize, Key), [i64; tensor_meta::LEN]>,
    expected: HashMap<(usize, Key), [i64; tensor_meta::LEN]>,
    /// Receives posted ahead.
    posted: HashMap<(usize, Key), Posted>,
}

/// Header integers: the tensor's encoding, then whether a placeholder of the old shape comes first.
const HEADER: usize = tensor_meta::LEN + 1;

struct Posted {
    header: Tensor,
    header_work: Work,
    /// The body's receive, posted when its shape was known.
    body: Option<(Tensor, Work)>,
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
        // two tags per message: header (even) and payload (odd)
        (((kind * self.microbatches + key.1) * self.virtual_stages + key.2) * 2) as i32
    }

    fn recv_body(&self, meta: &[i64], from_rank: usize, tag: i32) -> Result<(Tensor, Work)> {
        let mut t = tensor_meta::empty(meta, self.device).ok_or_else(|| {
            Error::invalid("pipeline recv", format!("stage {from_rank} announced {}", tensor_meta::render(meta)))
        })?;
        let w = self.pg.recv_raw(&mut t, from_rank, tag + 1)?;
        Ok((t, w))
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

impl Transport for GroupTransport {
    fn send(&mut self, to_rank: usize, key: Key, t: &Tensor) -> Result<()> {
        let m = tensor_meta::encode(t);
        if tensor_meta::decode(&m).is_none() {
            return Err(Error::invalid(
                "pipeline send",
                format!("{}: at most {} dims of a known dtype", tensor_meta::render(&m), tensor_meta::MAX_DIMS),
            ));
        }
        // the receiver posted its body for the shape sent last time: a new shape completes that first
        let stale = self.sent.get(&(to_rank, key)).filter(|prev| **prev != m).copied();
        let mut h = [0i64; HEADER];
        h[..tensor_meta::LEN].copy_from_slice(&m);
        h[tensor_meta::LEN] = i64::from(stale.is_some());
        let header = Tensor::from_slice(&h).f_to_device(self.pg.meta_device())?;
        let body = t.f_contiguous()?;
        let tag = self.tag(key);
        let _l = crate::flight::label(format!(
            "pipeline send {:?} of microbatch {} to virtual stage {}",
            key.0, key.1, key.2
        ));
        // Our header already tells the receiver what comes, so the group's own checks are skipped.
        self.pending.push(self.pg.send_raw(&header, to_rank, tag)?);
        if let Some(prev) = stale {
            let placeholder = tensor_meta::empty(&prev, body.device())
                .ok_or_else(|| Error::invalid("pipeline send", "the previous shape cannot be rebuilt"))?;
            self.pending.push(self.pg.send_raw(&placeholder, to_rank, tag + 1)?);
        }
        self.pending.push(self.pg.send_raw(&body, to_rank, tag + 1)?);
        self.sent.insert((to_rank, key), m);
        Ok(())
    }

    fn prepost(&mut self, from_rank: usize, key: Key) -> Result<()> {
        if self.posted.contains_key(&(from_rank, key)) {
            return Ok(());
        }
        let tag = self.tag(key);
        let mut header = Tensor::f_zeros([HEADER as i64], (Kind::Int64, self.pg.meta_device()))?;
        let header_work = self.pg.recv_raw(&mut header, from_rank, tag)?;
        let body = match self.expected.get(&(from_rank, key)) {
            Some(m) => Some(self.recv_body(m, from_rank, tag)?),
            None => None,
        };
        self.posted.insert((from_rank, key), Posted { header, header_work, body });
        Ok(())
    }

    fn recv(&mut self, from_rank: usize, key: Key) -> Result<Tensor> {
        let tag = self.tag(key);
        let _l = crate::flight::label(format!(
            "pipeline recv {:?} of microbatch {} for virtual stage {}",
            key.0, key.1, key.2
        ));
        self.prepost(from_rank, key)?;
        let Some(posted) = self.posted.remove(&(from_rank, key)) else {
            return Err(Error::invalid("pipeline recv", format!("no receive posted for {key:?}")));
        };
        posted.header_work.wait()?;
        let h = Vec::<i64>::try_from(posted.header.f_to_device(Device::Cpu)?)?;
        if h[0] == ABORT {
            return Err(self.aborted(&h, key));
        }
        let meta = &h[..tensor_meta::LEN];
        let stale = h[tensor_meta::LEN] != 0;
        let (t, work) = match posted.body {
            Some((old, w)) if stale => {
                w.wait()?; // the placeholder
                drop(old);
                self.recv_body(meta, from_rank, tag)?
            }
            Some((t, w)) if tensor_meta::encode(&t)[..] == *meta => (t, w),
            Some((t, _)) => {
                return Err(Error::invalid(
                    "pipeline recv",
                    format!(
                        "stage {from_rank} announced {} for {key:?} where {} was posted, without a placeholder",
                        tensor_meta::render(meta),
                        tensor_meta::render(&tensor_meta::encode(&t))
                    ),
                ))
            }
            None if stale => {
                return Err(Error::invalid(
                    "pipeline recv",
                    format!("stage {from_rank} sent a placeholder for {key:?} where nothing was posted"),
                ))
            }
            None => self.recv_body(meta, from_rank, tag)?,
        };
        work.wait()?;
        let mut m = [0i64; tensor_meta::LEN];
        m.copy_from_slice(meta);
        self.expected.insert((from_rank, key), m);
        Ok(t)
    }

    fn flush(&mut self) -> Result<()> {
        for w in self.pending.drain(..) {
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
        let header = Tensor::from_slice(&h).f_to_device(self.pg.meta_device())?;
        let _l = crate::flight::label(format!("pipeline abort to rank {to_rank}"));
        // a small message: out within moments, whether or not the other side still listens
        let work = self.pg.send_raw(&header, to_rank, self.tag(key))?;
        let _ = work.wait_timeout(Duration::from_secs(2));
        Ok(())
    }
}

fn abort_key(origin: usize) -> String {
    format!("pipeline/abort/{origin}")
}
