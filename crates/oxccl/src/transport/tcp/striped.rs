//! A [`Link`] over several TCP connections to one peer (`OXCCL_TCP_STREAMS`): the byte
//! stream is cut into stripes of [`STRIPE`] bytes dealt round-robin over the connections, so
//! stripe `i` travels on connection `i mod k`. Both ends count bytes, so the receiver knows
//! which connection holds the next stripe and the stream stays ordered; each connection has
//! its own congestion window and kernel buffers, which helps where one TCP flow cannot fill
//! a link (per-flow rate limits, one flow's softirq pinned to one core, long fat pipes).

use crate::transport::tcp::TcpLink;
use crate::transport::{Link, LinkError, TransportKind, WaitSource};

/// Bytes per stripe.
pub(crate) const STRIPE: usize = 256 << 10;

/// One link striped over `k` TCP connections.
#[derive(Debug)]
pub(crate) struct StripedLink {
    links: Vec<TcpLink>,
    sent: u64,
    recvd: u64,
}

impl StripedLink {
    /// Stripes over `links` (all to one peer, opened in the same order on both ends).
    pub(crate) fn new(links: Vec<TcpLink>) -> StripedLink {
        assert!(!links.is_empty());
        StripedLink {
            links,
            sent: 0,
            recvd: 0,
        }
    }

    fn at(&self, offset: u64) -> (usize, usize) {
        let k = self.links.len() as u64;
        let s = STRIPE as u64;
        (((offset / s) % k) as usize, (s - offset % s) as usize)
    }
}

impl Link for StripedLink {
    fn kind(&self) -> TransportKind {
        TransportKind::Tcp
    }

    fn try_send(&mut self, data: &[u8]) -> Result<usize, LinkError> {
        let mut total = 0;
        while total < data.len() {
            let (i, room) = self.at(self.sent);
            let want = room.min(data.len() - total);
            let n = self.links[i].try_send(&data[total..total + want])?;
            total += n;
            self.sent += n as u64;
            if n < want {
                break;
            }
        }
        Ok(total)
    }

    fn try_recv(&mut self, consume: &mut dyn FnMut(&[u8]) -> usize) -> Result<usize, LinkError> {
        let mut total = 0;
        loop {
            let (i, room) = self.at(self.recvd);
            let mut left = room;
            let n = self.links[i].try_recv(&mut |d: &[u8]| {
                let d = &d[..d.len().min(left)];
                if d.is_empty() {
                    return 0;
                }
                let t = consume(d).min(d.len());
                left -= t;
                t
            })?;
            total += n;
            self.recvd += n as u64;
            if n < room {
                return Ok(total);
            }
        }
    }

    fn try_recv_into(&mut self, dst: &mut [u8]) -> Result<usize, LinkError> {
        let mut total = 0;
        while total < dst.len() {
            let (i, room) = self.at(self.recvd);
            let want = room.min(dst.len() - total);
            let n = self.links[i].try_recv_into(&mut dst[total..total + want])?;
            total += n;
            self.recvd += n as u64;
            if n < want {
                break;
            }
        }
        Ok(total)
    }

    fn send_wait(&self) -> WaitSource<'_> {
        self.links[self.at(self.sent).0].send_wait()
    }

    fn recv_wait(&self) -> WaitSource<'_> {
        self.links[self.at(self.recvd).0].recv_wait()
    }

    fn check_alive(&mut self) -> Result<(), LinkError> {
        self.links.iter_mut().try_for_each(|l| l.check_alive())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{TcpListener, TcpStream};

    fn pair(k: usize) -> (StripedLink, StripedLink) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let (mut a, mut b) = (Vec::new(), Vec::new());
        for _ in 0..k {
            let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
            let (s, _) = l.accept().unwrap();
            a.push(TcpLink::new(c, 1).unwrap());
            b.push(TcpLink::new(s, 0).unwrap());
        }
        (StripedLink::new(a), StripedLink::new(b))
    }

    /// A peer that is alive but not reading (zero window) is not declared dead, however
    /// long it waits; `TCP_USER_TIMEOUT` would kill this connection.
    #[test]
    fn busy_peer_is_not_dead() {
        let (mut a, _b) = pair(1);
        let mut a = a.links.pop().unwrap();
        a.dead_after_for_test(std::time::Duration::from_millis(300));
        let chunk = vec![7u8; 1 << 16];
        let mut sent = 0;
        for _ in 0..10_000 {
            let k = a.try_send(&chunk).unwrap();
            if k == 0 {
                break;
            }
            sent += k;
        }
        assert!(sent > 0);
        for _ in 0..10 {
            std::thread::sleep(std::time::Duration::from_millis(100));
            a.check_alive()
                .expect("a live peer with a full window is not lost");
        }
    }

    #[test]
    fn stream_stays_ordered_across_stripes() {
        for k in [1, 2, 3] {
            let (mut a, mut b) = pair(k);
            let data: Vec<u8> = (0..3 * STRIPE + 12345)
                .map(|i| (i * 31 % 251) as u8)
                .collect();
            let mut got = vec![0u8; data.len()];
            let (mut sent, mut recvd, mut flip) = (0, 0, false);
            while recvd < data.len() {
                sent += a.try_send(&data[sent..]).unwrap();
                // Alternate the two receive paths, and take odd amounts.
                flip = !flip;
                recvd += if flip {
                    let end = (recvd + 70_001).min(data.len());
                    b.try_recv_into(&mut got[recvd..end]).unwrap()
                } else {
                    let mut off = recvd;
                    b.try_recv(&mut |d| {
                        let t = d.len().min(50_003).min(data.len() - off);
                        got[off..off + t].copy_from_slice(&d[..t]);
                        off += t;
                        t
                    })
                    .unwrap()
                };
            }
            assert_eq!(got, data, "k={k}");
        }
    }
}
