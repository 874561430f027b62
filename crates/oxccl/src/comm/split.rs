//! [`Communicator::split`]: new communicators from groups of an existing one, with
//! `ncclCommSplit`'s semantics.

use std::sync::Arc;

use crate::base::error::{Error, Result};
use crate::bootstrap::{default_ip, local_ip, UniqueId};
use crate::comm::fault::CAUSE_GRACE;
use crate::comm::Communicator;
use crate::fault::health::Failure;

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
        self.own_process("split")?;
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
        self.init_watched_as("split", &id, new_rank, group, self.config().clone())
            .map(Some)
    }

    /// Joins the communicator of `id` as its rank `rank` (as
    /// [`init_with_config`](Communicator::init_with_config)) while this communicator watches:
    /// `group[i]` is the rank here of the new communicator's rank `i`, and `group[rank]` must
    /// be this rank. A rank of the group lost here during the init fails the init at once
    /// with this communicator's error (the new rendezvous alone would wait for it until the
    /// timeout), and a rank lost here later fails the new communicator too. What
    /// [`split`](Communicator::split) uses, and what a framework making groups with ids of
    /// its own (torch's `new_group`) can use with its world communicator.
    pub fn init_watched(
        &self,
        id: &UniqueId,
        rank: usize,
        group: Vec<usize>,
        cfg: crate::base::param::Config,
    ) -> Result<Communicator> {
        self.init_watched_as("init_watched", id, rank, group, cfg)
    }

    /// [`init_watched`](Self::init_watched), its errors naming `call`.
    fn init_watched_as(
        &self,
        call: &'static str,
        id: &UniqueId,
        rank: usize,
        group: Vec<usize>,
        cfg: crate::base::param::Config,
    ) -> Result<Communicator> {
        let me = self.rank();
        let bad = |msg: String| Error::InvalidArgument {
            rank: me,
            call,
            seq: 0,
            msg,
        };
        if group.get(rank) != Some(&me) {
            return Err(bad(format!(
                "rank {rank} of the group must be this rank ({me}) here; the group is {group:?}"
            )));
        }
        let mut seen = vec![false; self.world_size()];
        for &r in &group {
            match seen.get_mut(r) {
                Some(s) if !*s => *s = true,
                Some(_) => return Err(bad(format!("rank {r} is in the group twice"))),
                None => {
                    return Err(bad(format!(
                        "rank {r} is not a rank of the watching communicator (size {})",
                        self.world_size()
                    )))
                }
            }
        }
        let child = self.init_watched_inner(call, id.clone(), rank, group.len(), cfg)?;
        // A rank of the group lost here (its links closed, its heartbeats stopped) is lost
        // there too: this communicator's watchdog may know before the new one's does (a rank
        // stopped before its first heartbeat there is lost only after the timeout).
        self.supervisor().health_arc().pass_on(
            Arc::downgrade(child.supervisor().health_arc()),
            Box::new(move |f| match f {
                Failure::Lost { peer, reason } => {
                    let p = group.iter().position(|r| r == peer)?;
                    Some(Failure::Lost {
                        peer: p,
                        reason: format!(
                            "{reason} (seen by the communicator that watched this one's init, where it is rank {peer})"
                        ),
                    })
                }
                _ => None,
            }),
        );
        Ok(child)
    }

    /// The new communicator's init, made on a thread of its own while this one watches this
    /// communicator: a rank of the group that dies or stops during the init is known here
    /// within the heartbeat timeout (its links close, or its heartbeats stop), while the new
    /// communicator's rendezvous would wait for it until the whole timeout (600 s by default).
    /// Then the split fails at once with this communicator's error, naming that rank; the
    /// thread's init ends by its own timeout and drops what it made.
    fn init_watched_inner(
        &self,
        call: &'static str,
        id: UniqueId,
        rank: usize,
        size: usize,
        cfg: crate::base::param::Config,
    ) -> Result<Communicator> {
        let (tx, rx) = std::sync::mpsc::channel();
        let spawned = std::thread::Builder::new()
            .name("oxccl-split-init".into())
            .spawn(move || {
                let _ = tx.send(Communicator::init_with_config(&id, rank, size, cfg));
            });
        if let Err(e) = spawned {
            return Err(Error::Io {
                rank: self.rank(),
                context: format!("{call}: starting the new communicator's init thread"),
                source: e,
            });
        }
        loop {
            match rx.recv_timeout(WATCH_EVERY) {
                // An init that failed because a rank was lost (whose loss another rank saw
                // first, and left): the cause, if this communicator hears of it in time.
                Ok(Err(e)) => {
                    let t = std::time::Instant::now();
                    while !self.supervisor().health().is_failed() && t.elapsed() < CAUSE_GRACE {
                        std::thread::sleep(WATCH_EVERY);
                    }
                    self.supervisor().check(call, 0)?;
                    return Err(e);
                }
                Ok(made) => return made,
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                    self.supervisor().check(call, 0)?;
                }
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                    return Err(Error::Protocol {
                        rank: self.rank(),
                        peer: self.rank(),
                        call,
                        seq: 0,
                        msg: "the new communicator's init thread ended without a result".into(),
                    })
                }
            }
        }
    }
}

/// How often a split's init looks at the health of the communicator it splits.
const WATCH_EVERY: std::time::Duration = std::time::Duration::from_millis(10);
