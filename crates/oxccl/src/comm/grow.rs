//! [`Communicator::grow`]: new ranks join a running communicator (as NCCL 2.27's
//! `ncclCommGrow`), e.g. a replacement for a rank lost and [`shrink`](Communicator::shrink)ed
//! out.

use crate::base::error::{Error, Result};
use crate::bootstrap::UniqueId;
use crate::comm::Communicator;

/// Bytes per rank of the agreement exchange: magic, id present flag, new rank count, id.
const ENTRY: usize = 4 + 1 + 8 + UniqueId::BYTES;
/// Marks a grow entry, so that a rank calling another all_gather of the same size is caught.
const MAGIC: &[u8; 4] = b"GROW";

impl Communicator {
    /// Builds a communicator of this one's `n` ranks plus `new_ranks` new ones. Every rank
    /// of this communicator calls it (it is a collective here); each new process calls
    /// [`Communicator::init`]`(&id, r, n + new_ranks)` with `r` in `n..n + new_ranks`. The
    /// ranks here keep their numbers; the new communicator has this one's settings and is
    /// independent of it (this one stays usable).
    ///
    /// `id` is the new communicator's [`UniqueId`], made by [`UniqueId::new`] in rank 0's
    /// process (rank 0 hosts the rendezvous) and handed out of band to the new processes.
    /// Rank 0 must pass it; the others may pass `None` (they learn it from rank 0 here) or
    /// the same id. All ranks must pass the same `new_ranks`: a disagreement (or an id that
    /// differs from rank 0's) is an [`Error::InvalidArgument`] on every rank, naming the
    /// rank at odds. Every wait is bounded by the timeout (a new process that never comes
    /// makes the init time out, naming the missing rank).
    pub fn grow(&self, new_ranks: usize, id: Option<&UniqueId>) -> Result<Communicator> {
        self.own_process("grow")?;
        let (rank, n) = (self.rank(), self.world_size());
        let bad = |msg: String| Error::InvalidArgument {
            rank,
            call: "grow",
            seq: 0,
            msg,
        };
        if new_ranks == 0 {
            return Err(bad("grow by 0 ranks".into()));
        }
        let mut mine = [0u8; ENTRY];
        mine[..4].copy_from_slice(MAGIC);
        mine[5..13].copy_from_slice(&(new_ranks as u64).to_le_bytes());
        if let Some(id) = id {
            mine[4] = 1;
            mine[13..].copy_from_slice(&id.to_bytes());
        }
        let mut all = vec![0u8; ENTRY * n];
        self.all_gather(&mine, &mut all)?;
        let entries: Vec<&[u8]> = all.chunks_exact(ENTRY).collect();
        let root = entries[0];
        if &root[..4] == MAGIC && root[4] != 1 {
            return Err(bad(
                "rank 0 must pass the new communicator's UniqueId".into()
            ));
        }
        for (r, e) in entries.iter().enumerate() {
            if &e[..4] != MAGIC {
                return Err(bad(format!(
                    "rank {r} is not calling grow (another call of the same size?)"
                )));
            }
            if e[5..13] != root[5..13] {
                let k = u64::from_le_bytes(e[5..13].try_into().expect("8 bytes"));
                let k0 = u64::from_le_bytes(root[5..13].try_into().expect("8 bytes"));
                return Err(bad(format!(
                    "rank {r} grows by {k} rank(s), rank 0 by {k0}"
                )));
            }
            if e[4] == 1 && e[13..] != root[13..] {
                return Err(bad(format!(
                    "rank {r} passed a UniqueId other than rank 0's"
                )));
            }
        }
        let id = UniqueId::from_bytes(&root[13..])?;
        let size = n + new_ranks;
        let mut cfg = self.config().clone();
        cfg.timeout = self.timeout();
        tracing::info!(rank, old = n, new = size, addr = %id.addr, "grow");
        Communicator::init_with_config(&id, rank, size, cfg)
    }
}
