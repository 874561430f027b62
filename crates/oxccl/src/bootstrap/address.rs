//! Where this rank is: the host identity that decides who shares memory, the host name, and
//! the address its data connections listen on.

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket};

use crate::base::error::{Error, Result};
use crate::base::param::Config;

/// This host's identity for deciding who shares memory: `cfg.host_id` (`OXCCL_HOSTID`) if
/// set, else `hostname:boot_id:dev:inode`, where the boot id comes from
/// `/proc/sys/kernel/random/boot_id` and the device and inode are those of `/dev/shm` (so
/// containers with separate `/dev/shm` mounts do not count as one host).
pub fn local_host_id(cfg: &Config) -> String {
    if let Some(h) = &cfg.host_id {
        return h.clone();
    }
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "noboot".into());
    let shm = {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata("/dev/shm")
            .map(|m| format!("{}:{}", m.dev(), m.ino()))
            .unwrap_or_else(|_| "noshm".into())
    };
    format!("{}:{boot}:{shm}", hostname())
}

/// This host's name (`uname`'s node name).
pub(super) fn hostname() -> String {
    rustix::system::uname()
        .nodename()
        .to_string_lossy()
        .into_owned()
}

/// The address this rank's data connections should listen on: the first address of the
/// interface `cfg.socket_ifname` names (preferring `toward`'s address family), else the
/// local address of a UDP socket "connected" to `toward` (which picks the route without
/// sending anything; no host name is looked up). An unknown interface name is an
/// [`Error::Env`] listing the interfaces that exist.
pub(crate) fn local_ip(cfg: &Config, toward: SocketAddr) -> Result<IpAddr> {
    if let Some(name) = &cfg.socket_ifname {
        let ifs = if_addrs::get_if_addrs().map_err(|e| {
            Error::Env(format!(
                "OXCCL_SOCKET_IFNAME={name}: cannot list network interfaces: {e}"
            ))
        })?;
        let mine: Vec<IpAddr> = ifs
            .iter()
            .filter(|i| &i.name == name)
            .map(|i| i.ip())
            .collect();
        return mine.iter().find(|ip| ip.is_ipv4() == toward.is_ipv4()).or(mine.first()).copied().ok_or_else(|| {
            let mut names: Vec<&str> = ifs.iter().map(|i| i.name.as_str()).collect();
            names.sort_unstable();
            names.dedup();
            Error::Env(format!("OXCCL_SOCKET_IFNAME={name}: no such interface with an address; this host has: {}", names.join(", ")))
        });
    }
    let bind: SocketAddr = if toward.is_ipv4() {
        (Ipv4Addr::UNSPECIFIED, 0).into()
    } else {
        (Ipv6Addr::UNSPECIFIED, 0).into()
    };
    let probe = || -> io::Result<IpAddr> {
        let s = UdpSocket::bind(bind)?;
        s.connect(toward)?;
        Ok(s.local_addr()?.ip())
    };
    match probe() {
        Ok(ip) if !ip.is_unspecified() => Ok(ip),
        Ok(_) => Ok(if toward.is_ipv4() {
            Ipv4Addr::LOCALHOST.into()
        } else {
            Ipv6Addr::LOCALHOST.into()
        }),
        Err(e) => Err(Error::Env(format!(
            "no route to {toward} to pick a local address ({e}); set OXCCL_SOCKET_IFNAME"
        ))),
    }
}
