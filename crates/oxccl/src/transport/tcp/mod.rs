//! TCP transport.
//!
//! [`setup`] builds one authenticated TCP connection per pair of ranks that need one, at
//! once (the higher rank connects to the lower) or, under `OXCCL_TCP_CONNECT=lazy`, when a
//! call first needs it (the end that needs it first connects: [`lazy`]); [`TcpLink`] drives
//! it as a non-blocking [`Link`].

pub(crate) mod lazy;
pub(crate) mod striped;

use std::io::{self, Read};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::base::error::{Error, Result};
use crate::base::param::Config;
use crate::bootstrap::{decode_ip, encode_ip, local_ip, Exchange};
use crate::net::accept::{self, AcceptStop};
use crate::net::auth::{self, Deadlined, Hello, Purpose, Verdict};
use crate::net::dial::Dial;
use crate::transport::tcp::striped::StripedLink;
use crate::transport::{Link, LinkError, TransportKind, WaitSource};

/// Bytes a [`TcpLink`] reads ahead from its socket.
pub(crate) const RECV_BUFFER: usize = 512 << 10;
/// Requested kernel socket buffer size, each direction (best effort: the kernel may cap it).
pub(crate) const SOCKET_BUFFER: usize = 4 << 20;

const CALL: &str = "tcp_connect";
const BLOB_VERSION: u8 = 1;

/// One end of a TCP connection to a peer, non-blocking.
pub(crate) struct TcpLink {
    stream: TcpStream,
    peer: usize,
    buf: Box<[u8]>,
    start: usize,
    end: usize,
    /// Nothing more comes from the socket: the peer closed it, or (`reset`) a read failed
    /// because it was reset. What is buffered is still taken first.
    eof: bool,
    reset: Option<String>,
    /// See [`TcpLink::with_dead_after`]; zero: no check.
    dead_after: Duration,
    /// When [`Link::check_alive`] first saw sent bytes unacknowledged (reset once all are).
    unacked_since: Option<Instant>,
}

impl std::fmt::Debug for TcpLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpLink")
            .field("peer", &self.peer)
            .field("local", &self.stream.local_addr().ok())
            .field("remote", &self.stream.peer_addr().ok())
            .field("buffered", &(self.end - self.start))
            .field("eof", &self.eof)
            .finish()
    }
}

impl TcpLink {
    /// Wraps an established, authenticated connection to `peer` (made non-blocking here).
    pub(crate) fn new(stream: TcpStream, peer: usize) -> io::Result<TcpLink> {
        tune(&stream);
        stream.set_read_timeout(None)?;
        stream.set_write_timeout(None)?;
        stream.set_nonblocking(true)?;
        Ok(TcpLink {
            stream,
            peer,
            buf: vec![0u8; RECV_BUFFER].into_boxed_slice(),
            start: 0,
            end: 0,
            eof: false,
            reset: None,
            dead_after: Duration::ZERO,
            unacked_since: None,
        })
    }

    /// Declares the peer lost when it acknowledges nothing for `after` (zero: never; the
    /// kernel retransmits for many minutes). Two mechanisms, neither of which fires on a peer
    /// that is alive but slow to read:
    /// - an idle connection sends keepalive probes after `after/2`, every `after/6`, and the
    ///   kernel fails the socket after 3 unanswered ones;
    /// - while sent bytes are unacknowledged, [`Link::check_alive`] (called by a waiting
    ///   executor) reads `TCP_INFO` and fails when no acknowledgement at all came for
    ///   `after`. A receiver with a full buffer still acknowledges window probes, so a busy
    ///   peer is not mistaken for a dead one.
    ///
    /// `TCP_USER_TIMEOUT` is deliberately not used: Linux applies it to zero-window probing
    /// too, so it would kill the connection to a live peer that is busy elsewhere (a rank
    /// writing a checkpoint) for longer than the timeout.
    pub(crate) fn with_dead_after(mut self, after: Duration) -> io::Result<TcpLink> {
        self.dead_after = after;
        if !after.is_zero() {
            let r = socket2::SockRef::from(&self.stream);
            let secs = |d: Duration| d.max(Duration::from_secs(1));
            let ka = socket2::TcpKeepalive::new()
                .with_time(secs(after / 2))
                .with_interval(secs(after / 6))
                .with_retries(3);
            r.set_tcp_keepalive(&ka)?;
            r.set_keepalive(true)?;
        }
        Ok(self)
    }

    /// A read failed with `e` (reset): nothing more comes, what is buffered still goes first.
    fn reset_by(&mut self, e: &io::Error) {
        self.eof = true;
        self.reset = Some(e.to_string());
    }

    /// The error of a read once everything that came is taken.
    fn ended(&self) -> LinkError {
        LinkError::Closed(match &self.reset {
            Some(e) => format!("rank {}: {e}", self.peer),
            None => format!("rank {} closed the connection", self.peer),
        })
    }

    #[cfg(test)]
    pub(crate) fn dead_after_for_test(&mut self, after: Duration) {
        self.dead_after = after;
    }
}

fn closed(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::BrokenPipe
            | io::ErrorKind::NotConnected
    )
}

impl Link for TcpLink {
    fn kind(&self) -> TransportKind {
        TransportKind::Tcp
    }

    fn try_send(&mut self, data: &[u8]) -> Result<usize, LinkError> {
        if data.is_empty() {
            return Ok(0);
        }
        loop {
            // MSG_NOSIGNAL: a closed peer must give EPIPE, not kill the process with SIGPIPE.
            match rustix::net::send(&self.stream, data, rustix::net::SendFlags::NOSIGNAL) {
                Ok(n) => return Ok(n),
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => {
                    let e = io::Error::from(e);
                    return match e.kind() {
                        io::ErrorKind::WouldBlock => Ok(0),
                        _ if closed(&e) => {
                            Err(LinkError::Closed(format!("rank {}: {e}", self.peer)))
                        }
                        _ => Err(LinkError::Io(e)),
                    };
                }
            }
        }
    }

    fn try_recv(&mut self, consume: &mut dyn FnMut(&[u8]) -> usize) -> Result<usize, LinkError> {
        let cap = self.buf.len();
        let mut total = 0;
        loop {
            if self.start == self.end {
                self.start = 0;
                self.end = 0;
            } else if self.end == cap && self.start > 0 {
                // Keep the unconsumed tail: move it to the front to make room.
                self.buf.copy_within(self.start..self.end, 0);
                self.end -= self.start;
                self.start = 0;
            }
            if self.end < cap && !self.eof {
                match (&self.stream).read(&mut self.buf[self.end..]) {
                    Ok(0) => self.eof = true,
                    Ok(n) => self.end += n,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e) if closed(&e) => self.reset_by(&e),
                    Err(e) => return Err(LinkError::Io(e)),
                }
            }
            let avail = self.end - self.start;
            if avail == 0 {
                if self.eof && total == 0 {
                    return Err(self.ended());
                }
                return Ok(total);
            }
            let taken = consume(&self.buf[self.start..self.end]).min(avail);
            self.start += taken;
            total += taken;
            if taken < avail {
                return Ok(total);
            }
        }
    }

    fn try_recv_into(&mut self, dst: &mut [u8]) -> Result<usize, LinkError> {
        // Bytes read ahead earlier first, then from the socket straight into `dst` (no copy
        // through the link's buffer: on large receives that copy costs more than the
        // kernel's).
        let buffered = (self.end - self.start).min(dst.len());
        dst[..buffered].copy_from_slice(&self.buf[self.start..self.start + buffered]);
        self.start += buffered;
        let mut total = buffered;
        while total < dst.len() && !self.eof {
            match (&self.stream).read(&mut dst[total..]) {
                Ok(0) => self.eof = true,
                Ok(n) => total += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) if closed(&e) => self.reset_by(&e),
                Err(e) => return Err(LinkError::Io(e)),
            }
        }
        if total == 0 && self.eof && !dst.is_empty() {
            return Err(self.ended());
        }
        Ok(total)
    }

    fn send_wait(&self) -> WaitSource<'_> {
        WaitSource::Fd(self.stream.as_fd())
    }

    fn recv_wait(&self) -> WaitSource<'_> {
        WaitSource::Fd(self.stream.as_fd())
    }

    fn check_alive(&mut self) -> Result<(), LinkError> {
        if self.dead_after.is_zero() {
            return Ok(());
        }
        // Bytes the peer sent and this rank has yet to read come first, even when a reset
        // followed them (the kernel keeps them readable): the next read takes them, and ends
        // the link only once they are taken. (Looked at before the socket's error, which
        // reading clears.)
        if self.end > self.start || rustix::io::ioctl_fionread(&self.stream).is_ok_and(|n| n > 0) {
            return Ok(());
        }
        if let Ok(Err(e)) = rustix::net::sockopt::socket_error(&self.stream) {
            return Err(LinkError::Closed(format!(
                "rank {}: {}",
                self.peer,
                io::Error::from(e)
            )));
        }
        let Some((unacked, last_ack)) = tcp_info(&self.stream) else {
            return Ok(());
        };
        if unacked == 0 {
            self.unacked_since = None;
            return Ok(());
        }
        let since = *self.unacked_since.get_or_insert_with(Instant::now);
        let silent = last_ack.min(since.elapsed());
        if silent >= self.dead_after {
            return Err(LinkError::Closed(format!(
                "rank {}: no acknowledgement for {:.1} s with {unacked} segment(s) unacknowledged: \
                 the network path is cut or the host is down (OXCCL_TCP_DEAD_AFTER={} s)",
                self.peer,
                silent.as_secs_f64(),
                self.dead_after.as_secs_f64()
            )));
        }
        Ok(())
    }
}

impl Drop for TcpLink {
    /// Reads what the peer sent and this end did not take before the socket closes: a close
    /// with unread bytes sends a reset instead of a FIN, and a reset drops whatever this end
    /// sent that has not left its send buffer yet (the last bytes of a rank that finished its
    /// call and exits). Bounded: a peer that keeps sending is not waited for.
    fn drop(&mut self) {
        for _ in 0..16 {
            match (&self.stream).read(&mut self.buf) {
                Ok(n) if n > 0 => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                _ => break,
            }
        }
    }
}

/// `TCP_INFO`: segments sent and not acknowledged, and the time since the last
/// acknowledgement arrived.
fn tcp_info(s: &TcpStream) -> Option<(u32, Duration)> {
    use std::os::fd::AsRawFd;
    // SAFETY: tcp_info is plain old data; getsockopt writes at most `len` bytes into it.
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    // SAFETY: a valid socket, a buffer of `len` bytes, and `len` passed by pointer.
    let rc = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            (&mut info as *mut libc::tcp_info).cast(),
            &mut len,
        )
    };
    (rc == 0).then(|| {
        (
            info.tcpi_unacked,
            Duration::from_millis(u64::from(info.tcpi_last_ack_recv)),
        )
    })
}

/// TCP_NODELAY and large socket buffers, best effort.
fn tune(s: &TcpStream) {
    let r = socket2::SockRef::from(s);
    let _ = r.set_tcp_nodelay(true);
    let _ = r.set_send_buffer_size(SOCKET_BUFFER);
    let _ = r.set_recv_buffer_size(SOCKET_BUFFER);
}

fn listen(ip: IpAddr) -> io::Result<TcpListener> {
    let addr = SocketAddr::new(ip, 0);
    let s = socket2::Socket::new(
        socket2::Domain::for_address(addr),
        socket2::Type::STREAM,
        None,
    )?;
    // Set before listen so that accepted sockets negotiate a large window.
    let _ = s.set_recv_buffer_size(SOCKET_BUFFER);
    let _ = s.set_send_buffer_size(SOCKET_BUFFER);
    s.bind(&addr.into())?;
    s.listen(accept::LISTEN_BACKLOG)?;
    Ok(s.into())
}

/// Opens a data connection with this transport's socket options.
fn dial(addr: SocketAddr, timeout: Duration) -> io::Result<TcpStream> {
    let s = socket2::Socket::new(
        socket2::Domain::for_address(addr),
        socket2::Type::STREAM,
        None,
    )?;
    let _ = s.set_recv_buffer_size(SOCKET_BUFFER);
    let _ = s.set_send_buffer_size(SOCKET_BUFFER);
    let _ = s.set_tcp_nodelay(true);
    s.connect_timeout(&addr.into(), timeout)?;
    Ok(s.into())
}

/// What each rank contributes to the exchange: its data port (if it listens) and the ranks
/// it expects links with.
fn encode_blob(listen: Option<SocketAddr>, peers: &[usize]) -> Vec<u8> {
    let mut b = vec![BLOB_VERSION, listen.is_some() as u8];
    if let Some(a) = listen {
        encode_ip(a.ip(), &mut b);
        b.extend_from_slice(&a.port().to_le_bytes());
    }
    b.extend_from_slice(&(peers.len() as u32).to_le_bytes());
    for p in peers {
        b.extend_from_slice(&(*p as u32).to_le_bytes());
    }
    b
}

/// The connections per pair a peer's blob asks for: a `u32` after [`encode_blob`]'s fields
/// (1 when absent).
fn blob_streams(b: &[u8], listens: bool, npeers: usize) -> usize {
    let fields = 2 + if listens { 19 } else { 0 } + 4 + 4 * npeers;
    b.get(fields..fields + 4)
        .and_then(|x| x.try_into().ok())
        .map_or(1, |x| u32::from_le_bytes(x) as usize)
}

/// Whether a peer's blob asks for connect on first use: a byte after [`blob_streams`]'s
/// (eager when absent).
fn blob_lazy(b: &[u8], listens: bool, npeers: usize) -> bool {
    let fields = 2 + if listens { 19 } else { 0 } + 4 + 4 * npeers + 4;
    b.get(fields) == Some(&1)
}

/// Reads a rank's contribution to the port exchange; `None` for anything malformed.
pub(crate) fn decode_blob(b: &[u8]) -> Option<(Option<SocketAddr>, Vec<usize>)> {
    let mut r = b;
    let mut take = |n: usize| -> Option<&[u8]> {
        if r.len() < n {
            return None;
        }
        let (a, rest) = r.split_at(n);
        r = rest;
        Some(a)
    };
    if take(1)?[0] != BLOB_VERSION {
        return None;
    }
    let listen = match take(1)?[0] {
        0 => None,
        1 => {
            let mut ipb = take(17)?;
            let ip = decode_ip(&mut ipb)?;
            let port = u16::from_le_bytes(take(2)?.try_into().ok()?);
            Some(SocketAddr::new(ip, port))
        }
        _ => return None,
    };
    let n = u32::from_le_bytes(take(4)?.try_into().ok()?) as usize;
    let mut peers = Vec::with_capacity(n.min(1 << 16));
    for _ in 0..n {
        peers.push(u32::from_le_bytes(take(4)?.try_into().ok()?) as usize);
    }
    Some((listen, peers))
}

/// Connects this rank to `peers` (rank and IP of each) over TCP. Collective: every rank of
/// `ex` must call it, also one with no peers, because it exchanges listen ports through
/// `ex`. For each pair the higher rank connects to the lower; every connection is
/// authenticated with `secret` ([`auth`], purpose data); strangers are refused and
/// accepting goes on. Connects are retried until `cfg.timeout`, then fail with
/// [`Error::Connect`] naming the rank and address; ranks that never connect to us give
/// [`Error::Timeout`]. Returns the links ordered by peer rank.
///
/// This rank listens on the address of `cfg.socket_ifname`, else on the local address that
/// routes to its first peer, and tells the peers where; `peers`' addresses pick that route.
///
/// Under `OXCCL_TCP_CONNECT=lazy` (rank 0's) every link is made here all the same, by the
/// connect-on-first-use engine ([`lazy::LazyTcp`]); init uses [`setup`] instead (this is
/// the tests' form).
#[cfg(test)]
pub(crate) fn connect(
    ex: &mut dyn Exchange,
    peers: &[(usize, IpAddr)],
    secret: &[u8; 16],
    cfg: &Config,
) -> Result<Vec<(usize, Box<dyn Link>)>> {
    match setup(ex, peers, secret, cfg)? {
        Setup::Now(links) => Ok(links),
        Setup::Later(mut lazy) => {
            let all = lazy.peers();
            lazy.connect(
                &all,
                Instant::now() + cfg.timeout,
                &|| -> Option<Error> { None },
                CALL,
                0,
            )
        }
    }
}

/// What [`setup`] made.
pub(crate) enum Setup {
    /// Every link, made now (`OXCCL_TCP_CONNECT=eager`, the default; or no TCP peer).
    Now(Vec<(usize, Box<dyn Link>)>),
    /// The listener and every peer's address, no link yet: each is made when a call first
    /// needs it ([`lazy::LazyTcp::connect`]).
    Later(lazy::LazyTcp),
}

/// The port exchange (collective: every rank of `ex` calls it, also one with no peers; see
/// `connect` for the rest), then the links at once under
/// `OXCCL_TCP_CONNECT=eager` (rank 0's), else nothing more.
pub(crate) fn setup(
    ex: &mut dyn Exchange,
    peers: &[(usize, IpAddr)],
    secret: &[u8; 16],
    cfg: &Config,
) -> Result<Setup> {
    let start = Instant::now();
    let ports = exchange_ports(ex, peers, cfg)?;
    if ports.lazy {
        if let Some(listener) = ports.listener {
            return lazy::LazyTcp::new(
                ports.me,
                listener,
                &ports.ranks,
                &ports.addrs,
                ports.streams,
                secret,
                cfg.tcp_dead_after,
            )
            .map(Setup::Later);
        }
    }
    connect_eager(ports, secret, cfg, start).map(Setup::Now)
}

/// What the port exchange settled for this rank.
struct Ports {
    me: usize,
    /// Where this rank listens (none without TCP peers).
    listener: Option<TcpListener>,
    /// Every TCP peer, ascending.
    ranks: Vec<usize>,
    /// The lower-ranked peers (this rank dials them at init) and where they listen.
    lower: Vec<(usize, SocketAddr)>,
    /// Where every TCP peer that listens listens, ascending by rank (links made on first
    /// use are dialed by whichever end needs one first).
    addrs: Vec<(usize, SocketAddr)>,
    /// Connections per pair.
    streams: usize,
    /// Rank 0 asked for connect on first use.
    lazy: bool,
}

/// The port exchange: this rank's listener, checked against every peer's blob.
fn exchange_ports(ex: &mut dyn Exchange, peers: &[(usize, IpAddr)], cfg: &Config) -> Result<Ports> {
    let me = ex.rank();
    let n = ex.world_size();
    let invalid = |msg: String| Error::InvalidArgument {
        rank: me,
        call: CALL,
        seq: 0,
        msg,
    };
    let mut ranks: Vec<usize> = peers.iter().map(|p| p.0).collect();
    ranks.sort_unstable();
    for w in ranks.windows(2) {
        if w[0] == w[1] {
            return Err(invalid(format!("peer rank {} listed twice", w[0])));
        }
    }
    if let Some(&r) = ranks.iter().find(|&&r| r >= n || r == me) {
        return Err(invalid(format!(
            "peer rank {r} is this rank or not below the world size {n}"
        )));
    }

    let listener = match peers.first() {
        Some(&(_, ip)) => {
            let my_ip = local_ip(cfg, SocketAddr::new(ip, 9))?;
            Some(listen(my_ip).map_err(|source| Error::Io {
                rank: me,
                context: format!("listening on {my_ip}"),
                source,
            })?)
        }
        None => None,
    };
    let listen_addr = match &listener {
        Some(l) => Some(l.local_addr().map_err(|source| Error::Io {
            rank: me,
            context: "reading the listen address".into(),
            source,
        })?),
        None => None,
    };
    let streams = cfg.tcp_streams.max(1);
    let mut mine = encode_blob(listen_addr, &ranks);
    mine.extend_from_slice(&(streams as u32).to_le_bytes());
    // This rank's choice for a communicator of `n` ranks; rank 0's is the one that holds.
    mine.push(cfg.tcp_connect.lazy_for(n, cfg.tcp_lazy_min_ranks).into());
    let all = ex.allgather(&mine)?;
    if all.len() != n {
        return Err(Error::Protocol {
            rank: me,
            peer: 0,
            call: CALL,
            seq: 0,
            msg: format!("exchange returned {} entries for {n} ranks", all.len()),
        });
    }
    let (mut lower, mut addrs) = (Vec::new(), Vec::new());
    for &r in &ranks {
        let proto = |msg: String| Error::Protocol {
            rank: me,
            peer: r,
            call: CALL,
            seq: 0,
            msg,
        };
        let (addr, theirs) =
            decode_blob(&all[r]).ok_or_else(|| proto("malformed port exchange".into()))?;
        if !theirs.contains(&me) {
            return Err(proto(format!(
                "rank {r} does not expect a TCP link to rank {me}"
            )));
        }
        let their_streams = blob_streams(&all[r], addr.is_some(), theirs.len());
        if their_streams != streams {
            return Err(Error::Env(format!(
                "OXCCL_TCP_STREAMS differs between ranks: {streams} on rank {me}, {their_streams} on rank {r}; \
                 set the same value everywhere"
            )));
        }
        if r < me {
            lower.push((r, addr.ok_or_else(|| proto("no listen address".into()))?));
        }
        if let Some(a) = addr {
            addrs.push((r, a));
        }
    }
    for (r, blob) in all.iter().enumerate() {
        if r != me
            && !ranks.contains(&r)
            && decode_blob(blob).is_some_and(|(_, theirs)| theirs.contains(&me))
        {
            return Err(Error::Protocol {
                rank: me,
                peer: r,
                call: CALL,
                seq: 0,
                msg: format!(
                    "rank {r} expects a TCP link to rank {me}, which does not list it as a peer"
                ),
            });
        }
    }
    // Rank 0's choice holds for every rank (a rank dialing at init while its peer waits for
    // a call to accept would wait for nothing).
    let lazy = decode_blob(&all[0])
        .is_some_and(|(addr, theirs)| blob_lazy(&all[0], addr.is_some(), theirs.len()));
    Ok(Ports {
        me,
        listener,
        ranks,
        lower,
        addrs,
        streams,
        lazy,
    })
}

/// Makes every link of `ports` now: this rank dials its lower peers while a thread accepts
/// the higher ones.
fn connect_eager(
    ports: Ports,
    secret: &[u8; 16],
    cfg: &Config,
    start: Instant,
) -> Result<Vec<(usize, Box<dyn Link>)>> {
    let Ports {
        me,
        listener,
        ranks,
        lower,
        streams,
        ..
    } = ports;
    let deadline = start + cfg.timeout;
    let higher: Vec<usize> = ranks.iter().copied().filter(|&r| r > me).collect();
    let tag = auth::comm_tag(secret);
    let cancel = AtomicBool::new(false);

    let (accepted, connected) = std::thread::scope(|scope| {
        let acceptor = (!higher.is_empty()).then(|| {
            let (listener, higher, cancel) = (listener.as_ref(), &higher, &cancel);
            let secret = *secret;
            scope.spawn(move || -> Result<Vec<(usize, TcpStream)>> {
                let Some(listener) = listener else { return Ok(Vec::new()) };
                let mut got: Vec<(usize, TcpStream)> = Vec::new();
                let keys = accept::Keys { secret, purpose: Purpose::Data, tag, rank: me };
                let mut admit = |h: Hello, s: TcpStream, from: SocketAddr| -> Result<bool> {
                    let verdict = if !higher.contains(&h.rank) {
                        Verdict::UnexpectedRank
                    } else if got.iter().filter(|(r, _)| *r == h.rank).count() >= streams {
                        Verdict::DuplicateRank
                    } else {
                        Verdict::Accepted
                    };
                    let sent = auth::send_verdict(&mut Deadlined::new(&s, Instant::now() + auth::HANDSHAKE_TIMEOUT), verdict);
                    match (verdict, sent) {
                        (Verdict::Accepted, Ok(())) => got.push((h.rank, s)),
                        (Verdict::Accepted, Err(e)) => tracing::debug!("rank {me}: lost rank {} at {from} after its handshake: {e}", h.rank),
                        (v, _) => {
                            tracing::warn!("rank {me}: refused a data connection from {from} claiming rank {}: {v:?}", h.rank);
                            let _ = s.shutdown(std::net::Shutdown::Both);
                        }
                    }
                    Ok(got.len() == higher.len() * streams)
                };
                let res = accept::accept_loop(listener, deadline, cancel, &keys, &mut admit);
                match res {
                    Ok(Ok(())) => Ok(got),
                    Ok(Err(e)) => Err(e),
                    Err(AcceptStop::Deadline(strangers)) => {
                        let waiting_on: Vec<usize> = higher.iter().copied().filter(|r| got.iter().filter(|(g, _)| g == r).count() < streams).collect();
                        Err(match strangers.summary() {
                            None => Error::Timeout { rank: me, call: CALL, seq: 0, waiting_on, elapsed: start.elapsed() },
                            Some(s) => Error::Connect {
                                rank: me,
                                peer: waiting_on.first().copied().unwrap_or(me),
                                addr: listener.local_addr().map_or_else(|_| "?".into(), |a| a.to_string()),
                                timeout: start.elapsed(),
                                reason: format!("no data connection from rank(s) {} arrived; {s}", crate::base::error::rank_list(&waiting_on)),
                            },
                        })
                    }
                    Err(AcceptStop::Io(source)) => Err(Error::Io { rank: me, context: "accepting data connections".into(), source }),
                }
            })
        });
        let connected = connect_lower(me, &lower, streams, secret, tag, cfg.timeout, deadline);
        if connected.is_err() {
            cancel.store(true, Ordering::SeqCst);
        }
        let accepted = match acceptor {
            Some(h) => h.join().unwrap_or_else(|_| {
                Err(Error::Aborted {
                    rank: me,
                    msg: "the TCP accept thread panicked".into(),
                })
            }),
            None => Ok(Vec::new()),
        };
        (accepted, connected)
    });
    let mut conns = connected?;
    conns.extend(accepted?);
    // Stable: a peer's connections stay in the order they were made (the connecting side
    // dials the next only after the previous one's verdict), the same on both ends.
    conns.sort_by_key(|(r, _)| *r);
    into_links(me, conns, cfg.tcp_dead_after)
}

/// Links from authenticated connections sorted by peer (a peer's in the order they were
/// made): one [`TcpLink`] per peer, or a [`StripedLink`] over several.
fn into_links(
    me: usize,
    conns: Vec<(usize, TcpStream)>,
    dead_after: Duration,
) -> Result<Vec<(usize, Box<dyn Link>)>> {
    let mut groups: Vec<(usize, Vec<TcpLink>)> = Vec::new();
    for (r, s) in conns {
        let link = TcpLink::new(s, r)
            .and_then(|l| l.with_dead_after(dead_after))
            .map_err(|source| Error::Io {
                rank: me,
                context: format!("setting up the link to rank {r}"),
                source,
            })?;
        match groups.last_mut() {
            Some((g, v)) if *g == r => v.push(link),
            _ => groups.push((r, vec![link])),
        }
    }
    Ok(groups
        .into_iter()
        .map(|(r, mut v)| -> (usize, Box<dyn Link>) {
            if v.len() == 1 {
                (r, Box::new(v.pop().expect("one link")))
            } else {
                (r, Box::new(StripedLink::new(v)))
            }
        })
        .collect())
}

/// Connects to each lower-ranked peer in turn, retrying until `deadline`.
fn connect_lower(
    me: usize,
    lower: &[(usize, SocketAddr)],
    streams: usize,
    secret: &[u8; 16],
    tag: u64,
    timeout: Duration,
    deadline: Instant,
) -> Result<Vec<(usize, TcpStream)>> {
    let plan = DialPlan {
        me,
        secret,
        tag,
        deadline,
        refused_limit: None,
        stop: None,
    };
    plan.dial_each_in_turn(lower, streams, |peer, addr, g| Error::Connect {
        rank: me,
        peer,
        addr: addr.to_string(),
        timeout,
        reason: g.last_err,
    })
}

/// How a rank dials its peers' data listeners: eagerly at init ([`connect_lower`]) or on
/// first use (`lazy`), the same loop with its own limits.
struct DialPlan<'a> {
    me: usize,
    secret: &'a [u8; 16],
    tag: u64,
    deadline: Instant,
    /// [`Dial::refused_limit`].
    refused_limit: Option<Duration>,
    /// [`Dial::stop`].
    stop: Option<&'a dyn Fn() -> bool>,
}

impl DialPlan<'_> {
    /// Dials each peer of `peers` (`streams` connections each, in turn); a peer given up on
    /// fails the whole with `give_up(peer, addr, why)`.
    fn dial_each_in_turn(
        &self,
        peers: &[(usize, SocketAddr)],
        streams: usize,
        give_up: impl Fn(usize, SocketAddr, crate::net::dial::GaveUp) -> Error,
    ) -> Result<Vec<(usize, TcpStream)>> {
        let hello = Hello {
            rank: self.me,
            purpose: Purpose::Data,
            tag: self.tag,
        };
        let mut out = Vec::with_capacity(peers.len() * streams);
        for &(peer, addr) in peers.iter().flat_map(|p| std::iter::repeat_n(p, streams)) {
            let dial = Dial {
                addr,
                secret: self.secret,
                hello,
                deadline: self.deadline,
                first_pause: Duration::from_millis(10),
                max_pause: Duration::from_millis(200),
                refused_limit: self.refused_limit,
                connect: dial,
                stop: self.stop,
            };
            let stream = dial.run(|_, _| {}, |g| give_up(peer, addr, g))?;
            out.push((peer, stream));
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests;
