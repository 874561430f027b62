//! Rank 0's side of the rendezvous while ranks join: what it does with each authenticated
//! connection (read and check the join message, or a host leader's batch of joins,
//! `host.rs`), and what it watches while it waits (ranks that joined and died, host leaders'
//! further batches and reports, and a periodic word on who is still missing).

use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use super::host::{self, HOST_LOST, JOIN_BATCH};
use super::{parse_join, take_u32, PeerInfo};
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
    /// For each rank that joined, the rank whose connection carries it: itself, or its
    /// host's leader (`usize::MAX` before it joins).
    pub via: Vec<usize>,
    /// Whether each rank's connection is a host leader's (its answer then carries its
    /// members' too).
    pub leader: Vec<bool>,
    /// Connections accepted (that passed the handshake).
    pub accepts: u64,
    /// Join messages read (a host leader's batch counts once).
    pub messages: u64,
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

    /// Why the join of `info` (world size `ws`, from `from`) cannot be admitted, if it cannot.
    fn refuse(&self, ws: usize, info: &PeerInfo, from: SocketAddr) -> Option<String> {
        if ws != self.world {
            return Some(format!(
                "rank {} at {from} was started with world size {ws}, rank 0 with {}",
                info.rank, self.world
            ));
        }
        if info.rank == 0 || info.rank >= self.world || self.infos[info.rank].is_some() {
            let first = self
                .infos
                .get(info.rank)
                .and_then(|i| i.as_ref())
                .map(|i| format!("{} (pid {})", i.hostname, i.pid));
            return Some(format!(
                "rank {} joined twice: from {from} ({}, pid {}) and earlier from {}",
                info.rank,
                info.hostname,
                info.pid,
                first.unwrap_or_default()
            ));
        }
        None
    }

    /// Admits a host leader's batch of joins (`l`: the leader's rank); the error names what
    /// is wrong with it.
    fn admit_batch(
        &mut self,
        l: usize,
        frame: &[u8],
        from: SocketAddr,
    ) -> std::result::Result<(), String> {
        let joins = host::parse_batch(frame).ok_or_else(|| {
            format!("malformed batch of joins from {from} (host leader rank {l})")
        })?;
        for j in joins {
            let (ws, info, port) = parse_join(j).ok_or_else(|| {
                format!("malformed join message in a batch from {from} (host leader rank {l})")
            })?;
            if let Some(why) = self.refuse(ws, &info, from) {
                return Err(why);
            }
            let r = info.rank;
            self.infos[r] = Some(info);
            self.ports[r] = port;
            self.via[r] = l;
            self.joined += 1;
        }
        self.messages += 1;
        Ok(())
    }

    /// The ranks that joined through host leader `l`, but `l`.
    fn members_of(&self, l: usize) -> Vec<usize> {
        (0..self.world)
            .filter(|&r| r != l && self.via[r] == l)
            .collect()
    }

    /// What a host leader sent after its first batch: more joins, or a report that a rank of
    /// its host died.
    fn leader_says(&mut self, l: usize) -> Result<()> {
        let Some(c) = self.conns[l].as_ref() else {
            return Ok(());
        };
        let from = c.peer_addr().unwrap_or(self.root);
        let frame = {
            let mut d = Deadlined::new(c, Instant::now() + auth::HANDSHAKE_TIMEOUT);
            auth::read_frame(&mut d, host::MAX_BATCH)
        };
        let root = self.root.to_string();
        let err = move |msg: String| Error::Rendezvous {
            rank: 0,
            addr: root.clone(),
            msg,
        };
        match frame {
            Ok(f) if f.first() == Some(&JOIN_BATCH) => self.admit_batch(l, &f, from).map_err(err),
            Ok(f) if f.first() == Some(&HOST_LOST) => {
                let mut rest = &f[1..];
                match take_u32(&mut rest) {
                    Some(r) if (r as usize) < self.world && r != 0 => Err(Error::PeerLost {
                        rank: 0,
                        peer: r as usize,
                        call: "init",
                        seq: 0,
                        reason: format!(
                            "host leader {} reports it: {}",
                            self.who(l),
                            String::from_utf8_lossy(rest)
                        ),
                    }),
                    _ => Err(err(format!("malformed report from host leader rank {l}"))),
                }
            }
            Ok(_) => Err(err(format!(
                "unexpected message from host leader rank {l} during the rendezvous"
            ))),
            Err(e) => {
                let gone = if e.kind() == std::io::ErrorKind::UnexpectedEof {
                    "closed its connection".to_string()
                } else {
                    format!("lost its connection ({e})")
                };
                Err(Error::PeerLost {
                    rank: 0,
                    peer: l,
                    call: "init",
                    seq: 0,
                    reason: format!(
                        "{}, the leader of its host's ranks ({} joined through it: {}), joined the rendezvous at {} and then {gone} before every rank had joined (rank(s) {} had not joined yet); it died or was stopped",
                        self.who(l),
                        self.members_of(l).len(),
                        crate::base::error::rank_list(&self.members_of(l)),
                        self.root,
                        crate::base::error::rank_list(&self.missing())
                    ),
                })
            }
        }
    }

    /// A rank that joined has nothing to send before the peer table: a readable connection
    /// is one that closed (or broke the protocol), or a host leader's with more to say.
    fn check_joined(&mut self) -> Result<()> {
        let joined: Vec<(usize, &TcpStream)> = self
            .conns
            .iter()
            .enumerate()
            .filter_map(|(r, c)| c.as_ref().map(|c| (r, c)))
            .collect();
        let ready = crate::net::readable_now(&joined);
        let leaders: Vec<usize> = ready
            .iter()
            .map(|&(r, _)| r)
            .filter(|&r| self.leader[r])
            .collect();
        let lone = ready.into_iter().find(|&(r, _)| !self.leader[r]);
        if let Some((r, c)) = lone {
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
        for l in leaders {
            self.leader_says(l)?;
        }
        Ok(())
    }
}

impl Admit for RootJoin {
    fn admit(&mut self, hello: Hello, stream: TcpStream, from: SocketAddr) -> Result<bool> {
        let join = {
            let mut d = Deadlined::new(&stream, Instant::now() + auth::HANDSHAKE_TIMEOUT);
            auth::send_verdict(&mut d, Verdict::Accepted)
                .and_then(|_| auth::read_frame(&mut d, host::MAX_BATCH))
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
        self.accepts += 1;
        if join.first() == Some(&HOST_LOST) {
            // A rank whose host's leader died before rank 0 answered it says so.
            let mut rest = &join[1..];
            if let Some(lost) = take_u32(&mut rest).map(|r| r as usize) {
                if lost != 0 && lost < self.world {
                    self.offender = Some(stream);
                    return Err(Error::PeerLost {
                        rank: 0,
                        peer: lost,
                        call: "init",
                        seq: 0,
                        reason: format!(
                            "rank {} at {from} reports it: {}",
                            hello.rank,
                            String::from_utf8_lossy(rest)
                        ),
                    });
                }
            }
            return self.fail(format!("malformed report from {from}"), stream);
        }
        if join.first() == Some(&JOIN_BATCH) {
            // A host leader: its own join first, then its members' so far.
            let l = hello.rank;
            let first = host::parse_batch(&join)
                .and_then(|j| j.first().and_then(|j| parse_join(j)))
                .map(|(_, info, _)| info.rank);
            if first != Some(l) || l == 0 || l >= self.world || self.conns[l].is_some() {
                return self.fail(
                    format!("malformed batch of joins from {from} (host leader claiming rank {l})"),
                    stream,
                );
            }
            if let Err(why) = self.admit_batch(l, &join, from) {
                return self.fail(why, stream);
            }
            self.conns[l] = Some(stream);
            self.leader[l] = true;
            return Ok(self.joined == self.world);
        }
        let Some((ws, info, port)) = parse_join(&join) else {
            return self.fail(
                format!(
                    "malformed join message from {from} (claiming rank {})",
                    hello.rank
                ),
                stream,
            );
        };
        if info.rank != hello.rank {
            return self.fail(
                format!(
                    "rank {} at {from} sent the join of rank {}",
                    hello.rank, info.rank
                ),
                stream,
            );
        }
        if let Some(why) = self.refuse(ws, &info, from) {
            return self.fail(why, stream);
        }
        let r = info.rank;
        self.conns[r] = Some(stream);
        self.infos[r] = Some(info);
        self.ports[r] = port;
        self.via[r] = r;
        self.messages += 1;
        self.joined += 1;
        Ok(self.joined == self.world)
    }

    fn done(&self) -> bool {
        self.joined == self.world
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
