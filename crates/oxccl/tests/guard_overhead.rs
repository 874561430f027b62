//! What failure handling adds to every call, measured on one core without peers (the
//! scheduler noise of a shared machine does not reach these numbers as it does a two-rank
//! benchmark). Run: `cargo test --release -p oxccl --test guard_overhead -- --ignored --nocapture`.

use std::hint::black_box;

use oxccl::testing::fingerprint::{Fingerprint, Header, Sequencer};
use oxccl::testing::flight::Recorder;
use oxccl::testing::health::Health;
use oxccl::{CollKind, DataType, ReduceOp};

/// Nanoseconds of this thread's CPU time per call of `f` (CPU time, not wall time: other
/// processes on a shared machine do not count).
fn per_iter(n: u32, mut f: impl FnMut(u32)) -> f64 {
    let cpu = || {
        let t = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
        t.tv_sec as f64 * 1e9 + t.tv_nsec as f64
    };
    for i in 0..n / 10 {
        f(i);
    }
    let t = cpu();
    for i in 0..n {
        f(i);
    }
    (cpu() - t) / n as f64
}

#[test]
#[ignore = "a measurement: run with --ignored --nocapture"]
fn per_call_cost_of_fingerprints_health_recorder_and_metrics() {
    let n = 2_000_000;
    let mut seq = Sequencer::new(8);
    let health = Health::new();
    let rec = Recorder::new(0, 8, 1, 256, None, None);
    let fp_cost = per_iter(n, |i| {
        let fp = Fingerprint::of(CollKind::AllReduce, DataType::F32, ReduceOp::Sum, 2, 0);
        black_box(seq.next(0, i as u64, CollKind::AllReduce, black_box(fp)));
    });
    let fp = Fingerprint::of(CollKind::AllReduce, DataType::F32, ReduceOp::Sum, 2, 0);
    let print = seq.next(0, 1, CollKind::AllReduce, fp);
    let hdr_cost = per_iter(n, |_| {
        let h = black_box(&print).header();
        black_box(print.matches(black_box(&h)));
    });
    let h = print.header();
    assert!(Header::decode(&h).is_ok_and(|d| print.check(&d).is_ok()));
    let health_cost = per_iter(n, |_| {
        black_box(black_box(&health).is_failed());
    });
    let rec_cost = per_iter(n, |i| {
        rec.begin(i as u64, "all_reduce", fp, i as u64, "ring");
        rec.end(i as u64, None);
    });
    let dir = std::env::temp_dir().join(format!("oxccl-overhead-{}", std::process::id()));
    let id = oxccl::testing::metrics::Identity {
        comm: 1,
        rank: 0,
        nranks: 8,
        nnodes: 1,
    };
    let metrics = oxccl::testing::metrics::Metrics::new(
        id,
        dir.to_str().unwrap(),
        std::time::Duration::from_secs(3600),
    );
    let metrics_cost = per_iter(n, |i| {
        metrics.begin();
        metrics.end(i as u64, "all_reduce", &fp, false);
    });
    drop(metrics);
    let _ = std::fs::remove_dir_all(dir);
    println!(
        "per call: fingerprint+sequence {fp_cost:.1} ns, header encode+check (per link) {hdr_cost:.1} ns, \
         health check {health_cost:.1} ns, flight recorder begin+end {rec_cost:.1} ns, \
         metrics (OXCCL_METRICS) begin+end {metrics_cost:.1} ns"
    );
}
