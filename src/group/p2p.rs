//! Batched point-to-point: the sends and receives of one step posted as one unit (PyTorch's
//! `batch_isend_irecv`). On NCCL they are coalesced into one launch, so a rank may receive from and send
//! to the same peer in one step; posted one at a time, the receive would block the pair's stream before
//! the send runs.
use tch::Tensor;

use super::{describe, strict, Backend, ProcessGroup};
use crate::error::{Error, Result};
use crate::work::{Finish, Handle, Work};

/// One operation of [`ProcessGroup::batch_isend_irecv`] (`torch.distributed.P2POp`).
pub struct P2pOp {
    send: bool,
    tensor: Tensor,
    peer: usize,
    tag: i32,
}

impl P2pOp {
    /// Sends `t` to rank `dst`.
    pub fn send(t: &Tensor, dst: usize) -> P2pOp {
        P2pOp { send: true, tensor: t.shallow_clone(), peer: dst, tag: 0 }
    }

    /// Receives into `t` (the sender's dtype and shape) from rank `src`.
    pub fn recv(t: &Tensor, src: usize) -> P2pOp {
        P2pOp { send: false, tensor: t.shallow_clone(), peer: src, tag: 0 }
    }

    /// The tag Gloo matches on (NCCL ignores tags and matches in posting order).
    pub fn tag(mut self, tag: i32) -> P2pOp {
        self.tag = tag;
        self
    }

    fn describe(&self, pg: &ProcessGroup) -> String {
        let (what, dir) = if self.send { ("send", "to") } else { ("recv", "from") };
        format!("{what} of {} {dir} {}", describe(&self.tensor), pg.who(self.peer))
    }
}

impl ProcessGroup {
    /// Posts `ops` as one batch and returns one work for all of them. Every rank that appears as a peer
    /// must post its matching operations in a batch of its own, in the same order. With agreement
    /// checks on (Gloo), each receive first checks the sender's dtype and shape.
    pub fn batch_isend_irecv(&self, ops: Vec<P2pOp>) -> Result<Work> {
        self.check_batch(&ops)?;
        let device = ops[0].tensor.device();
        let e = self.engine(device, &|| ops[0].describe(self))?;
        if !(self.verify && e.backend == Backend::Gloo && self.strict.is_none()) {
            return self.batch_unverified(ops);
        }
        // Gloo's sends never block: post them all first, then each receive checks its header
        let (sends, recvs): (Vec<_>, Vec<_>) = ops.into_iter().partition(|o| o.send);
        let mut works = Vec::new();
        for o in sends {
            works.push(self.send_async(&o.tensor, o.peer, o.tag)?);
        }
        for mut o in recvs {
            works.push(self.recv_async(&mut o.tensor, o.peer, o.tag)?);
        }
        Ok(combine(works))
    }

    fn check_batch(&self, ops: &[P2pOp]) -> Result<()> {
        let Some(first) = ops.first() else {
            return Err(Error::invalid("batch_isend_irecv", "the batch is empty"));
        };
        for o in ops {
            self.check_peer("batch_isend_irecv peer", o.peer)?;
            if o.peer == self.rank {
                return Err(Error::invalid(
                    o.describe(self),
                    format!("{} cannot send to or receive from itself", self.who(self.rank)),
                ));
            }
            let (a, b) = (first.tensor.device(), o.tensor.device());
            if std::mem::discriminant(&a) != std::mem::discriminant(&b) {
                return Err(Error::invalid(
                    "batch_isend_irecv",
                    format!(
                        "{} and {} are on different device types: one batch runs on one engine",
                        first.describe(self),
                        o.describe(self)
                    ),
                ));
            }
        }
        Ok(())
    }

    /// [`batch_isend_irecv`](Self::batch_isend_irecv) without agreement checks (the crate's own rings).
    pub(crate) fn batch_unverified(&self, ops: Vec<P2pOp>) -> Result<Work> {
        self.check_batch(&ops)?;
        let desc = || format!("batch of {}", ops.iter().map(|o| o.describe(self)).collect::<Vec<_>>().join(", "));
        let e = self.engine(ops[0].tensor.device(), &desc)?;
        match e.backend {
            Backend::Nccl => {
                let batch: Vec<(&Tensor, usize, bool, i32)> =
                    ops.iter().map(|o| (&o.tensor, o.peer, o.send, o.tag)).collect();
                self.launch(e, desc(), |pg| pg.batch_p2p(&batch), None)
            }
            Backend::Gloo => match self.strict_for(e) {
                Some(s) => {
                    let mut finishes = Vec::new();
                    let mut queued = Vec::new();
                    for o in &ops {
                        let (t, f) = self.stage(e, &o.tensor, o.send)?;
                        finishes.extend(f);
                        queued.push(strict::Op { send: o.send, peer: o.peer, tensor: t });
                    }
                    let finish: Option<Finish> = (!finishes.is_empty())
                        .then(|| Box::new(move || finishes.into_iter().try_for_each(|f| f())) as Finish);
                    self.launch_with(e, desc(), finish, |d| Ok(Handle::Ticket(s.post_batch(queued, d())?)))
                }
                // Gloo runs each message on its own: posted one by one, none waits for another
                None => {
                    let mut works = Vec::new();
                    for mut o in ops {
                        works.push(if o.send {
                            self.send_raw(&o.tensor, o.peer, o.tag)?
                        } else {
                            self.recv_raw(&mut o.tensor, o.peer, o.tag)?
                        });
                    }
                    Ok(combine(works))
                }
            },
        }
    }
}

/// One work that completes when all of `works` have.
fn combine(mut works: Vec<Work>) -> Work {
    let mut last = match works.pop() {
        Some(w) => w,
        // check_batch refuses empty batches
        None => std::process::abort(),
    };
    for w in works {
        last.wait_first(w);
    }
    last
}
