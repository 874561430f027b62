//! Cross-memory attach (`process_vm_readv`/`process_vm_writev`) of a whole range: the
//! single-copy transfers of the shared-memory transport (`transport/shm/lend.rs`) and the
//! direct area's start-up probe (`direct/shm.rs`) read and write a peer's memory with these.

use std::io::{IoSlice, IoSliceMut};

use nix::sys::uio::{process_vm_readv, process_vm_writev, RemoteIoVec};
use nix::unistd::Pid as NixPid;

/// Repeats `step(done)` (which moves bytes from offset `done` on and returns how many it
/// moved) until `len` bytes have moved: the kernel may move fewer than asked.
fn until_done(
    len: usize,
    what: &str,
    mut step: impl FnMut(usize) -> nix::Result<usize>,
) -> std::io::Result<()> {
    let mut done = 0;
    while done < len {
        let k = step(done).map_err(std::io::Error::from)?;
        if k == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                format!("{what} moved nothing"),
            ));
        }
        done += k;
    }
    Ok(())
}

/// Copies `dst.len()` bytes at `addr` of process `pid` into `dst`.
pub(crate) fn read_remote(pid: u32, addr: u64, dst: &mut [u8]) -> std::io::Result<()> {
    let len = dst.len();
    until_done(len, "process_vm_readv", |done| {
        let remote = [RemoteIoVec {
            base: addr as usize + done,
            len: len - done,
        }];
        let mut local = [IoSliceMut::new(&mut dst[done..])];
        process_vm_readv(NixPid::from_raw(pid as i32), &mut local, &remote)
    })
}

/// Copies `src` to `addr` of process `pid`.
pub(crate) fn write_remote(pid: u32, addr: u64, src: &[u8]) -> std::io::Result<()> {
    let len = src.len();
    until_done(len, "process_vm_writev", |done| {
        let remote = [RemoteIoVec {
            base: addr as usize + done,
            len: len - done,
        }];
        process_vm_writev(
            NixPid::from_raw(pid as i32),
            &[IoSlice::new(&src[done..])],
            &remote,
        )
    })
}
