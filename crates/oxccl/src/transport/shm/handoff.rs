//! How a shared-memory segment gets from the rank that creates it to its peers, so that
//! nothing outlives the job in `/dev/shm`, however the ranks die:
//!
//! - by default the segment is a memfd (anonymous: it lives while someone holds it open or
//!   mapped) and peers take a copy of its descriptor with `pidfd_open` + `pidfd_getfd`, or
//!   open `/proc/<pid>/fd/<n>` where `pidfd_getfd` is refused (it needs ptrace rights, which
//!   Yama's `ptrace_scope=1` withholds between siblings; the `/proc` link needs only read
//!   rights). The token sent to peers is `fd:<pid>:<n>`.
//! - where no peer can do either (another pid namespace, a hardened kernel), the ranks fall
//!   back to named files, `/dev/shm/oxccl-<tag>-<rank>-L<random>`, unlinked as soon as
//!   every peer has opened them. The random part makes names of two job instances distinct
//!   (pids and pid-namespace numbers repeat: ranks in their own pid namespaces are all pid 1).
//!   The creator holds an exclusive `flock` on its file for the file's lifetime, so a file
//!   whose lock can be taken belongs to a dead rank, in whatever pid namespace: the survivors
//!   of a failed start-up remove those of their job ([`sweep_after_failure`]) and every
//!   start-up with named files removes any of the user's ([`remove_stale`]).

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
    /// The peer's process is gone (it died during start-up): an error that names it as lost.
    Gone(String),
    /// Anything else (a malformed token, ...): an error.
    Failed(String),
}

/// A copy of the descriptor that [`token`] names in process `pid` (which must be the pid the
/// token carries).
pub(crate) fn open_token(tok: &str, pid: u32) -> Result<OwnedFd, OpenError> {
    let bad = || OpenError::Failed(format!("malformed segment token {tok:?}"));
    let gone = || {
        OpenError::Gone(format!(
            "its process {pid} is gone (it died during start-up)"
        ))
    };
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
            rustix::io::Errno::SRCH => gone(),
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
        Err(rustix::io::Errno::SRCH) => Err(gone()),
        Err(rustix::io::Errno::BADF) => Err(OpenError::Failed(format!(
            "pid {pid} no longer holds descriptor {n} (it gave up the start-up)"
        ))),
        Err(e) => Err(OpenError::Failed(format!(
            "pidfd_getfd of descriptor {n} of pid {pid}: {e}"
        ))),
    }
}

/// Marks the random part of a named segment's file name: `oxccl-<what>-L<16 hex digits>`.
const NONCE_MARK: &str = "-L";

/// A fresh named-file path for `what` (e.g. `0123abcd-3` for rank 3's segment of a
/// communicator): `/dev/shm/oxccl-<what>-L<random>`. The random part makes every job
/// instance's names distinct, whatever pids and pid namespaces the ranks have.
pub(crate) fn named_path(what: &str) -> PathBuf {
    let mut b = [0u8; 8];
    // A failed getrandom falls back to the time and pid: still distinct between jobs.
    let nonce = match getrandom::fill(&mut b) {
        Ok(()) => u64::from_le_bytes(b),
        Err(_) => {
            let t = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64);
            t ^ (u64::from(std::process::id()) << 32)
        }
    };
    PathBuf::from(format!("{SHM_DIR}/{PREFIX}{what}{NONCE_MARK}{nonce:016x}"))
}

/// Whether `name` was made by [`named_path`].
fn is_named_segment(name: &str) -> bool {
    let Some(rest) = name.strip_prefix(PREFIX) else {
        return false;
    };
    match rest.rsplit_once(NONCE_MARK) {
        Some((what, nonce)) => {
            !what.is_empty() && nonce.len() == 16 && nonce.bytes().all(|c| c.is_ascii_hexdigit())
        }
        None => false,
    }
}

/// Creates the file `path` (mode 0600, `O_EXCL`) and takes an exclusive `flock` on it that
/// the creator holds for the file's lifetime (the lock goes with the open file, which the
/// mapping keeps: it is released only when the creator unmaps and closes it, or dies). A file
/// whose lock can be taken is therefore stale ([`remove_stale`]). If a sweeper removed the file
/// between its creation and the lock, tries again under a fresh name; `Ok` holds the path.
pub(crate) fn create_locked(what: &str) -> Result<(OwnedFd, PathBuf), String> {
    let mut last = String::new();
    for _ in 0..4 {
        let path = named_path(what);
        let fd: OwnedFd = match rustix::fs::open(
            &path,
            OFlags::RDWR | OFlags::CREATE | OFlags::EXCL | OFlags::CLOEXEC | OFlags::NOFOLLOW,
            Mode::from_raw_mode(0o600),
        ) {
            Ok(fd) => fd,
            Err(rustix::io::Errno::EXIST) => {
                // A random 64-bit name already taken: a stale file (removed if so) or a
                // collision; either way try another name.
                remove_if_stale(&path);
                last = format!(
                    "cannot create {}: it exists (os error 17) and is in use",
                    path.display()
                );
                continue;
            }
            Err(e) => return Err(super::segment::io_msg("cannot create", &path, e)),
        };
        rustix::fs::flock(&fd, rustix::fs::FlockOperation::LockExclusive)
            .map_err(|e| super::segment::io_msg("flock", &path, e))?;
        let st = rustix::fs::fstat(&fd).map_err(|e| super::segment::io_msg("fstat", &path, e))?;
        if st.st_nlink > 0 {
            return Ok((fd, path));
        }
        last = format!("{} was removed while being created", path.display());
    }
    Err(last)
}

/// Removes `path` if no live process holds its lock; whether it did.
fn remove_if_stale(path: &Path) -> bool {
    let Ok(fd) = rustix::fs::open(
        path,
        OFlags::RDONLY | OFlags::CLOEXEC | OFlags::NOFOLLOW | OFlags::NONBLOCK,
        Mode::empty(),
    ) else {
        return false;
    };
    if rustix::fs::flock(&fd, rustix::fs::FlockOperation::NonBlockingLockExclusive).is_err() {
        return false;
    }
    // Unlinked while holding the lock: a creator that opened the file just before blocks in
    // its flock until we close, then sees no link and picks another name.
    rustix::fs::unlink(path).is_ok()
}

/// Removes the named segments in `dir` of this user whose creator is gone (no process holds
/// the file's lock: ranks killed during a start-up, in any pid namespace); returns how many.
pub(crate) fn remove_stale(dir: &Path) -> usize {
    remove_stale_with(dir, "")
}

/// [`remove_stale`], for the files whose name (after the `oxccl-` prefix) starts with `what`.
pub(crate) fn remove_stale_with(dir: &Path, what: &str) -> usize {
    use std::os::unix::fs::MetadataExt;
    let uid = rustix::process::getuid().as_raw();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    let mut removed = 0;
    for e in entries.flatten() {
        let Ok(name) = e.file_name().into_string() else {
            continue;
        };
        if !is_named_segment(&name)
            || !name[PREFIX.len()..].starts_with(what)
            || !e.metadata().is_ok_and(|m| m.uid() == uid && m.is_file())
        {
            continue;
        }
        if remove_if_stale(&e.path()) {
            tracing::info!("removed {} left by a dead rank", e.path().display());
            removed += 1;
        }
    }
    removed
}

/// The named segments in `dir` whose name (after `oxccl-`) starts with `what`.
pub(crate) fn named_files(dir: &Path, what: &str) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| is_named_segment(n) && n[PREFIX.len()..].starts_with(what))
        .collect()
}

/// After a failed start-up with named files: removes the files of communicator prefix `what`
/// left by dead ranks, waiting a little (at most `patience`) for peers that are still
/// exiting to release theirs, so that nothing of this job stays in `/dev/shm`.
pub(crate) fn sweep_after_failure(dir: &Path, what: &str, patience: std::time::Duration) {
    let start = std::time::Instant::now();
    loop {
        remove_stale_with(dir, what);
        if named_files(dir, what).is_empty() || start.elapsed() >= patience {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
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
    fn files_whose_lock_is_free_are_stale_and_held_ones_are_kept() {
        let dir = std::env::temp_dir().join(format!("oxccl-stale-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let n = |what: &str, nonce: &str| format!("{PREFIX}{what}{NONCE_MARK}{nonce}");
        let names = [
            (n("00ab-1", "0123456789abcdef"), true),
            (n("00ab-d1", "fedcba9876543210"), true),
            (n("00ab-2", "00000000000000aa"), false), // locked below: a live creator
            (n("00cd-3", "00000000000000bb"), false), // another job: not swept with "00ab"
            (format!("{PREFIX}00ab-4-12345-1"), false), // not a name of ours
            (n("00ab-5", "xyz"), false),
            (format!("other-00ab-1{NONCE_MARK}0123456789abcdef"), false),
        ];
        for (name, _) in &names {
            std::fs::write(dir.join(name), b"x").unwrap();
        }
        let held = std::fs::File::open(dir.join(&names[2].0)).unwrap();
        rustix::fs::flock(&held, rustix::fs::FlockOperation::LockExclusive).unwrap();
        assert_eq!(remove_stale_with(&dir, "00ab"), 2);
        for (name, gone) in &names {
            assert_eq!(!dir.join(name).exists(), *gone, "{name}");
        }
        // Released (its creator died): the next sweep removes it.
        drop(held);
        assert_eq!(
            remove_stale(&dir),
            2,
            "the released file and the other job's"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_created_file_is_locked_until_closed_and_names_never_repeat() {
        let what = format!("unittest-lock-{:x}", std::process::id());
        let (fd, path) = create_locked(&what).unwrap();
        let (fd2, path2) = create_locked(&what).unwrap();
        assert_ne!(path, path2);
        let dir = Path::new(SHM_DIR);
        assert_eq!(remove_stale_with(dir, &what), 0);
        assert!(path.exists() && path2.exists());
        drop(fd);
        drop(fd2);
        sweep_after_failure(dir, &what, std::time::Duration::from_secs(2));
        assert!(!path.exists() && !path2.exists());
        assert!(named_files(dir, &what).is_empty());
    }
}
