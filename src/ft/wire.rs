//! The lighthouse's protocol: one JSON object per line each way, over a TCP connection that a replica
//! keeps open (a heartbeat connection, and one per quorum request).
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// What a replica asks.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) enum Request {
    /// "I am alive": sent every heartbeat interval.
    Heartbeat { replica: String },
    /// Join the next quorum, at `step` committed steps, the last of them in quorum `commit_quorum`.
    /// `reconfigure`: this replica's last step failed (or it just started), so the replicate group must be
    /// rebuilt even if the members stay the same.
    Quorum { replica: String, step: u64, commit_quorum: u64, reconfigure: bool },
}

/// One replica of a quorum.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Member {
    pub replica: String,
    /// The steps it has committed.
    pub step: u64,
    /// The quorum its last committed step was taken in (0: none, or resumed from a checkpoint). Of two
    /// replicas at the same step, the one with the later quorum holds the state that went on: the other
    /// committed alone what the rest discarded and redid without it.
    pub commit_quorum: u64,
}

/// The replicas that take the next step together. Every member receives the same value.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Quorum {
    /// Changes whenever the members change or one of them asked to rebuild the group: the replicate
    /// group of quorum `id` is built under the store prefix `ft/{id}/`.
    pub id: u64,
    /// Sorted by replica id; a member's index is its rank in the replicate group.
    pub members: Vec<Member>,
    /// `host:port` of the lighthouse's TCPStore, where replicate groups meet.
    pub store: String,
}

impl Quorum {
    /// The highest committed step among the members: where the quorum trains next.
    pub fn max_step(&self) -> u64 {
        self.members.iter().map(|m| m.step).max().unwrap_or(0)
    }
    /// The members that hold the state the quorum goes on from: the highest (step, commit quorum).
    pub fn healthy(&self) -> Vec<usize> {
        let best = self.members.iter().map(|m| (m.step, m.commit_quorum)).max();
        (0..self.members.len())
            .filter(|&i| Some((self.members[i].step, self.members[i].commit_quorum)) == best)
            .collect()
    }
    pub(crate) fn rank_of(&self, replica: &str) -> Option<usize> {
        self.members.iter().position(|m| m.replica == replica)
    }
}

/// What the lighthouse answers.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) enum Response {
    Ok,
    Quorum(Quorum),
    Refused(String),
}

/// A line-oriented connection to the lighthouse.
pub(crate) struct Connection {
    reader: BufReader<TcpStream>,
    addr: String,
}

impl Connection {
    pub(crate) fn open(addr: &str, timeout: Duration) -> Result<Connection> {
        let gone = |e: std::io::Error| Error::PeerGone {
            op: "fault tolerance".into(),
            msg: format!("the lighthouse at {addr} cannot be reached: {e}"),
        };
        let sock = addr
            .to_socket_addrs()
            .map_err(gone)?
            .next()
            .ok_or_else(|| Error::invalid("lighthouse address", format!("{addr:?} names no address")))?;
        let s = TcpStream::connect_timeout(&sock, timeout).map_err(gone)?;
        s.set_nodelay(true).map_err(gone)?;
        Ok(Connection { reader: BufReader::new(s), addr: addr.to_string() })
    }

    /// Sends `req` and waits at most `timeout` for the answer.
    pub(crate) fn call(&mut self, req: &Request, timeout: Duration) -> Result<Response> {
        let addr = self.addr.clone();
        let gone = move |e: std::io::Error| Error::PeerGone {
            op: "fault tolerance".into(),
            msg: format!("the lighthouse at {addr} did not answer: {e}"),
        };
        let s = self.reader.get_mut();
        s.set_read_timeout(Some(timeout.max(Duration::from_millis(1)))).map_err(&gone)?;
        s.set_write_timeout(Some(timeout.max(Duration::from_millis(1)))).map_err(&gone)?;
        write_line(s, req).map_err(&gone)?;
        read_line(&mut self.reader)
            .map_err(&gone)?
            .ok_or_else(|| gone(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "connection closed")))
    }
}

pub(crate) fn write_line<T: Serialize>(s: &mut TcpStream, v: &T) -> std::io::Result<()> {
    let mut text = serde_json::to_string(v).map_err(std::io::Error::other)?;
    text.push('\n');
    s.write_all(text.as_bytes())
}

/// The next message, `None` at the end of the stream.
pub(crate) fn read_line<T: for<'de> Deserialize<'de>>(r: &mut BufReader<TcpStream>) -> std::io::Result<Option<T>> {
    let mut line = String::new();
    if r.read_line(&mut line)? == 0 {
        return Ok(None);
    }
    serde_json::from_str(&line).map(Some).map_err(std::io::Error::other)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(r: &str, step: u64, commit_quorum: u64) -> Member {
        Member { replica: r.into(), step, commit_quorum }
    }

    #[test]
    fn the_state_that_went_on_is_the_latest_commit_at_the_highest_step() {
        // "a" completed step 9's sum in quorum 4 where "b" and "c" failed; cut off, it missed quorum 5,
        // where they ran step 9 again without it: same step, but theirs is the state that went on
        let q = Quorum {
            id: 6,
            members: vec![member("a", 10, 4), member("b", 10, 5), member("c", 10, 5)],
            store: String::new(),
        };
        assert_eq!(q.healthy(), [1, 2]);
        let q = Quorum {
            id: 7,
            members: vec![member("a", 3, 0), member("b", 12, 5), member("c", 12, 5)],
            store: String::new(),
        };
        assert_eq!(q.healthy(), [1, 2]);
        assert_eq!(q.max_step(), 12);
    }
}
