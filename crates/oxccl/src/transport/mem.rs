//! In-process transport: bounded byte queues between threads of one process.
//!
//! For tests: it runs algorithms and the executor over real flow control (a small capacity
//! forces every stream to wait for its consumer) without processes or sockets. Waiting uses
//! the same [`Doorbell`] protocol as shared memory.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};

use super::{Link, LinkError, TransportKind, WaitSource};
use crate::base::wait::Doorbell;

#[derive(Default)]
struct PipeState {
    bytes: VecDeque<u8>,
    sender_gone: bool,
    receiver_gone: bool,
}

struct Pipe {
    cap: usize,
    state: Mutex<PipeState>,
}

impl Pipe {
    fn lock(&self) -> MutexGuard<'_, PipeState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// One end of an in-process link.
pub struct MemLink {
    out: Arc<Pipe>,
    inbox: Arc<Pipe>,
    my_bell: Arc<Doorbell>,
    peer_bell: Arc<Doorbell>,
}

impl Link for MemLink {
    fn kind(&self) -> TransportKind {
        TransportKind::Mem
    }

    fn try_send(&mut self, data: &[u8]) -> Result<usize, LinkError> {
        let k = {
            let mut st = self.out.lock();
            if st.receiver_gone {
                return Err(LinkError::Closed("receiver dropped its link".into()));
            }
            let k = (self.out.cap - st.bytes.len()).min(data.len());
            st.bytes.extend(&data[..k]);
            k
        };
        if k > 0 {
            self.peer_bell.ring();
        }
        Ok(k)
    }

    fn try_recv(&mut self, consume: &mut dyn FnMut(&[u8]) -> usize) -> Result<usize, LinkError> {
        let taken = {
            let mut st = self.inbox.lock();
            let (a, b) = st.bytes.as_slices();
            let mut taken = 0;
            if !a.is_empty() {
                taken = consume(a).min(a.len());
                if taken == a.len() && !b.is_empty() {
                    taken += consume(b).min(b.len());
                }
            }
            st.bytes.drain(..taken);
            if taken == 0 && st.bytes.is_empty() && st.sender_gone {
                return Err(LinkError::Closed("sender dropped its link".into()));
            }
            taken
        };
        if taken > 0 {
            self.peer_bell.ring();
        }
        Ok(taken)
    }

    fn send_wait(&self) -> WaitSource<'_> {
        WaitSource::Doorbell(&self.my_bell)
    }

    fn recv_wait(&self) -> WaitSource<'_> {
        WaitSource::Doorbell(&self.my_bell)
    }
}

impl Drop for MemLink {
    fn drop(&mut self) {
        self.out.lock().sender_gone = true;
        self.inbox.lock().receiver_gone = true;
        self.peer_bell.ring();
    }
}

/// Links for `n` ranks, fully connected, each direction holding at most `cap` bytes:
/// `group(n, cap)[r]` is rank r's list of `(peer, link)`.
pub fn group(n: usize, cap: usize) -> Vec<Vec<(usize, Box<dyn Link>)>> {
    let bells: Vec<Arc<Doorbell>> = (0..n).map(|_| Arc::new(Doorbell::new())).collect();
    let pipes: Vec<Vec<Arc<Pipe>>> = (0..n)
        .map(|_| {
            (0..n)
                .map(|_| {
                    Arc::new(Pipe {
                        cap: cap.max(1),
                        state: Mutex::default(),
                    })
                })
                .collect()
        })
        .collect();
    (0..n)
        .map(|r| {
            (0..n)
                .filter(|&p| p != r)
                .map(|p| {
                    let link: Box<dyn Link> = Box::new(MemLink {
                        out: pipes[r][p].clone(),
                        inbox: pipes[p][r].clone(),
                        my_bell: bells[r].clone(),
                        peer_bell: bells[p].clone(),
                    });
                    (p, link)
                })
                .collect()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounded_and_ordered() {
        let mut g = group(2, 5);
        let (_, mut b) = g[1].pop().unwrap();
        let (_, mut a) = g[0].pop().unwrap();
        assert_eq!(a.try_send(b"hello world").unwrap(), 5);
        assert_eq!(a.try_send(b" world").unwrap(), 0);
        let mut got = Vec::new();
        b.try_recv(&mut |d| {
            got.extend_from_slice(&d[..2]);
            2
        })
        .unwrap();
        assert_eq!(got, b"he");
        assert_eq!(a.try_send(b" world").unwrap(), 2);
        b.try_recv(&mut |d| {
            got.extend_from_slice(d);
            d.len()
        })
        .unwrap();
        assert_eq!(got, b"hello w");
        drop(a);
        assert!(matches!(
            b.try_recv(&mut |d| d.len()),
            Err(LinkError::Closed(_))
        ));
        assert!(matches!(b.try_send(b"x"), Err(LinkError::Closed(_))));
    }
}
