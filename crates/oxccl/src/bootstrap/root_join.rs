//! Rank 0's side of the rendezvous while ranks join: what it does with each authenticated
//! connection (read and check the join message), and what it watches while it waits (ranks
//! that joined and died, and a periodic word on who is still missing).

use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use super::{parse_join, PeerInfo, MAX_JOIN};
use crate::base::error::{Error, Result};
use crate::net::accept::{Admit, Strangers};
use crate::net::auth::{self, Deadlined, Hello, Verdict};

/// Rank 0's state while the ranks join.
pub(super) struct RootJoin {
    pub world: usize,
    pub root: SocketAddr,
    /// A connection to every rank that joined, indexed by rank (`None` at 0).
    pub conns: Vec<Option<TcpStream>>,
    /// Every rank's [`PeerInfo`] as it joins.
    pub infos: Vec<Option<PeerInfo>>,
    /// Every rank's exchange listener port as it joins.
    pub ports: Vec<u16>,
    pub joined: usize,
    /// A connection that broke the rendezvous (told why before rank 0 fails).
    pub offender: Option<TcpStream>,
    pub start: Instant,
    pub report_every: Option<Duration>,
    pub next_report: Option<Instant>,
}

impl RootJoin {
    /// The ranks that have not joined.
    pub(super) fn missing(&self) -> Vec<usize> {
        (0..self.world)
            .filter(|&r| self.infos[r].is_none())
            .collect()
    }

    fn fail(&mut self, msg: String, stream: TcpStream) -> Result<bool> {
        self.offender = Some(stream);
        Err(Error::Rendezvous {
            rank: 0,
            addr: self.root.to_string(),
            msg,
        })
    }

    fn who(&self, r: usize) -> String {
        match &self.infos[r] {
            Some(i) => format!("rank {r} ({}, pid {})", i.hostname, i.pid),
            None => format!("rank {r}"),
        }
    }

    /// A rank that joined has nothing to send before the peer table: a readable connection
    /// is one that closed (or broke the protocol).
    fn check_joined(&self) -> Result<()> {
        let joined: Vec<(usize, &TcpStream)> = self
            .conns
            .iter()
            .enumerate()
            .filter_map(|(r, c)| c.as_ref().map(|c| (r, c)))
            .collect();
        if let Some(&(r, c)) = crate::net::readable_now(&joined).first() {
            let gone = match c.peek(&mut [0u8; 1]) {
                Ok(0) => "closed its connection".to_string(),
                Ok(_) => "sent data before the rendezvous completed".to_string(),
                Err(e) => format!("lost its connection ({e})"),
            };
            // PeerLost naming it: the ranks told of this failure blame it, not rank 0.
            return Err(Error::PeerLost {
                rank: 0,
                peer: r,
                call: "init",
                seq: 0,
                reason: format!(
                    "{} joined the rendezvous at {} and then {gone} before every rank had joined (rank(s) {} had not joined yet); it died or was stopped",
                    self.who(r),
                    self.root,
                    crate::base::error::rank_list(&self.missing())
                ),
            });
        }
        Ok(())
    }
}

impl Admit for RootJoin {
    fn admit(&mut self, hello: Hello, stream: TcpStream, from: SocketAddr) -> Result<bool> {
        let join = {
            let mut d = Deadlined::new(&stream, Instant::now() + auth::HANDSHAKE_TIMEOUT);
            auth::send_verdict(&mut d, Verdict::Accepted)
                .and_then(|_| auth::read_frame(&mut d, MAX_JOIN))
        };
        let join = match join {
            Ok(j) => j,
            Err(e) => {
                // It may retry; a rank that never comes back is reported as missing.
                tracing::debug!(
                    "rank 0: lost rank {} at {from} before its join message: {e}",
                    hello.rank
                );
                return Ok(false);
            }
        };
        let Some((ws, info, port)) = parse_join(&join) else {
            return self.fail(
                format!(
                    "malformed join message from {from} (claiming rank {})",
                    hello.rank
                ),
                stream,
            );
        };
        if ws != self.world || info.rank != hello.rank {
            return self.fail(
                format!(
                    "rank {} at {from} was started with world size {ws}, rank 0 with {}",
                    info.rank, self.world
                ),
                stream,
            );
        }
        if info.rank == 0 || info.rank >= self.world || self.infos[info.rank].is_some() {
            let first = self
                .infos
                .get(info.rank)
                .and_then(|i| i.as_ref())
                .map(|i| format!("{} (pid {})", i.hostname, i.pid));
            return self.fail(
                format!(
                    "rank {} joined twice: from {from} ({}, pid {}) and earlier from {}",
                    info.rank,
                    info.hostname,
                    info.pid,
                    first.unwrap_or_default()
                ),
                stream,
            );
        }
        let r = info.rank;
        self.conns[r] = Some(stream);
        self.infos[r] = Some(info);
        self.ports[r] = port;
        self.joined += 1;
        Ok(self.joined == self.world)
    }

    fn tick(&mut self, strangers: &Strangers) -> Result<()> {
        self.check_joined()?;
        let (Some(at), Some(every)) = (self.next_report, self.report_every) else {
            return Ok(());
        };
        let now = Instant::now();
        if now < at {
            return Ok(());
        }
        self.next_report = Some(now + every);
        let missing = crate::base::error::rank_list(&self.missing());
        let strangers = strangers
            .summary()
            .map(|s| format!("; {s}"))
            .unwrap_or_default();
        crate::base::debug::announce(&format!(
            "rank 0: rendezvous at {}: {} of {} ranks joined after {:.0?}, waiting on rank(s) {missing}{strangers}",
            self.root,
            self.joined,
            self.world,
            now.duration_since(self.start)
        ));
        Ok(())
    }
}
