//! An in-process [`Exchange`] between threads, for tests of transports and algorithms.

use std::sync::{Arc, Condvar, Mutex};

use super::Exchange;
use crate::base::error::Result;

struct Shared {
    n: usize,
    state: Mutex<Round>,
    cv: Condvar,
}

#[derive(Default)]
struct Round {
    generation: u64,
    slots: Vec<Option<Vec<u8>>>,
    arrived: usize,
    result: Arc<Vec<Vec<u8>>>,
}

/// One rank's handle on an in-process exchange; make a group with [`LocalExchange::group`].
pub struct LocalExchange {
    rank: usize,
    shared: Arc<Shared>,
}

impl LocalExchange {
    /// `n` handles, one per rank, to move into `n` threads.
    pub fn group(n: usize) -> Vec<LocalExchange> {
        let shared = Arc::new(Shared {
            n,
            state: Mutex::new(Round {
                slots: vec![None; n],
                ..Default::default()
            }),
            cv: Condvar::new(),
        });
        (0..n)
            .map(|rank| LocalExchange {
                rank,
                shared: shared.clone(),
            })
            .collect()
    }
}

impl Exchange for LocalExchange {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.shared.n
    }

    fn allgather(&mut self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        let sh = &*self.shared;
        let mut st = sh.state.lock().unwrap_or_else(|e| e.into_inner());
        let generation = st.generation;
        st.slots[self.rank] = Some(mine.to_vec());
        st.arrived += 1;
        if st.arrived == sh.n {
            let all: Vec<Vec<u8>> = st
                .slots
                .iter_mut()
                .map(|s| s.take().unwrap_or_default())
                .collect();
            st.result = Arc::new(all);
            st.arrived = 0;
            st.generation += 1;
            sh.cv.notify_all();
        } else {
            while st.generation == generation {
                st = sh.cv.wait(st).unwrap_or_else(|e| e.into_inner());
            }
        }
        Ok((*st.result).clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allgather_in_threads() {
        let handles: Vec<_> = LocalExchange::group(4)
            .into_iter()
            .map(|mut ex| {
                std::thread::spawn(move || {
                    for round in 0..50u8 {
                        let all = ex.allgather(&[ex.rank() as u8, round]).unwrap();
                        for (r, v) in all.iter().enumerate() {
                            assert_eq!(v, &vec![r as u8, round]);
                        }
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
    }
}
