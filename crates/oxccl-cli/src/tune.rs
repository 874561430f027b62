//! `oxccl tune`: measures this host and saves where one intra-host algorithm overtakes
//! another (one-shot, ring, single-copy all_reduce), for [`oxccl::Tuning`], and the rates
//! the multi-host cost model uses (shared-memory link, reduction and copy, the TCP stack:
//! [`oxccl::Rates`], read by every communicator and by `oxccl sim`).
//!
//! Every later run on the host reads the file, so tune saves only measurements it trusts
//! ([`judge`]): each size is timed in several sweeps (the fastest counts), and nothing is
//! saved (exit 1, `--force` to save anyway) when the processes waited for a CPU (other
//! processes ran), the sweeps disagree, the algorithms take turns, or a rate lies outside
//! the bounds communicators accept ([`Tuning::implausible`]); a threshold outside them is
//! saved as the built-in one. A run on a loaded machine once saved `cma_min` past every
//! size, and no later run took the single-copy path.

use std::io::Write;

use clap::Args as ClapArgs;
use indicatif::{ProgressBar, ProgressStyle};
use oxccl::check::Case;
use oxccl::params::{TUNE_FILE, USER_TUNE_FILE};
use oxccl::Algo;
use oxccl::Tuning;
use oxccl::{CollKind, Communicator, DataType, ReduceOp};

use crate::launch::rank_or_launch;
use crate::perf::{runq, time_calls, under_launcher};

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
    /// Sweeps over every size and algorithm (1 to 10): each time is the fastest of them, and
    /// the sizes where one algorithm overtakes another must agree between them.
    #[arg(long, default_value_t = 2, value_parser = crate::args::count(1, 10))]
    repeats: usize,
    /// Refuse to save when the ranks, or rank 0 measuring the rates alone, waited for a CPU
    /// more than this share of the time, in percent (0 to 100): other processes ran here.
    #[arg(long, default_value_t = 10, value_parser = crate::args::count(0, 100))]
    max_wait: usize,
    /// Save even measurements that look disturbed (other processes competing for the CPUs,
    /// sweeps that disagree, values outside sane bounds); communicators still ignore the
    /// values outside sane bounds.
    #[arg(long)]
    force: bool,
}

/// Entry point: start ranks, or be one.
pub fn main(a: Args) -> i32 {
    // The measurement must not be steered by an earlier tuning: the ranks read none.
    let mut env = vec![(TUNE_FILE.name, String::new())];
    if let Some(p) = Tuning::path() {
        env.push((USER_TUNE_FILE.name, p.to_string_lossy().into_owned()));
    }
    rank_or_launch(
        "tune",
        crate::launch::Output::Raw,
        under_launcher(),
        a.ranks,
        &env,
        None,
        || rank_main(&a),
    )
}

const ALGOS: [Algo; 3] = [Algo::OneShot, Algo::Ring, Algo::Cma];

/// One sweep's times: `[size][algo]` in microseconds, `None` where the algorithm cannot run.
type Times = Vec<[Option<f64>; 3]>;

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
        let b = ProgressBar::new((a.repeats * sizes.len() * ALGOS.len()) as u64);
        b.set_style(
            ProgressStyle::with_template("{msg:>24} [{bar:40}] {pos}/{len} {elapsed}")
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> "),
        );
        b
    });
    let mut sweeps: Vec<Times> = Vec::new();
    // Per row, the share of the timed calls' time (ranks x seconds) the ranks waited for a
    // CPU; NaN where a rank cannot read it.
    let mut waits: Vec<f64> = Vec::new();
    for _ in 0..a.repeats {
        let mut times: Times = Vec::new();
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
                let t = time_calls(&comm, &case, send, recv, 3, None).map_err(|e| e.to_string())?;
                if t.algo == algo.name() {
                    row[i] = Some(t.secs * 1e6);
                }
                waits.push(
                    t.runq_wait
                        .map_or(f64::NAN, |w| w / (t.secs * n as f64).max(1e-12)),
                );
                if let Some(b) = &bar {
                    b.inc(1);
                }
            }
            times.push(row);
        }
        sweeps.push(times);
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
    let times = fastest(&sweeps);
    if times.iter().all(|r| r[0].is_none() && r[2].is_none()) {
        return Err(
            "no direct algorithm ran: tune measures ranks of one host over shared memory".into(),
        );
    }
    let mut out = std::io::stdout();
    let _ = writeln!(
        out,
        "# oxccl tune: all_reduce float sum, {n} ranks, time (us) per algorithm, the fastest \
         of {} sweep(s)",
        a.repeats
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
            best(r).map_or("-", |i| ALGOS[i].name())
        );
    }
    let (oneshot_max, cma_min) = crossovers(&sizes, &times);
    let _ = writeln!(
        out,
        "# oneshot_max={oneshot_max} cma_min={cma_min} ranks={n} (a communicator of m ranks \
         takes one-shot up to oneshot_max/(ranks-1)*(m-1), at most a slot)"
    );
    for (j, key) in [(0, "oneshot_max"), (2, "cma_min")] {
        if times.iter().all(|r| r[j].is_none()) {
            let _ = writeln!(
                out,
                "# {} did not run here: {key} keeps the built-in value",
                ALGOS[j].name()
            );
        }
    }
    // Only rank 0 runs now: with a CPU to itself, any wait for one is another process's doing.
    let (wait0, t0) = (runq::wait_secs(), std::time::Instant::now());
    let rates = measure_rates(n, &sizes, &times)?;
    let rates_wait = match (wait0, runq::wait_secs()) {
        (Some(w0), Some(w1)) => Some((w1 - w0) / t0.elapsed().as_secs_f64().max(1e-9)),
        _ => None,
    };
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
    let measured = Tuning {
        oneshot_max,
        cma_min,
        ranks: Some(n),
        rates: Some(rates),
    };
    // The ranks' wait tells of other processes only where each rank has a CPU of its own
    // (oxccl binds ranks that outnumber the CPUs to one each: rank 0 then sees one).
    let own_cpus = std::thread::available_parallelism().map_or(1, |c| c.get());
    let m = Measured {
        sizes: &sizes,
        sweeps: &sweeps,
        sweep_wait: (own_cpus >= n && !waits.is_empty())
            .then(|| waits.iter().sum::<f64>() / waits.len() as f64)
            .filter(|w| !w.is_nan()),
        rates_wait,
        max_wait: a.max_wait as f64 / 100.0,
    };
    let _ = writeln!(out, "# checks: {}", m.summary());
    let Verdict {
        save: t,
        replaced,
        doubts,
    } = judge(&m, measured);
    for r in &replaced {
        let _ = writeln!(out, "# replaced: {r}");
    }
    for d in &doubts {
        let _ = writeln!(out, "# not trusted: {d}");
    }
    if a.dry_run {
        return Ok(());
    }
    if !doubts.is_empty() && !a.force {
        return Err(format!(
            "not saved: {} check(s) failed (\"# not trusted\" above); measure on a quiet machine, \
             or save anyway with --force (communicators still ignore values outside sane bounds)",
            doubts.len()
        ));
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
    let forced = if doubts.is_empty() {
        ""
    } else {
        " (--force: saved despite failed checks)"
    };
    std::fs::write(
        &path,
        t.render(&format!("oxccl tune on {host}, {n} ranks{forced}")),
    )
    .map_err(|e| format!("{}: {e}", path.display()))?;
    let _ = writeln!(out, "# saved to {}{forced}", path.display());
    Ok(())
}

/// Each time the fastest of the sweeps (a preempted call is only ever slower).
fn fastest(sweeps: &[Times]) -> Times {
    let mut out = sweeps.first().cloned().unwrap_or_default();
    for sweep in sweeps.iter().skip(1) {
        for (row, other) in out.iter_mut().zip(sweep) {
            for (x, y) in row.iter_mut().zip(other) {
                *x = match (*x, *y) {
                    (Some(a), Some(b)) => Some(a.min(b)),
                    (a, b) => a.or(b),
                };
            }
        }
    }
    out
}

/// The fastest algorithm of a row (an index into [`ALGOS`]), `None` where none ran.
fn best(r: &[Option<f64>; 3]) -> Option<usize> {
    (0..3)
        .filter_map(|i| r[i].map(|t| (i, t)))
        .min_by(|x, y| x.1.total_cmp(&y.1))
        .map(|(i, _)| i)
}

/// `(oneshot_max, cma_min)`: one-shot up to the largest size where it is still the fastest
/// (0: never); single-copy from the smallest size after which it always is (never,
/// `MAX_THRESHOLD`: past the largest measured). Where an algorithm never ran (no direct
/// slots; no reading of peers' memory here, which communicators find out for themselves),
/// its threshold is the built-in one.
fn crossovers(sizes: &[usize], times: &[[Option<f64>; 3]]) -> (usize, usize) {
    let built_in = oxccl::Config::default();
    let ran = |j: usize| times.iter().any(|r| r[j].is_some());
    let oneshot_max = if ran(0) {
        sizes
            .iter()
            .zip(times)
            .filter(|(_, r)| best(r) == Some(0))
            .map(|(s, _)| *s)
            .max()
            .unwrap_or(0)
    } else {
        built_in.oneshot_max
    };
    let cma_min = if ran(2) {
        (0..sizes.len().min(times.len()))
            .find(|&i| times[i..].iter().all(|r| best(r) == Some(2)))
            .map_or(oxccl::params::MAX_THRESHOLD as usize, |i| sizes[i])
    } else {
        built_in.cma_min
    };
    (oneshot_max, cma_min)
}

/// What a tune measured besides the times' minima, for [`doubts`].
struct Measured<'a> {
    sizes: &'a [usize],
    /// Every sweep's times.
    sweeps: &'a [Times],
    /// The share of their timed calls the ranks waited for a CPU, the mean over rows (`None`:
    /// unknown, or the ranks outnumber the CPUs, which makes them wait for each other).
    sweep_wait: Option<f64>,
    /// The share of the rates' measurement rank 0, alone, waited for a CPU.
    rates_wait: Option<f64>,
    /// Above this share of their time waiting for a CPU, measurements time the load of
    /// other processes more than this host (`--max-wait`).
    max_wait: f64,
}

/// The sweeps' crossovers may differ by this many sizes (factors of 2) and no more.
const MAX_STEPS: f64 = 2.0;
/// A sweep's winner at a size counts only when it is faster than the other algorithm by
/// more than this factor (near ties flip from sweep to sweep and matter little).
const MARGIN: f64 = 1.25;
/// At most this many sizes may break the order one-shot, ring, single-copy (a flip or two
/// where two algorithms take about the same time).
const MAX_DISORDER: usize = 2;

impl Measured<'_> {
    /// Each sweep's crossovers.
    fn crossovers(&self) -> Vec<(usize, usize)> {
        self.sweeps
            .iter()
            .map(|t| crossovers(self.sizes, t))
            .collect()
    }

    /// Whether the sweeps contradict each other about algorithms `x` and `y` (indices into
    /// [`ALGOS`]) at a size from `lo` to `hi` bytes: in one sweep `x` is faster than `y`
    /// by more than [`MARGIN`], in another `y` than `x`.
    fn contradict(&self, x: usize, y: usize, lo: usize, hi: usize) -> bool {
        (0..self.sizes.len())
            .filter(|&i| (lo..=hi).contains(&self.sizes[i]))
            .any(|i| {
                let ratios: Vec<f64> = self
                    .sweeps
                    .iter()
                    .filter_map(|t| {
                        let r = t.get(i)?;
                        Some(r[x]? / r[y]?)
                    })
                    .collect();
                ratios.iter().any(|&q| q > MARGIN) && ratios.iter().any(|&q| q * MARGIN < 1.0)
            })
    }

    /// How many sizes break the order one-shot, ring, single-copy in the fastest times: a
    /// size up to `oneshot_max` where one-shot is not the fastest, or one below `cma_min`
    /// where single-copy is.
    fn disorder(&self) -> usize {
        let times = fastest(self.sweeps);
        let (oneshot_max, cma_min) = crossovers(self.sizes, &times);
        self.sizes
            .iter()
            .zip(&times)
            .filter(|(&s, r)| {
                let b = best(r);
                (s <= oneshot_max && b != Some(0)) || (s < cma_min && b == Some(2))
            })
            .count()
    }

    /// The median, over every size and algorithm, of the slowest sweep's time over the
    /// fastest one's.
    fn median_spread(&self) -> Option<f64> {
        let mut spreads: Vec<f64> = (0..self.sizes.len())
            .flat_map(|i| (0..3).map(move |j| (i, j)))
            .filter_map(|(i, j)| {
                let ts: Vec<f64> = self
                    .sweeps
                    .iter()
                    .filter_map(|s| s.get(i).and_then(|r| r[j]))
                    .collect();
                let lo = ts.iter().copied().fold(f64::INFINITY, f64::min);
                let hi = ts.iter().copied().fold(0.0, f64::max);
                (ts.len() > 1 && lo > 0.0).then(|| hi / lo)
            })
            .collect();
        spreads.sort_by(f64::total_cmp);
        spreads.get(spreads.len() / 2).copied()
    }

    /// One line for the output: every quantity the checks look at.
    fn summary(&self) -> String {
        let pct = |x: Option<f64>| x.map_or("-".to_string(), |w| format!("{:.0}%", w * 100.0));
        let cross: Vec<String> = self
            .crossovers()
            .iter()
            .map(|(o, c)| format!("{o}/{}", shown_size(*c)))
            .collect();
        format!(
            "waited for a CPU {} (ranks), {} (rates); oneshot_max/cma_min per sweep {}; \
             sizes out of order {}; median spread between sweeps {}",
            pct(self.sweep_wait),
            pct(self.rates_wait),
            cross.join(" "),
            self.disorder(),
            self.median_spread()
                .map_or("-".to_string(), |s| format!("{s:.2}"))
        )
    }
}

/// A size for the output, "never" for `MAX_THRESHOLD`.
fn shown_size(s: usize) -> String {
    if s as u64 >= oxccl::params::MAX_THRESHOLD {
        "never".to_string()
    } else {
        s.to_string()
    }
}

/// Why the measurements `m` are not to be trusted: the ranks, or rank 0 measuring the
/// rates, waited for a CPU more than `m.max_wait` of the time; the sweeps' crossovers
/// differ by more than [`MAX_STEPS`] sizes and, at a size in between, one sweep has one
/// algorithm faster by more than [`MARGIN`], another the other; more than [`MAX_DISORDER`] sizes break the
/// order one-shot, ring, single-copy.
fn doubts(m: &Measured) -> Vec<String> {
    let mut out = Vec::new();
    for (who, w) in [
        ("the ranks", m.sweep_wait),
        ("rank 0 measuring the rates", m.rates_wait),
    ] {
        if let Some(w) = w.filter(|&w| w > m.max_wait) {
            out.push(format!(
                "{who} waited for a CPU {:.0}% of the time (more than {:.0}%: other processes \
                 ran here)",
                w * 100.0,
                m.max_wait * 100.0
            ));
        }
    }
    let steps = |a: usize, b: usize| (a.max(1) as f64).log2() - (b.max(1) as f64).log2();
    let cross = m.crossovers();
    // The sizes the sweeps' crossovers leave contested, and the algorithms contested there.
    for (key, vals, (x, y)) in [
        (
            "oneshot_max",
            cross.iter().map(|c| c.0).collect::<Vec<_>>(),
            (0, 1),
        ),
        ("cma_min", cross.iter().map(|c| c.1).collect(), (1, 2)),
    ] {
        let (lo, hi) = (
            vals.iter().copied().min().unwrap_or(0),
            vals.iter().copied().max().unwrap_or(0),
        );
        let contested = if key == "oneshot_max" {
            (lo + 1, hi)
        } else {
            (lo, hi.saturating_sub(1))
        };
        if steps(hi, lo) > MAX_STEPS && m.contradict(x, y, contested.0, contested.1) {
            out.push(format!(
                "{key} differs between the sweeps ({}), by more than a factor of {}, and \
                 they contradict each other in between",
                vals.iter()
                    .map(|&v| shown_size(v))
                    .collect::<Vec<_>>()
                    .join(", "),
                2f64.powf(MAX_STEPS)
            ));
        }
    }
    let disorder = m.disorder();
    if disorder > MAX_DISORDER {
        out.push(format!(
            "at {disorder} sizes the fastest algorithm breaks the order one-shot, ring, \
             single-copy (more than {MAX_DISORDER})"
        ));
    }
    out
}

/// What tune does with its measurements.
#[derive(Debug, PartialEq)]
struct Verdict {
    /// What to save: the measured tuning, its thresholds outside the bounds communicators
    /// accept replaced by the built-in ones (with a rate outside them: no rates).
    save: Tuning,
    /// The thresholds replaced, and why.
    replaced: Vec<String>,
    /// Why nothing is to be saved (without `--force`): [`doubts`], and the rates outside
    /// the bounds. Empty: save.
    doubts: Vec<String>,
}

/// The decision on the measurements `m` and the tuning `measured` drawn from them. A
/// threshold outside the bounds communicators accept ([`Tuning::implausible`]) is replaced
/// by the built-in one and the rest saved: a quiet host can measure one (single-copy never
/// the fastest for private buffers, as on a 2-core VM from 1 MiB on, while shared buffers,
/// which the threshold also governs, need it; a crossover past `--max-bytes`). A rate
/// outside them, or a failed check, is a doubt: nothing is saved.
fn judge(m: &Measured, measured: Tuning) -> Verdict {
    let mut doubts = doubts(m);
    let mut replaced = Vec::new();
    let never = measured.cma_min as u64 >= oxccl::params::MAX_THRESHOLD;
    let (save, dropped) = measured.trusted();
    for (key, why) in dropped {
        match key {
            "oneshot_max" | "cma_min" => {
                let (hint, value) = if key == "cma_min" {
                    let hint = if never {
                        " (single-copy was not the fastest up to --max-bytes)"
                    } else {
                        ""
                    };
                    (hint, save.cma_min)
                } else {
                    ("", save.oneshot_max)
                };
                replaced.push(format!(
                    "{why}{hint}: the built-in {value} is saved instead"
                ));
            }
            _ => doubts.push(why),
        }
    }
    Verdict {
        save,
        replaced,
        doubts,
    }
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

    /// 8 B to 4 MiB.
    fn sizes() -> Vec<usize> {
        (3..=22).map(|k| 1usize << k).collect()
    }

    /// A sweep where algorithm `best[i]` is the fastest at size `i` (`us`, the others twice
    /// that).
    fn sweep(best: &[usize], us: f64) -> Times {
        best.iter()
            .map(|&b| {
                let mut r = [Some(2.0 * us); 3];
                r[b] = Some(us);
                r
            })
            .collect()
    }

    /// One-shot up to `oneshot` sizes, then ring, single-copy for the last `cma` sizes;
    /// `us` the fastest time.
    fn shaped(oneshot: usize, cma: usize, us: f64) -> Times {
        let n = sizes().len();
        sweep(
            &(0..n)
                .map(|i| match i {
                    i if i < oneshot => 0,
                    i if i >= n - cma => 2,
                    _ => 1,
                })
                .collect::<Vec<_>>(),
            us,
        )
    }

    fn tuning(sweeps: &[Times], rates: oxccl::Rates) -> Tuning {
        let (oneshot_max, cma_min) = crossovers(&sizes(), &fastest(sweeps));
        Tuning {
            oneshot_max,
            cma_min,
            ranks: Some(2),
            rates: Some(rates),
        }
    }

    /// The decision on measured numbers: a quiet run's are saved; a loaded machine's (ranks
    /// waiting for a CPU, sweeps that disagree, algorithms taking turns, a 56 ms link
    /// latency) are not; single-copy never the fastest (the tune file that broke the
    /// shared-buffer tests) is saved as the built-in threshold.
    #[test]
    fn disturbed_measurements_are_not_saved() {
        let sizes = sizes();
        let rates = oxccl::Rates {
            shm_lat_us: 1.5,
            ..oxccl::Rates::NOMINAL
        };
        // The second sweep slower: the first's times are the fastest.
        let quiet = [shaped(12, 7, 1.0), shaped(11, 6, 1.1)];
        let m = |sweeps, sweep_wait, rates_wait| Measured {
            sizes: &sizes,
            sweeps,
            sweep_wait,
            rates_wait,
            max_wait: 0.1,
        };
        let t = tuning(&quiet, rates);
        assert_eq!((t.oneshot_max, t.cma_min), (16 << 10, 64 << 10));
        assert_eq!(
            judge(&m(&quiet, Some(0.02), Some(0.0)), t.clone()),
            Verdict {
                save: t.clone(),
                replaced: vec![],
                doubts: vec![]
            }
        );
        assert!(m(&quiet, Some(0.02), None)
            .summary()
            .contains("16384/65536 8192/131072"));

        let waited = judge(&m(&quiet, Some(0.4), Some(0.5)), t).doubts;
        assert_eq!(waited.len(), 2, "{waited:?}");
        assert!(waited[0].contains("waited for a CPU 40%"), "{waited:?}");
        assert!(
            waited[1].contains("rank 0 measuring the rates"),
            "{waited:?}"
        );

        let moved = [shaped(12, 7, 1.0), shaped(9, 0, 1.1)];
        let d = judge(&m(&moved, None, None), tuning(&moved, rates)).doubts;
        assert!(
            d.iter()
                .any(|d| d.contains("cma_min differs between the sweeps (65536, never)")),
            "{d:?}"
        );

        // Crossovers far apart, but where they differ the second sweep has ring and
        // single-copy within 10 %: a near tie, no contradiction.
        let mut tied = shaped(12, 3, 1.0);
        for r in &mut tied[13..17] {
            r[2] = Some(1.1);
        }
        let ties = [shaped(12, 7, 1.0), tied];
        assert_eq!(
            judge(&m(&ties, None, None), tuning(&ties, rates)).doubts,
            Vec::<String>::new()
        );

        // One-shot, ring and single-copy taking turns.
        let flips: Vec<usize> = (0..sizes.len()).map(|i| [0, 2, 1, 0, 1][i % 5]).collect();
        let noisy = [sweep(&flips, 1.0), sweep(&flips, 1.1)];
        let d = judge(&m(&noisy, None, None), tuning(&noisy, rates)).doubts;
        assert!(d.iter().any(|d| d.contains("breaks the order")), "{d:?}");

        let slow = oxccl::Rates {
            shm_lat_us: 56_000.0,
            ..rates
        };
        let v = judge(&m(&quiet, None, None), tuning(&quiet, slow));
        assert_eq!(v.doubts.len(), 1, "{v:?}");
        assert!(
            v.doubts[0].starts_with("shm_lat_us=56000 is outside"),
            "{v:?}"
        );
        assert_eq!(v.save.rates, None);

        // Quiet, and single-copy never the fastest: saved, with the built-in threshold.
        let never = [shaped(12, 0, 1.0), shaped(12, 0, 1.1)];
        let v = judge(&m(&never, Some(0.0), Some(0.0)), tuning(&never, rates));
        assert_eq!(v.doubts, Vec::<String>::new());
        assert_eq!((v.save.oneshot_max, v.save.cma_min), (16 << 10, 64 << 10));
        assert_eq!(v.replaced.len(), 1, "{v:?}");
        let r = &v.replaced[0];
        assert!(
            r.starts_with("cma_min=1099511627776 (never) is outside"),
            "{r}"
        );
        assert!(r.contains("not the fastest up to --max-bytes"), "{r}");
        assert!(r.ends_with("the built-in 65536 is saved instead"), "{r}");
    }

    #[test]
    fn each_time_is_the_fastest_sweeps() {
        let a = vec![[Some(3.0), None, Some(1.0)]];
        let b = vec![[Some(2.0), Some(5.0), None]];
        assert_eq!(fastest(&[a, b]), vec![[Some(2.0), Some(5.0), Some(1.0)]]);
        assert_eq!(best(&[None, Some(5.0), Some(1.0)]), Some(2));
        assert_eq!(best(&[None; 3]), None);
    }
}
