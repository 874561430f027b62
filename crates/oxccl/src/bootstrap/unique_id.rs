//! The [`UniqueId`]: the rendezvous address and the communicator's secret.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, UdpSocket};
use std::str::FromStr;
use std::sync::Mutex;

use crate::base::error::{Error, Result};

/// Made by one rank ([`UniqueId::new`]), handed to every other rank out of band, then passed
/// to `Communicator::init`: the address where rank 0 hosts the rendezvous, and a random
/// 128-bit secret every connection must prove it knows.
///
/// It travels as a string (`oxccl1:<ip:port>:<32 hex digits>`, see [`Display`](fmt::Display)
/// and [`FromStr`]) or as [`UniqueId::BYTES`] bytes ([`to_bytes`](Self::to_bytes),
/// [`from_bytes`](Self::from_bytes)). Both forms contain the secret: pass them only to the
/// ranks of the communicator. `Debug` never shows the secret.
#[derive(Clone, PartialEq, Eq)]
pub struct UniqueId {
    /// Where rank 0 listens for the rendezvous.
    pub addr: SocketAddr,
    /// The communicator's secret.
    pub secret: [u8; 16],
}

impl fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never print the secret.
        f.debug_struct("UniqueId")
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

/// Listeners bound by [`UniqueId::new`], waiting for rank 0's `Bootstrap::init` in this
/// process to take them over (so the port cannot be lost between the two calls).
static PARKED: Mutex<Vec<(SocketAddr, TcpListener)>> = Mutex::new(Vec::new());

/// Parks `listener` for `addr`, for a later `Bootstrap::init` of rank 0 in this process
/// (as [`UniqueId::new`] does; used by `Communicator::shrink`).
pub(crate) fn park(addr: SocketAddr, listener: TcpListener) {
    PARKED
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push((addr, listener));
}

/// Takes the listener [`UniqueId::new`] parked for `addr` in this process, if any.
pub(crate) fn take_parked(addr: SocketAddr) -> Option<TcpListener> {
    let mut p = PARKED.lock().unwrap_or_else(|e| e.into_inner());
    let i = p.iter().position(|(a, _)| *a == addr)?;
    Some(p.swap_remove(i).1)
}

/// This host's address on the interface that routes outward: the local address of a UDP
/// socket "connected" to a public-looking address (connecting a UDP socket only picks a
/// route; no packet is sent). 127.0.0.1 when there is no route.
pub fn default_ip() -> IpAddr {
    let probe = |bind: SocketAddr, to: SocketAddr| -> Option<IpAddr> {
        let s = UdpSocket::bind(bind).ok()?;
        s.connect(to).ok()?;
        let ip = s.local_addr().ok()?.ip();
        (!ip.is_unspecified()).then_some(ip)
    };
    probe(
        (Ipv4Addr::UNSPECIFIED, 0).into(),
        (Ipv4Addr::new(8, 8, 8, 8), 53).into(),
    )
    .or_else(|| {
        probe(
            (Ipv6Addr::UNSPECIFIED, 0).into(),
            (
                Ipv6Addr::new(0x2001, 0x4860, 0x4860, 0, 0, 0, 0, 0x8888),
                53,
            )
                .into(),
        )
    })
    .unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST))
}

fn random_secret() -> Result<[u8; 16]> {
    let mut s = [0u8; 16];
    getrandom::fill(&mut s).map_err(|e| Error::Io {
        rank: 0,
        context: "drawing the communicator secret".into(),
        source: std::io::Error::other(e.to_string()),
    })?;
    Ok(s)
}

/// Parses 32 hex digits into a secret.
pub(crate) fn parse_secret_hex(s: &str) -> Option<[u8; 16]> {
    let b = s.as_bytes();
    if b.len() != 32 {
        return None;
    }
    let mut out = [0u8; 16];
    for (i, o) in out.iter_mut().enumerate() {
        let hi = (b[2 * i] as char).to_digit(16)?;
        let lo = (b[2 * i + 1] as char).to_digit(16)?;
        *o = (hi * 16 + lo) as u8;
    }
    Some(out)
}

impl UniqueId {
    /// Size of [`to_bytes`](Self::to_bytes)'s output.
    pub const BYTES: usize = 40;

    /// A fresh id, as `ncclGetUniqueId`: binds a listener on this host's default interface
    /// ([`default_ip`]), port 0, and keeps it for rank 0's `Bootstrap::init` in this process
    /// (which must therefore be the process that called this), with a random secret.
    pub fn new() -> Result<UniqueId> {
        Self::new_on(default_ip())
    }

    /// As [`new`](Self::new), but listening on `ip` (e.g. 127.0.0.1 for a single host).
    pub fn new_on(ip: IpAddr) -> Result<UniqueId> {
        let secret = random_secret()?;
        let listener = TcpListener::bind((ip, 0)).map_err(|source| Error::Io {
            rank: 0,
            context: format!("binding the rendezvous listener on {ip}"),
            source,
        })?;
        let addr = listener.local_addr().map_err(|source| Error::Io {
            rank: 0,
            context: "reading the rendezvous address".into(),
            source,
        })?;
        PARKED
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((addr, listener));
        Ok(UniqueId { addr, secret })
    }

    /// An id for a rendezvous at a known address (e.g. from a launcher) with a known secret.
    /// Nothing is bound: rank 0 binds `addr` in `Bootstrap::init`.
    pub fn with_addr(addr: SocketAddr, secret: [u8; 16]) -> UniqueId {
        UniqueId { addr, secret }
    }

    /// The binary form: `b"OXC1"`, family (4 or 6), 16 address bytes (IPv4 in the first
    /// four), port (big endian), secret, one reserved zero byte.
    pub fn to_bytes(&self) -> [u8; Self::BYTES] {
        let mut b = [0u8; Self::BYTES];
        b[..4].copy_from_slice(b"OXC1");
        match self.addr.ip() {
            IpAddr::V4(ip) => {
                b[4] = 4;
                b[5..9].copy_from_slice(&ip.octets());
            }
            IpAddr::V6(ip) => {
                b[4] = 6;
                b[5..21].copy_from_slice(&ip.octets());
            }
        }
        b[21..23].copy_from_slice(&self.addr.port().to_be_bytes());
        b[23..39].copy_from_slice(&self.secret);
        b
    }

    /// Parses [`to_bytes`](Self::to_bytes)'s output; anything else is an [`Error::Env`].
    pub fn from_bytes(b: &[u8]) -> Result<UniqueId> {
        let bad = |why: &str| Error::Env(format!("malformed UniqueId bytes: {why}"));
        if b.len() != Self::BYTES {
            return Err(bad(&format!("{} bytes, expected {}", b.len(), Self::BYTES)));
        }
        if &b[..4] != b"OXC1" {
            return Err(bad("wrong magic or version"));
        }
        let ip = match b[4] {
            4 => IpAddr::V4(Ipv4Addr::new(b[5], b[6], b[7], b[8])),
            6 => {
                let mut o = [0u8; 16];
                o.copy_from_slice(&b[5..21]);
                IpAddr::V6(Ipv6Addr::from(o))
            }
            _ => return Err(bad("unknown address family")),
        };
        let port = u16::from_be_bytes([b[21], b[22]]);
        let mut secret = [0u8; 16];
        secret.copy_from_slice(&b[23..39]);
        Ok(UniqueId {
            addr: SocketAddr::new(ip, port),
            secret,
        })
    }
}

impl fmt::Display for UniqueId {
    /// `oxccl1:<ip:port>:<secret as 32 hex digits>`; IPv6 addresses in brackets.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "oxccl1:{}:", self.addr)?;
        for b in self.secret {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

impl FromStr for UniqueId {
    type Err = Error;

    /// Parses the [`Display`](fmt::Display) form. Errors are [`Error::Env`] and never
    /// repeat the secret.
    fn from_str(s: &str) -> Result<UniqueId> {
        let s = s.trim();
        let bad = |why: &str| {
            Error::Env(format!(
                "malformed UniqueId string: {why} (expected oxccl1:<ip:port>:<32 hex digits>)"
            ))
        };
        let rest = s
            .strip_prefix("oxccl1:")
            .ok_or_else(|| bad("missing 'oxccl1:' prefix"))?;
        let (addr, secret) = rest.rsplit_once(':').ok_or_else(|| bad("missing secret"))?;
        let addr: SocketAddr = addr.parse().map_err(|_| bad("bad address"))?;
        let secret =
            parse_secret_hex(secret).ok_or_else(|| bad("the secret is not 32 hex digits"))?;
        Ok(UniqueId { addr, secret })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn string_and_bytes_round_trip() {
        for addr in ["127.0.0.1:29500", "[::1]:80", "[fe80::1]:65535"] {
            let id = UniqueId::with_addr(addr.parse().unwrap(), *b"0123456789abcdef");
            let s = id.to_string();
            assert!(s.starts_with("oxccl1:"));
            assert_eq!(s.parse::<UniqueId>().unwrap(), id);
            assert_eq!(UniqueId::from_bytes(&id.to_bytes()).unwrap(), id);
        }
    }

    #[test]
    fn malformed_ids_rejected() {
        for s in [
            "",
            "oxccl1:",
            "oxccl2:127.0.0.1:1:00112233445566778899aabbccddeeff",
            "oxccl1:127.0.0.1:1:0011",
            "oxccl1:nohost:00112233445566778899aabbccddeeff",
            "oxccl1:127.0.0.1:1:zz112233445566778899aabbccddeeff",
        ] {
            assert!(matches!(s.parse::<UniqueId>(), Err(Error::Env(_))), "{s}");
        }
        assert!(UniqueId::from_bytes(&[0; 3]).is_err());
        let mut b = UniqueId::with_addr("127.0.0.1:1".parse().unwrap(), [1; 16]).to_bytes();
        b[4] = 5;
        assert!(UniqueId::from_bytes(&b).is_err());
    }

    #[test]
    fn debug_hides_secret() {
        let id = UniqueId::with_addr("127.0.0.1:1".parse().unwrap(), [0xab; 16]);
        let d = format!("{id:?}");
        assert!(!d.contains("ab") && !d.contains("171"), "{d}");
    }

    #[test]
    fn new_parks_listener() {
        let id = UniqueId::new_on(IpAddr::V4(Ipv4Addr::LOCALHOST)).unwrap();
        assert_ne!(id.addr.port(), 0);
        let other = UniqueId::new_on(IpAddr::V4(Ipv4Addr::LOCALHOST)).unwrap();
        assert_ne!(id.secret, other.secret);
        assert!(take_parked(id.addr).is_some());
        assert!(take_parked(id.addr).is_none());
        assert!(take_parked(other.addr).is_some());
    }
}
