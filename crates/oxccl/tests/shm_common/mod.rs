//! Code shared by the shared-memory integration tests: verifiable byte streams and a
//! spin-then-sleep driver that follows the doorbell protocol of `oxccl::testing::wait`.

#![allow(dead_code)]

use std::path::Path;
use std::time::{Duration, Instant};

use oxccl::testing::transport::{Link, LinkError, WaitSource};
use oxccl::testing::wait::{Backoff, Doorbell};

/// A random tag for one test's communicator.
pub fn random_tag() -> u64 {
    let mut b = [0u8; 8];
    getrandom::fill(&mut b).unwrap();
    u64::from_le_bytes(b)
}

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The seed of the stream from `src` to `dst`.
pub fn pair_seed(tag: u64, src: usize, dst: usize) -> u64 {
    splitmix(tag ^ ((src as u64) << 32) ^ dst as u64)
}

/// Byte `pos` of the stream `seed`: position-addressable, so sender and receiver agree
/// without sharing state.
#[inline]
pub fn stream_byte(seed: u64, pos: u64) -> u8 {
    (splitmix(seed ^ (pos >> 3)) >> ((pos & 7) * 8)) as u8
}

/// Fills `buf` with stream bytes `[pos, pos + buf.len())`.
pub fn fill(seed: u64, pos: u64, buf: &mut [u8]) {
    for (i, b) in buf.iter_mut().enumerate() {
        *b = stream_byte(seed, pos + i as u64);
    }
}

/// A small xorshift generator for sizes.
pub struct Rng(pub u64);
impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    /// Uniform in `1..=max`.
    pub fn size(&mut self, max: u64) -> u64 {
        self.next() % max.max(1) + 1
    }
}

/// How a rank streams to and from its peers.
pub struct Plan {
    /// Bytes each ordered pair sends.
    pub bytes: u64,
    /// Largest single `try_send` offer.
    pub max_send: u64,
    /// Largest prefix a `consume` call takes.
    pub max_take: u64,
    /// Sleep slice of the doorbell wait.
    pub slice: Duration,
    /// The whole run must finish before this.
    pub deadline: Duration,
    /// The communicator tag (stream seeds).
    pub tag: u64,
}

/// What a rank saw.
#[derive(Debug, Default)]
pub struct Stats {
    pub sleeps: u64,
    pub sleep_timeouts: u64,
}

struct Pair {
    peer: usize,
    sent: u64,
    recvd: u64,
    send_seed: u64,
    recv_seed: u64,
}

/// One progress round over every link: a random-sized send and a random-prefix receive on
/// each unfinished pair. Returns whether anything moved.
fn round(
    links: &mut [(usize, Box<dyn Link>)],
    pairs: &mut [Pair],
    plan: &Plan,
    rng: &mut Rng,
    buf: &mut [u8],
) -> Result<bool, String> {
    let mut progress = false;
    for ((_, link), p) in links.iter_mut().zip(pairs.iter_mut()) {
        if p.sent < plan.bytes {
            let n = rng.size(plan.max_send).min(plan.bytes - p.sent) as usize;
            fill(p.send_seed, p.sent, &mut buf[..n]);
            let k = link
                .try_send(&buf[..n])
                .map_err(|e| format!("send to {}: {e}", p.peer))?;
            if k > n {
                return Err(format!("try_send returned {k} > {n}"));
            }
            p.sent += k as u64;
            progress |= k > 0;
        }
        if p.recvd < plan.bytes {
            let mut budget = rng.size(plan.max_take);
            let mut bad = None;
            let (seed, peer) = (p.recv_seed, p.peer);
            let mut pos = p.recvd;
            let k = link
                .try_recv(&mut |b: &[u8]| {
                    let take = (b.len() as u64).min(budget) as usize;
                    for (i, &x) in b[..take].iter().enumerate() {
                        if x != stream_byte(seed, pos + i as u64) && bad.is_none() {
                            bad = Some(pos + i as u64);
                        }
                    }
                    budget -= take as u64;
                    pos += take as u64;
                    take
                })
                .map_err(|e| format!("recv from {peer}: {e}"))?;
            if let Some(at) = bad {
                return Err(format!("byte {at} from rank {peer} is wrong"));
            }
            if pos != p.recvd + k as u64 {
                return Err(format!(
                    "try_recv returned {k}, consume took {}",
                    pos - p.recvd
                ));
            }
            if p.recvd + k as u64 > plan.bytes {
                return Err(format!("received more than sent from rank {peer}"));
            }
            p.recvd = pos;
            progress |= k > 0;
        }
    }
    Ok(progress)
}

/// Streams `plan.bytes` to and from every peer of `links`, verifying every byte; waits the
/// documented way (spin with [`Backoff`], then prepare → re-check → wait with a time slice)
/// on the links' doorbell. Fails when `plan.deadline` passes (a lost wake-up shows up so).
pub fn run_rank(
    rank: usize,
    mut links: Vec<(usize, Box<dyn Link>)>,
    plan: &Plan,
    spin: u32,
) -> Result<Stats, String> {
    let start = Instant::now();
    let mut pairs: Vec<Pair> = links
        .iter()
        .map(|(p, _)| Pair {
            peer: *p,
            sent: 0,
            recvd: 0,
            send_seed: pair_seed(plan.tag, rank, *p),
            recv_seed: pair_seed(plan.tag, *p, rank),
        })
        .collect();
    let mut rng = Rng(pair_seed(plan.tag, rank, 1000) | 1);
    let mut buf = vec![0u8; plan.max_send as usize];
    let mut backoff = Backoff::new(oxccl::testing::wait::Spin::new(spin));
    let mut stats = Stats::default();
    loop {
        if pairs
            .iter()
            .all(|p| p.sent == plan.bytes && p.recvd == plan.bytes)
        {
            return Ok(stats);
        }
        if round(&mut links, &mut pairs, plan, &mut rng, &mut buf)? {
            backoff.reset();
            continue;
        }
        if !backoff.should_sleep() {
            continue;
        }
        // Every link of a rank must sleep on the same (own) doorbell.
        let addr = bell(&*links[0].1)? as *const Doorbell;
        for (_, l) in &links {
            for w in [l.send_wait(), l.recv_wait()] {
                match w {
                    WaitSource::Doorbell(b) if std::ptr::eq(b, addr) => {}
                    _ => return Err("links of one rank use different wait sources".into()),
                }
            }
        }
        // prepare → re-check → wait. The doorbell is borrowed from the link anew for each
        // step (it lives at a fixed address), since the re-check needs the link mutably.
        let tok = bell(&*links[0].1)?.prepare();
        let progressed = round(&mut links, &mut pairs, plan, &mut rng, &mut buf);
        match progressed {
            Ok(true) => {
                bell(&*links[0].1)?.cancel(tok);
                backoff.reset();
                continue;
            }
            Ok(false) => {}
            Err(e) => {
                bell(&*links[0].1)?.cancel(tok);
                return Err(e);
            }
        }
        let t0 = Instant::now();
        bell(&*links[0].1)?.wait(tok, plan.slice);
        stats.sleeps += 1;
        if t0.elapsed() >= plan.slice {
            stats.sleep_timeouts += 1;
        }
        for ((_, l), p) in links.iter_mut().zip(&pairs) {
            if p.sent < plan.bytes || p.recvd < plan.bytes {
                l.check_alive()
                    .map_err(|e| format!("rank {rank}: link to {}: {e}", p.peer))?;
            }
        }
        if start.elapsed() > plan.deadline {
            let left: Vec<_> = pairs.iter().map(|p| (p.peer, p.sent, p.recvd)).collect();
            return Err(format!(
                "rank {rank}: deadline {:?} exceeded (lost wake-up?), (peer, sent, received) = {left:?} of {}",
                plan.deadline, plan.bytes
            ));
        }
        backoff.reset();
    }
}

/// The doorbell a shm link sleeps on.
pub fn bell(link: &dyn Link) -> Result<&Doorbell, String> {
    match link.recv_wait() {
        WaitSource::Doorbell(b) => Ok(b),
        WaitSource::Fd(_) => Err("shm link without a doorbell".into()),
    }
}

/// Segment files of communicator `tag` still in /dev/shm.
pub fn leftover_segments(tag: u64) -> Vec<String> {
    let prefix = format!("oxccl-{tag:016x}-");
    std::fs::read_dir(Path::new("/dev/shm"))
        .map(|d| {
            d.filter_map(|e| e.ok())
                .filter_map(|e| e.file_name().into_string().ok())
                .filter(|n| n.starts_with(&prefix))
                .collect()
        })
        .unwrap_or_default()
}

/// Is `e` a Closed link error?
pub fn is_closed(e: &LinkError) -> bool {
    matches!(e, LinkError::Closed(_))
}
