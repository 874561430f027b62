//! How a single-copy call reaches one buffer of a peer: through a mapping of the peer's shared
//! buffer, or with the kernel's cross-memory copies.

use std::ptr::NonNull;

use crate::base::error::Result;
use crate::base::reduce;
use crate::direct::exec::DirectCtx;

/// How this rank reaches one buffer of a peer: through a mapping of the peer's shared memory
/// (`local`: where the buffer starts here), or with the kernel's cross-memory copies at `addr`.
#[derive(Clone, Copy)]
pub(super) struct PeerBuf {
    pub(super) peer: usize,
    pub(super) addr: u64,
    pub(super) local: Option<NonNull<u8>>,
    /// Whether its owner published it as a shared buffer (known alike to every rank, unlike
    /// `local`: a rank that fails to map it falls back to cross-memory copies).
    pub(super) published: bool,
}

impl PeerBuf {
    /// Copies `dst.len()` bytes at `off` of the buffer into `dst` (with streaming stores if
    /// `nt` and the buffer is mapped).
    pub(super) fn read(
        &self,
        cx: &DirectCtx<'_>,
        off: usize,
        dst: &mut [u8],
        nt: bool,
    ) -> Result<()> {
        match self.local {
            // SAFETY: `off + dst.len()` is within the peer's buffer (the header check made
            // every rank's lengths agree), which lies inside the mapping (checked when it was
            // mapped); nobody writes these bytes in this phase, and `dst` is this rank's own
            // memory.
            Some(l) => copy(nt, dst, unsafe {
                std::slice::from_raw_parts(l.as_ptr().add(off), dst.len())
            }),
            None => cx
                .direct
                .read_peer(self.peer, self.addr + off as u64, dst)
                .map_err(|e| cx.read_error(self.peer, e))?,
        }
        Ok(())
    }

    /// Copies `src` to `off` of the buffer (with streaming stores if `nt` and the buffer is
    /// mapped).
    pub(super) fn write(&self, cx: &DirectCtx<'_>, off: usize, src: &[u8], nt: bool) -> Result<()> {
        // Not while the peer's process forks (see `Direct::enter_peer_writes`).
        cx.direct.enter_peer_writes(self.peer);
        let res = self.write_ungated(cx, off, src, nt);
        cx.direct.leave_peer_writes(self.peer);
        res
    }

    fn write_ungated(&self, cx: &DirectCtx<'_>, off: usize, src: &[u8], nt: bool) -> Result<()> {
        match self.local {
            // SAFETY: within the peer's buffer as in `read`; only this rank touches these bytes
            // in this phase, and `src` is this rank's own memory.
            Some(l) => copy(
                nt,
                unsafe { std::slice::from_raw_parts_mut(l.as_ptr().add(off), src.len()) },
                src,
            ),
            None => cx
                .direct
                .write_peer(self.peer, self.addr + off as u64, src)
                .map_err(|e| cx.write_error(self.peer, e))?,
        }
        Ok(())
    }

    /// The `k` bytes at `off`: in place where the buffer is mapped, else read into `tmp`.
    pub(super) fn view<'t>(
        &self,
        cx: &DirectCtx<'_>,
        off: usize,
        k: usize,
        tmp: &'t mut [u8],
    ) -> Result<&'t [u8]> {
        match self.local {
            // SAFETY: as in `read`; the slice is dropped before this rank's next event, and
            // nobody writes these bytes until then (only their owner, this rank, writes an
            // in-place buffer's block, after its last read of it).
            Some(l) => Ok(unsafe { std::slice::from_raw_parts(l.as_ptr().add(off), k) }),
            None => {
                self.read(cx, off, &mut tmp[..k], false)?;
                Ok(&tmp[..k])
            }
        }
    }
}

/// Copies `src` into `dst`, with streaming stores if `nt`.
pub(super) fn copy(nt: bool, dst: &mut [u8], src: &[u8]) {
    if nt {
        reduce::copy_streaming(dst, src);
    } else {
        dst.copy_from_slice(src);
    }
}
