//! Reading a launcher's environment (torchrun, `oxccl run`, Slurm, Open MPI, PMI).
//!
//! Rank and world size come from the first launcher whose variables are set, in this order:
//!
//! | launcher | rank | world size | local rank |
//! |---|---|---|---|
//! | torchrun / `oxccl run` | `RANK` | `WORLD_SIZE` | `LOCAL_RANK` |
//! | Slurm (`srun`) | `SLURM_PROCID` | `SLURM_NTASKS` | `SLURM_LOCALID` |
//! | Open MPI (`mpirun`) | `OMPI_COMM_WORLD_RANK` | `OMPI_COMM_WORLD_SIZE` | `OMPI_COMM_WORLD_LOCAL_RANK` |
//! | PMI (MPICH, Hydra) | `PMI_RANK` | `PMI_SIZE` | — |
//!
//! `RANK` wins over the others even when they disagree: torchrun started by `srun` gives
//! each process its own `RANK` while `SLURM_PROCID` numbers the torchrun agents.
//!
//! The rendezvous is at `OXCCL_ROOT=host:port` if set, else `MASTER_ADDR:MASTER_PORT`. The
//! secret is `OXCCL_SECRET` (32 hex digits); without it one is derived from the job's
//! identity, which keeps concurrent jobs apart but does not stop a hostile peer.

use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::Once;

use sha2::{Digest, Sha256};

use super::unique_id::parse_secret_hex;
#[cfg(test)]
use super::unique_id::UniqueId;
use crate::base::error::{Error, Result};
use crate::base::param::table::{shown, ROOT, SECRET};

/// What a launcher told this process.
#[derive(Clone)]
pub(crate) struct LaunchEnv {
    /// This process's rank.
    pub rank: usize,
    /// The number of ranks.
    pub world_size: usize,
    /// Rank among the ranks on this host, if the launcher says.
    pub local_rank: Option<usize>,
    /// Where rank 0 hosts the rendezvous.
    pub root: SocketAddr,
    /// The communicator's secret.
    pub secret: [u8; 16],
    /// Which launcher's variables were used (`"torchrun"`, `"slurm"`, `"openmpi"`, `"pmi"`).
    pub launcher: &'static str,
    /// True when the secret was derived from the job's identity because `OXCCL_SECRET` was
    /// not set.
    pub secret_derived: bool,
}

impl std::fmt::Debug for LaunchEnv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the secret.
        f.debug_struct("LaunchEnv")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("local_rank", &self.local_rank)
            .field("root", &self.root)
            .field("launcher", &self.launcher)
            .field("secret_derived", &self.secret_derived)
            .finish_non_exhaustive()
    }
}

/// (launcher, rank variable, size variable, local-rank variable), in order of precedence.
const LAUNCHERS: [(&str, &str, &str, Option<&str>); 4] = [
    ("torchrun", "RANK", "WORLD_SIZE", Some("LOCAL_RANK")),
    (
        "slurm",
        "SLURM_PROCID",
        "SLURM_NTASKS",
        Some("SLURM_LOCALID"),
    ),
    (
        "openmpi",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        Some("OMPI_COMM_WORLD_LOCAL_RANK"),
    ),
    ("pmi", "PMI_RANK", "PMI_SIZE", None),
];

static DERIVED_WARNING: Once = Once::new();

impl LaunchEnv {
    /// Reads the process environment; see the [module docs](self).
    pub(crate) fn from_env() -> Result<LaunchEnv> {
        Self::from_vars(|name| std::env::var(name).ok())
    }

    /// As [`from_env`](Self::from_env), with variables looked up by `get` (for tests and
    /// embedders). Empty values count as unset, except `OXCCL_SECRET`, where one is an error.
    pub(crate) fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<LaunchEnv> {
        let var = |name: &str| {
            get(name)
                .map(|v| v.trim().to_string())
                .filter(|v| !v.is_empty())
        };
        let num = |name: &str| -> Result<Option<usize>> {
            match var(name) {
                None => Ok(None),
                Some(v) => v.parse::<usize>().map(Some).map_err(|_| {
                    Error::Env(format!(
                        "{name}={} is not a non-negative integer (digits only, e.g. 8)",
                        shown(&v)
                    ))
                }),
            }
        };

        let mut found = None;
        for (launcher, rank_var, size_var, local_var) in LAUNCHERS {
            let rank = num(rank_var)?;
            let size = num(size_var)?;
            let (rank, size) = match (rank, size) {
                (None, None) => continue,
                (Some(_), None) => {
                    return Err(Error::Env(format!(
                        "{rank_var} is set but {size_var} is not"
                    )))
                }
                (None, Some(_)) if launcher == "slurm" => continue, // SLURM_NTASKS alone: an allocation, not a task
                (None, Some(_)) => {
                    return Err(Error::Env(format!(
                        "{size_var} is set but {rank_var} is not"
                    )))
                }
                (Some(r), Some(s)) => (r, s),
            };
            if size == 0 {
                return Err(Error::Env(format!(
                    "{size_var}=0: the world needs at least one rank"
                )));
            }
            if size > super::MAX_WORLD_SIZE {
                return Err(Error::Env(format!(
                    "{size_var}={size}: more than the {} ranks oxccl supports",
                    super::MAX_WORLD_SIZE
                )));
            }
            if rank >= size {
                return Err(Error::Env(format!(
                    "{rank_var}={rank} is not below {size_var}={size}"
                )));
            }
            let local_rank = match local_var {
                Some(v) => num(v)?,
                None => None,
            };
            found = Some((launcher, rank_var, rank, size, local_rank));
            break;
        }
        let Some((launcher, rank_var, rank, world_size, local_rank)) = found else {
            return Err(Error::Env(
                "no launcher environment: set RANK and WORLD_SIZE (torchrun, oxccl run), or start under Slurm (SLURM_PROCID, SLURM_NTASKS), Open MPI (OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE) or PMI (PMI_RANK, PMI_SIZE)".into(),
            ));
        };
        for (other, other_rank, _, _) in LAUNCHERS {
            if other != launcher {
                if let Ok(Some(r)) = num(other_rank) {
                    if r != rank {
                        tracing::debug!("{rank_var}={rank} and {other_rank}={r} differ; {rank_var} ({launcher}) wins");
                    }
                }
            }
        }

        let (root_text, root) = Self::root_addr(&var)?;
        if get(SECRET.name).is_some_and(|v| v.trim().is_empty()) {
            return Err(Error::Env(
                "OXCCL_SECRET is set but empty: set it to 32 random hex digits shared by all ranks, or unset it to derive a (guessable) secret from the job identity"
                    .into(),
            ));
        }
        let (secret, secret_derived) = match var(SECRET.name) {
            Some(s) => (
                parse_secret_hex(&s).ok_or_else(|| {
                    Error::Env(format!("OXCCL_SECRET must be 32 hex digits (16 bytes); it has {} characters or a non-hex digit", s.len()))
                })?,
                false,
            ),
            None => {
                let identity = if let Some(id) = var("TORCHELASTIC_RUN_ID") {
                    format!("torchelastic:{id}")
                } else if let Some(job) = var("SLURM_JOB_ID") {
                    format!("slurm:{job}.{}", var("SLURM_STEP_ID").unwrap_or_default())
                } else if let Some(uri) = var("OMPI_MCA_orte_hnp_uri") {
                    format!("ompi:{uri}")
                } else if let Some(ns) = var("PMIX_NAMESPACE") {
                    format!("pmix:{ns}")
                } else {
                    String::new()
                };
                DERIVED_WARNING.call_once(|| {
                    crate::base::debug::announce(&format!(
                        "warning: OXCCL_SECRET is not set: the communicator secret is derived from the rendezvous address {root_text}{}, \
                         so anyone who can reach that address can compute it and join or disturb the job. \
                         Set OXCCL_SECRET to the same 32 random hex digits on every rank (oxccl run does)",
                        if identity.is_empty() { String::new() } else { " and the launcher's job id".into() }
                    ))
                });
                let mut h = Sha256::new();
                h.update(b"oxccl-derived-secret-v1\0");
                h.update(identity.as_bytes());
                h.update(b"\0");
                h.update(root_text.as_bytes());
                let d = h.finalize();
                let mut s = [0u8; 16];
                s.copy_from_slice(&d[..16]);
                (s, true)
            }
        };
        Ok(LaunchEnv {
            rank,
            world_size,
            local_rank,
            root,
            secret,
            launcher,
            secret_derived,
        })
    }

    /// The rendezvous address: its text as given (the same on every rank) and resolved.
    fn root_addr(var: &dyn Fn(&str) -> Option<String>) -> Result<(String, SocketAddr)> {
        let (name, text) = if let Some(r) = var(ROOT.name) {
            (ROOT.name, r)
        } else {
            match (var("MASTER_ADDR"), var("MASTER_PORT")) {
                (Some(a), Some(p)) => {
                    let mut port: u16 = p.parse().map_err(|_| Error::Env(format!("MASTER_PORT={} is not a port number", shown(&p))))?;
                    // torchrun's agent already listens on MASTER_PORT (its TCPStore, shared
                    // with the workers): rank 0 takes the next port, as every rank knows.
                    if var("TORCHELASTIC_USE_AGENT_STORE").is_some_and(|v| v.eq_ignore_ascii_case("true")) {
                        port = port.checked_add(1).ok_or_else(|| Error::Env(format!("MASTER_PORT={}: torchrun holds it and there is no next port; set OXCCL_ROOT=host:port", shown(&p))))?;
                    }
                    let host = a.trim_start_matches('[').trim_end_matches(']');
                    let text = if host.contains(':') { format!("[{host}]:{port}") } else { format!("{host}:{port}") };
                    ("MASTER_ADDR/MASTER_PORT", text)
                }
                (Some(_), None) => return Err(Error::Env("MASTER_ADDR is set but MASTER_PORT is not".into())),
                (None, Some(_)) => return Err(Error::Env("MASTER_PORT is set but MASTER_ADDR is not".into())),
                (None, None) => {
                    return Err(Error::Env(
                        "no rendezvous address: set MASTER_ADDR and MASTER_PORT, or OXCCL_ROOT=host:port (the address where rank 0 listens)"
                            .into(),
                    ))
                }
            }
        };
        let addr = text
            .to_socket_addrs()
            .map_err(|e| Error::Env(format!("{name}: cannot resolve '{}': {e}", shown(&text))))?
            .next()
            .ok_or_else(|| {
                Error::Env(format!("{name}: '{}' resolves to no address", shown(&text)))
            })?;
        if addr.port() == 0 {
            return Err(Error::Env(format!(
                "{name}: '{text}' has port 0; rank 0 must listen on a known port"
            )));
        }
        Ok((text, addr))
    }

    /// The [`UniqueId`] of this launch: [`root`](Self::root) and [`secret`](Self::secret).
    #[cfg(test)]
    pub(crate) fn unique_id(&self) -> UniqueId {
        UniqueId::with_addr(self.root, self.secret)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> Result<LaunchEnv> {
        let m: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        LaunchEnv::from_vars(|k| m.get(k).cloned())
    }

    #[test]
    fn torchrun_agent_store_keeps_master_port() {
        let e = env(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "29500"),
            ("TORCHELASTIC_USE_AGENT_STORE", "True"),
            ("OXCCL_SECRET", "00112233445566778899aabbccddeeff"),
        ])
        .unwrap();
        assert_eq!(e.root.port(), 29501);
    }

    fn env_err(pairs: &[(&str, &str)]) -> String {
        match env(pairs) {
            Err(Error::Env(m)) => m,
            other => panic!("expected Error::Env, got {other:?}"),
        }
    }

    const ROOT: [(&str, &str); 2] = [("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")];

    #[test]
    fn torchrun() {
        let e = env(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "1"),
            ROOT[0],
            ROOT[1],
        ])
        .unwrap();
        assert_eq!(
            (e.rank, e.world_size, e.local_rank, e.launcher),
            (3, 8, Some(1), "torchrun")
        );
        assert_eq!(e.root, "127.0.0.1:29500".parse().unwrap());
        assert!(e.secret_derived);
    }

    #[test]
    fn slurm() {
        let e = env(&[
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "6"),
            ("SLURM_LOCALID", "2"),
            ("OXCCL_ROOT", "127.0.0.1:1234"),
        ])
        .unwrap();
        assert_eq!(
            (e.rank, e.world_size, e.local_rank, e.launcher),
            (5, 6, Some(2), "slurm")
        );
        assert_eq!(e.root, "127.0.0.1:1234".parse().unwrap());
    }

    #[test]
    fn openmpi() {
        let e = env(&[
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "0"),
            ("OXCCL_ROOT", "[::1]:4000"),
        ])
        .unwrap();
        assert_eq!(
            (e.rank, e.world_size, e.local_rank, e.launcher),
            (1, 2, Some(0), "openmpi")
        );
        assert_eq!(e.root, "[::1]:4000".parse().unwrap());
    }

    #[test]
    fn pmi() {
        let e = env(&[("PMI_RANK", "0"), ("PMI_SIZE", "1"), ROOT[0], ROOT[1]]).unwrap();
        assert_eq!(
            (e.rank, e.world_size, e.local_rank, e.launcher),
            (0, 1, None, "pmi")
        );
    }

    #[test]
    fn precedence() {
        // torchrun under srun: RANK wins over SLURM_PROCID.
        let e = env(&[
            ("RANK", "7"),
            ("WORLD_SIZE", "16"),
            ("SLURM_PROCID", "1"),
            ("SLURM_NTASKS", "2"),
            ROOT[0],
            ROOT[1],
        ])
        .unwrap();
        assert_eq!((e.rank, e.world_size, e.launcher), (7, 16, "torchrun"));
        let e = env(&[
            ("SLURM_PROCID", "1"),
            ("SLURM_NTASKS", "2"),
            ("PMI_RANK", "0"),
            ("PMI_SIZE", "2"),
            ROOT[0],
            ROOT[1],
        ])
        .unwrap();
        assert_eq!(e.launcher, "slurm");
        let e = env(&[
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("PMI_RANK", "0"),
            ("PMI_SIZE", "2"),
            ROOT[0],
            ROOT[1],
        ])
        .unwrap();
        assert_eq!((e.rank, e.launcher), (1, "openmpi"));
        // SLURM_NTASKS alone (inside an allocation, not a task) falls through.
        let e = env(&[
            ("SLURM_NTASKS", "4"),
            ("PMI_RANK", "1"),
            ("PMI_SIZE", "2"),
            ROOT[0],
            ROOT[1],
        ])
        .unwrap();
        assert_eq!(e.launcher, "pmi");
        // OXCCL_ROOT wins over MASTER_ADDR.
        let e = env(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "1"),
            ("OXCCL_ROOT", "127.0.0.2:9"),
            ROOT[0],
            ROOT[1],
        ])
        .unwrap();
        assert_eq!(e.root, "127.0.0.2:9".parse().unwrap());
    }

    #[test]
    fn missing_and_contradictory() {
        assert!(env_err(&[]).contains("RANK and WORLD_SIZE"));
        assert!(env_err(&[("RANK", "0"), ROOT[0], ROOT[1]]).contains("WORLD_SIZE"));
        assert!(env_err(&[("WORLD_SIZE", "2"), ROOT[0], ROOT[1]]).contains("RANK"));
        assert!(
            env_err(&[("RANK", "2"), ("WORLD_SIZE", "2"), ROOT[0], ROOT[1]]).contains("RANK=2")
        );
        assert!(
            env_err(&[("RANK", "0"), ("WORLD_SIZE", "0"), ROOT[0], ROOT[1]])
                .contains("WORLD_SIZE=0")
        );
        assert!(
            env_err(&[("RANK", "x"), ("WORLD_SIZE", "2"), ROOT[0], ROOT[1]]).contains("RANK=x")
        );
        assert!(env_err(&[("OMPI_COMM_WORLD_RANK", "0"), ROOT[0], ROOT[1]])
            .contains("OMPI_COMM_WORLD_SIZE"));
        assert!(env_err(&[("PMI_SIZE", "2"), ROOT[0], ROOT[1]]).contains("PMI_RANK"));
        assert!(env_err(&[("SLURM_PROCID", "0"), ROOT[0], ROOT[1]]).contains("SLURM_NTASKS"));
        assert!(env_err(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_RANK", "-1"),
            ROOT[0],
            ROOT[1]
        ])
        .contains("LOCAL_RANK"));
    }

    #[test]
    fn absurd_world_sizes() {
        for (ws, want) in [
            ("4294967296", "more than the 65536 ranks"),
            ("65537", "more than the 65536 ranks"),
            ("1e9", "not a non-negative integer"),
            ("-1", "not a non-negative integer"),
            ("0", "at least one rank"),
        ] {
            let m = env_err(&[("RANK", "0"), ("WORLD_SIZE", ws), ROOT[0], ROOT[1]]);
            assert!(m.contains(want) && m.contains(ws), "{ws}: {m}");
        }
        assert_eq!(
            env(&[("RANK", "0"), ("WORLD_SIZE", "65536"), ROOT[0], ROOT[1]])
                .unwrap()
                .world_size,
            65536
        );
    }

    #[test]
    fn root_errors() {
        let m = env_err(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "2")]);
        assert!(m.contains("MASTER_ADDR") && m.contains("OXCCL_ROOT"), "{m}");
        assert!(env_err(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "127.0.0.1")
        ])
        .contains("MASTER_PORT"));
        assert!(
            env_err(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "1")])
                .contains("MASTER_ADDR")
        );
        assert!(env_err(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "99999")
        ])
        .contains("MASTER_PORT"));
        assert!(env_err(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("OXCCL_ROOT", "127.0.0.1")
        ])
        .contains("OXCCL_ROOT"));
        assert!(env_err(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("OXCCL_ROOT", "127.0.0.1:0")
        ])
        .contains("port 0"));
        // Host names resolve.
        let e = env(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "localhost"),
            ("MASTER_PORT", "29500"),
        ])
        .unwrap();
        assert!(e.root.ip().is_loopback());
        assert_eq!(e.root.port(), 29500);
    }

    #[test]
    fn secrets() {
        let hex = "00112233445566778899aabbccddeeff";
        let e = env(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ROOT[0],
            ROOT[1],
            ("OXCCL_SECRET", hex),
        ])
        .unwrap();
        assert_eq!(e.secret[..3], [0x00, 0x11, 0x22]);
        assert!(!e.secret_derived);
        assert!(!format!("{e:?}").contains("0x11") && !format!("{e:?}").contains("17"));
        assert_eq!(e.unique_id().secret, e.secret);
        let m = env_err(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ROOT[0],
            ROOT[1],
            ("OXCCL_SECRET", "0011"),
        ]);
        assert!(m.contains("OXCCL_SECRET"));
        assert!(!env_err(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ROOT[0],
            ROOT[1],
            ("OXCCL_SECRET", &hex.replace('f', "g"))
        ])
        .contains("aabb"));

        let m = env_err(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ROOT[0],
            ROOT[1],
            ("OXCCL_SECRET", " "),
        ]);
        assert!(m.contains("OXCCL_SECRET is set but empty"), "{m}");

        // Derived secrets: equal across ranks of one job, different across jobs.
        let a0 = env(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ROOT[0],
            ROOT[1],
            ("SLURM_JOB_ID", "11"),
            ("SLURM_STEP_ID", "0"),
        ])
        .unwrap();
        let a1 = env(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ROOT[0],
            ROOT[1],
            ("SLURM_JOB_ID", "11"),
            ("SLURM_STEP_ID", "0"),
        ])
        .unwrap();
        let b = env(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ROOT[0],
            ROOT[1],
            ("SLURM_JOB_ID", "11"),
            ("SLURM_STEP_ID", "1"),
        ])
        .unwrap();
        let c = env(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ROOT[0],
            ROOT[1],
            ("TORCHELASTIC_RUN_ID", "x"),
        ])
        .unwrap();
        let d = env(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ROOT[0],
            ("MASTER_PORT", "29501"),
        ])
        .unwrap();
        let d0 = env(&[("RANK", "0"), ("WORLD_SIZE", "2"), ROOT[0], ROOT[1]]).unwrap();
        assert!(a0.secret_derived);
        assert_eq!(a0.secret, a1.secret);
        assert_ne!(a0.secret, b.secret);
        assert_ne!(a0.secret, c.secret);
        assert_ne!(d.secret, d0.secret);
    }
}
