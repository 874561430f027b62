//! The bootstrap's exchanges through rank 0, for communicators of at most
//! `OXCCL_BOOTSTRAP_RELAY_MAX` ranks: every rank sends its contribution to rank 0 on its
//! rendezvous connection, and rank 0 sends the concatenation back. One round trip and no
//! connections beyond the rendezvous's, so small groups start fastest this way; rank 0 sends
//! `n` times all `n` contributions (about 75 n² bytes for the peer table, 300 KB at 64 ranks).
//! Larger communicators use `mesh.rs` (O(n log n) bytes at rank 0). Rank 0 sends the peer
//! table with its answer to each join ([`TABLE_RELAY`](super::TABLE_RELAY)).
//!
//! A rank that fails tells rank 0 nothing (its connection closes); rank 0, which waits on
//! every rank in turn, names the rank at fault to every other rank ([`SEQ_LOST`]).

use std::io;
use std::net::TcpStream;
use std::time::{Duration, Instant};

use super::{
    await_readable, take, take_u32, take_u64, tell_all, Bootstrap, Links, CALL, MAX_FRAME,
    MEMBER_GRACE, SEQ_LOST,
};
use crate::base::error::{Error, Result};
use crate::net::auth;

impl Bootstrap {
    /// One exchange through rank 0, numbered `seq`; every rank's `mine`, by rank. On failure
    /// rank 0 names the rank at fault to every other rank.
    pub(super) fn allgather_relay(&mut self, mine: &[u8], seq: u64) -> Result<Vec<Vec<u8>>> {
        let mut links = std::mem::replace(&mut self.links, Links::Root(Vec::new()));
        let res = match &mut links {
            Links::Root(conns) => {
                let res = self.allgather_root(conns, mine, seq);
                if let Err(e) = &res {
                    if let Some((lost, msg)) = super::mesh::lost_message(e) {
                        // Every other rank waits on rank 0: name the rank at fault to them.
                        tell_all(conns, lost, &msg);
                    }
                }
                res
            }
            Links::Member(s) => self.allgather_member(s, mine, seq),
            // Ranks that join through a host leader exchange directly (`host.rs`).
            Links::Via(l, _) => Err(self.proto(
                *l,
                CALL,
                "an exchange through rank 0 on a rank that joined through its host's leader",
            )),
        };
        self.links = links;
        if let Ok(all) = &res {
            // What this rank sent: rank 0 the concatenation to every rank, the others their own.
            let whole = 4 + 8 + all.iter().map(|v| 4 + v.len() as u64).sum::<u64>();
            let (messages, bytes) = if self.rank == 0 {
                let n = self.world_size as u64 - 1;
                (n, n * whole)
            } else {
                (1, 4 + 8 + mine.len() as u64)
            };
            self.traffic.messages += messages;
            self.traffic.bytes += bytes;
        }
        res
    }

    /// Before a read on `s` bounded by `timeout`: when progress lines are on, waits for `s`
    /// to become readable, printing `say(waited)` every period, and sets the read timeout to
    /// what is left of `timeout` (so the whole wait stays within it). Restore the socket's
    /// usual timeout after the read.
    fn announce_wait(&self, s: &TcpStream, timeout: Duration, say: &dyn Fn(Duration) -> String) {
        let Some(every) = self.report_every else {
            return;
        };
        let start = Instant::now();
        await_readable(s, start + timeout, every, say);
        let left = timeout.saturating_sub(start.elapsed());
        let _ = s.set_read_timeout(Some(left.max(Duration::from_millis(1))));
    }

    /// Rank 0's side of [`allgather_relay`](Self::allgather_relay).
    fn allgather_root(
        &self,
        conns: &mut [Option<TcpStream>],
        mine: &[u8],
        seq: u64,
    ) -> Result<Vec<Vec<u8>>> {
        let mut all = Vec::with_capacity(self.world_size);
        all.push(mine.to_vec());
        for (r, c) in conns.iter_mut().enumerate().skip(1) {
            let s = c
                .as_mut()
                .ok_or_else(|| self.lost(r, CALL, io::ErrorKind::NotConnected.into()))?;
            self.announce_wait(s, self.timeout, &|waited| {
                format!(
                    "rank 0: bootstrap exchange #{seq}: waiting {waited:.0?} for rank {r} \
                     (the ranks below it have answered); is rank {r} stopped or overloaded?"
                )
            });
            let f = auth::read_frame(s, MAX_FRAME);
            let _ = s.set_read_timeout(Some(self.timeout));
            let f = f.map_err(|e| self.lost(r, CALL, e))?;
            let mut rd = &f[..];
            match take_u64(&mut rd) {
                Some(s) if s == seq => all.push(rd.to_vec()),
                Some(s) => {
                    return Err(self.proto(
                        r,
                        CALL,
                        &format!("rank {r} is at bootstrap exchange #{s}, rank 0 at #{seq}"),
                    ))
                }
                None => return Err(self.proto(r, CALL, "short message")),
            }
        }
        let total: usize = all.iter().map(|v| v.len() + 4).sum::<usize>() + 8;
        if total > MAX_FRAME {
            return Err(Error::InvalidArgument {
                rank: 0,
                call: CALL,
                seq,
                msg: format!("{total} bytes in all exceed the bootstrap limit of {MAX_FRAME}"),
            });
        }
        let mut out = Vec::with_capacity(total);
        out.extend_from_slice(&seq.to_le_bytes());
        for v in &all {
            out.extend_from_slice(&(v.len() as u32).to_le_bytes());
            out.extend_from_slice(v);
        }
        for (r, c) in conns.iter_mut().enumerate().skip(1) {
            if let Some(s) = c {
                auth::write_frame(s, &out).map_err(|e| self.lost(r, CALL, e))?;
            }
        }
        Ok(all)
    }

    /// A member's side of [`allgather_relay`](Self::allgather_relay).
    fn allgather_member(&self, s: &mut TcpStream, mine: &[u8], seq: u64) -> Result<Vec<Vec<u8>>> {
        let mut msg = Vec::with_capacity(mine.len() + 8);
        msg.extend_from_slice(&seq.to_le_bytes());
        msg.extend_from_slice(mine);
        if let Err(e) = auth::write_frame(s, &msg) {
            // Rank 0 may have closed after saying which rank it lost: read that first.
            let _ = s.set_read_timeout(Some(Duration::from_millis(200)));
            return Err(match auth::read_frame(s, MAX_FRAME) {
                Ok(f) if f.len() >= 8 && take_u64(&mut &f[..8]) == Some(SEQ_LOST) => {
                    self.lost_report(0, &f[8..], CALL)
                }
                _ => self.lost(0, CALL, e),
            });
        }
        let _ = s.set_read_timeout(Some(self.timeout + MEMBER_GRACE));
        self.announce_wait(s, self.timeout + MEMBER_GRACE, &|waited| {
            format!(
                "rank {}: bootstrap exchange #{seq}: waiting {waited:.0?} for rank 0's answer \
                 (rank 0 waits for every rank; its own progress line names the one it waits for)",
                self.rank
            )
        });
        let f = auth::read_frame(s, MAX_FRAME);
        let _ = s.set_read_timeout(Some(self.timeout));
        let f = f.map_err(|e| self.lost(0, CALL, e))?;
        let mut r = &f[..];
        match take_u64(&mut r) {
            Some(SEQ_LOST) => return Err(self.lost_report(0, r, CALL)),
            Some(got) if got == seq => {}
            _ => return Err(self.proto(0, CALL, "answer to another bootstrap exchange")),
        }
        let mut all = Vec::with_capacity(self.world_size);
        for _ in 0..self.world_size {
            let len = take_u32(&mut r).ok_or_else(|| self.proto(0, CALL, "short answer"))? as usize;
            all.push(
                take(&mut r, len)
                    .ok_or_else(|| self.proto(0, CALL, "short answer"))?
                    .to_vec(),
            );
        }
        if !r.is_empty() {
            return Err(self.proto(0, CALL, "trailing bytes in answer"));
        }
        Ok(all)
    }
}
