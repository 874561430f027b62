//! What each rank tells the others at rendezvous ([`PeerInfo`]) and how it travels: the
//! join message every rank sends rank 0, and the little-endian readers and the address
//! encoding the bootstrap's messages share.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// Largest join message (a [`PeerInfo`]) rank 0 accepts.
pub(super) const MAX_JOIN: usize = 64 << 10;
/// Longest host id or host name a [`PeerInfo`] may carry.
pub(super) const MAX_NAME: usize = 4096;
/// The join message's format, its first byte.
pub(super) const JOIN_VERSION: u8 = 2;

/// What each rank tells the others at rendezvous.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerInfo {
    /// The rank.
    pub rank: usize,
    /// Host identity: ranks with equal host ids share memory (see [`crate::bootstrap::topo`]).
    pub host_id: String,
    /// Host name, for messages.
    pub hostname: String,
    /// Process id, for messages and liveness checks of shared-memory peers.
    pub pid: u32,
    /// The address this rank's data connections listen on (the interface that routes to the
    /// rendezvous, or `OXCCL_SOCKET_IFNAME`'s).
    pub ip: IpAddr,
}

impl PeerInfo {
    pub(super) fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&(self.rank as u32).to_le_bytes());
        out.extend_from_slice(&self.pid.to_le_bytes());
        encode_ip(self.ip, out);
        for s in [&self.host_id, &self.hostname] {
            let b = &s.as_bytes()[..s.len().min(MAX_NAME)];
            out.extend_from_slice(&(b.len() as u16).to_le_bytes());
            out.extend_from_slice(b);
        }
    }

    /// Reads what `encode` wrote; `None` for anything malformed.
    pub fn decode(r: &mut &[u8]) -> Option<PeerInfo> {
        let rank = take_u32(r)? as usize;
        let pid = take_u32(r)?;
        let ip = decode_ip(r)?;
        let mut strs = [String::new(), String::new()];
        for s in &mut strs {
            let len = u16::from_le_bytes(take(r, 2)?.try_into().ok()?) as usize;
            *s = String::from_utf8(take(r, len)?.to_vec()).ok()?;
        }
        let [host_id, hostname] = strs;
        Some(PeerInfo {
            rank,
            host_id,
            hostname,
            pid,
            ip,
        })
    }
}

/// Parses a join message (what each rank sends rank 0): version, world size, [`PeerInfo`],
/// the port of the rank's exchange listener (`u16`, 0 in a world of one).
pub(crate) fn parse_join(join: &[u8]) -> Option<(usize, PeerInfo, u16)> {
    let mut r = join;
    if take(&mut r, 1)?[0] != JOIN_VERSION {
        return None;
    }
    let ws = take_u32(&mut r)? as usize;
    let info = PeerInfo::decode(&mut r)?;
    let port = u16::from_le_bytes(take(&mut r, 2)?.try_into().ok()?);
    r.is_empty().then_some((ws, info, port))
}

pub(super) fn take<'a>(r: &mut &'a [u8], n: usize) -> Option<&'a [u8]> {
    if r.len() < n {
        return None;
    }
    let (a, b) = r.split_at(n);
    *r = b;
    Some(a)
}

pub(super) fn take_u32(r: &mut &[u8]) -> Option<u32> {
    Some(u32::from_le_bytes(take(r, 4)?.try_into().ok()?))
}

pub(super) fn take_u64(r: &mut &[u8]) -> Option<u64> {
    Some(u64::from_le_bytes(take(r, 8)?.try_into().ok()?))
}

/// Writes an address as a family byte (4 or 6) and 16 address bytes.
pub(crate) fn encode_ip(ip: IpAddr, out: &mut Vec<u8>) {
    let mut b = [0u8; 16];
    match ip {
        IpAddr::V4(v) => {
            out.push(4);
            b[..4].copy_from_slice(&v.octets());
        }
        IpAddr::V6(v) => {
            out.push(6);
            b.copy_from_slice(&v.octets());
        }
    }
    out.extend_from_slice(&b);
}

/// Reads what [`encode_ip`] wrote.
pub(crate) fn decode_ip(r: &mut &[u8]) -> Option<IpAddr> {
    let fam = take(r, 1)?[0];
    let b: [u8; 16] = take(r, 16)?.try_into().ok()?;
    match fam {
        4 => Some(IpAddr::V4(Ipv4Addr::new(b[0], b[1], b[2], b[3]))),
        6 => Some(IpAddr::V6(Ipv6Addr::from(b))),
        _ => None,
    }
}
