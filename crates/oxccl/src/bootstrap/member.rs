//! A rank's side of the rendezvous when it joins rank 0 itself (not through its host's
//! leader, `host.rs`): it dials rank 0, proves the secret, sends its join message and reads
//! rank 0's answer (the peer table, or the addresses it dials for the direct exchanges).

use std::io;
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use super::mesh;
use super::{
    await_readable, decode_ip, set_timeouts, take, take_u32, Answer, Bootstrap, Links, PeerInfo,
    JOIN_VERSION, MAX_FRAME, MEMBER_GRACE, TABLE_LOST, TABLE_RELAY,
};
use crate::base::error::{Error, Result};
use crate::base::param::Config;
use crate::net::auth::{self, Deadlined, Hello, Purpose};
use crate::net::dial::{Dial, GaveUp};

impl Bootstrap {
    /// This rank's join message: version, world size, [`PeerInfo`], exchange listener port.
    pub(super) fn join_message(&self, me: &PeerInfo, port: u16) -> Vec<u8> {
        let mut join = vec![JOIN_VERSION];
        join.extend_from_slice(&(self.world_size as u32).to_le_bytes());
        me.encode(&mut join);
        join.extend_from_slice(&port.to_le_bytes());
        join
    }

    /// Dials rank 0's rendezvous and proves the secret, retrying until `deadline`; returns
    /// the connection and when the dial began.
    pub(super) fn dial_root(
        &self,
        deadline: Instant,
        cfg: &Config,
    ) -> Result<(TcpStream, Instant)> {
        let addr = self.root.to_string();
        let hello = Hello {
            rank: self.rank,
            purpose: Purpose::Rendezvous,
            tag: self.comm_tag(),
        };
        let start = Instant::now();
        let mut next_report = cfg.startup_report.map(|p| start + p);
        let refused_limit = cfg.rendezvous_refused.min(self.timeout);
        let dial = Dial {
            addr: self.root,
            secret: &self.secret,
            hello,
            deadline,
            first_pause: Duration::from_millis(20),
            max_pause: Duration::from_millis(500),
            refused_limit: Some(refused_limit),
            connect: |a, t| TcpStream::connect_timeout(&a, t),
            stop: None,
        };
        let report = |now: Instant, last_err: &str| {
            if let (Some(at), Some(every)) = (next_report, cfg.startup_report) {
                if now >= at {
                    next_report = Some(now + every);
                    crate::base::debug::announce(&format!(
                        "rank {}: still cannot join the rendezvous at {addr} after {:.0?} ({last_err}); waiting for rank 0 up to OXCCL_TIMEOUT={:?}",
                        self.rank,
                        now - start,
                        self.timeout
                    ));
                }
            }
        };
        let give_up = |g: GaveUp| {
            let reason = if g.refused_for.is_some() {
                format!(
                    "{} for {:.0?} (OXCCL_RENDEZVOUS_REFUSED_SECS): nothing listens there; rank 0 is not running (it died, or was never started) or the address is wrong",
                    g.last_err, refused_limit
                )
            } else {
                g.last_err
            };
            Error::Connect {
                rank: self.rank,
                peer: 0,
                addr: addr.clone(),
                // Whole milliseconds: "3.203s", not "3.203556031s".
                timeout: Duration::from_millis((g.at - start).as_millis() as u64),
                reason,
            }
        };
        Ok((dial.run(report, give_up)?, start))
    }

    /// A member's side of the rendezvous: joins, and returns rank 0's answer (the peer
    /// table, or the addresses it dials for the direct exchanges).
    pub(super) fn init_member(
        &mut self,
        me: PeerInfo,
        port: u16,
        deadline: Instant,
        cfg: &Config,
    ) -> Result<Answer> {
        let join = self.join_message(&me, port);
        let (stream, start) = self.dial_root(deadline, cfg)?;
        // Rank 0 gives up at its own deadline and then says why (which rank is missing):
        // wait a little longer than that for its word.
        let deadline = deadline + MEMBER_GRACE;
        let mut d = Deadlined::new(&stream, deadline);
        auth::write_frame(&mut d, &join).map_err(|e| self.lost(0, "init", e))?;
        self.traffic.rendezvous_sent = 1;
        if let Some(every) = cfg.startup_report {
            self.await_table(&stream, deadline, start, every);
        }
        let table = auth::read_frame(&mut d, MAX_FRAME).map_err(|e| match e.kind() {
            // Rank 0 names a rank that has not joined at its own deadline; silent past that
            // and the grace, it is itself stopped or hung (a SIGSTOPped rank 0 whose listener
            // had taken this rank's connection looked like "some rank has not joined").
            io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock => Error::PeerLost {
                rank: self.rank,
                peer: 0,
                call: "init",
                seq: self.seq,
                reason: format!(
                    "rank 0 (the rendezvous at {}) took this rank's join and then said nothing for {:?} and {:?} more, not even which rank had not joined, as it does at its deadline: it is stopped or hung",
                    self.root, self.timeout, MEMBER_GRACE
                ),
            },
            _ => self.lost(0, "init", e),
        })?;
        drop(d);
        self.traffic.rendezvous_received = 1;
        let answer = self.parse_answer(&table, 0)?;
        set_timeouts(&stream, self.timeout).map_err(|e| self.lost(0, "init", e))?;
        self.links = Links::Member(stream);
        Ok(answer)
    }

    /// Reads rank 0's answer to this rank's join (from rank `from`: 0, or this host's leader
    /// passing it on): the peer table or the direct exchanges' addresses, and rank 0's
    /// settings ([`root_says`](Self::root_says)); or the error it reports.
    pub(super) fn parse_answer(&mut self, table: &[u8], from: usize) -> Result<Answer> {
        let mut r = table;
        let relay = match take(&mut r, 1) {
            Some([0]) => false,
            Some([TABLE_RELAY]) => true,
            Some([1]) => {
                return Err(self.rz_err(format!(
                    "rank 0 failed the rendezvous: {}",
                    String::from_utf8_lossy(r)
                )))
            }
            Some([TABLE_LOST]) => return Err(self.lost_report(from, r, "init")),
            _ => return Err(self.proto(from, "init", "malformed peer table")),
        };
        let n = take_u32(&mut r).ok_or_else(|| self.proto(from, "init", "malformed peer table"))?
            as usize;
        if n != self.world_size {
            return Err(self.rz_err(format!(
                "rank 0 has world size {n}, this rank {}",
                self.world_size
            )));
        }
        let mut peers = Vec::new();
        for i in 0..if relay { n } else { 0 } {
            match PeerInfo::decode(&mut r) {
                Some(p) if p.rank == i => peers.push(p),
                _ => return Err(self.proto(from, "init", "malformed peer table")),
            }
        }
        let mut to = Vec::new();
        for _ in 0..if relay { 0 } else { mesh::rounds(n) } {
            let ip = decode_ip(&mut r);
            let port = take(&mut r, 2).map(|p| u16::from_le_bytes([p[0], p[1]]));
            match (ip, port) {
                (Some(ip), Some(port)) => to.push(SocketAddr::new(ip, port)),
                _ => return Err(self.proto(from, "init", "malformed peer table")),
            }
        }
        let says = take_u32(&mut r).and_then(|len| take(&mut r, len as usize));
        match says {
            Some(says) if r.is_empty() => self.root_says = says.to_vec(),
            _ => return Err(self.proto(from, "init", "malformed peer table")),
        }
        Ok(if relay {
            Answer::Table(peers)
        } else {
            Answer::Direct(to)
        })
    }

    /// Waits until rank 0 sends something on `stream` or `deadline` passes, saying every
    /// `every` what it waits for.
    fn await_table(&self, stream: &TcpStream, deadline: Instant, start: Instant, every: Duration) {
        await_readable(stream, deadline, every, &|_| {
            format!(
                "rank {}: joined the rendezvous at {} {:.0?} ago; rank 0 is still waiting for other ranks",
                self.rank,
                self.root,
                start.elapsed()
            )
        });
    }
}
