//! Shared-memory transport between ranks of one host.
//!
//! Each rank creates one segment that it owns, holding a header, the rank's [`Doorbell`](crate::base::wait::Doorbell) and one incoming
//! single-producer/single-consumer byte ring per shared-memory peer (the owner reads, the
//! peer writes). [`connect`] creates it, hands it to the peers and maps every peer's: by
//! default the segment is a memfd whose descriptor peers copy (`pidfd_getfd`), so no file
//! exists at all; where they cannot, a named file in `/dev/shm` (mode 0600) that its owner
//! unlinks once every rank has mapped it. Either way nothing is left in `/dev/shm` once
//! `connect` returns, even if the process is killed (`handoff.rs`).
//!
//! A [`ShmLink`] to peer `p` writes into the ring for this rank in `p`'s segment and reads
//! the ring from `p` in this rank's segment. The segment's header and control pages are
//! allocated (`fallocate`) when it is made; a ring's data is allocated by its producer as its
//! writes first reach it (`RING_FIRST` bytes at its first write, then doubling up to the
//! capacity), with `MADV_POPULATE_WRITE`, so that a new communicator costs a few pages per
//! peer, a ring no call writes costs no data at all, and shared memory that cannot be had is
//! an error, never a SIGBUS. What a segment allocates, all its rings together, is held within
//! `OXCCL_SHM_BUDGET_BYTES` (a count in its header that producers grow by compare-and-swap):
//! a ring the budget cannot grow further keeps the size it has ([`ShmLink`]); one that cannot
//! get even `segment::RING_MIN` bytes fails the call with an error naming the variable. Whoever makes progress another rank may wait for
//! rings that rank's doorbell: the producer after writing (the consumer's), the consumer after
//! freeing space (the producer's). So a rank sleeps on its own doorbell for everything, and
//! [`Link::send_wait`] and [`Link::recv_wait`] both return it.
//!
//! The ring protocol (Release/Acquire on `head` and `tail`, cached opposite index) is
//! described in `ring.rs`, the segment layout in `segment.rs`.

pub(crate) mod handoff;
pub(crate) mod lend;
mod ring;
pub(crate) mod segment;

use std::path::Path;
use std::sync::Arc;

use handoff::{OpenError, Sharing};
use ring::{Consumer, Producer};
use segment::Segment;

use crate::base::error::{Error, Result};
use crate::base::param::Config;
use crate::bootstrap::Exchange;
use crate::transport::{Link, LinkError, TransportKind, WaitSource};

/// The name of the segment that `rank` creates for communicator `tag`: the memfd's name, or
/// the start of its file name in `/dev/shm` where the ranks fall back to named files
/// (`oxccl-<tag>-<rank>-L<random>`, see `handoff.rs`).
pub fn segment_name(tag: u64, rank: usize) -> String {
    format!("{tag:016x}-{rank}")
}

/// Most bytes of shared memory one rank's segment holds for `npeers` shared-memory peers
/// with rings of `ring_bytes` (rounded up to a power of two) under a per-rank budget of
/// `budget` bytes (`OXCCL_SHM_BUDGET_BYTES`, 0: none, every ring full), or `None` if out of
/// range.
pub fn segment_bytes(npeers: usize, ring_bytes: usize, budget: u64) -> Option<u64> {
    let nrings = u32::try_from(npeers).ok()?;
    let cap = segment::budgeted_capacity(nrings, ring_bytes, budget)?;
    let total = segment::SegLayout::new(nrings, cap)?.total;
    Some(if budget > 0 { total.min(budget) } else { total })
}

/// Bytes of a ring's data its producer allocates at its first write (less, down to
/// [`segment::RING_MIN`], where the budget is short); beyond them it allocates as its writes
/// reach them, doubling ([`ShmLink`]).
pub(crate) const RING_FIRST: u64 = 64 << 10;

/// Status bytes of the out-of-band messages of [`connect`].
const ST_NONE: u8 = 0;
const ST_OK: u8 = 1;
const ST_ERR: u8 = 2;
/// Phase 2: this rank may not copy a peer's memfd; every rank retries with named files.
const ST_REFUSED: u8 = 3;

fn shm_err(rank: usize, msg: impl Into<String>) -> Error {
    Error::SharedMemory {
        rank,
        msg: msg.into(),
    }
}

fn invalid(rank: usize, msg: String) -> Error {
    Error::InvalidArgument {
        rank,
        call: "init",
        seq: 0,
        msg,
    }
}

/// This process's pid namespace (`pid:[4026531836]`), or "" if unknown. Pids of peers in
/// another namespace (containers sharing /dev/shm) mean nothing here, so liveness checks by
/// pid are only made within one namespace.
pub(crate) fn pid_namespace() -> String {
    std::fs::read_link("/proc/self/ns/pid")
        .map(|p| p.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// Phase messages: a status byte, then the segment's token ([`Segment::token`]) and, after a
/// newline, the pid namespace (`ST_OK`), or an error message (`ST_ERR`), or nothing
/// (`ST_NONE`).
fn status_msg(r: &std::result::Result<Option<String>, String>) -> Vec<u8> {
    match r {
        Ok(None) => vec![ST_NONE],
        Ok(Some(p)) => {
            let mut v = vec![ST_OK];
            v.extend_from_slice(p.as_bytes());
            v.push(b'\n');
            v.extend_from_slice(pid_namespace().as_bytes());
            v
        }
        Err(e) => {
            let mut v = vec![ST_ERR];
            v.extend_from_slice(e.as_bytes());
            v
        }
    }
}

/// The first failure another rank reported in an exchange round, as an error of this rank.
fn peer_failure(rank: usize, all: &[Vec<u8>], what: &str) -> Option<Error> {
    all.iter()
        .enumerate()
        .find(|(r, m)| *r != rank && m.first() == Some(&ST_ERR))
        .map(|(r, m)| {
            shm_err(
                rank,
                format!(
                    "rank {r} failed to {what}: {}",
                    String::from_utf8_lossy(&m[1..])
                ),
            )
        })
}

/// Checks `peers` against the world: every rank in range, not this rank, no duplicates.
fn check_peers(
    rank: usize,
    world: usize,
    peers: &[(usize, u32)],
) -> std::result::Result<(), Error> {
    let mut seen = vec![false; world];
    for &(p, _) in peers {
        if p >= world {
            return Err(invalid(
                rank,
                format!("shm peer rank {p} out of range (world size {world})"),
            ));
        }
        if p == rank {
            return Err(invalid(
                rank,
                format!("rank {rank} listed itself as a shm peer"),
            ));
        }
        if std::mem::replace(&mut seen[p], true) {
            return Err(invalid(rank, format!("shm peer rank {p} listed twice")));
        }
    }
    Ok(())
}

/// Sets up shared-memory links from this rank to each of `peers` (`(rank, pid)`).
///
/// Collective: every rank of the communicator calls it, in the same order relative to other
/// exchanges, even with no shared-memory peers (it uses [`Exchange::allgather`]). The peer
/// lists must be symmetric (if `a` lists `b`, `b` lists `a`). `tag` identifies the
/// communicator and goes into the segment names, so that two communicators never collide.
/// Ring capacity is `cfg.shm_ring_bytes` rounded up to a power of two, halved while this
/// rank's segment would exceed `cfg.shm_budget_bytes` (down to 64 KiB, `segment.rs`).
///
/// Any rank's failure (no room in `/dev/shm`, a bad peer header, ...) makes every rank
/// return an error, naming the rank that failed. On return, success or not, this rank's
/// segment file has been removed from `/dev/shm` (the mappings stay while links live).
/// Returns the links in the order of `peers`.
pub fn connect(
    ex: &mut dyn Exchange,
    peers: &[(usize, u32)],
    tag: u64,
    cfg: &Config,
) -> Result<Vec<(usize, Box<dyn Link>)>> {
    let links = match connect_as(ex, peers, tag, cfg, Sharing::Memfd)? {
        Some(links) => links,
        None => {
            tracing::info!(
                rank = ex.rank(),
                "a rank may not copy its peers' memfds: shared-memory segments go through named files in /dev/shm"
            );
            let named = connect_as(ex, peers, tag, cfg, Sharing::Named);
            if named.is_err() {
                // A rank killed after creating its file leaves it (its lock is free): remove
                // the files of this communicator that dead ranks left.
                handoff::sweep_after_failure(
                    Path::new(segment::SHM_DIR),
                    &format!("{tag:016x}-"),
                    std::time::Duration::from_millis(500),
                );
            }
            named?.ok_or_else(|| {
                shm_err(
                    ex.rank(),
                    "named shared-memory segments refused too (internal error)",
                )
            })?
        }
    };
    Ok(links
        .into_iter()
        .map(|(p, l)| (p, Box::new(l) as Box<dyn Link>))
        .collect())
}

/// Splits each rank's message of an exchange into its first `k` bytes (fewer when it is
/// shorter: then it is also the rest) and the rest.
fn split_prefixes(all: Vec<Vec<u8>>, k: usize) -> (Vec<Vec<u8>>, Vec<Vec<u8>>) {
    all.into_iter()
        .map(|mut m| {
            if m.len() < k {
                return (Vec::new(), m);
            }
            let rest = m.split_off(k);
            (m, rest)
        })
        .unzip()
}

/// Links by peer rank.
type Links = Vec<(usize, ShmLink)>;

#[cfg(test)]
thread_local! {
    /// Tests: this thread's rank acts as if killed after the last exchange of
    /// [`connect_as`] and before it removed its named segment file (it keeps it).
    static DIE_BEFORE_UNLINK: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// [`connect`] with segments shared as `sharing` says; `Ok(None)` when some rank may not
/// open a peer's memfd (every rank then returns `None`: the decision is collective).
fn connect_as(
    ex: &mut dyn Exchange,
    peers: &[(usize, u32)],
    tag: u64,
    cfg: &Config,
    sharing: Sharing,
) -> Result<Option<Links>> {
    let rank = ex.rank();
    let world = ex.world_size();
    let pid = std::process::id();
    let t0 = std::time::Instant::now();
    // Which links may carry large messages single-copy, agreed within the two exchanges below.
    let probe = lend::Probe::new(tag, cfg.cma);

    // Phase 1: create this rank's segment (or fail), then tell everyone.
    let mut local_err: Option<Error> = None;
    let own: Option<Arc<Segment>> = match check_peers(rank, world, peers) {
        Err(e) => {
            local_err = Some(e);
            None
        }
        Ok(()) if peers.is_empty() => None,
        Ok(()) => {
            let producers: Vec<usize> = peers.iter().map(|p| p.0).collect();
            match Segment::create(
                sharing,
                &segment_name(tag, rank),
                tag,
                rank,
                &producers,
                cfg.shm_ring_bytes,
                cfg.shm_budget_bytes as u64,
            ) {
                Ok(s) => Some(Arc::new(s)),
                Err(m) => {
                    local_err = Some(shm_err(rank, m));
                    None
                }
            }
        }
    };
    let st1 = match (&local_err, &own) {
        (Some(e), _) => Err(e.to_string()),
        (None, s) => Ok(s.as_ref().map(|s| s.token())),
    };
    let t_create = t0.elapsed();
    let mut msg1 = probe.addr().to_le_bytes().to_vec();
    msg1.extend_from_slice(&status_msg(&st1));
    let (probes, all) = split_prefixes(ex.allgather(&msg1)?, 8);
    let probe_addrs: Vec<u64> = probes
        .iter()
        .map(|p| p.as_slice().try_into().map_or(0, u64::from_le_bytes))
        .collect();
    let t_ex1 = t0.elapsed();
    if let Some(e) = local_err {
        return Err(e);
    }
    if let Some(e) = peer_failure(rank, &all, "create its shared-memory segment") {
        return Err(e);
    }
    if all.len() != world {
        return Err(shm_err(
            rank,
            format!("exchange returned {} entries for {world} ranks", all.len()),
        ));
    }

    // Phase 2: open every peer's segment and find the ring meant for this rank.
    let my_ns = pid_namespace();
    let opened: std::result::Result<Vec<(Arc<Segment>, u32, bool)>, OpenError> = peers
        .iter()
        .map(|&(p, ppid)| {
            let failed = |m: String| OpenError::Failed(m);
            let m = &all[p];
            if m.first() != Some(&ST_OK) {
                return Err(failed(format!("rank {p} has no shared-memory segment (does it list rank {rank} as a shm peer?)")));
            }
            let text = std::str::from_utf8(&m[1..]).map_err(|_| failed(format!("rank {p} sent a non-UTF-8 segment token")))?;
            let (tok, ns) = text.split_once('\n').unwrap_or((text, ""));
            let same_ns = !ns.is_empty() && ns == my_ns;
            if !same_ns {
                tracing::debug!(rank, peer = p, ns, my_ns, "peer in another pid namespace: no liveness checks by pid");
            }
            let path = Path::new(tok);
            let seg = if tok.starts_with("fd:") {
                if !same_ns {
                    return Err(OpenError::Refused(format!("rank {p} is in another pid namespace")));
                }
                let fd = handoff::open_token(tok, ppid).map_err(|e| match e {
                    OpenError::Failed(m) => failed(format!("rank {p}'s segment: {m}")),
                    // Named as a lost peer, so that every rank blames it (not the rank that
                    // found it gone).
                    OpenError::Gone(m) => failed(format!("lost peer rank {p}: {m}")),
                    refused => refused,
                })?;
                Segment::open_fd(fd, path, tag, p)
            } else {
                let expect_dir = Path::new(segment::SHM_DIR);
                let name_ok = path.parent() == Some(expect_dir)
                    && path.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with(segment::PREFIX));
                if !name_ok {
                    return Err(failed(format!("rank {p} sent an unexpected segment path {}", path.display())));
                }
                Segment::open(path, tag, p)
            }
            .map_err(|e| failed(format!("rank {p}'s segment: {e}")))?;
            if seg.owner_pid() != ppid {
                return Err(failed(format!(
                    "rank {p}'s segment {} was created by pid {}, but rank {p} is pid {ppid}",
                    path.display(),
                    seg.owner_pid()
                )));
            }
            let ring = seg
                .find_ring(rank)
                .ok_or_else(|| failed(format!("rank {p}'s segment has no ring for rank {rank} (asymmetric peer lists?)")))?;
            Ok((Arc::new(seg), ring, same_ns))
        })
        .collect();

    // Everyone has opened (or failed to open) the segments it needs: the files can go.
    let st2 = match &opened {
        Ok(_) => vec![ST_NONE],
        Err(OpenError::Refused(m)) => [&[ST_REFUSED][..], m.as_bytes()].concat(),
        Err(OpenError::Failed(m) | OpenError::Gone(m)) => status_msg(&Err(m.clone())),
    };
    let readable = probe.check(world, peers, &probe_addrs);
    // This rank's verdict about each peer goes into the control page of the ring that peer
    // writes (ring `i` is `peers[i]`'s); the peer reads it there after the exchange below.
    if let Some(own) = &own {
        for (i, &(p, _)) in peers.iter().enumerate() {
            own.set_verdict(i as u32, readable[p] == 1);
        }
    }
    let t_open = t0.elapsed();
    let all2 = ex.allgather(&st2);
    let t_ex2 = t0.elapsed();
    #[cfg(test)]
    let killed_before_unlink = DIE_BEFORE_UNLINK.with(std::cell::Cell::get);
    #[cfg(not(test))]
    let killed_before_unlink = false;
    let unlinked = match &own {
        Some(s) if !killed_before_unlink => s.unlink(),
        _ => Ok(()),
    };
    let all2 = all2?;
    if let Some(e) = peer_failure(rank, &all2, "open the shared-memory segments of its peers") {
        return Err(e);
    }
    if let Err(OpenError::Failed(m) | OpenError::Gone(m)) = &opened {
        return Err(shm_err(rank, m.clone()));
    }
    if let Some(m) = all2.iter().find(|m| m.first() == Some(&ST_REFUSED)) {
        tracing::debug!(
            rank,
            "memfd hand-over refused: {}",
            String::from_utf8_lossy(&m[1..])
        );
        return Ok(None);
    }
    let opened = opened.map_err(|e| match e {
        OpenError::Failed(m) | OpenError::Gone(m) | OpenError::Refused(m) => shm_err(rank, m),
    })?;
    unlinked.map_err(|m| shm_err(rank, m))?;
    // Every rank has opened what it needs (the exchange above): a named file is no longer
    // needed by anyone, and each rank removes its peers' too, so that a creator killed
    // before it removed its own leaves nothing (the first removal wins; the others find it
    // gone).
    if sharing == Sharing::Named {
        for (seg, _, _) in &opened {
            seg.remove_peers_file();
        }
    }

    let own = match own {
        Some(o) => o,
        None => return Ok(Some(Vec::new())),
    };
    // Each peer recorded its verdict about this rank before the exchange above returned.
    let theirs: Vec<bool> = opened
        .iter()
        .map(|(remote, ring_idx, _)| remote.verdict(*ring_idx))
        .collect();
    let lending = lend::verdicts(peers, &readable, &theirs);
    let mut links: Links = Vec::with_capacity(peers.len());
    for (i, ((&(p, ppid), (remote, ring_idx, same_ns)), (may_borrow, may_lend))) in
        peers.iter().zip(opened).zip(lending).enumerate()
    {
        let (rc, rd, rcap) = own.ring(i as u32);
        let (tc, td, tcap) = remote.ring(ring_idx);
        // The header and control pages only (the owner allocated them): data on first write.
        let tx_ready = 0;
        remote
            .populate_ring(ring_idx, 0, tx_ready)
            .map_err(|m| shm_err(rank, format!("the ring to rank {p}: {m}")))?;
        // SAFETY: the rings lie inside mappings that the link keeps alive through its Arcs
        // (fields `own` and `remote`, dropped after the ends are no longer used); ring `i` of
        // this rank's segment is read only by this link (one link per peer, one ring per
        // peer), and ring `ring_idx` of `p`'s segment is written only by this link (the
        // directory maps it to this rank alone); capacities come from validated layouts.
        let (tx, rx) = unsafe { (Producer::new(tc, td, tcap), Consumer::new(rc, rd, rcap)) };
        let link = ShmLink {
            rank,
            peer: p,
            peer_pid: if ppid == pid || !same_ns {
                None
            } else {
                rustix::process::Pid::from_raw(ppid as i32)
            },
            read_pid: ppid,
            may_lend,
            may_borrow,
            lending: None,
            borrowed: None,
            tx,
            tx_ring: ring_idx,
            tx_ready,
            rx,
            own: own.clone(),
            remote,
        };
        links.push((p, link));
    }
    let us = |d: std::time::Duration| d.as_micros() as u64;
    tracing::debug!(
        rank,
        npeers = peers.len(),
        path = %own.path().display(),
        create_us = us(t_create),
        exchange1_us = us(t_ex1),
        open_us = us(t_open),
        exchange2_us = us(t_ex2),
        links_us = us(t0.elapsed()),
        "shm links ready"
    );
    Ok(Some(links))
}

/// A shared-memory [`Link`] to one peer on the same host; made by [`connect`].
///
/// Closing: dropping the link marks both of its ring ends closed and rings the peer, whose
/// link then reports [`LinkError::Closed`] (after draining what was sent before).
pub struct ShmLink {
    rank: usize,
    peer: usize,
    /// The peer's pid, for liveness checks; `None` when it is this process (threads) or
    /// lives in another pid namespace.
    peer_pid: Option<rustix::process::Pid>,
    /// The peer's pid for cross-memory reads (this process's own for threads).
    read_pid: u32,
    /// Whether the peer may read this rank's memory: large sends are lent ([`lend`]).
    may_lend: bool,
    /// Whether this rank may read the peer's memory: large receives are borrowed.
    may_borrow: bool,
    /// The message lent now: its address and the ring position the peer's `tail` must pass.
    lending: Option<(u64, u64)>,
    /// The message borrowed now: its address in the peer (its descriptor is still in the ring).
    borrowed: Option<u64>,
    tx: Producer,
    /// The index of `tx`'s ring in the peer's segment.
    tx_ring: u32,
    /// Bytes of `tx`'s data allocated so far, from its start ([`Segment::populate_ring`]).
    tx_ready: u64,
    rx: Consumer,
    // Declared after the ring ends: the mappings outlive every use of them.
    own: Arc<Segment>,
    remote: Arc<Segment>,
}

impl ShmLink {
    /// The peer's rank.
    pub fn peer(&self) -> usize {
        self.peer
    }

    fn closed(&self, what: &str) -> LinkError {
        LinkError::Closed(format!("rank {} {what}", self.peer))
    }

    /// Allocates more of the ring to the peer before a write of up to `len` bytes would reach
    /// data not allocated yet (positions only grow, so the data used is `[0, head + len)`
    /// until it wraps): at least double what is allocated ([`RING_FIRST`] the first time), up
    /// to the capacity. Where the peer's segment budget cannot give that much, less (halving,
    /// not below [`segment::RING_MIN`]) and the ring keeps that size for good
    /// ([`Producer::limit_to`]): writes then wait for the peer to drain it, which is only
    /// slower. An error only when a ring that has nothing yet cannot get its minimum.
    fn grow_for(&mut self, len: usize) -> std::result::Result<(), LinkError> {
        let cap = self.tx.capacity();
        let want = self.tx.head().saturating_add(len as u64).min(cap);
        if want <= self.tx_ready {
            return Ok(());
        }
        let floor = segment::RING_MIN.min(cap);
        let mut to = want
            .max(self.tx_ready.saturating_mul(2))
            .max(RING_FIRST)
            .checked_next_power_of_two()
            .unwrap_or(cap)
            .min(cap);
        loop {
            match self.remote.grow_ring(self.tx_ring, self.tx_ready, to) {
                Ok(()) => {
                    self.tx_ready = to;
                    if to < want {
                        // `head <= ` what was allocated before `< to`: always accepted.
                        self.tx.limit_to(to);
                        self.note_limited(want);
                    }
                    return Ok(());
                }
                Err(segment::GrowError::Budget { .. })
                    if to / 2 > self.tx_ready && to / 2 >= floor =>
                {
                    to /= 2
                }
                Err(segment::GrowError::Budget { .. })
                    if self.tx_ready > 0 && self.tx.limit_to(self.tx_ready) =>
                {
                    self.note_limited(want);
                    return Ok(());
                }
                Err(segment::GrowError::Budget {
                    allocated,
                    budget,
                    needed,
                }) => {
                    let (nrings, all) = self.remote.all_rings_minimum();
                    return Err(LinkError::Resource(format!(
                        "rank {}'s shared-memory segment cannot hold a ring for rank {}: the ring's \
                         first {needed} bytes would take the segment past its budget \
                         (OXCCL_SHM_BUDGET_BYTES={budget} bytes, {allocated} allocated to \
                         control pages and the rings of its other peers); raise \
                         OXCCL_SHM_BUDGET_BYTES (a call that talks to all {nrings} peers at \
                         once needs at least {all}; 0: no limit) or set OXCCL_TRANSPORT=tcp",
                        self.peer, self.rank
                    )));
                }
                // A resource of this host, not the peer: not a lost peer (rank 0 was told it
                // lost itself when /dev/shm was full).
                Err(segment::GrowError::Memory(m)) => {
                    return Err(LinkError::Resource(format!(
                        "rank {}: the shared-memory ring to rank {} (growing to {to} bytes): {m}",
                        self.rank, self.peer
                    )))
                }
            }
        }
    }

    /// Says (once per link: a ring shrinks once) that the budget stopped this ring's growth.
    fn note_limited(&self, want: u64) {
        let (allocated, budget) = self.remote.allocation();
        tracing::debug!(
            rank = self.rank,
            peer = self.peer,
            ring = self.tx.capacity(),
            want,
            allocated,
            budget,
            "shared-memory ring kept at its size: the peer's segment is at OXCCL_SHM_BUDGET_BYTES"
        );
    }

    /// `Closed` if the peer closed its end and nothing it sent is left to read.
    fn drained_closed(&mut self, closed: bool) -> std::result::Result<(), LinkError> {
        if closed && self.rx.pending()? == 0 {
            return Err(self.closed("closed its end of the shared-memory link"));
        }
        Ok(())
    }
}

impl Link for ShmLink {
    fn kind(&self) -> TransportKind {
        TransportKind::Shm
    }

    fn try_send(&mut self, data: &[u8]) -> std::result::Result<usize, LinkError> {
        if self.tx.consumer_closed() {
            return Err(self.closed("closed its end of the shared-memory link"));
        }
        self.grow_for(data.len())?;
        let n = self.tx.write(data)?;
        if n > 0 {
            self.remote.doorbell().ring();
        }
        Ok(n)
    }

    fn try_recv(
        &mut self,
        consume: &mut dyn FnMut(&[u8]) -> usize,
    ) -> std::result::Result<usize, LinkError> {
        // Load the flag before the data: everything written before the close is then seen.
        let closed = self.rx.producer_closed();
        let n = self.rx.read(consume)?;
        if n > 0 {
            self.remote.doorbell().ring();
        } else {
            self.drained_closed(closed)?;
        }
        Ok(n)
    }

    fn single_copy(&self, send: bool, len: usize) -> bool {
        len >= lend::LEND_MIN && if send { self.may_lend } else { self.may_borrow }
    }

    fn try_lend(&mut self, src: &[u8]) -> std::result::Result<bool, LinkError> {
        if self.tx.consumer_closed() {
            return Err(self.closed("closed its end of the shared-memory link"));
        }
        let addr = src.as_ptr() as u64;
        let pos = match self.lending {
            Some((a, pos)) if a == addr => pos,
            // Another message is still lent: it goes first (stream order).
            Some(_) => return Ok(false),
            None => {
                self.grow_for(lend::DESC_BYTES)?;
                if !self
                    .tx
                    .write_whole(&lend::descriptor(addr, src.len() as u64))?
                {
                    return Ok(false);
                }
                self.remote.doorbell().ring();
                let pos = self.tx.head();
                self.lending = Some((addr, pos));
                pos
            }
        };
        if !self.tx.consumed_to(pos)? {
            return Ok(false);
        }
        self.lending = None;
        Ok(true)
    }

    fn try_copy_lent(
        &mut self,
        len: usize,
        off: usize,
        dst: &mut [u8],
    ) -> std::result::Result<bool, LinkError> {
        let addr = match self.borrowed {
            Some(a) => a,
            None => {
                let closed = self.rx.producer_closed();
                let mut d = [0u8; lend::DESC_BYTES];
                if !self.rx.peek(&mut d)? {
                    self.drained_closed(closed)?;
                    return Ok(false);
                }
                let (addr, _) = lend::parse(&d, len)?;
                self.borrowed = Some(addr);
                addr
            }
        };
        if off + dst.len() > len {
            return Err(LinkError::Protocol(format!(
                "copy of {} bytes at {off} of a lent message of {len}",
                dst.len()
            )));
        }
        crate::base::cross_memory::read_remote(self.read_pid, addr + off as u64, dst)?;
        // Whether the peer withdrew the loan (its call failed, `withdraw`), looked at after
        // the copy: the peer closes before its caller may write the memory again, so a copy
        // that saw any such write sees the close here. The fence orders the copy's reads
        // before the load; `withdraw` has the matching one.
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        if self.rx.producer_closed() {
            return Err(LinkError::Withdrawn(format!(
                "it left the call with a message of {len} bytes still lent to rank {}; the \
                 copy out of its memory is refused (that memory may hold anything now)",
                self.rank
            )));
        }
        if off + dst.len() == len {
            // Done with the peer's memory: consuming the descriptor ends the loan.
            self.rx.skip(lend::DESC_BYTES as u64);
            self.borrowed = None;
            self.remote.doorbell().ring();
        }
        Ok(true)
    }

    /// Closes the ring this rank writes while a loan is outstanding: the peer's copy then
    /// fails (`try_copy_lent` checks the close after each piece). A loan ends only when the
    /// peer consumed the descriptor, so a close with a descriptor unread means withdrawn.
    fn withdraw(&mut self) {
        if self.lending.take().is_some() {
            self.tx.close();
            // Orders the close before the caller's next writes into the memory (the receiver
            // has the matching fence between its copy and its look at the close).
            std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
            self.remote.doorbell().ring();
        }
    }

    fn send_wait(&self) -> WaitSource<'_> {
        WaitSource::Doorbell(self.own.doorbell())
    }

    fn recv_wait(&self) -> WaitSource<'_> {
        WaitSource::Doorbell(self.own.doorbell())
    }

    /// `Closed` once the peer has left (closed its link, or its process is gone) and nothing
    /// it sent is left to read: what a peer wrote before it left is still delivered (a rank
    /// that finished its part of a call and exited is not lost to a slower peer that has yet
    /// to read its last bytes). Also `Closed` when its process is gone with bytes this rank
    /// sent it unread: a send to it can never end. (A send to a peer that closed fails in
    /// [`try_send`](Link::try_send) itself, and its close rings this rank's doorbell.)
    fn check_alive(&mut self) -> std::result::Result<(), LinkError> {
        // Both before the ring is looked at: whatever the peer wrote before it closed or
        // exited is then seen below (its exit, or the Acquire of the flag, orders its writes
        // before these loads).
        let gone = self.peer_pid.filter(|&pid| process_gone(pid));
        let closed = self.rx.producer_closed();
        if gone.is_none() && !closed {
            return Ok(());
        }
        if let Some(pid) = gone {
            let unread = self.tx.in_flight()?;
            if unread > 0 {
                return Err(LinkError::Closed(format!(
                    "process {} of rank {} exited without reading {unread} byte(s) sent to it",
                    pid.as_raw_nonzero(),
                    self.peer
                )));
            }
        }
        if self.rx.pending()? > 0 {
            return Ok(());
        }
        Err(match gone {
            Some(pid) => LinkError::Closed(format!(
                "process {} of rank {} exited",
                pid.as_raw_nonzero(),
                self.peer
            )),
            None => self.closed("closed its end of the shared-memory link"),
        })
    }
}

/// True if process `pid` has exited (reaped or not).
pub(crate) fn process_gone(pid: rustix::process::Pid) -> bool {
    match rustix::process::test_kill_process(pid) {
        Err(rustix::io::Errno::SRCH) => true,
        // A dead child that its parent has not reaped yet still answers kill 0 (the parent
        // may be this very process, waiting here instead of in wait()).
        Ok(()) => is_zombie(pid),
        Err(_) => false,
    }
}

/// True if `/proc` says the process has exited but was not reaped yet (state Z or X).
fn is_zombie(pid: rustix::process::Pid) -> bool {
    let Ok(stat) = std::fs::read(format!("/proc/{}/stat", pid.as_raw_nonzero())) else {
        return false;
    };
    // "pid (comm) S ...": comm may hold anything, so the state follows the last ')'.
    let Some(close) = stat.iter().rposition(|&b| b == b')') else {
        return false;
    };
    matches!(stat.get(close + 2), Some(b'Z' | b'X'))
}

impl Drop for ShmLink {
    fn drop(&mut self) {
        self.tx.close();
        self.rx.close();
        self.remote.doorbell().ring();
        tracing::trace!(rank = self.rank, peer = self.peer, "shm link closed");
    }
}

impl std::fmt::Debug for ShmLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmLink")
            .field("rank", &self.rank)
            .field("peer", &self.peer)
            .field("own", &self.own.path())
            .field("remote", &self.remote.path())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bootstrap::local::LocalExchange;

    /// A communicator tag of its own for one test's segments.
    fn random_tag() -> u64 {
        let mut b = [0u8; 8];
        getrandom::fill(&mut b).unwrap();
        u64::from_le_bytes(b)
    }

    /// Runs `f` on two threads, ranks 0 and 1 of one host, each with its shared-memory link
    /// to the other (segments of `tag`, shared as `sharing`, made under `cfg`); returns what
    /// each returned, by rank.
    fn pair<T: Send + 'static>(
        tag: u64,
        sharing: Sharing,
        cfg: &Config,
        f: impl Fn(&mut LocalExchange, &mut ShmLink) -> T + Send + Sync + 'static,
    ) -> Vec<T> {
        let pid = std::process::id();
        let f = std::sync::Arc::new(f);
        let ts: Vec<_> = LocalExchange::group(2)
            .into_iter()
            .map(|mut ex| {
                let (cfg, f) = (cfg.clone(), f.clone());
                std::thread::spawn(move || {
                    let peer = 1 - ex.rank();
                    let mut links = connect_as(&mut ex, &[(peer, pid)], tag, &cfg, sharing)
                        .unwrap()
                        .unwrap();
                    f(&mut ex, &mut links[0].1)
                })
            })
            .collect();
        ts.into_iter().map(|t| t.join().unwrap()).collect()
    }

    /// Both ways of sharing: links carry bytes, and nothing of the communicator is left in
    /// `/dev/shm` once `connect_as` returns.
    #[test]
    fn memfd_and_named_segments_both_carry_bytes_and_leave_nothing() {
        for sharing in [Sharing::Memfd, Sharing::Named] {
            let tag = random_tag();
            let res = pair(tag, sharing, &Config::default(), move |ex, link| {
                ex.barrier().unwrap();
                let left: Vec<String> = std::fs::read_dir(segment::SHM_DIR)
                    .unwrap()
                    .flatten()
                    .filter_map(|e| e.file_name().into_string().ok())
                    .filter(|n| n.contains(&format!("{tag:016x}")))
                    .collect();
                let msg = [ex.rank() as u8 + 1; 100];
                let mut sent = 0;
                let mut got = Vec::new();
                while sent < msg.len() || got.len() < msg.len() {
                    if sent < msg.len() {
                        sent += link.try_send(&msg[sent..]).unwrap();
                    }
                    link.try_recv(&mut |d| {
                        got.extend_from_slice(d);
                        d.len()
                    })
                    .unwrap();
                }
                ex.barrier().unwrap();
                (left, got)
            });
            for (r, (left, got)) in res.into_iter().enumerate() {
                assert!(left.is_empty(), "{sharing:?}: left {left:?}");
                assert_eq!(got, vec![(1 - r) as u8 + 1; 100], "{sharing:?}");
            }
        }
    }

    /// Shared memory that cannot be had (`/dev/shm` full) is a resource error naming the
    /// rank and the size, not a lost peer.
    #[test]
    fn a_full_dev_shm_is_a_resource_error_not_a_lost_peer() {
        let res = pair(
            random_tag(),
            Sharing::Memfd,
            &Config::default(),
            |ex, link| {
                let out = (ex.rank() == 0).then(|| {
                    segment::FULL.with(|f| f.set(true));
                    let e = link.try_send(&[7; 100]).unwrap_err();
                    segment::FULL.with(|f| f.set(false));
                    e.into_error(0, 1, "all_reduce", 4)
                });
                ex.barrier().unwrap();
                out
            },
        );
        let e = res[0].as_ref().unwrap();
        assert!(
            matches!(e, crate::Error::SharedMemory { rank: 0, .. }),
            "{e:?}"
        );
        let m = e.to_string();
        assert!(
            m.contains("all_reduce (call #4)")
                && m.contains("rank 0: the shared-memory ring to rank 1")
                && m.contains("cannot allocate")
                && m.contains("bytes"),
            "{m}"
        );
    }

    /// A rank killed after every peer opened its named segment file and before it removed
    /// it leaves nothing: its peers remove the file.
    #[test]
    fn a_creator_killed_before_removing_its_file_leaves_nothing() {
        let tag = random_tag();
        let res = pair(tag, Sharing::Named, &Config::default(), move |ex, _link| {
            if ex.rank() == 0 {
                DIE_BEFORE_UNLINK.with(|d| d.set(true));
            }
            ex.barrier().unwrap();
            std::fs::read_dir(segment::SHM_DIR)
                .unwrap()
                .flatten()
                .filter_map(|e| e.file_name().into_string().ok())
                .filter(|n| n.contains(&format!("{tag:016x}")))
                .collect::<Vec<_>>()
        });
        assert!(res.iter().all(Vec::is_empty), "left: {res:?}");
    }

    /// A peer whose process is gone is lost only once nothing it sent is left to read (a
    /// rank that finished its part of a call and exited is not lost to a slower peer), and
    /// at once when it left bytes sent to it unread (a send to it can never end).
    #[test]
    fn a_gone_peers_bytes_are_read_before_it_counts_as_lost() {
        let dead = {
            let mut c = std::process::Command::new("true").spawn().unwrap();
            let pid = c.id();
            c.wait().unwrap();
            rustix::process::Pid::from_raw(pid as i32).unwrap()
        };
        pair(
            random_tag(),
            Sharing::Memfd,
            &Config::default(),
            move |ex, link| {
                let me = ex.rank();
                if me == 1 {
                    assert_eq!(link.try_send(&[5u8; 1000]).unwrap(), 1000);
                }
                ex.barrier().unwrap();
                if me == 0 {
                    // Rank 1 "exited" after its send.
                    link.peer_pid = Some(dead);
                    link.check_alive().expect("its bytes are still to read");
                    let mut got = 0;
                    link.try_recv(&mut |d: &[u8]| {
                        got += d.len();
                        d.len()
                    })
                    .unwrap();
                    assert_eq!(got, 1000);
                    let e = link.check_alive().unwrap_err();
                    assert!(
                        matches!(&e, LinkError::Closed(m) if m.ends_with("exited")),
                        "{e}"
                    );
                    // Bytes it will never read.
                    assert_eq!(link.try_send(&[6u8; 10]).unwrap(), 10);
                    let e = link.check_alive().unwrap_err();
                    assert!(
                        matches!(&e, LinkError::Closed(m) if m.contains("without reading 10 byte(s)")),
                        "{e}"
                    );
                }
                ex.barrier().unwrap();
            },
        );
    }

    /// Rings allocated as they are first written: many times their capacity, in writes of
    /// every size (some beyond what is allocated, some wrapping), arrive intact; also where
    /// the segment's budget (one header page, one control page and 40 KiB) stops a ring at
    /// 32 KiB, which then carries everything at that size, the segment never past its budget.
    #[test]
    fn bytes_arrive_intact_while_rings_grow_and_wrap() {
        for (budget, ring) in [(0usize, 1u64 << 20), ((8 + 40) << 10, 32 << 10)] {
            rings_grow_and_wrap(budget, ring);
        }
    }

    fn rings_grow_and_wrap(budget: usize, ring: u64) {
        let cfg = Config {
            shm_ring_bytes: 1 << 20,
            shm_budget_bytes: budget,
            ..Config::default()
        };
        let total: usize = 3 << 20;
        let pattern = |i: usize| (i * 7 + i / 251) as u8;
        let res = pair(random_tag(), Sharing::Memfd, &cfg, move |_, link| {
            let msg: Vec<u8> = (0..total).map(pattern).collect();
            let (mut sent, mut got, mut chunk) = (0, Vec::new(), 1usize);
            while sent < total || got.len() < total {
                if sent < total {
                    let end = (sent + chunk).min(total);
                    sent += link.try_send(&msg[sent..end]).unwrap();
                    chunk = chunk * 3 % 300_007 + 1;
                }
                link.try_recv(&mut |d| {
                    got.extend_from_slice(d);
                    d.len()
                })
                .unwrap();
            }
            let (allocated, b) = link.remote.allocation();
            assert!(b == 0 || allocated <= b, "{allocated} of {b}");
            if b > 0 {
                assert_eq!(link.tx.capacity(), ring, "budget {budget}");
            }
            got == msg
        });
        assert!(res.into_iter().all(|ok| ok), "budget {budget}");
    }

    /// Under the default budget a rank's segment holds at most `OXCCL_SHM_BUDGET_BYTES`,
    /// control pages included, however many local peers it has; 2 to 4 ranks keep their full
    /// `OXCCL_SHM_RING_BYTES` rings.
    #[test]
    fn a_ranks_segment_does_not_grow_with_the_rank_count() {
        let cfg = Config::default();
        let budget = cfg.shm_budget_bytes as u64;
        let bytes = |peers: usize| segment_bytes(peers, cfg.shm_ring_bytes, budget).unwrap();
        let unbudgeted = |peers: usize| segment_bytes(peers, cfg.shm_ring_bytes, 0).unwrap();
        for peers in 1..=3 {
            assert_eq!(bytes(peers), unbudgeted(peers).min(budget), "{peers} peers");
        }
        for peers in [4, 7, 8, 15, 31, 63, 127, 191, 1000] {
            let b = bytes(peers);
            assert!(b <= budget, "{peers} peers: {b} bytes");
        }
        // 32 ranks: a rank reserves less than at 4 ranks, where 4 MiB rings were already kept.
        assert!(bytes(31) < bytes(3), "{} vs {}", bytes(31), bytes(3));
        // Before the budget: 31 rings of 4 MiB.
        assert!(unbudgeted(31) > 120 << 20);
    }

    /// A large message lent over a link: the receiver copies it out of the sender's memory in
    /// pieces, the sender's loan completes only after the last piece, the next bytes on the
    /// link are the sender's next message, and a receiver expecting another length gets a
    /// protocol error. With `cma` off no link lends.
    #[test]
    fn lent_messages_are_copied_out_of_the_senders_memory() {
        for cma in [true, false] {
            let tag = random_tag();
            let pid = std::process::id();
            let len = lend::LEND_MIN + 12_345;
            let cfg = Config {
                cma,
                ..Config::default()
            };
            let ts: Vec<_> = LocalExchange::group(2)
                .into_iter()
                .map(|mut ex| {
                    let cfg = cfg.clone();
                    std::thread::spawn(move || {
                        let rank = ex.rank();
                        let mut links = connect(&mut ex, &[(1 - rank, pid)], tag, &cfg).unwrap();
                        let link = &mut links[0].1;
                        let single = [true, false].map(|send| link.single_copy(send, len));
                        assert_eq!(single, [cma, cma]);
                        assert!(!link.single_copy(true, lend::LEND_MIN - 1));
                        if !cma {
                            return;
                        }
                        if rank == 0 {
                            let msg: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
                            while !link.try_lend(&msg).unwrap() {
                                std::thread::yield_now();
                            }
                            // The receiver has finished with `msg`: it may change now.
                            ex.barrier().unwrap();
                            let mut sent = 0;
                            while sent < 8 {
                                sent += link.try_send(&[7u8; 8][sent..]).unwrap();
                            }
                            // Read as the wrong length: the receiver fails and closes.
                            while let Ok(done) = link.try_lend(&msg[..lend::LEND_MIN]) {
                                assert!(!done, "a refused loan completed");
                                std::thread::yield_now();
                            }
                        } else {
                            let mut got = vec![0u8; len];
                            let mut off = 0;
                            for piece in [100_000, 100_000, len - 200_000] {
                                while !link
                                    .try_copy_lent(len, off, &mut got[off..off + piece])
                                    .unwrap()
                                {
                                    std::thread::yield_now();
                                }
                                off += piece;
                            }
                            let want: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
                            assert!(got == want, "lent bytes differ");
                            ex.barrier().unwrap();
                            let mut next = [0u8; 8];
                            let mut k = 0;
                            while k < 8 {
                                k += link.try_recv_into(&mut next[k..]).unwrap();
                            }
                            assert_eq!(next, [7u8; 8]);
                            let err = loop {
                                match link.try_copy_lent(len, 0, &mut got[..10]) {
                                    Ok(false) => std::thread::yield_now(),
                                    r => break r.unwrap_err(),
                                }
                            };
                            assert!(
                                matches!(&err, LinkError::Protocol(m) if m.contains(&format!("lent message of {len} bytes"))),
                                "{err}"
                            );
                            drop(links);
                        }
                    })
                })
                .collect();
            for t in ts {
                t.join().unwrap();
            }
        }
    }
}
