//! How a shared-memory segment gets from the rank that creates it to its peers, so that
//! nothing outlives the job in `/dev/shm`, however the ranks die:
//!
//! - by default the segment is a memfd (anonymous: it lives while someone holds it open or
//!   mapped) and peers take a copy of its descriptor with `pidfd_open` + `pidfd_getfd`, or
//!   open `/proc/<pid>/fd/<n>` where `pidfd_getfd` is refused (it needs ptrace rights, which
//!   Yama's `ptrace_scope=1` withholds between siblings; the `/proc` link needs only read
//!   rights). The token sent to peers is `fd:<pid>:<n>`.
//! - where no peer can do either (another pid namespace, a hardened kernel), the ranks fall
//!   back to named files, `/dev/shm/oxccl-<tag>-<rank>-<pidns>-<pid>`, unlinked as soon as
//!   every peer has opened them; a rank killed before that leaves its file, which the next
//!   job of the same user and pid namespace removes ([`remove_stale`]) once its pid is dead.

use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};

use rustix::fs::{Mode, OFlags};

use super::segment::{PREFIX, SHM_DIR};

/// How the segments of one `connect` are shared.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Sharing {
    /// memfd, handed over by pid and descriptor number.
    Memfd,
    /// A named file in `/dev/shm`.
    Named,
}

/// A new memfd called `name` (the name shows in `/proc/<pid>/fd` only).
pub(crate) fn memfd(name: &str) -> Result<OwnedFd, String> {
    rustix::fs::memfd_create(name, rustix::fs::MemfdFlags::CLOEXEC)
        .map_err(|e| format!("memfd_create({name}): {e}"))
}

/// The token that lets peers open `fd` of this process.
pub(crate) fn token(fd: &OwnedFd) -> String {
    format!("fd:{}:{}", std::process::id(), fd.as_raw_fd())
}

/// Why a token could not be opened.
#[derive(Debug)]
pub(crate) enum OpenError {
    /// The kernel refuses this process access to the peer's descriptors: fall back to
    /// named files.
    Refused(String),
    /// Anything else (the peer is gone, a malformed token): an error.
    Failed(String),
}

/// A copy of the descriptor that [`token`] names in process `pid` (which must be the pid the
/// token carries).
pub(crate) fn open_token(tok: &str, pid: u32) -> Result<OwnedFd, OpenError> {
    let bad = || OpenError::Failed(format!("malformed segment token {tok:?}"));
    let mut it = tok.strip_prefix("fd:").ok_or_else(bad)?.split(':');
    let (Some(p), Some(n), None) = (it.next(), it.next(), it.next()) else {
        return Err(bad());
    };
    let (p, n): (u32, i32) = (p.parse().map_err(|_| bad())?, n.parse().map_err(|_| bad())?);
    if p != pid {
        return Err(OpenError::Failed(format!(
            "the segment was created by pid {p}, but the rank is pid {pid}"
        )));
    }
    let rpid = rustix::process::Pid::from_raw(pid as i32).ok_or_else(bad)?;
    let pidfd = rustix::process::pidfd_open(rpid, rustix::process::PidfdFlags::empty()).map_err(
        |e| match e {
            rustix::io::Errno::SRCH => {
                OpenError::Failed(format!("process {pid} is gone (it died during start-up)"))
            }
            rustix::io::Errno::NOSYS | rustix::io::Errno::PERM | rustix::io::Errno::ACCESS => {
                OpenError::Refused(format!("pidfd_open({pid}): {e}"))
            }
            e => OpenError::Failed(format!("pidfd_open({pid}): {e}")),
        },
    )?;
    match rustix::process::pidfd_getfd(&pidfd, n, rustix::process::PidfdGetfdFlags::empty()) {
        Ok(fd) => Ok(fd),
        Err(
            e @ (rustix::io::Errno::PERM | rustix::io::Errno::ACCESS | rustix::io::Errno::NOSYS),
        ) => {
            let link = format!("/proc/{pid}/fd/{n}");
            rustix::fs::open(&link, OFlags::RDWR | OFlags::CLOEXEC, Mode::empty()).map_err(|e2| {
                OpenError::Refused(format!(
                    "pidfd_getfd of descriptor {n} of pid {pid}: {e}; open {link}: {e2}"
                ))
            })
        }
        Err(rustix::io::Errno::BADF) => Err(OpenError::Failed(format!(
            "pid {pid} no longer holds descriptor {n} (it gave up the start-up)"
        ))),
        Err(e) => Err(OpenError::Failed(format!(
            "pidfd_getfd of descriptor {n} of pid {pid}: {e}"
        ))),
    }
}

/// This process's pid namespace as a number (the inode of `/proc/self/ns/pid`), 0 if unknown.
fn pidns_ino() -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self/ns/pid").map_or(0, |m| m.ino())
}

/// The named-file path of `what` (e.g. `0123abcd-3` for rank 3's segment of a communicator)
/// made by this process.
pub(crate) fn named_path(what: &str) -> PathBuf {
    PathBuf::from(format!(
        "{SHM_DIR}/{PREFIX}{what}-{}-{}",
        pidns_ino(),
        std::process::id()
    ))
}

/// Whether the file name was made by [`named_path`] in this pid namespace by a process that
/// is gone.
fn is_stale(name: &str, ns: u64) -> bool {
    let Some(rest) = name.strip_prefix(PREFIX) else {
        return false;
    };
    let mut parts = rest.rsplitn(3, '-');
    let (Some(pid), Some(file_ns), Some(_)) = (parts.next(), parts.next(), parts.next()) else {
        return false;
    };
    let (Ok(pid), Ok(file_ns)) = (pid.parse::<i32>(), file_ns.parse::<u64>()) else {
        return false;
    };
    if file_ns != ns || ns == 0 {
        return false;
    }
    match rustix::process::Pid::from_raw(pid) {
        Some(p) => matches!(
            rustix::process::test_kill_process(p),
            Err(rustix::io::Errno::SRCH)
        ),
        None => false,
    }
}

/// Removes the named segments in `dir` of dead processes of this user and pid namespace
/// (left by ranks killed during a start-up); returns how many.
pub(crate) fn remove_stale(dir: &Path) -> usize {
    use std::os::unix::fs::MetadataExt;
    let ns = pidns_ino();
    let uid = rustix::process::getuid().as_raw();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    let mut removed = 0;
    for e in entries.flatten() {
        let Ok(name) = e.file_name().into_string() else {
            continue;
        };
        if !is_stale(&name, ns) || !e.metadata().is_ok_and(|m| m.uid() == uid) {
            continue;
        }
        if std::fs::remove_file(e.path()).is_ok() {
            tracing::info!("removed {} left by a dead rank", e.path().display());
            removed += 1;
        }
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_opens_the_same_memory_and_bad_tokens_fail() {
        let fd = memfd("oxccl-test").unwrap();
        rustix::fs::ftruncate(&fd, 4096).unwrap();
        let tok = token(&fd);
        let copy = open_token(&tok, std::process::id()).unwrap();
        let a = rustix::fs::fstat(&fd).unwrap();
        let b = rustix::fs::fstat(&copy).unwrap();
        assert_eq!((a.st_dev, a.st_ino), (b.st_dev, b.st_ino));
        for bad in ["", "fd:", "fd:1", "fd:x:3", "path:/dev/shm/x", "fd:1:2:3"] {
            assert!(
                matches!(
                    open_token(bad, std::process::id()),
                    Err(OpenError::Failed(_))
                ),
                "{bad}"
            );
        }
        let other_pid = format!("fd:{}:3", std::process::id() + 1);
        assert!(matches!(
            open_token(&other_pid, std::process::id()),
            Err(OpenError::Failed(_))
        ));
        // A descriptor this process does not hold.
        let closed = format!("fd:{}:999999", std::process::id());
        assert!(matches!(
            open_token(&closed, std::process::id()),
            Err(OpenError::Failed(_))
        ));
    }

    #[test]
    fn stale_named_files_of_dead_pids_are_removed_and_others_kept() {
        let dir = std::env::temp_dir().join(format!("oxccl-stale-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let ns = pidns_ino();
        // A pid that is surely dead: a child that has been reaped.
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let dead_pid = child.id();
        child.wait().unwrap();
        let me = std::process::id();
        let names = [
            (format!("{PREFIX}00ab-1-{ns}-{dead_pid}"), true),
            (format!("{PREFIX}00ab-d1-{ns}-{dead_pid}"), true),
            (format!("{PREFIX}00ab-2-{ns}-{me}"), false),
            (format!("{PREFIX}00ab-3-{}-{dead_pid}", ns + 1), false),
            (format!("{PREFIX}00ab-4-{dead_pid}"), false),
            (format!("other-00ab-1-{ns}-{dead_pid}"), false),
        ];
        for (n, _) in &names {
            std::fs::write(dir.join(n), b"x").unwrap();
        }
        assert_eq!(remove_stale(&dir), 2);
        for (n, gone) in &names {
            assert_eq!(!dir.join(n).exists(), *gone, "{n}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
