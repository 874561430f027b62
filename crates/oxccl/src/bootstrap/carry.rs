//! Exchanges that ride in another setup's: [`Carrier`] wraps an [`Exchange`] and adds a
//! [`Rider`]'s message to each of the rounds it is handed, so that two setups of two rounds
//! each cost two round trips through rank 0, not four (`comm/init.rs`: the direct area and
//! the supervisor's ports ride in the shared-memory transport's exchanges).

use super::Exchange;
use crate::base::error::{Error, Result};

/// What rides in a [`Carrier`]'s rounds.
pub(crate) trait Rider: Send {
    /// This rank's message for round `round` (from 0); empty when it has nothing to send.
    fn message(&mut self, round: usize) -> Vec<u8>;
    /// Every rank's message of round `round`, by rank.
    fn arrived(&mut self, round: usize, all: Vec<Vec<u8>>);
    /// Whether it needs more rounds.
    fn wants_more(&self, round: usize) -> bool;
}

/// An [`Exchange`] whose every round also carries a [`Rider`]'s messages. Each message goes
/// as the carried message's length (`u32`), the carried message, then the rider's.
pub(crate) struct Carrier<'a> {
    inner: &'a mut dyn Exchange,
    rider: &'a mut dyn Rider,
    round: usize,
}

impl<'a> Carrier<'a> {
    /// Carries `rider` in the exchanges made through it over `inner`.
    pub(crate) fn new(inner: &'a mut dyn Exchange, rider: &'a mut dyn Rider) -> Carrier<'a> {
        Carrier {
            inner,
            rider,
            round: 0,
        }
    }

    /// Runs the rounds the rider still wants on their own (collective: every rank's carried
    /// setup made the same number of rounds).
    pub(crate) fn finish(mut self) -> Result<()> {
        while self.rider.wants_more(self.round) {
            self.allgather(&[])?;
        }
        Ok(())
    }
}

impl Exchange for Carrier<'_> {
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn world_size(&self) -> usize {
        self.inner.world_size()
    }

    fn allgather(&mut self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        let round = self.round;
        self.round += 1;
        let extra = if self.rider.wants_more(round) {
            self.rider.message(round)
        } else {
            Vec::new()
        };
        let mut msg = Vec::with_capacity(4 + mine.len() + extra.len());
        msg.extend_from_slice(&(mine.len() as u32).to_le_bytes());
        msg.extend_from_slice(mine);
        msg.extend_from_slice(&extra);
        let all = self.inner.allgather(&msg)?;
        let rank = self.rank();
        let mut carried = Vec::with_capacity(all.len());
        let mut rides = Vec::with_capacity(all.len());
        for (r, mut m) in all.into_iter().enumerate() {
            let len = m
                .get(..4)
                .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize)
                .filter(|&len| 4 + len <= m.len())
                .ok_or_else(|| Error::Protocol {
                    rank,
                    peer: r,
                    call: "init",
                    seq: 0,
                    msg: format!("malformed message in setup exchange #{}", round + 1),
                })?;
            let ride = m.split_off(4 + len);
            m.drain(..4);
            carried.push(m);
            rides.push(ride);
        }
        if self.rider.wants_more(round) {
            self.rider.arrived(round, rides);
        }
        Ok(carried)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bootstrap::local::LocalExchange;

    /// Records what it sends and gets; wants `rounds` rounds.
    struct Echo {
        rank: usize,
        rounds: usize,
        got: Vec<Vec<Vec<u8>>>,
    }

    impl Rider for Echo {
        fn message(&mut self, round: usize) -> Vec<u8> {
            vec![self.rank as u8 * 10 + round as u8; round + self.rank]
        }
        fn arrived(&mut self, _round: usize, all: Vec<Vec<u8>>) {
            self.got.push(all);
        }
        fn wants_more(&self, round: usize) -> bool {
            round < self.rounds
        }
    }

    /// The carried exchange sees its own messages only; the rider gets every rank's of each
    /// round, in the carried rounds and then in rounds of its own.
    #[test]
    fn a_rider_gets_its_rounds_in_and_after_the_carried_ones() {
        let ts: Vec<_> = LocalExchange::group(3)
            .into_iter()
            .map(|mut ex| {
                std::thread::spawn(move || {
                    let rank = ex.rank();
                    let mut echo = Echo {
                        rank,
                        rounds: 3,
                        got: Vec::new(),
                    };
                    let mut c = Carrier::new(&mut ex, &mut echo);
                    for round in 0..2u8 {
                        let all = c.allgather(&[rank as u8, round]).unwrap();
                        assert_eq!(all, (0..3u8).map(|r| vec![r, round]).collect::<Vec<_>>());
                    }
                    c.finish().unwrap();
                    let more = ex.allgather(b"x").unwrap();
                    assert_eq!(more, vec![b"x".to_vec(); 3]);
                    echo.got
                })
            })
            .collect();
        for t in ts {
            let got = t.join().unwrap();
            assert_eq!(got.len(), 3);
            for (round, all) in got.iter().enumerate() {
                for (r, m) in all.iter().enumerate() {
                    assert_eq!(m, &vec![r as u8 * 10 + round as u8; round + r]);
                }
            }
        }
    }
}
