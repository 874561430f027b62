//! `oxccl tune`: measures this host and saves where one intra-host algorithm overtakes
//! another (one-shot, ring, single-copy all_reduce), for [`oxccl::Tuning`], and the rates
//! the multi-host cost model uses (shared-memory link, reduction and copy, the TCP stack:
//! [`oxccl::Rates`], read by every communicator and by `oxccl sim`).

use std::io::Write;

use clap::Args as ClapArgs;
use indicatif::{ProgressBar, ProgressStyle};
use oxccl::check::Case;
use oxccl::params::{TUNE_FILE, USER_TUNE_FILE};
use oxccl::Algo;
use oxccl::Tuning;
use oxccl::{CollKind, Communicator, DataType, ReduceOp};

use crate::launch::rank_or_launch;
use crate::perf::{time_calls, under_launcher};

/// `oxccl tune` arguments.
#[derive(ClapArgs, Clone)]
pub struct Args {
    /// Ranks to start on this host (ignored under a launcher).
    #[arg(long, default_value_t = 2, value_parser = crate::args::count(1, crate::args::MAX_LOCAL_RANKS))]
    ranks: usize,
    /// Largest all_reduce size to measure (bytes; K, M, G suffixes; 8 to 1G).
    #[arg(long, default_value = "4M", value_parser = crate::args::bytes(8, 1 << 30))]
    max_bytes: usize,
    /// Where to save the result (default: OXCCL_TUNE_FILE or ~/.cache/oxccl/tune.conf).
    #[arg(long)]
    out: Option<std::path::PathBuf>,
    /// Measure and print, but do not save.
    #[arg(long)]
    dry_run: bool,
}

/// Entry point: start ranks, or be one.
pub fn main(a: Args) -> i32 {
    // The measurement must not be steered by an earlier tuning: the ranks read none.
    let mut env = vec![(TUNE_FILE.name, String::new())];
    if let Some(p) = Tuning::path() {
        env.push((USER_TUNE_FILE.name, p.to_string_lossy().into_owned()));
    }
    rank_or_launch("tune", under_launcher(), a.ranks, &env, None, || {
        rank_main(&a)
    })
}

const ALGOS: [Algo; 3] = [Algo::OneShot, Algo::Ring, Algo::Cma];

fn rank_main(a: &Args) -> Result<(), String> {
    let mut comm = Communicator::from_env().map_err(|e| e.to_string())?;
    let (n, rank) = (comm.world_size(), comm.rank());
    let mut sizes = vec![];
    let mut s = 8usize;
    while s <= a.max_bytes {
        sizes.push(s);
        s *= 2;
    }
    let bar = (rank == 0).then(|| {
        let b = ProgressBar::new((sizes.len() * ALGOS.len()) as u64);
        b.set_style(
            ProgressStyle::with_template("{msg:>24} [{bar:40}] {pos}/{len} {elapsed}")
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> "),
        );
        b
    });
    // times[size][algo] in microseconds, None where the algorithm cannot run.
    let mut times: Vec<[Option<f64>; 3]> = Vec::new();
    for &size in &sizes {
        let mut row = [None; 3];
        for (i, algo) in ALGOS.iter().enumerate() {
            if let Some(b) = &bar {
                b.set_message(format!("{} {} B", algo.name(), size));
            }
            comm.set_algo(Some(*algo));
            let case = Case {
                kind: CollKind::AllReduce,
                dtype: DataType::F32,
                op: ReduceOp::Sum,
                root: 0,
                count: size / 4,
                in_place: false,
                rank,
                nranks: n,
            };
            let mut bufs = case.buffers(None).map_err(|e| e.to_string())?;
            let (send, recv) = bufs.get();
            case.fill(send, recv);
            let (secs, ran) =
                time_calls(&comm, &case, send, recv, 3, None).map_err(|e| e.to_string())?;
            if ran == algo.name() {
                row[i] = Some(secs * 1e6);
            }
            if let Some(b) = &bar {
                b.inc(1);
            }
        }
        times.push(row);
    }
    comm.set_algo(None);
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    // The rates below are one process's: no other rank runs meanwhile.
    drop(comm);
    if rank != 0 {
        return Ok(());
    }
    if times.iter().all(|r| r[0].is_none() && r[2].is_none()) {
        return Err(
            "no direct algorithm ran: tune measures ranks of one host over shared memory".into(),
        );
    }
    let best = |r: &[Option<f64>; 3]| -> usize {
        (0..3)
            .filter(|&i| r[i].is_some())
            .min_by(|&x, &y| {
                r[x].unwrap_or(f64::MAX)
                    .total_cmp(&r[y].unwrap_or(f64::MAX))
            })
            .unwrap_or(1)
    };
    let mut out = std::io::stdout();
    let _ = writeln!(
        out,
        "# oxccl tune: all_reduce float sum, {n} ranks, time (us) per algorithm"
    );
    let _ = writeln!(
        out,
        "#{:>11} {:>10} {:>10} {:>10}  best",
        "bytes", "oneshot", "ring", "cma"
    );
    let fmt = |x: Option<f64>| x.map_or("-".to_string(), |v| format!("{v:.2}"));
    for (s, r) in sizes.iter().zip(&times) {
        let _ = writeln!(
            out,
            " {:>11} {:>10} {:>10} {:>10}  {}",
            s,
            fmt(r[0]),
            fmt(r[1]),
            fmt(r[2]),
            ALGOS[best(r)].name()
        );
    }
    // One-shot up to the largest size where it is still the fastest (0: never); single-copy
    // from the smallest size after which it always is (never: past the largest measured).
    let oneshot_max = sizes
        .iter()
        .zip(&times)
        .filter(|(_, r)| best(r) == 0)
        .map(|(s, _)| *s)
        .max()
        .unwrap_or(0);
    let cma_min = (0..sizes.len())
        .find(|&i| times[i..].iter().all(|r| best(r) == 2))
        .map_or(oxccl::params::MAX_THRESHOLD as usize, |i| sizes[i]);
    let _ = writeln!(out, "# oneshot_max={oneshot_max} cma_min={cma_min}");
    let rates = measure_rates(n, &sizes, &times)?;
    let _ = writeln!(
        out,
        "# rates for the multi-host cost model (oxccl sim): {}",
        rates
            .entries()
            .iter()
            .map(|(k, v)| format!("{k}={v:.3}"))
            .collect::<Vec<_>>()
            .join(" ")
    );
    let t = Tuning {
        oneshot_max,
        cma_min,
        rates: Some(rates),
    };
    if a.dry_run {
        return Ok(());
    }
    // The ranks run with OXCCL_TUNE_FILE empty (so that no earlier tuning steers them): find
    // the path as the user's environment gives it.
    let path = a
        .out
        .clone()
        .or_else(|| std::env::var_os(USER_TUNE_FILE.name).map(Into::into))
        .or_else(Tuning::path)
        .ok_or("no place to save: set --out or OXCCL_TUNE_FILE")?;
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    }
    let host = rustix::system::uname()
        .nodename()
        .to_string_lossy()
        .into_owned();
    std::fs::write(&path, t.render(&format!("oxccl tune on {host}, {n} ranks")))
        .map_err(|e| format!("{}: {e}", path.display()))?;
    let _ = writeln!(out, "# saved to {}", path.display());
    Ok(())
}

/// Sizes whose ring time stands for the link's latency in [`measure_rates`].
const SMALL_BYTES: usize = 4096;

/// The fastest ring time (column 1 of `times`) among the sizes up to [`SMALL_BYTES`].
fn fastest_small_ring(sizes: &[usize], times: &[[Option<f64>; 3]]) -> Option<f64> {
    sizes
        .iter()
        .zip(times)
        .take_while(|(&s, _)| s <= SMALL_BYTES)
        .filter_map(|(_, r)| r[1])
        .min_by(f64::total_cmp)
}

/// The cost model's rates: the shared-memory link from the ring's times at the small sizes
/// (the fastest of them) and the largest size measured (`calibrate::shm_link`), reduction, copy and the TCP stack
/// measured in this process (`calibrate::measure`).
fn measure_rates(
    n: usize,
    sizes: &[usize],
    times: &[[Option<f64>; 3]],
) -> Result<oxccl::Rates, String> {
    let memory = oxccl::calibrate::memory_gbps();
    let reduce_gbps = memory.0;
    let ring = |i: usize| times.get(i).and_then(|r| r[1]);
    let last = sizes.len().saturating_sub(1);
    // The latency point: the fastest ring time among the small sizes (up to 4 KiB, where the
    // bytes cost little), not the first row alone, which one disturbed batch can make the
    // slowest of all (seen under test.sh's load: 147 µs at 8 B, 1.8 µs at 256 B, 43 µs at
    // 256 KiB, and so no link at all).
    let small = fastest_small_ring(sizes, times);
    let (lat, gbps) = match (small, ring(last)) {
        (Some(small), Some(big)) => {
            oxccl::calibrate::shm_link(n, small, sizes[last], big, reduce_gbps)
        }
        _ => None,
    }
    .ok_or_else(|| {
        format!(
            "the ring's times ({:?} us at most at {} B to {SMALL_BYTES} B, {:?} us at {} B, {n} \
             ranks) give no shared-memory link: measure with --ranks 2 or more and a larger \
             --max-bytes",
            small,
            sizes.first().copied().unwrap_or(0),
            ring(last),
            sizes.get(last).copied().unwrap_or(0)
        )
    })?;
    oxccl::calibrate::measure(memory, lat, gbps).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A disturbed first row (the times of a failed test.sh run) does not stand for the
    /// link's latency; rows past `SMALL_BYTES` never do.
    #[test]
    fn the_latency_point_is_the_fastest_small_ring_row() {
        let sizes = [8, 16, 256, 4096, 8192, 262144];
        let row = |us: f64| [None, Some(us), None];
        let times = [
            row(147.1),
            row(202.0),
            row(1.83),
            row(2.24),
            row(1.0),
            row(42.8),
        ];
        assert_eq!(fastest_small_ring(&sizes, &times), Some(1.83));
        let missing = [[None; 3], row(5.0), row(6.0), row(7.0), row(1.0), row(9.0)];
        assert_eq!(fastest_small_ring(&sizes, &missing), Some(5.0));
        assert_eq!(fastest_small_ring(&[8192], &[row(1.0)]), None);
    }
}
