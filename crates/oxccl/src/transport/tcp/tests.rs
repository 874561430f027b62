//! Tests of the TCP transport over loopback, with threads as ranks.

use super::*;
use crate::bootstrap::local::LocalExchange;
use std::io::Write;
use std::net::Ipv4Addr;
use std::sync::mpsc;
use std::thread;

const SECRET: [u8; 16] = *b"tcp-test-secret!";
const LO: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);

fn cfg(timeout_ms: u64) -> Config {
    Config {
        timeout: Duration::from_millis(timeout_ms),
        ..Config::default()
    }
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// Byte `i` of the stream from rank `s` to rank `d`.
fn pattern(s: usize, d: usize, i: usize) -> u8 {
    ((i ^ (i >> 9) ^ (i >> 17)) as u8)
        .wrapping_mul(31)
        .wrapping_add((s * 16 + d) as u8)
}

fn all_peers(me: usize, n: usize) -> Vec<(usize, IpAddr)> {
    (0..n).filter(|&r| r != me).map(|r| (r, LO)).collect()
}

/// Streams `len` bytes to every peer and checks `len` bytes from each, all at once, with
/// random chunk sizes and random partial consumption.
fn stream_all(me: usize, links: &mut [(usize, Box<dyn Link>)], len: usize) {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ ((me as u64 + 1) * 0x1234_5678));
    let mut sent = vec![0usize; links.len()];
    let mut got = vec![0usize; links.len()];
    let mut chunk = vec![0u8; 300_000];
    let deadline = Instant::now() + Duration::from_secs(60);
    while sent.iter().chain(&got).any(|&x| x < len) {
        assert!(
            Instant::now() < deadline,
            "rank {me}: stuck at sent {sent:?} got {got:?}"
        );
        let mut progress = false;
        for (i, (peer, link)) in links.iter_mut().enumerate() {
            let peer = *peer;
            if sent[i] < len {
                let k = (1 + rng.below(chunk.len())).min(len - sent[i]);
                for (j, b) in chunk[..k].iter_mut().enumerate() {
                    *b = pattern(me, peer, sent[i] + j);
                }
                let n = link.try_send(&chunk[..k]).unwrap();
                assert!(n <= k);
                sent[i] += n;
                progress |= n > 0;
            }
            if got[i] < len {
                let mode = rng.next();
                let off = &mut got[i];
                let n = link
                    .try_recv(&mut |data: &[u8]| {
                        let take = match mode % 4 {
                            0 => 0,
                            1 => data.len(),
                            _ => (mode as usize >> 8) % (data.len() + 1),
                        };
                        for (j, &b) in data[..take].iter().enumerate() {
                            assert_eq!(
                                b,
                                pattern(peer, me, *off + j),
                                "rank {me} from {peer} at {}",
                                *off + j
                            );
                        }
                        *off += take;
                        take
                    })
                    .unwrap();
                progress |= n > 0;
            }
        }
        if !progress {
            let mut fds: Vec<rustix::event::PollFd> = links
                .iter()
                .map(|(_, l)| match l.recv_wait() {
                    WaitSource::Fd(fd) => rustix::event::PollFd::from_borrowed_fd(
                        fd,
                        rustix::event::PollFlags::IN | rustix::event::PollFlags::OUT,
                    ),
                    WaitSource::Doorbell(_) => panic!("TCP links wait on sockets"),
                })
                .collect();
            let ts = rustix::time::Timespec {
                tv_sec: 0,
                tv_nsec: 5_000_000,
            };
            let _ = rustix::event::poll(&mut fds, Some(&ts));
        }
    }
}

#[test]
fn four_ranks_stream_both_ways() {
    let len = 3 << 20;
    let hs: Vec<_> = LocalExchange::group(4)
        .into_iter()
        .map(|mut ex| {
            thread::spawn(move || {
                let me = ex.rank();
                let mut links = connect(&mut ex, &all_peers(me, 4), &SECRET, &cfg(20_000)).unwrap();
                assert_eq!(
                    links.iter().map(|(r, _)| *r).collect::<Vec<_>>(),
                    all_peers(me, 4).iter().map(|p| p.0).collect::<Vec<_>>()
                );
                assert!(links.iter().all(|(_, l)| l.kind() == TransportKind::Tcp));
                stream_all(me, &mut links, len);
                // Nothing may be left over.
                for (_, l) in &mut links {
                    assert_eq!(l.try_recv(&mut |d: &[u8]| d.len()).unwrap(), 0);
                }
                ex.barrier().unwrap();
            })
        })
        .collect();
    for h in hs {
        h.join().unwrap();
    }
}

#[test]
fn ranks_without_peers_still_take_part() {
    // Rank 2 has no TCP peers (say, all on shared memory) but must still call connect.
    let hs: Vec<_> = LocalExchange::group(3)
        .into_iter()
        .map(|mut ex| {
            thread::spawn(move || {
                let me = ex.rank();
                let peers: Vec<(usize, IpAddr)> = match me {
                    0 => vec![(1, LO)],
                    1 => vec![(0, LO)],
                    _ => vec![],
                };
                let links = connect(&mut ex, &peers, &SECRET, &cfg(20_000)).unwrap();
                assert_eq!(links.len(), peers.len());
            })
        })
        .collect();
    for h in hs {
        h.join().unwrap();
    }
}

#[test]
fn dropped_peer_gives_closed() {
    let hs: Vec<_> = LocalExchange::group(2)
        .into_iter()
        .map(|mut ex| {
            thread::spawn(move || {
                let me = ex.rank();
                let mut links = connect(&mut ex, &all_peers(me, 2), &SECRET, &cfg(20_000)).unwrap();
                let (_, mut link) = links.pop().unwrap();
                if me == 1 {
                    assert_eq!(link.try_send(b"bye").unwrap(), 3);
                    drop(link);
                    return;
                }
                // Rank 0: gets the last bytes, then Closed.
                let start = Instant::now();
                let mut got = Vec::new();
                loop {
                    assert!(start.elapsed() < Duration::from_secs(10));
                    match link.try_recv(&mut |d: &[u8]| {
                        got.extend_from_slice(d);
                        d.len()
                    }) {
                        Ok(_) => thread::sleep(Duration::from_millis(1)),
                        Err(LinkError::Closed(_)) => break,
                        Err(e) => panic!("{e}"),
                    }
                }
                assert_eq!(got, b"bye");
                // Sending eventually fails too, without killing the process.
                let mut failed = false;
                for _ in 0..1000 {
                    match link.try_send(&[0u8; 65536]) {
                        Ok(_) => thread::sleep(Duration::from_millis(1)),
                        Err(LinkError::Closed(_)) => {
                            failed = true;
                            break;
                        }
                        Err(e) => panic!("{e}"),
                    }
                }
                assert!(failed);
            })
        })
        .collect();
    for h in hs {
        h.join().unwrap();
    }
}

/// Forwards to a [`LocalExchange`], publishes every result, and lets rank 1 pause after it
/// (so strangers reach rank 0's port before the real peer).
struct Spy {
    inner: LocalExchange,
    tx: mpsc::Sender<Vec<Vec<u8>>>,
    pause: Duration,
}

impl Exchange for Spy {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn allgather(&mut self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        let all = self.inner.allgather(mine)?;
        let _ = self.tx.send(all.clone());
        thread::sleep(self.pause);
        Ok(all)
    }
}

#[test]
fn strangers_are_refused_and_real_links_form() {
    let (tx, rx) = mpsc::channel();
    let hs: Vec<_> = LocalExchange::group(3)
        .into_iter()
        .map(|inner| {
            let pause = Duration::from_millis(if inner.rank() == 0 { 0 } else { 400 });
            let mut ex = Spy {
                inner,
                tx: tx.clone(),
                pause,
            };
            thread::spawn(move || {
                let me = ex.rank();
                let mut links = connect(&mut ex, &all_peers(me, 3), &SECRET, &cfg(20_000)).unwrap();
                stream_all(me, &mut links, 100_000);
            })
        })
        .collect();
    let all = rx.recv().unwrap();
    let (addr, _) = decode_blob(&all[0]).unwrap();
    let addr = addr.unwrap();
    // Silent stranger: holds a connection and says nothing.
    let silent = TcpStream::connect(addr).unwrap();
    // Garbage.
    let mut g = TcpStream::connect(addr).unwrap();
    let _ = g.write_all(&[0x55; 4096]);
    // Wrong secret.
    let s = TcpStream::connect(addr).unwrap();
    let h = Hello {
        rank: 2,
        purpose: Purpose::Data,
        tag: auth::comm_tag(&SECRET),
    };
    let r = auth::client_handshake(
        &mut Deadlined::new(&s, Instant::now() + Duration::from_secs(5)),
        &[0; 16],
        &h,
        2,
        "rank 0",
    );
    assert!(matches!(r, Err(Error::Auth { .. })), "{r:?}");
    // Right secret, but for the rendezvous, not data.
    let s = TcpStream::connect(addr).unwrap();
    let h = Hello {
        rank: 2,
        purpose: Purpose::Rendezvous,
        tag: auth::comm_tag(&SECRET),
    };
    let r = auth::client_handshake(
        &mut Deadlined::new(&s, Instant::now() + Duration::from_secs(5)),
        &SECRET,
        &h,
        2,
        "rank 0",
    );
    assert!(matches!(r, Err(Error::Auth { .. })), "{r:?}");
    for h in hs {
        h.join().unwrap();
    }
    drop(silent);
}

#[test]
fn unreachable_peer_fails_with_connect_error() {
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let dead = SocketAddr::new(LO, port);
    let mut group = LocalExchange::group(2);
    let mut ex1 = group.pop().unwrap();
    let mut ex0 = group.pop().unwrap();
    // Rank 0 advertises a port nobody listens on.
    let fake = thread::spawn(move || ex0.allgather(&encode_blob(Some(dead), &[1])).unwrap());
    let start = Instant::now();
    let e = match connect(&mut ex1, &[(0, LO)], &SECRET, &cfg(500)) {
        Err(e) => e,
        Ok(_) => panic!("connected to nobody"),
    };
    fake.join().unwrap();
    assert!(start.elapsed() >= Duration::from_millis(450));
    match &e {
        Error::Connect {
            rank: 1,
            peer: 0,
            addr,
            ..
        } => assert_eq!(addr, &dead.to_string()),
        e => panic!("{e}"),
    }
}

#[test]
fn peer_that_never_connects_times_out() {
    let mut group = LocalExchange::group(2);
    let mut ex1 = group.pop().unwrap();
    let mut ex0 = group.pop().unwrap();
    // Rank 1 takes part in the exchange but never connects.
    let fake = thread::spawn(move || ex1.allgather(&encode_blob(None, &[0])).unwrap());
    let e = match connect(&mut ex0, &[(1, LO)], &SECRET, &cfg(300)) {
        Err(e) => e,
        Ok(_) => panic!("no peer connected"),
    };
    fake.join().unwrap();
    match e {
        Error::Timeout {
            rank: 0,
            waiting_on,
            ..
        } => assert_eq!(waiting_on, vec![1]),
        e => panic!("{e}"),
    }
}

#[test]
fn bad_arguments_and_asymmetric_peers() {
    let mut ex = LocalExchange::group(1).pop().unwrap();
    assert!(matches!(
        connect(&mut ex, &[(0, LO)], &SECRET, &cfg(100)),
        Err(Error::InvalidArgument { .. })
    ));
    let mut g = LocalExchange::group(2);
    let mut ex1 = g.pop().unwrap();
    let mut ex0 = g.pop().unwrap();
    assert!(matches!(
        connect(&mut ex0, &[(1, LO), (1, LO)], &SECRET, &cfg(100)),
        Err(Error::InvalidArgument { .. })
    ));
    // Rank 0 wants rank 1, rank 1 wants nobody.
    let t = thread::spawn(move || {
        connect(&mut ex1, &[], &SECRET, &cfg(1000))
            .map(|l| l.len())
            .unwrap_err()
    });
    match connect(&mut ex0, &[(1, LO)], &SECRET, &cfg(1000)) {
        Err(Error::Protocol {
            rank: 0, peer: 1, ..
        }) => {}
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("connected"),
    }
    assert!(matches!(
        t.join().unwrap(),
        Error::Protocol {
            rank: 1,
            peer: 0,
            ..
        }
    ));
}

#[test]
fn blob_round_trip() {
    let a: SocketAddr = "[::1]:5000".parse().unwrap();
    let b = encode_blob(Some(a), &[1, 5]);
    assert_eq!(decode_blob(&b), Some((Some(a), vec![1, 5])));
    for cut in 0..b.len() {
        assert_eq!(decode_blob(&b[..cut]), None);
    }
}

#[test]
fn bootstrap_then_tcp_links() {
    use crate::bootstrap::{Bootstrap, UniqueId};
    let id = UniqueId::new_on(LO).unwrap();
    let hs: Vec<_> = (0..3)
        .map(|r| {
            let id = id.clone();
            thread::spawn(move || {
                let c = cfg(20_000);
                let mut boot = Bootstrap::init(&id, r, 3, &c).unwrap();
                let peers: Vec<(usize, IpAddr)> = boot
                    .peers()
                    .iter()
                    .filter(|p| p.rank != r)
                    .map(|p| (p.rank, p.ip))
                    .collect();
                let secret = *boot.secret();
                let mut links = connect(&mut boot, &peers, &secret, &c).unwrap();
                stream_all(r, &mut links, 200_000);
                boot.barrier().unwrap();
            })
        })
        .collect();
    for h in hs {
        h.join().unwrap();
    }
}

/// A connected pair over loopback: (this rank's link to rank 1, rank 1's raw socket).
fn raw_pair() -> (TcpLink, TcpStream) {
    let l = TcpListener::bind((LO, 0)).unwrap();
    let peer = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (mine, _) = l.accept().unwrap();
    let link = TcpLink::new(mine, 1)
        .unwrap()
        .with_dead_after(Duration::from_secs(5))
        .unwrap();
    (link, peer)
}

/// A peer that sends its last bytes and closes its socket with bytes of this rank's unread
/// resets the connection: its bytes are still taken, in small bites, before the link ends,
/// whether the waiting rank checks the link's liveness first or reads first.
#[test]
fn bytes_sent_before_a_reset_are_taken_before_the_link_ends() {
    for check_first in [true, false] {
        let (mut link, peer) = raw_pair();
        assert_eq!(link.try_send(b"never read").unwrap(), 10);
        let last: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        (&peer).write_all(&last).unwrap();
        thread::sleep(Duration::from_millis(100));
        drop(peer); // with bytes unread: a reset
        thread::sleep(Duration::from_millis(50));
        if check_first {
            link.check_alive()
                .expect("the peer's bytes are still to read");
        }
        let mut got = Vec::new();
        let start = Instant::now();
        let end = loop {
            assert!(start.elapsed() < Duration::from_secs(10));
            match link.try_recv(&mut |d: &[u8]| {
                let k = d.len().min(4096);
                got.extend_from_slice(&d[..k]);
                k
            }) {
                Ok(_) => {}
                Err(e) => break e,
            }
        };
        assert!(matches!(end, LinkError::Closed(_)), "{end}");
        assert_eq!(got.len(), last.len(), "check first: {check_first}");
        assert!(got == last);
    }
}

/// A link dropped with bytes of its peer unread closes with a FIN, not a reset: the peer
/// gets everything the link sent last, then the end of the stream (a reset would have
/// dropped what had not left the send buffer yet, and failed the peer's reads).
#[test]
fn a_link_dropped_with_unread_bytes_ends_its_stream_cleanly() {
    let (mut link, mut peer) = raw_pair();
    peer.write_all(b"bytes the link never reads").unwrap();
    thread::sleep(Duration::from_millis(50));
    let last = vec![7u8; 64 << 10];
    let mut sent = 0;
    while sent < last.len() {
        sent += link.try_send(&last[sent..]).unwrap();
    }
    drop(link);
    peer.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut got = Vec::new();
    let res = peer.read_to_end(&mut got);
    assert!(res.is_ok(), "{res:?} after {} bytes", got.len());
    assert!(got == last, "{} bytes", got.len());
}
