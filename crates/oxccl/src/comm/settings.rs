//! The settings every rank must share, agreed at init.

use crate::base::error::Result;
use crate::base::param::Config;
use crate::bootstrap::Bootstrap;

/// Every setting that decides which algorithm or transport runs must be the same on every
/// rank, or ranks would run different schedules and wait for each other forever: rank 0's
/// win, and a rank whose environment said otherwise logs a warning naming the setting.
pub(super) fn agree_on_settings(boot: &mut Bootstrap, mut cfg: Config) -> Result<Config> {
    let mine = [
        format!("transport={:?}", cfg.transport),
        format!("algo={}", cfg.algo.as_deref().unwrap_or("")),
        format!("oneshot_max={}", cfg.oneshot_max),
        format!("cma_min={}", cfg.cma_min),
        format!("cma={}", cfg.cma),
        format!("chunk_bytes={}", cfg.chunk_bytes),
        format!("deterministic={}", cfg.deterministic),
    ]
    .join("\n");
    let all = crate::bootstrap::Exchange::allgather(boot, mine.as_bytes())?;
    let root = String::from_utf8_lossy(&all[0]).into_owned();
    if root == mine {
        return Ok(cfg);
    }
    for (m, r) in mine.lines().zip(root.lines()) {
        if m != r {
            tracing::warn!(
                rank = boot.rank(),
                "setting {m} differs from rank 0's {r}: using rank 0's"
            );
        }
    }
    for line in root.lines() {
        let Some((k, v)) = line.split_once('=') else {
            continue;
        };
        match k {
            "transport" => {
                cfg.transport = match v {
                    "Shm" => crate::base::param::TransportChoice::Shm,
                    "Tcp" => crate::base::param::TransportChoice::Tcp,
                    _ => crate::base::param::TransportChoice::Auto,
                }
            }
            "algo" => cfg.algo = (!v.is_empty()).then(|| v.to_string()),
            "oneshot_max" => cfg.oneshot_max = v.parse().unwrap_or(cfg.oneshot_max),
            "cma_min" => cfg.cma_min = v.parse().unwrap_or(cfg.cma_min),
            "cma" => cfg.cma = v == "true",
            "chunk_bytes" => cfg.chunk_bytes = v.parse().unwrap_or(cfg.chunk_bytes),
            "deterministic" => cfg.deterministic = v == "true",
            _ => {}
        }
    }
    Ok(cfg)
}
