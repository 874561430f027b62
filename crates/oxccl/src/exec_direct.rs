//! Running the intra-host direct algorithms ([`crate::algo::oneshot`], [`crate::algo::cma`]):
//! publishing events and waiting for peers, with the executor's waiting discipline (spin,
//! then sleep on this rank's doorbell in slices, checking the deadline and that the awaited
//! peers are alive between slices).

use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::transport::direct::{Direct, ADDRS};
use crate::transport::LinkError;
use crate::wait::Backoff;

const SLEEP_SLICE: Duration = Duration::from_millis(50);

/// One call's view of the direct area.
pub struct DirectCtx<'a> {
    /// The direct area of this rank.
    pub direct: &'a mut dyn Direct,
    /// This rank.
    pub rank: usize,
    /// Number of ranks (all on this host).
    pub nranks: usize,
    /// Spin budget before sleeping.
    pub spin: u32,
    /// How long the call may take.
    pub timeout: Duration,
    /// The call's name, for errors.
    pub call: &'static str,
    /// The call's sequence number, for errors.
    pub seq: u64,
    /// When the call started.
    pub start: Instant,
}

impl DirectCtx<'_> {
    /// Publishes the next event (see [`Direct::publish`]).
    pub fn publish(&mut self, data: &[u8], addrs: [u64; ADDRS]) -> u64 {
        self.direct.publish(data, addrs)
    }

    fn lost(&self, peer: usize, e: LinkError) -> Error {
        let (rank, call, seq) = (self.rank, self.call, self.seq);
        match e {
            LinkError::Protocol(msg) => Error::Protocol {
                rank,
                peer,
                call,
                seq,
                msg,
            },
            LinkError::Closed(reason) => Error::PeerLost {
                rank,
                peer,
                call,
                seq,
                reason,
            },
            LinkError::Io(e) => Error::PeerLost {
                rank,
                peer,
                call,
                seq,
                reason: e.to_string(),
            },
        }
    }

    /// An error for a failed read of a peer's memory.
    pub fn read_error(&self, peer: usize, e: std::io::Error) -> Error {
        if self.direct.check_alive(peer).is_err() {
            return self.lost(peer, LinkError::Io(e));
        }
        Error::Io {
            rank: self.rank,
            context: format!(
                "{} (call #{}): reading rank {peer}'s buffer",
                self.call, self.seq
            ),
            source: e,
        }
    }

    /// Waits until every peer has published event `e`.
    pub fn wait_all(&mut self, e: u64) -> Result<()> {
        let n = self.nranks;
        let me = self.rank;
        let pending = |d: &dyn Direct| (0..n).find(|&p| p != me && !d.reached(p, e));
        let mut backoff = Backoff::new(self.spin);
        let mut last_check = Instant::now();
        loop {
            let Some(_) = pending(&*self.direct) else {
                return Ok(());
            };
            if !backoff.should_sleep() {
                continue;
            }
            let bell = self.direct.doorbell();
            let token = bell.prepare();
            if pending(&*self.direct).is_none() {
                bell.cancel(token);
                return Ok(());
            }
            bell.wait(token, SLEEP_SLICE);
            if last_check.elapsed() >= SLEEP_SLICE {
                last_check = Instant::now();
                let waiting: Vec<usize> = (0..n)
                    .filter(|&p| p != me && !self.direct.reached(p, e))
                    .collect();
                for &p in &waiting {
                    if let Err(err) = self.direct.check_alive(p) {
                        return Err(self.lost(p, err));
                    }
                }
                let elapsed = self.start.elapsed();
                if elapsed > self.timeout && !waiting.is_empty() {
                    return Err(Error::Timeout {
                        rank: me,
                        call: self.call,
                        seq: self.seq,
                        waiting_on: waiting,
                        elapsed,
                    });
                }
            }
        }
    }
}
