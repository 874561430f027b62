//! The settings every rank must share, agreed at init.
//!
//! Every setting that decides which algorithm or transport runs must be the same on every
//! rank, or ranks would run different schedules and wait for each other forever. At init rank
//! 0 sends its [`Agreed`] settings ([`Agreed::encode`]) to every rank with the rendezvous's
//! peer table (no exchange of its own); rank 0's win, and a
//! rank whose environment said otherwise logs a warning naming the setting and both values
//! ([`Agreed::differences`]).

use std::fmt::Display;

use crate::base::error::{Error, Result};
use crate::base::param::{Config, TransportChoice};
use crate::bootstrap::Bootstrap;

/// The settings of a [`Config`] that every rank must share.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Agreed {
    transport: TransportChoice,
    algo: Option<String>,
    oneshot_max: usize,
    oneshot_mapped_min: usize,
    mapped_min: usize,
    cma_min: usize,
    cma: bool,
    chunk_bytes: usize,
    deterministic: bool,
}

/// Bytes of an encoding before the algorithm's name: transport, cma and deterministic (one
/// byte each), then oneshot_max, cma_min, chunk_bytes, oneshot_mapped_min and mapped_min (8
/// bytes each, little-endian).
const FIXED: usize = 3 + 5 * 8;

impl Agreed {
    fn of(cfg: &Config) -> Agreed {
        Agreed {
            transport: cfg.transport,
            algo: cfg.algo.clone(),
            oneshot_max: cfg.oneshot_max,
            oneshot_mapped_min: cfg.oneshot_mapped_min,
            mapped_min: cfg.mapped_min,
            cma_min: cfg.cma_min,
            cma: cfg.cma,
            chunk_bytes: cfg.chunk_bytes,
            deterministic: cfg.deterministic,
        }
    }

    /// `cfg` with these settings in place of its own.
    fn apply(self, mut cfg: Config) -> Config {
        cfg.transport = self.transport;
        cfg.algo = self.algo;
        cfg.oneshot_max = self.oneshot_max;
        cfg.oneshot_mapped_min = self.oneshot_mapped_min;
        cfg.mapped_min = self.mapped_min;
        cfg.cma_min = self.cma_min;
        cfg.cma = self.cma;
        cfg.chunk_bytes = self.chunk_bytes;
        cfg.deterministic = self.deterministic;
        cfg
    }

    /// The settings as bytes: the fixed fields ([`FIXED`]), then the algorithm's name (empty
    /// for none).
    fn encode(&self) -> Vec<u8> {
        let algo = self.algo.as_deref().unwrap_or("");
        let mut out = Vec::with_capacity(FIXED + algo.len());
        out.push(match self.transport {
            TransportChoice::Auto => 0,
            TransportChoice::Shm => 1,
            TransportChoice::Tcp => 2,
        });
        out.push(self.cma.into());
        out.push(self.deterministic.into());
        for n in [
            self.oneshot_max,
            self.cma_min,
            self.chunk_bytes,
            self.oneshot_mapped_min,
            self.mapped_min,
        ] {
            out.extend_from_slice(&(n as u64).to_le_bytes());
        }
        out.extend_from_slice(algo.as_bytes());
        out
    }

    /// The settings from [`encode`](Self::encode)'s bytes.
    fn decode(b: &[u8]) -> std::result::Result<Agreed, String> {
        if b.len() < FIXED {
            return Err(format!(
                "{} bytes of settings, expected at least {FIXED}",
                b.len()
            ));
        }
        let transport = match b[0] {
            0 => TransportChoice::Auto,
            1 => TransportChoice::Shm,
            2 => TransportChoice::Tcp,
            t => return Err(format!("unknown transport code {t}")),
        };
        let flag = |i: usize| match b[i] {
            0 => Ok(false),
            1 => Ok(true),
            v => Err(format!("setting flag {v} is neither 0 nor 1")),
        };
        let num = |i: usize| {
            let v = u64::from_le_bytes(b[3 + 8 * i..][..8].try_into().expect("8 bytes"));
            usize::try_from(v).map_err(|_| format!("setting {v} does not fit this machine"))
        };
        let algo = std::str::from_utf8(&b[FIXED..])
            .map_err(|_| "the algorithm's name is not UTF-8".to_string())?;
        Ok(Agreed {
            transport,
            algo: (!algo.is_empty()).then(|| algo.to_string()),
            oneshot_max: num(0)?,
            oneshot_mapped_min: num(3)?,
            mapped_min: num(4)?,
            cma_min: num(1)?,
            cma: flag(1)?,
            chunk_bytes: num(2)?,
            deterministic: flag(2)?,
        })
    }

    /// One message per setting where `self` (this rank's) differs from `root` (rank 0's).
    fn differences(&self, root: &Agreed) -> Vec<String> {
        let mut out = Vec::new();
        let mut field = |name: &str, mine: &dyn Display, theirs: &dyn Display| {
            let (mine, theirs) = (mine.to_string(), theirs.to_string());
            if mine != theirs {
                out.push(format!(
                    "setting {name}={mine} differs from rank 0's {name}={theirs}: using rank 0's"
                ));
            }
        };
        let algo = |a: &Agreed| a.algo.clone().unwrap_or_default();
        field(
            "transport",
            &format_args!("{:?}", self.transport),
            &format_args!("{:?}", root.transport),
        );
        field("algo", &algo(self), &algo(root));
        field("oneshot_max", &self.oneshot_max, &root.oneshot_max);
        field(
            "oneshot_mapped_min",
            &self.oneshot_mapped_min,
            &root.oneshot_mapped_min,
        );
        field("mapped_min", &self.mapped_min, &root.mapped_min);
        field("cma_min", &self.cma_min, &root.cma_min);
        field("cma", &self.cma, &root.cma);
        field("chunk_bytes", &self.chunk_bytes, &root.chunk_bytes);
        field("deterministic", &self.deterministic, &root.deterministic);
        out
    }
}

/// This rank's settings as rank 0 needs to send them with the peer table
/// ([`Bootstrap::init_saying`]).
pub(super) fn encode_settings(cfg: &Config) -> Vec<u8> {
    Agreed::of(cfg).encode()
}

/// Rank 0's agreed settings in place of `cfg`'s own (see the module documentation): what
/// rank 0 sent with the peer table ([`encode_settings`]), so no exchange of its own.
pub(super) fn agree_on_settings(boot: &Bootstrap, cfg: Config) -> Result<Config> {
    let mine = Agreed::of(&cfg);
    let root = Agreed::decode(boot.root_says()).map_err(|msg| Error::Protocol {
        rank: boot.rank(),
        peer: 0,
        call: "init",
        seq: 0,
        msg: format!("settings: {msg}"),
    })?;
    if root == mine {
        return Ok(cfg);
    }
    for msg in mine.differences(&root) {
        tracing::warn!(rank = boot.rank(), "{msg}");
    }
    Ok(root.apply(cfg))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings() -> Agreed {
        Agreed::of(&Config::default())
    }

    #[test]
    fn encoding_round_trips() {
        let mut a = settings();
        for (transport, algo, cma, det) in [
            (TransportChoice::Auto, None, true, false),
            (TransportChoice::Shm, Some("ring"), false, true),
            (TransportChoice::Tcp, Some("halving_doubling"), true, true),
        ] {
            a.transport = transport;
            a.algo = algo.map(str::to_string);
            a.cma = cma;
            a.deterministic = det;
            a.oneshot_max = 12345;
            a.cma_min = usize::MAX;
            a.oneshot_mapped_min = 777;
            a.mapped_min = 4321;
            a.chunk_bytes = 1 << 20;
            assert_eq!(Agreed::decode(&a.encode()), Ok(a.clone()));
        }
    }

    #[test]
    fn bad_encodings_are_errors() {
        let good = settings().encode();
        assert!(Agreed::decode(&good[..FIXED - 1]).is_err());
        let mut bad = good.clone();
        bad[0] = 7;
        assert_eq!(
            Agreed::decode(&bad),
            Err("unknown transport code 7".to_string())
        );
        let mut bad = good;
        bad[1] = 2;
        assert!(Agreed::decode(&bad).is_err());
    }

    #[test]
    fn mismatch_names_setting_and_both_values() {
        let root = settings();
        assert!(root.differences(&root).is_empty());
        let mut mine = root.clone();
        mine.transport = TransportChoice::Tcp;
        mine.algo = Some("ring".into());
        mine.chunk_bytes = root.chunk_bytes + 1;
        let msgs = mine.differences(&root);
        assert_eq!(
            msgs,
            vec![
                format!(
                    "setting transport=Tcp differs from rank 0's transport={:?}: using rank 0's",
                    root.transport
                ),
                format!(
                    "setting algo=ring differs from rank 0's algo={}: using rank 0's",
                    root.algo.as_deref().unwrap_or("")
                ),
                format!(
                    "setting chunk_bytes={} differs from rank 0's chunk_bytes={}: using rank 0's",
                    mine.chunk_bytes, root.chunk_bytes
                ),
            ]
        );
        assert_eq!(
            mine.clone().apply(Config::default()).chunk_bytes,
            mine.chunk_bytes
        );
    }
}
