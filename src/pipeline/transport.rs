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
use crate::group::{tensor_meta, P2pOp, ProcessGroup};
use crate::work::Work;

/// What travels.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Payload {
    Activation,
    Grad,
}

/// (payload, microbatch, virtual stage that receives it)
pub(crate) type Key = (Payload, usize, usize);

/// A tensor leaving with a batch.
pub(crate) struct Outgoing {
    pub to: usize,
    pub key: Key,
    pub tensor: Tensor,
    /// Freed once the send is over, when nothing else holds it (the stage's output, whose values
    /// backward does not need: Megatron's deallocate_output_tensor).
    pub release: Option<Tensor>,
}

/// The batches of a plan a failing rank has not posted: (sends, receives) of each.
pub(crate) type Rest = [(Vec<(usize, Key)>, Vec<(usize, Key)>)];

pub(crate) trait Transport {
    /// A step begins; `input` is its full batch (every rank passes the same one).
    fn begin(&mut self, _input: &Tensor) -> Result<()> {
        Ok(())
    }
    /// Posts one batch of the step's plan: these sends and the receives of `recvs` (from, key), without
    /// blocking on them.
    fn exchange(&mut self, sends: Vec<Outgoing>, recvs: &[(usize, Key)]) -> Result<()>;
    /// Blocks until the tensor for `key`, received in an earlier batch, is there.
    fn recv(&mut self, from_rank: usize, key: Key) -> Result<Tensor>;
    /// Completes outstanding sends (end of a step).
    fn flush(&mut self) -> Result<()>;
    /// This rank failed (with `msg`, its own failure or an earlier stage's that reached it) before
    /// posting the batches in `rest`: posts them anyway, with placeholders for what it sends, so every
    /// other rank finds its batches matched and learns of the failure at once rather than waiting for
    /// its timeout.
    fn abort(&mut self, rest: &Rest, msg: &str) -> Result<()>;
}

/// Channels between stage threads. A failing stage raises `abort`, so the others stop waiting.
pub(crate) struct ChannelTransport {
    pub(crate) rank: usize,
    pub(crate) senders: Vec<Sender<(Key, Tensor)>>, // indexed by destination rank
    pub(crate) inbox: Receiver<(Key, Tensor)>,
    pub(crate) mailbox: HashMap<Key, Tensor>,
    pub(crate) abort: Arc<AtomicBool>,
    pub(crate) timeout: Duration,
}

/// One transport per stage thread, all connected.
pub(crate) fn channels(ranks: usize, abort: Arc<AtomicBool>, timeout: Duration) -> Vec<ChannelTransport> {
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
    fn exchange(&mut self, sends: Vec<Outgoing>, _recvs: &[(usize, Key)]) -> Result<()> {
        // the receiving thread reads the same memory: nothing is released
        for o in sends {
            let key = o.key;
            self.senders[o.to].send((key, o.tensor)).map_err(|_| Error::PeerGone {
                op: format!("stage {} send {key:?}", self.rank),
                msg: "stage thread ended".into(),
            })?;
        }
        Ok(())
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

    fn abort(&mut self, _rest: &Rest, _msg: &str) -> Result<()> {
        // threads share an abort flag, raised by the runner
        Ok(())
    }
}

/// Batched point-to-point over a process group (one process per stage), safe on NCCL: each batch of
/// the step's plan (`plan`) goes out as one `batch_isend_irecv`, in the plan's order, so that every pair
/// of ranks meets batch by batch in one order on NCCL's stream; nothing relies on tags. A tensor travels
/// as itself: no header, no copy. Shapes travel once: a step whose batch has a dtype and shape not seen
/// before ([`Transport::begin`]) sends each tensor's dtype and shape first, in a batch of headers
/// waited for at once, and every later step with that batch shape reuses them (a stage whose output
/// shape then changes anyway fails, naming it). A failing stage posts the rest of its batches with
/// placeholders and leaves its message in the store: the receiver of a placeholder fails at once (on
/// CPU, where it can look at the bytes without a device sync; elsewhere at the end of the step).
pub(crate) struct GroupTransport {
    pub(crate) pg: Arc<ProcessGroup>,
    /// Where received tensors are put.
    pub(crate) device: Device,
    /// Steps begun: keys this step's abort message in the store.
    step: u64,
    /// The batch (dtype and shape) of the last step that ended well, and whether this step sends shapes.
    input: Option<(Kind, Vec<i64>)>,
    discover: bool,
    /// Whether the last step ended well.
    clean: bool,
    /// Dtype and shape of each (peer, key) sent or received in the last step that sent shapes.
    shapes: HashMap<(usize, Key), (Kind, Vec<i64>)>,
    /// Posted batches not yet waited for, by number.
    batches: HashMap<usize, Work>,
    next_batch: usize,
    /// Received tensors and their batch.
    arrivals: HashMap<(usize, Key), Arrival>,
    /// Sends not yet known to be over: their batch, and what to release then.
    sends: Vec<(usize, Key, usize, Option<Tensor>)>,
    /// Receives a failing stage posted into placeholders: kept until they complete.
    drained: Vec<Work>,
}

enum Arrival {
    Tensor {
        t: Tensor,
        batch: usize,
    },
    /// The sender failed (origin rank) and sent no tensor.
    Aborted(usize),
}

/// Header integers: the tensor's encoding, then what follows.
const HEADER: usize = tensor_meta::LEN + 2;
/// `header[tensor_meta::LEN]`: the tensor follows in the next batch.
const BODY: i64 = 0;
/// `header[tensor_meta::LEN]`: the sender failed (`header[LEN + 1]` is where the failure began); no tensor
/// follows.
const ABORT: i64 = 1;
/// The first bytes of a placeholder: a quiet NaN no computation makes (its payload spells "tchdist").
const PLACEHOLDER: [u8; 8] = *b"tchdis\xf8\x7f";

impl GroupTransport {
    pub(crate) fn new(pg: Arc<ProcessGroup>, device: Device) -> Self {
        GroupTransport {
            pg,
            device,
            step: 0,
            input: None,
            discover: true,
            clean: false,
            shapes: HashMap::new(),
            batches: HashMap::new(),
            next_batch: 0,
            arrivals: HashMap::new(),
            sends: Vec::new(),
            drained: Vec::new(),
        }
    }

    fn abort_key(&self) -> String {
        format!("pipeline/abort/{}", self.step)
    }

    /// Posts `ops` as one batch; returns its number.
    fn post(&mut self, ops: Vec<P2pOp>) -> Result<usize> {
        let id = self.next_batch;
        self.next_batch += 1;
        let w = self.pg.batch_unverified(ops)?;
        self.batches.insert(id, w);
        Ok(id)
    }

    /// Waits for batch `id`, if it was not waited for yet; then releases what its sends leave behind.
    fn wait_batch(&mut self, id: usize) -> Result<()> {
        if let Some(w) = self.batches.remove(&id) {
            w.wait()?;
        }
        let (done, open): (Vec<_>, Vec<_>) = self.sends.drain(..).partition(|s| s.2 == id);
        self.sends = open;
        for (_, _, _, release) in done {
            if let Some(t) = release {
                if crate::storage::sole_owner(&t)? {
                    crate::storage::free(&t)?;
                }
            }
        }
        Ok(())
    }

    /// The headers of one batch, exchanged and waited for: what each receive will get.
    fn exchange_headers(
        &mut self,
        sends: &[(usize, Key, [i64; HEADER])],
        recvs: &[(usize, Key)],
        device: Device,
    ) -> Result<Vec<Vec<i64>>> {
        let mut ops = Vec::new();
        for (to, _, h) in sends {
            ops.push(P2pOp::send(&Tensor::from_slice(h).f_to_device(device)?, *to));
        }
        let heads: Vec<Tensor> = recvs
            .iter()
            .map(|_| Tensor::f_zeros([HEADER as i64], (Kind::Int64, device)))
            .collect::<std::result::Result<_, _>>()?;
        for ((from, _), h) in recvs.iter().zip(&heads) {
            ops.push(P2pOp::recv(h, *from));
        }
        let _l = crate::flight::label("pipeline shapes");
        let id = self.post(ops)?;
        self.wait_batch(id)?;
        heads.iter().map(|h| Ok(Vec::<i64>::try_from(h.f_to_device(Device::Cpu)?)?)).collect()
    }

    /// The failure a stage announced instead of its tensor.
    fn aborted(&self, origin: usize, key: Key) -> Error {
        self.failed(
            origin,
            format!("pipeline stage {} waiting for {:?} of microbatch {}", self.pg.rank(), key.0, key.1),
        )
    }

    /// Rank `origin`'s failure, as it left it in the store, reported as `op`'s, naming the failed rank by
    /// its launcher rank (what tchrun and the flight recorder call it), which its message carries.
    fn failed(&self, origin: usize, op: String) -> Error {
        match self.pg.store().get(&self.abort_key()) {
            Ok(m) => match AbortMessage::read(&m) {
                Some(a) => Error::RankFailed { op, rank: a.world, msg: a.msg },
                None => Error::RankFailed { op, rank: origin, msg: String::from_utf8_lossy(&m).to_string() },
            },
            Err(e) => Error::RankFailed { op, rank: origin, msg: format!("(its message could not be read: {e})") },
        }
    }

    /// Whether a stage failed this step: the origin its message names.
    fn failure(&self) -> Result<Option<usize>> {
        let key = self.abort_key();
        if !self.pg.store().check(&key)? {
            return Ok(None);
        }
        Ok(Some(AbortMessage::read(&self.pg.store().get(&key)?).map_or(0, |a| a.origin)))
    }

    /// A placeholder for a tensor this rank cannot send: `shape` when known, its first bytes marked.
    fn placeholder(kind: Kind, shape: &[i64], device: Device) -> Result<Tensor> {
        let t = Tensor::f_zeros(shape, (kind, Device::Cpu))?;
        let bytes = t.f_view_dtype(Kind::Uint8)?.f_reshape([-1])?;
        let n = bytes.size()[0].min(8);
        bytes.f_narrow(0, 0, n)?.f_copy_(&Tensor::from_slice(&PLACEHOLDER[..n as usize]))?;
        Ok(t.f_to_device(device)?)
    }
}

/// A stage's abort message, as [`GroupTransport::abort`] writes it: `rank O world W: MSG`.
struct AbortMessage {
    /// The failed stage's rank in the pipeline group.
    origin: usize,
    /// Its launcher rank.
    world: usize,
    msg: String,
}

impl AbortMessage {
    fn write(origin: usize, world: usize, msg: &str) -> String {
        format!("rank {origin} world {world}: {msg}")
    }

    fn read(bytes: &[u8]) -> Option<AbortMessage> {
        let s = String::from_utf8_lossy(bytes);
        let (head, msg) = s.split_once(": ")?;
        match head.split_whitespace().collect::<Vec<_>>()[..] {
            ["rank", o, "world", w] => {
                Some(AbortMessage { origin: o.parse().ok()?, world: w.parse().ok()?, msg: msg.to_string() })
            }
            _ => None,
        }
    }
}

fn header_of(t: &Tensor, holds: i64, origin: usize) -> [i64; HEADER] {
    let mut h = [0i64; HEADER];
    h[..tensor_meta::LEN].copy_from_slice(&tensor_meta::encode(t));
    h[tensor_meta::LEN] = holds;
    h[tensor_meta::LEN + 1] = origin as i64;
    h
}

impl Transport for GroupTransport {
    fn begin(&mut self, input: &Tensor) -> Result<()> {
        if self.step > 0 && !self.clean {
            // its batches may have stopped anywhere, and the other stages need not know it failed: what
            // this stage posted next could meet batches of another size
            return Err(Error::invalid(
                format!("pipeline stage {}", self.pg.rank()),
                "an earlier step failed on this stage: start again with a new process group and PipelineRank \
                 (tchrun's restarts give one)",
            ));
        }
        self.step += 1;
        let now = (input.kind(), input.size());
        self.discover = self.input.as_ref() != Some(&now);
        self.clean = false;
        if self.discover {
            self.shapes.clear();
        }
        self.input = Some(now);
        Ok(())
    }

    fn exchange(&mut self, sends: Vec<Outgoing>, recvs: &[(usize, Key)]) -> Result<()> {
        let _l = crate::flight::label(match (sends.first(), recvs.first()) {
            (Some(o), _) => {
                format!("pipeline batch: {:?} of microbatch {} to virtual stage {}", o.key.0, o.key.1, o.key.2)
            }
            (None, Some((_, k))) => {
                format!("pipeline batch: {:?} of microbatch {} for virtual stage {}", k.0, k.1, k.2)
            }
            _ => "pipeline batch".into(),
        });
        // the engines send a tensor's memory as it lies: a transposed or channels-last output goes as a
        // contiguous copy, so the receiver's plain buffer reads it right; anything that cannot be
        // described is refused before a message goes out
        let mut sends = sends;
        for o in &mut sends {
            if tensor_meta::decode(&tensor_meta::encode(&o.tensor)).is_none() {
                return Err(Error::invalid(
                    "pipeline send",
                    format!(
                        "{}: at most {} dims of a known dtype",
                        crate::group::describe(&o.tensor),
                        tensor_meta::MAX_DIMS
                    ),
                ));
            }
            o.tensor = o.tensor.f_contiguous()?;
        }
        let mut incoming: Vec<Option<Tensor>> = Vec::with_capacity(recvs.len());
        if self.discover {
            let heads: Vec<_> = sends.iter().map(|o| (o.to, o.key, header_of(&o.tensor, BODY, 0))).collect();
            let device = sends.first().map_or(self.device, |o| o.tensor.device());
            let got = self.exchange_headers(&heads, recvs, device)?;
            for (&(from, key), h) in recvs.iter().zip(got) {
                if h[tensor_meta::LEN] == ABORT {
                    self.arrivals.insert((from, key), Arrival::Aborted(h[tensor_meta::LEN + 1].max(0) as usize));
                    incoming.push(None);
                    continue;
                }
                let Some((kind, shape)) = tensor_meta::decode(&h[..tensor_meta::LEN]) else {
                    return Err(Error::invalid(
                        "pipeline recv",
                        format!("stage {from} announced {} for {key:?}", tensor_meta::render(&h[..tensor_meta::LEN])),
                    ));
                };
                self.shapes.insert((from, key), (kind, shape.clone()));
                incoming.push(Some(Tensor::f_empty(shape.as_slice(), (kind, self.device))?));
            }
            for o in &sends {
                self.shapes.insert((o.to, o.key), (o.tensor.kind(), o.tensor.size()));
            }
        } else {
            for o in &sends {
                let want = self.shapes.get(&(o.to, o.key));
                if want != Some(&(o.tensor.kind(), o.tensor.size())) {
                    return Err(Error::mismatch(
                        format!("pipeline stage {} sending {:?} of microbatch {}", self.pg.rank(), o.key.0, o.key.1),
                        format!(
                            "it is {}, but a batch of the same shape gave {} before: a stage's output shape must \
                             follow from its input's",
                            crate::group::describe(&o.tensor),
                            want.map_or("nothing".into(), |(k, s)| format!("{k:?}{s:?}"))
                        ),
                    ));
                }
            }
            for &(from, key) in recvs {
                let Some((kind, shape)) = self.shapes.get(&(from, key)) else {
                    return Err(Error::invalid(
                        "pipeline recv",
                        format!("no shape known for {key:?} from stage {from}"),
                    ));
                };
                incoming.push(Some(Tensor::f_empty(shape.as_slice(), (*kind, self.device))?));
            }
        }
        let mut ops = Vec::with_capacity(sends.len() + recvs.len());
        for o in &sends {
            ops.push(P2pOp::send(&o.tensor, o.to));
        }
        for (&(from, _), t) in recvs.iter().zip(&incoming) {
            if let Some(t) = t {
                ops.push(P2pOp::recv(t, from));
            }
        }
        if ops.is_empty() {
            return Ok(());
        }
        let id = self.post(ops)?;
        for o in sends {
            self.sends.push((o.to, o.key, id, o.release));
        }
        for (&(from, key), t) in recvs.iter().zip(incoming) {
            if let Some(t) = t {
                self.arrivals.insert((from, key), Arrival::Tensor { t, batch: id });
            }
        }
        Ok(())
    }

    fn recv(&mut self, from_rank: usize, key: Key) -> Result<Tensor> {
        let _l = crate::flight::label(format!(
            "pipeline recv {:?} of microbatch {} for virtual stage {}",
            key.0, key.1, key.2
        ));
        let (t, batch) = match self.arrivals.remove(&(from_rank, key)) {
            Some(Arrival::Tensor { t, batch }) => (t, batch),
            Some(Arrival::Aborted(origin)) => return Err(self.aborted(origin, key)),
            None => return Err(Error::invalid("pipeline recv", format!("no receive posted for {key:?}"))),
        };
        {
            // the time this stage waits for its neighbour (the bubble, as seen from the host)
            let _w = crate::timeline::span("pipeline wait", || format!("wait for {:?} of microbatch {}", key.0, key.1));
            self.wait_batch(batch)?;
        }
        if t.device() == Device::Cpu && is_placeholder(&t)? {
            if let Some(origin) = self.failure()? {
                return Err(self.aborted(origin, key));
            }
        }
        // a gradient from `from_rank` means it received the activation it came from: that send is over
        if let (Payload::Grad, mb, v) = key {
            let sent = (Payload::Activation, mb, v + 1);
            if let Some(b) = self.sends.iter().find(|s| s.0 == from_rank && s.1 == sent).map(|s| s.2) {
                self.wait_batch(b)?;
            }
        }
        Ok(t)
    }

    fn flush(&mut self) -> Result<()> {
        let ids: Vec<usize> = self.batches.keys().copied().collect();
        for id in ids {
            self.wait_batch(id)?;
        }
        self.arrivals.clear();
        // placeholders on a GPU are not looked at as they arrive
        if let Some(origin) = self.failure()? {
            return Err(
                self.failed(origin, format!("pipeline stage {} (a placeholder came this step)", self.pg.rank()))
            );
        }
        self.clean = true;
        Ok(())
    }

    fn abort(&mut self, rest: &Rest, msg: &str) -> Result<()> {
        // the stage whose message is in the store began it; none there: this one did (a failure of its
        // own, or one from another group, as a data-parallel collective's). A store that cannot be read
        // does not keep the placeholders from going out. (Two stages failing at once each send their
        // own origin; the message is the later one's.)
        let origin = match self.failure().ok().flatten() {
            Some(o) => o,
            None => {
                let me = self.pg.rank();
                // with its launcher rank (a pipeline group is often a subgroup of the world), as the flight
                // recorder's dumps and tchrun name ranks; else (ranks of one process) its world rank
                let world = crate::settings::launch_rank().or(self.pg.global_rank(me)).unwrap_or(me);
                let _ = self.pg.store().set(&self.abort_key(), AbortMessage::write(me, world, msg).as_bytes());
                me
            }
        };
        let _l = crate::flight::label("pipeline abort: the rest of this stage's batches, with placeholders");
        let device = self.device;
        for (sends, recvs) in rest {
            let mut ops = Vec::new();
            let mut keep = Vec::new();
            if self.discover {
                let mut h = [0i64; HEADER];
                h[0] = -1;
                h[tensor_meta::LEN] = ABORT;
                h[tensor_meta::LEN + 1] = origin as i64;
                let heads: Vec<_> = sends.iter().map(|&(to, key)| (to, key, h)).collect();
                let got = self.exchange_headers(&heads, recvs, device)?;
                for (&(from, _), h) in recvs.iter().zip(got) {
                    let shape = tensor_meta::decode(&h[..tensor_meta::LEN]).filter(|_| h[tensor_meta::LEN] == BODY);
                    if let Some((kind, shape)) = shape {
                        let t = Tensor::f_empty(shape.as_slice(), (kind, device))?;
                        ops.push(P2pOp::recv(&t, from));
                        keep.push(t);
                    }
                }
            } else {
                for &(to, key) in sends {
                    if let Some((kind, shape)) = self.shapes.get(&(to, key)).cloned() {
                        ops.push(P2pOp::send(&Self::placeholder(kind, &shape, device)?, to));
                    }
                }
                for &(from, key) in recvs {
                    if let Some((kind, shape)) = self.shapes.get(&(from, key)).cloned() {
                        let t = Tensor::f_empty(shape.as_slice(), (kind, device))?;
                        ops.push(P2pOp::recv(&t, from));
                        keep.push(t);
                    }
                }
            }
            if !ops.is_empty() {
                // not waited for: the others may be gone already; each work keeps its tensors
                self.drained.push(self.pg.batch_unverified(ops)?);
            }
        }
        Ok(())
    }
}

/// Whether a CPU tensor starts with the placeholder's bytes.
fn is_placeholder(t: &Tensor) -> Result<bool> {
    let bytes = t.f_view_dtype(Kind::Uint8)?.f_reshape([-1])?;
    let n = bytes.size()[0].min(8);
    if n < 8 {
        return Ok(n > 0);
    }
    Ok(Vec::<u8>::try_from(bytes.f_narrow(0, 0, 8)?)? == PLACEHOLDER)
}
