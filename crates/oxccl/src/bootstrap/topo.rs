//! Topology: which ranks share a host, and so which transport links each pair.

use std::net::IpAddr;

use crate::base::param::TransportChoice;
use crate::bootstrap::PeerInfo;

/// Ranks grouped by host identity.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Topology {
    /// For each rank, the index of its host in [`hosts`](Self::hosts).
    pub host_of: Vec<usize>,
    /// For each host (in order of first appearance), its ranks in increasing order.
    pub hosts: Vec<Vec<usize>>,
}

impl Topology {
    /// Groups ranks by [`PeerInfo::host_id`].
    pub fn new(peers: &[PeerInfo]) -> Self {
        let mut ids: Vec<&str> = Vec::new();
        let mut hosts: Vec<Vec<usize>> = Vec::new();
        let host_of = peers
            .iter()
            .enumerate()
            .map(|(r, p)| {
                let h = match ids.iter().position(|id| *id == p.host_id) {
                    Some(h) => h,
                    None => {
                        ids.push(&p.host_id);
                        hosts.push(Vec::new());
                        ids.len() - 1
                    }
                };
                hosts[h].push(r);
                h
            })
            .collect();
        Topology { host_of, hosts }
    }

    /// From the host index of each rank (hosts numbered as given; tests).
    #[cfg(test)]
    pub(crate) fn of_hosts(host_of: Vec<usize>) -> Self {
        let mut hosts = vec![Vec::new(); host_of.iter().max().map_or(0, |m| m + 1)];
        for (r, &h) in host_of.iter().enumerate() {
            hosts[h].push(r);
        }
        Topology { host_of, hosts }
    }

    /// `rank`'s index among the ranks of its host.
    pub fn local_rank(&self, rank: usize) -> usize {
        let h = &self.hosts[self.host_of[rank]];
        h.iter().position(|&r| r == rank).unwrap_or(0)
    }

    /// How many ranks share `rank`'s host.
    pub fn local_size(&self, rank: usize) -> usize {
        self.hosts[self.host_of[rank]].len()
    }
}

/// Which peers of `me` get a shared-memory link (with their pid) and which a TCP link (with
/// their address), under the user's transport choice. Errs when `shm` is forced but a peer is
/// on another host.
#[allow(clippy::type_complexity)]
pub(crate) fn plan_links(
    me: usize,
    peers: &[PeerInfo],
    topo: &Topology,
    choice: TransportChoice,
) -> Result<(Vec<(usize, u32)>, Vec<(usize, IpAddr)>), String> {
    let mut shm = Vec::new();
    let mut tcp = Vec::new();
    for (r, p) in peers.iter().enumerate() {
        if r == me {
            continue;
        }
        let same_host = topo.host_of[r] == topo.host_of[me];
        match (choice, same_host) {
            (TransportChoice::Tcp, _) | (TransportChoice::Auto, false) => {
                if !same_host && p.ip.is_loopback() != peers[me].ip.is_loopback() {
                    // One side will not reach the other: say why before the connect times out.
                    tracing::warn!(
                        "rank {me} ({}) and rank {r} on host {} ({}) disagree on loopback: \
                         MASTER_ADDR probably resolves to 127.x on some host; use an address \
                         every host can reach, or set OXCCL_SOCKET_IFNAME",
                        peers[me].ip,
                        p.hostname,
                        p.ip
                    );
                }
                tcp.push((r, p.ip))
            }
            (TransportChoice::Shm | TransportChoice::Auto, true) => shm.push((r, p.pid)),
            (TransportChoice::Shm, false) => {
                return Err(format!(
                    "OXCCL_TRANSPORT=shm, but rank {r} is on host {} ({}), not this host ({})",
                    p.hostname, p.host_id, peers[me].host_id
                ))
            }
        }
    }
    Ok((shm, tcp))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(rank: usize, host: &str) -> PeerInfo {
        PeerInfo {
            rank,
            host_id: host.into(),
            hostname: host.into(),
            pid: 100 + rank as u32,
            ip: "127.0.0.1".parse().unwrap(),
        }
    }

    #[test]
    fn groups_and_plans() {
        let peers = vec![info(0, "a"), info(1, "b"), info(2, "a"), info(3, "b")];
        let t = Topology::new(&peers);
        assert_eq!(t.hosts, vec![vec![0, 2], vec![1, 3]]);
        assert_eq!(t.local_rank(2), 1);
        assert_eq!(t.local_size(3), 2);
        let (shm, tcp) = plan_links(0, &peers, &t, TransportChoice::Auto).unwrap();
        assert_eq!(shm, vec![(2, 102)]);
        assert_eq!(tcp.iter().map(|x| x.0).collect::<Vec<_>>(), vec![1, 3]);
        let (shm, tcp) = plan_links(0, &peers, &t, TransportChoice::Tcp).unwrap();
        assert!(shm.is_empty());
        assert_eq!(tcp.len(), 3);
        let err = plan_links(0, &peers, &t, TransportChoice::Shm).unwrap_err();
        assert!(err.contains("rank 1"), "{err}");
    }
}
