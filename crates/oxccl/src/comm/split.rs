//! [`Communicator::split`]: new communicators from groups of an existing one, with
//! `ncclCommSplit`'s semantics.

use crate::base::error::{Error, Result};
use crate::bootstrap::{default_ip, local_ip, UniqueId};
use crate::comm::Communicator;

/// Bytes per rank of the first exchange: present flag, color, key.
const ENTRY: usize = 1 + 4 + 8;
/// Bytes per rank of the second exchange: present flag, the group's id.
const ID_ENTRY: usize = 1 + UniqueId::BYTES;

impl Communicator {
    /// Splits this communicator as `ncclCommSplit`: every rank calls it (it is a collective of
    /// this communicator); the ranks that pass the same `color` form a new communicator, in
    /// which they are ordered by `key`, then by their rank here. `color: None` (NCCL's
    /// `NCCL_SPLIT_NOCOLOR`) joins no new communicator and gets `Ok(None)`.
    ///
    /// The new communicators have this one's settings and are independent of it (each has
    /// its own links, sequence numbers and stream); this one stays usable. Each group's new
    /// rank 0 makes a fresh [`UniqueId`] and hands it to the group over this communicator.
    pub fn split(&self, color: Option<u32>, key: i64) -> Result<Option<Communicator>> {
        let n = self.world_size();
        let me = self.rank();

        // 1. Everyone's (color, key).
        let mut mine = [0u8; ENTRY];
        if let Some(c) = color {
            mine[0] = 1;
            mine[1..5].copy_from_slice(&c.to_le_bytes());
        }
        mine[5..13].copy_from_slice(&key.to_le_bytes());
        let mut all = vec![0u8; ENTRY * n];
        self.all_gather(&mine, &mut all)?;
        let entries: Vec<(Option<u32>, i64)> = all
            .chunks_exact(ENTRY)
            .map(|e| {
                let c = u32::from_le_bytes(e[1..5].try_into().expect("4 bytes"));
                let k = i64::from_le_bytes(e[5..13].try_into().expect("8 bytes"));
                ((e[0] == 1).then_some(c), k)
            })
            .collect();
        if entries[me] != (color, key) {
            return Err(Error::Protocol {
                rank: me,
                peer: me,
                call: "split",
                seq: 0,
                msg: "this rank's own (color, key) came back changed".into(),
            });
        }

        // 2. My group, in new-rank order: by key, then by rank here.
        let group = color.map(|c| {
            let mut g: Vec<usize> = (0..n).filter(|&r| entries[r].0 == Some(c)).collect();
            g.sort_by_key(|&r| (entries[r].1, r));
            g
        });
        let new_rank = group
            .as_ref()
            .map(|g| g.iter().position(|&r| r == me).expect("in own group"));

        // 3. Each group's new rank 0 makes the group's id; everyone learns them all.
        let mut id_entry = [0u8; ID_ENTRY];
        if new_rank == Some(0) {
            let ip = match &self.config().socket_ifname {
                Some(_) => local_ip(self.config(), ([127, 0, 0, 1], 0).into())?,
                None => default_ip(),
            };
            let id = UniqueId::new_on(ip)?;
            id_entry[0] = 1;
            id_entry[1..].copy_from_slice(&id.to_bytes());
        }
        let mut ids = vec![0u8; ID_ENTRY * n];
        self.all_gather(&id_entry, &mut ids)?;

        let (Some(group), Some(new_rank)) = (group, new_rank) else {
            return Ok(None);
        };
        let leader = group[0];
        let e = &ids[leader * ID_ENTRY..(leader + 1) * ID_ENTRY];
        if e[0] != 1 {
            return Err(Error::Protocol {
                rank: me,
                peer: leader,
                call: "split",
                seq: 0,
                msg: "the group's first rank sent no id".into(),
            });
        }
        let id = UniqueId::from_bytes(&e[1..])?;
        Communicator::init_with_config(&id, new_rank, group.len(), self.config().clone()).map(Some)
    }
}
