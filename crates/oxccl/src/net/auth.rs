//! Mutual authentication of every connection (rendezvous and data) by the shared secret.
//!
//! The protocol is a challenge–response with HMAC-SHA256 keyed by the communicator's 128-bit
//! secret; neither side ever sends the secret:
//!
//! 1. connector → acceptor: [`MAGIC`], [`VERSION`], `nonce_c` (16 random bytes);
//! 2. acceptor → connector: [`MAGIC`], [`VERSION`], `nonce_a`,
//!    `HMAC(secret, "oxccl-acceptor" || nonce_c || nonce_a)`;
//! 3. the connector checks that MAC (the acceptor knows the secret), then sends its
//!    [`Hello`] (rank, [`Purpose`], communicator tag) and
//!    `HMAC(secret, "oxccl-connector" || nonce_a || nonce_c || hello)`;
//! 4. the acceptor checks that MAC, purpose and tag, and answers with one verdict byte
//!    ([`send_verdict`]): accepted, or why not.
//!
//! Every message of the handshake has a fixed size, so nothing a stranger sends makes us
//! allocate; MACs are compared in constant time. The handshake does not encrypt the stream
//! and does not protect against an attacker who can rewrite packets in flight: it keeps
//! strangers and other communicators out.
//!
//! The module also has length-prefixed frame functions ([`write_frame`], [`read_frame`]) that
//! refuse frames above a caller-given size before allocating, and a [`Deadlined`] stream
//! wrapper that bounds the total time a handshake may take.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;

use crate::base::error::{Error, Result};

type HmacSha256 = Hmac<Sha256>;

/// First bytes of every handshake message.
pub const MAGIC: [u8; 8] = *b"OXCCLAUT";
/// Protocol version; both sides must agree.
pub const VERSION: u16 = 1;
/// How long an acceptor gives an accepted socket to complete its part of the handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(2);

pub(crate) const NONCE: usize = 16;
const TAG: usize = 32;
pub(crate) const HELLO_C_LEN: usize = 8 + 2 + NONCE;
pub(crate) const HELLO_A_LEN: usize = 8 + 2 + NONCE + TAG;
const PAYLOAD_LEN: usize = 4 + 1 + 8;
pub(crate) const PROOF_C_LEN: usize = PAYLOAD_LEN + TAG;

/// What a connection is for; part of the authenticated payload so that a connection made
/// for one purpose can never be taken for another.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Purpose {
    /// A rank joining the rendezvous of rank 0.
    Rendezvous,
    /// A data link of the TCP transport.
    Data,
    /// A link of the bootstrap's exchanges between two ranks (`bootstrap/mesh.rs`).
    Exchange,
    /// A watchdog's connection to the hub that took over a star (`fault/control.rs`).
    Control,
}

impl Purpose {
    fn code(self) -> u8 {
        match self {
            Purpose::Rendezvous => 1,
            Purpose::Data => 2,
            Purpose::Exchange => 3,
            Purpose::Control => 4,
        }
    }

    fn from_code(c: u8) -> Option<Purpose> {
        match c {
            1 => Some(Purpose::Rendezvous),
            2 => Some(Purpose::Data),
            3 => Some(Purpose::Exchange),
            4 => Some(Purpose::Control),
            _ => None,
        }
    }
}

/// The connector's authenticated introduction.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Hello {
    /// The connector's rank.
    pub rank: usize,
    /// What the connection is for.
    pub purpose: Purpose,
    /// The communicator's tag (see [`comm_tag`]); connections of another communicator carry
    /// another tag.
    pub tag: u64,
}

impl Hello {
    fn encode(&self) -> [u8; PAYLOAD_LEN] {
        let mut b = [0u8; PAYLOAD_LEN];
        b[..4].copy_from_slice(&(self.rank as u32).to_le_bytes());
        b[4] = self.purpose.code();
        b[5..].copy_from_slice(&self.tag.to_le_bytes());
        b
    }

    fn decode(b: &[u8; PAYLOAD_LEN]) -> Option<Hello> {
        let rank = u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize;
        let purpose = Purpose::from_code(b[4])?;
        let mut t = [0u8; 8];
        t.copy_from_slice(&b[5..]);
        Some(Hello {
            rank,
            purpose,
            tag: u64::from_le_bytes(t),
        })
    }
}

/// The acceptor's last word in a handshake.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// The connection is accepted.
    Accepted,
    /// Refused: the connector's MAC, purpose or communicator tag is wrong.
    Refused,
    /// Refused: another connection already claimed this rank.
    DuplicateRank,
    /// Refused: this acceptor expects no connection from that rank.
    UnexpectedRank,
    /// Refused: this acceptor is connecting (or connected) to that rank itself, and its
    /// connection makes the pair's link (a TCP link made on first use that both ends dialed
    /// at once).
    Crossed,
}

impl Verdict {
    fn code(self) -> u8 {
        match self {
            Verdict::Accepted => 0,
            Verdict::Refused => 1,
            Verdict::DuplicateRank => 2,
            Verdict::UnexpectedRank => 3,
            Verdict::Crossed => 4,
        }
    }

    fn describe(code: u8) -> &'static str {
        match code {
            0 => "accepted",
            1 => "refused (wrong secret, purpose or communicator)",
            2 => "refused: another connection already claimed this rank",
            3 => "refused: the acceptor expects no connection from this rank",
            4 => "refused: the acceptor is connecting to this rank itself (crossed connections; its own makes the link)",
            _ => "refused with an unknown verdict",
        }
    }
}

/// A tag naming a communicator, derived from its secret (first 8 bytes of
/// `SHA-256("oxccl-comm-tag" || secret)`). Safe to show: it reveals nothing of the secret.
pub fn comm_tag(secret: &[u8; 16]) -> u64 {
    use sha2::Digest;
    let mut h = Sha256::new();
    h.update(b"oxccl-comm-tag");
    h.update(secret);
    let d = h.finalize();
    let mut b = [0u8; 8];
    b.copy_from_slice(&d[..8]);
    u64::from_le_bytes(b)
}

/// HMAC-SHA256 keyed by `secret` over `parts` one after the other: the one MAC of the crate
/// (the handshake's proofs here, the status agent's answers through [`mac_tag`] and
/// [`mac_matches`]).
fn mac(secret: &[u8; 16], parts: &[&[u8]]) -> HmacSha256 {
    // HMAC accepts keys of any length: this cannot fail.
    let mut m = <HmacSha256 as KeyInit>::new_from_slice(secret)
        .unwrap_or_else(|_| unreachable!("HMAC takes any key length"));
    for p in parts {
        m.update(p);
    }
    m
}

/// The [`mac`] of `parts`, keyed by `secret`.
pub(crate) fn mac_tag(secret: &[u8; 16], parts: &[&[u8]]) -> [u8; 32] {
    mac(secret, parts).finalize().into_bytes().into()
}

/// Whether `tag` is the [`mac`] of `parts` keyed by `secret` (compared in constant time).
pub(crate) fn mac_matches(secret: &[u8; 16], parts: &[&[u8]], tag: &[u8]) -> bool {
    mac(secret, parts).verify_slice(tag).is_ok()
}

fn nonce(rank: usize, addr: &str) -> Result<[u8; NONCE]> {
    let mut n = [0u8; NONCE];
    getrandom::fill(&mut n).map_err(|e| Error::Auth {
        rank,
        addr: addr.to_string(),
        msg: format!("no randomness for a nonce: {e}"),
    })?;
    Ok(n)
}

fn io_auth(rank: usize, addr: &str, step: &str, e: io::Error) -> Error {
    let msg = match e.kind() {
        io::ErrorKind::UnexpectedEof => format!("{step}: the other side closed the connection"),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => format!("{step}: timed out"),
        _ => format!("{step}: {e}"),
    };
    Error::Auth {
        rank,
        addr: addr.to_string(),
        msg,
    }
}

fn io_client(rank: usize, addr: &str, step: &str, source: io::Error) -> Error {
    // A socket timeout reads "Resource temporarily unavailable (os error 11)": say what it is.
    let source = match source.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => io::Error::new(
            io::ErrorKind::TimedOut,
            "no answer in time (the acceptor is busy, stopped or not an oxccl rank)",
        ),
        _ => source,
    };
    Error::Io {
        rank,
        context: format!("handshake with {addr}: {step}"),
        source,
    }
}

fn check_magic(b: &[u8], rank: usize, addr: &str) -> Result<()> {
    if b[..8] != MAGIC {
        return Err(Error::Auth {
            rank,
            addr: addr.to_string(),
            msg: "not an oxccl peer (bad magic)".into(),
        });
    }
    let v = u16::from_le_bytes([b[8], b[9]]);
    if v != VERSION {
        return Err(Error::Auth {
            rank,
            addr: addr.to_string(),
            msg: format!("protocol version {v}, this build speaks {VERSION}"),
        });
    }
    Ok(())
}

/// The connector's side of the handshake, up to and including the acceptor's verdict.
/// `rank` is this rank and `addr` the remote address, both for error messages. Fails with
/// [`Error::Auth`] when the acceptor does not know the secret, is no oxccl peer or refuses
/// us (retrying cannot help), and with [`Error::Io`] when the connection fails or times out
/// (a retry may succeed).
pub fn client_handshake<S: Read + Write>(
    s: &mut S,
    secret: &[u8; 16],
    hello: &Hello,
    rank: usize,
    addr: &str,
) -> Result<()> {
    let nonce_c = nonce(rank, addr)?;
    let mut m1 = [0u8; HELLO_C_LEN];
    m1[..8].copy_from_slice(&MAGIC);
    m1[8..10].copy_from_slice(&VERSION.to_le_bytes());
    m1[10..].copy_from_slice(&nonce_c);
    s.write_all(&m1)
        .and_then(|_| s.flush())
        .map_err(|e| io_client(rank, addr, "sending challenge", e))?;

    let mut m2 = [0u8; HELLO_A_LEN];
    s.read_exact(&mut m2)
        .map_err(|e| io_client(rank, addr, "reading the acceptor's answer", e))?;
    check_magic(&m2, rank, addr)?;
    let nonce_a = &m2[10..10 + NONCE];
    let tag_a = &m2[10 + NONCE..];
    mac(secret, &[b"oxccl-acceptor", &nonce_c, nonce_a])
        .verify_slice(tag_a)
        .map_err(|_| Error::Auth {
            rank,
            addr: addr.to_string(),
            msg: "the acceptor does not know this communicator's secret".into(),
        })?;

    let payload = hello.encode();
    let tag_c = mac(secret, &[b"oxccl-connector", nonce_a, &nonce_c, &payload])
        .finalize()
        .into_bytes();
    let mut m3 = [0u8; PROOF_C_LEN];
    m3[..PAYLOAD_LEN].copy_from_slice(&payload);
    m3[PAYLOAD_LEN..].copy_from_slice(&tag_c);
    s.write_all(&m3)
        .and_then(|_| s.flush())
        .map_err(|e| io_client(rank, addr, "sending proof", e))?;

    let mut v = [0u8; 1];
    s.read_exact(&mut v)
        .map_err(|e| io_client(rank, addr, "reading the verdict", e))?;
    if v[0] != Verdict::Accepted.code() {
        return Err(Error::Auth {
            rank,
            addr: addr.to_string(),
            msg: Verdict::describe(v[0]).to_string(),
        });
    }
    Ok(())
}

/// The acceptor's side of the handshake, up to checking the connector's proof, purpose and
/// tag. On success it returns the connector's [`Hello`]; the caller then decides and sends
/// the verdict with [`send_verdict`]. On a wrong proof, purpose or tag it sends
/// [`Verdict::Refused`] itself and fails with [`Error::Auth`]. Garbage, truncated input or a
/// silent peer (with a timeout on `s`) fail with [`Error::Auth`] too; nothing read is
/// allocated. (Listeners use `net::accept`, which runs the same steps
/// without a thread per connection.)
pub fn server_handshake<S: Read + Write>(
    s: &mut S,
    secret: &[u8; 16],
    purpose: Purpose,
    tag: u64,
    rank: usize,
    addr: &str,
) -> Result<Hello> {
    let mut m1 = [0u8; HELLO_C_LEN];
    s.read_exact(&mut m1)
        .map_err(|e| io_auth(rank, addr, "reading the challenge", e))?;
    let (nonce_a, m2) = answer_challenge(&m1, secret, rank, addr)?;
    s.write_all(&m2)
        .and_then(|_| s.flush())
        .map_err(|e| io_auth(rank, addr, "answering the challenge", e))?;
    let mut m3 = [0u8; PROOF_C_LEN];
    s.read_exact(&mut m3)
        .map_err(|e| io_auth(rank, addr, "reading the proof", e))?;
    let nonce_c: [u8; NONCE] = m1[10..].try_into().unwrap_or([0; NONCE]);
    check_proof(&m3, secret, &nonce_c, &nonce_a, purpose, tag, rank, addr).inspect_err(|_| {
        let _ = send_verdict(s, Verdict::Refused);
    })
}

/// Step 2 of the acceptor: checks the connector's challenge `m1` (magic and version) and
/// returns the acceptor's nonce and its answer, to be sent.
pub(crate) fn answer_challenge(
    m1: &[u8; HELLO_C_LEN],
    secret: &[u8; 16],
    rank: usize,
    addr: &str,
) -> Result<([u8; NONCE], [u8; HELLO_A_LEN])> {
    check_magic(m1, rank, addr)?;
    let nonce_c = &m1[10..];
    let nonce_a = nonce(rank, addr)?;
    let tag_a = mac(secret, &[b"oxccl-acceptor", nonce_c, &nonce_a])
        .finalize()
        .into_bytes();
    let mut m2 = [0u8; HELLO_A_LEN];
    m2[..8].copy_from_slice(&MAGIC);
    m2[8..10].copy_from_slice(&VERSION.to_le_bytes());
    m2[10..10 + NONCE].copy_from_slice(&nonce_a);
    m2[10 + NONCE..].copy_from_slice(&tag_a);
    Ok((nonce_a, m2))
}

/// Step 4 of the acceptor: checks the connector's proof `m3`, purpose and tag. On an error
/// the caller should send [`Verdict::Refused`].
#[allow(clippy::too_many_arguments)]
pub(crate) fn check_proof(
    m3: &[u8; PROOF_C_LEN],
    secret: &[u8; 16],
    nonce_c: &[u8; NONCE],
    nonce_a: &[u8; NONCE],
    purpose: Purpose,
    tag: u64,
    rank: usize,
    addr: &str,
) -> Result<Hello> {
    let mut payload = [0u8; PAYLOAD_LEN];
    payload.copy_from_slice(&m3[..PAYLOAD_LEN]);
    let refuse = |msg: String| {
        Err(Error::Auth {
            rank,
            addr: addr.to_string(),
            msg,
        })
    };
    if mac(secret, &[b"oxccl-connector", nonce_a, nonce_c, &payload])
        .verify_slice(&m3[PAYLOAD_LEN..])
        .is_err()
    {
        return refuse("the connector does not know this communicator's secret".into());
    }
    let Some(hello) = Hello::decode(&payload) else {
        return refuse("unknown connection purpose".into());
    };
    if hello.purpose != purpose {
        return refuse(format!(
            "connection for {:?}, expected {:?}",
            hello.purpose, purpose
        ));
    }
    if hello.tag != tag {
        return refuse(format!(
            "connection for communicator {:016x}, expected {tag:016x}",
            hello.tag
        ));
    }
    Ok(hello)
}

/// Whether `e` is [`client_handshake`]'s error for a [`Verdict::Crossed`] answer.
pub(crate) fn is_crossed(e: &Error) -> bool {
    matches!(e, Error::Auth { msg, .. } if msg == Verdict::describe(Verdict::Crossed.code()))
}

/// Sends the acceptor's verdict (one byte) after [`server_handshake`].
pub fn send_verdict<S: Write>(s: &mut S, v: Verdict) -> io::Result<()> {
    s.write_all(&[v.code()])?;
    s.flush()
}

/// Frames up to this size are written with one `write` (see [`write_frame`]).
const SMALL_FRAME: usize = 64 << 10;

/// Writes one frame: a 4-byte little-endian length, then `data`.
pub fn write_frame<W: Write>(w: &mut W, data: &[u8]) -> io::Result<()> {
    let len = u32::try_from(data.len())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "frame over 4 GiB"))?;
    // One write: a header written alone would leave the body behind Nagle's algorithm on a
    // socket without TCP_NODELAY until the peer's delayed ACK (~40 ms on Linux), as the
    // rendezvous join did.
    // (Large frames fill whole segments: two writes, no copy.)
    if data.len() > SMALL_FRAME {
        w.write_all(&len.to_le_bytes())?;
        w.write_all(data)?;
        return w.flush();
    }
    let mut frame = Vec::with_capacity(4 + data.len());
    frame.extend_from_slice(&len.to_le_bytes());
    frame.extend_from_slice(data);
    w.write_all(&frame)?;
    w.flush()
}

/// Reads one frame written by [`write_frame`]. A length above `max` fails with
/// [`io::ErrorKind::InvalidData`] before anything is allocated.
pub fn read_frame<R: Read>(r: &mut R, max: usize) -> io::Result<Vec<u8>> {
    let mut l = [0u8; 4];
    r.read_exact(&mut l)?;
    let len = u32::from_le_bytes(l) as usize;
    if len > max {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("frame of {len} bytes exceeds the limit of {max}"),
        ));
    }
    let mut buf = vec![0u8; len];
    r.read_exact(&mut buf)?;
    Ok(buf)
}

/// A borrowed [`TcpStream`] whose reads and writes all end by one deadline: before each
/// operation the socket timeout is set to the time left, so a peer that trickles bytes
/// cannot stretch a handshake.
pub struct Deadlined<'a> {
    stream: &'a TcpStream,
    deadline: Instant,
    /// While a read waits: every this often, this runs (a progress line).
    tick: Option<(Duration, Box<dyn FnMut() + 'a>)>,
}

impl std::fmt::Debug for Deadlined<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Deadlined")
            .field("stream", &self.stream)
            .field("deadline", &self.deadline)
            .field("tick", &self.tick.as_ref().map(|t| t.0))
            .finish()
    }
}

impl<'a> Deadlined<'a> {
    /// Wraps `stream` until `deadline`.
    pub fn new(stream: &'a TcpStream, deadline: Instant) -> Self {
        Deadlined {
            stream,
            deadline,
            tick: None,
        }
    }

    /// Runs `f` every `every` that a read waits with nothing received (to say what it waits
    /// for), until the deadline.
    pub fn with_tick(mut self, every: Duration, f: impl FnMut() + 'a) -> Self {
        if !every.is_zero() {
            self.tick = Some((every, Box::new(f)));
        }
        self
    }

    fn left(&self) -> io::Result<Duration> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            Err(io::Error::new(io::ErrorKind::TimedOut, "deadline passed"))
        } else {
            Ok(left)
        }
    }
}

impl Read for Deadlined<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            let left = self.left()?;
            let wait = self
                .tick
                .as_ref()
                .map_or(left, |(every, _)| left.min(*every));
            self.stream.set_read_timeout(Some(wait))?;
            match (&*self.stream).read(buf) {
                Err(e)
                    if wait < left
                        && matches!(
                            e.kind(),
                            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                        ) =>
                {
                    if let Some((_, f)) = &mut self.tick {
                        f();
                    }
                }
                r => return r,
            }
        }
    }
}

impl Write for Deadlined<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.stream.set_write_timeout(Some(self.left()?))?;
        (&*self.stream).write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;
    use std::os::unix::net::UnixStream;

    const S1: [u8; 16] = [7; 16];
    const S2: [u8; 16] = [8; 16];

    /// Counts the writes made to it.
    #[derive(Default)]
    struct Writes(Vec<Vec<u8>>);

    impl Write for Writes {
        fn write(&mut self, b: &[u8]) -> io::Result<usize> {
            self.0.push(b.to_vec());
            Ok(b.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_small_frame_is_one_write() {
        // A header written alone leaves the body behind Nagle's algorithm until the peer's
        // delayed ACK (the rendezvous join waited ~40 ms per rank that way).
        let mut w = Writes::default();
        write_frame(&mut w, b"join").unwrap();
        assert_eq!(w.0, vec![b"\x04\0\0\0join".to_vec()]);
        let mut w = Writes::default();
        let big = vec![5u8; SMALL_FRAME + 1];
        write_frame(&mut w, &big).unwrap();
        let all: Vec<u8> = w.0.concat();
        assert_eq!(read_frame(&mut &all[..], big.len()).unwrap(), big);
    }

    fn hello(rank: usize) -> Hello {
        Hello {
            rank,
            purpose: Purpose::Data,
            tag: comm_tag(&S1),
        }
    }

    fn run_pair(
        cs: [u8; 16],
        ss: [u8; 16],
        h: Hello,
        purpose: Purpose,
        tag: u64,
    ) -> (Result<()>, Result<Hello>) {
        let (mut a, mut b) = UnixStream::pair().unwrap();
        a.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        b.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let t = std::thread::spawn(move || {
            let r = server_handshake(&mut b, &ss, purpose, tag, 0, "test");
            if r.is_ok() {
                send_verdict(&mut b, Verdict::Accepted).unwrap();
            }
            r
        });
        let c = client_handshake(&mut a, &cs, &h, 1, "test");
        drop(a);
        (c, t.join().unwrap())
    }

    #[test]
    fn good_secret_passes() {
        let (c, s) = run_pair(S1, S1, hello(3), Purpose::Data, comm_tag(&S1));
        c.unwrap();
        assert_eq!(s.unwrap(), hello(3));
    }

    #[test]
    fn wrong_secret_fails_both_sides() {
        let (c, s) = run_pair(S1, S2, hello(3), Purpose::Data, comm_tag(&S1));
        assert!(matches!(c, Err(Error::Auth { .. })), "{c:?}");
        assert!(matches!(s, Err(Error::Auth { .. })), "{s:?}");
    }

    #[test]
    fn wrong_purpose_or_tag_refused() {
        let (c, s) = run_pair(S1, S1, hello(3), Purpose::Rendezvous, comm_tag(&S1));
        assert!(matches!(c, Err(Error::Auth { .. })), "{c:?}");
        assert!(matches!(s, Err(Error::Auth { .. })), "{s:?}");
        let (c, s) = run_pair(S1, S1, hello(3), Purpose::Data, comm_tag(&S2));
        assert!(matches!(c, Err(Error::Auth { .. })), "{c:?}");
        assert!(matches!(s, Err(Error::Auth { .. })), "{s:?}");
    }

    /// A stream that reads from a fixed input and swallows writes.
    struct Scripted {
        input: io::Cursor<Vec<u8>>,
        out: Vec<u8>,
    }

    impl Read for Scripted {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            self.input.read(buf)
        }
    }

    impl Write for Scripted {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.out.extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    fn scripted(input: Vec<u8>) -> Scripted {
        Scripted {
            input: io::Cursor::new(input),
            out: Vec::new(),
        }
    }

    #[test]
    fn garbage_and_truncated_input_fail_cleanly() {
        let tag = comm_tag(&S1);
        for input in [
            Vec::new(),
            b"GET / HTTP/1.1\r\n\r\nxxxxxxxxxxxxxxxxxxxxxx".to_vec(),
            MAGIC.to_vec(),
            [&MAGIC[..], &[1, 0], &[0; 10]].concat(),
            [&MAGIC[..], &[9, 0], &[0; 16]].concat(),
            [&MAGIC[..], &[1, 0], &[0; 16], &[0xff; PROOF_C_LEN]].concat(),
            [&MAGIC[..], &[1, 0], &[0; 16], &[0xff; 10]].concat(),
        ] {
            let mut s = scripted(input);
            let r = server_handshake(&mut s, &S1, Purpose::Data, tag, 0, "test");
            assert!(matches!(r, Err(Error::Auth { .. })), "{r:?}");
            let mut s = scripted(s.out.clone());
            let r = client_handshake(&mut s, &S1, &hello(1), 1, "test");
            assert!(
                matches!(r, Err(Error::Auth { .. } | Error::Io { .. })),
                "{r:?}"
            );
        }
    }

    #[test]
    fn oversized_frame_refused_without_allocating() {
        let mut input = (u32::MAX).to_le_bytes().to_vec();
        input.extend_from_slice(&[0; 16]);
        let e = read_frame(&mut io::Cursor::new(input), 1 << 20).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData);
        // Truncated frame.
        let mut input = 10u32.to_le_bytes().to_vec();
        input.extend_from_slice(&[1, 2, 3]);
        let e = read_frame(&mut io::Cursor::new(input), 1 << 20).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
        // Round trip.
        let mut buf = Vec::new();
        write_frame(&mut buf, b"hello").unwrap();
        assert_eq!(read_frame(&mut io::Cursor::new(buf), 5).unwrap(), b"hello");
    }

    #[test]
    fn deadline_stops_a_silent_peer() {
        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        drop(a);
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let _c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (s, _) = l.accept().unwrap();
        let start = Instant::now();
        let mut d = Deadlined::new(&s, Instant::now() + Duration::from_millis(200));
        let r = server_handshake(&mut d, &S1, Purpose::Data, 0, 0, "test");
        assert!(matches!(r, Err(Error::Auth { .. })), "{r:?}");
        assert!(start.elapsed() < Duration::from_secs(2));
    }

    proptest::proptest! {
        #[test]
        fn random_bytes_never_panic_the_acceptor(input in proptest::collection::vec(proptest::num::u8::ANY, 0..200)) {
            let mut s = scripted(input.clone());
            proptest::prop_assert!(server_handshake(&mut s, &S1, Purpose::Data, 1, 0, "p").is_err());
            let mut s = scripted(input.clone());
            proptest::prop_assert!(client_handshake(&mut s, &S1, &hello(1), 1, "p").is_err());
            let _ = read_frame(&mut io::Cursor::new(input), 64);
        }
    }
}
