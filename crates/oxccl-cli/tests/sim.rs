//! `oxccl sim`: the predicted table and JSON rows are consistent (the chosen algorithm is the
//! fastest prediction, busbw follows algbw), the environment's network model and forced
//! algorithm reach it, and the shape of the predictions is the model's (ring latency linear
//! in the hosts, tree latency logarithmic).

use std::process::Command;

use serde_json::Value;

const OXCCL: &str = env!("CARGO_BIN_EXE_oxccl");

/// Runs `oxccl sim ARGS` with `env` (and no tune file); its stdout, after checking it exited 0.
fn sim(args: &[&str], env: &[(&str, &str)]) -> String {
    let out = Command::new(OXCCL)
        .arg("sim")
        .args(args)
        .env("OXCCL_TUNE_FILE", "")
        .env_remove("OXCCL_NET_GBPS")
        .env_remove("OXCCL_NET_LAT_US")
        .env_remove("OXCCL_ALGO")
        .env_remove("OXCCL_DETERMINISTIC")
        .envs(env.iter().copied())
        .output()
        .unwrap();
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert!(
        out.status.success(),
        "oxccl sim {args:?}: {:?}\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

fn rows(args: &[&str], env: &[(&str, &str)]) -> Vec<Value> {
    let mut a = args.to_vec();
    a.push("--json");
    sim(&a, env)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn f(v: &Value, k: &str) -> f64 {
    v[k].as_f64().unwrap_or_else(|| panic!("{k} in {v}"))
}

#[test]
fn rows_are_consistent() {
    let args = [
        "--hosts",
        "2-8,3",
        "--ranks-per-host",
        "2",
        "-b",
        "8",
        "-e",
        "64M",
        "-f",
        "8",
    ];
    let r = rows(&args, &[]);
    // Hosts 2, 4, 8, 3; sizes 8 B .. 16 MB by 8.
    assert_eq!(r.len(), 4 * 8);
    for row in &r {
        let (n, bytes) = (f(row, "ranks"), f(row, "bytes"));
        assert_eq!(n, f(row, "hosts") * 2.0);
        let preds = row["predicted_us"].as_object().unwrap();
        assert_eq!(preds.len(), 4, "{row}");
        let best = preds
            .values()
            .filter_map(Value::as_f64)
            .fold(f64::INFINITY, f64::min);
        let algo = row["algo"].as_str().unwrap();
        assert_eq!(preds[algo].as_f64(), Some(best), "{row}");
        assert_eq!(f(row, "time_us"), best);
        let algbw = bytes / (best * 1e3);
        assert!(
            (f(row, "algbw_gbps") - algbw).abs() <= 1e-9 * algbw,
            "{row}"
        );
        let bus = algbw * 2.0 * (n - 1.0) / n;
        assert!((f(row, "busbw_gbps") - bus).abs() <= 1e-9 * bus, "{row}");
        assert_eq!(f(row, "net_gbps"), 1.2);
    }
    // The table has the same rows, one block per host count.
    let t = sim(&args, &[]);
    assert_eq!(t.lines().filter(|l| !l.starts_with('#')).count(), r.len());
    assert_eq!(
        t.matches("# 4 hosts x 2 rank(s) = 8 ranks").count(),
        1,
        "{t}"
    );
    assert!(
        t.contains("ring") && t.contains("hier") && t.contains("hd"),
        "{t}"
    );
}

#[test]
fn latency_scaling_is_the_models() {
    // 8 B on 2 and 4096 hosts: the ring's 2(n-1) steps grow with n, the tree's log2 n do not.
    let r = rows(&["--hosts", "2,4096", "-b", "8", "-e", "8"], &[]);
    let t = |i: usize, a: &str| r[i]["predicted_us"][a].as_f64().unwrap();
    assert!(t(1, "ring") / t(0, "ring") > 1000.0, "{r:?}");
    assert!(t(1, "tree") / t(0, "tree") < 13.0, "{r:?}");
    assert_eq!(r[1]["algo"], "tree");
}

#[test]
fn environment_and_flags_reach_the_model() {
    // OXCCL_NET_GBPS and OXCCL_NET_LAT_US as at run time; the flags win over them.
    let env = [("OXCCL_NET_GBPS", "12.5"), ("OXCCL_NET_LAT_US", "5")];
    let r = rows(&["--hosts", "4", "-b", "1M", "-e", "1M"], &env);
    assert_eq!((f(&r[0], "net_gbps"), f(&r[0], "net_lat_us")), (12.5, 5.0));
    let fast = f(&r[0], "time_us");
    let r = rows(
        &[
            "--hosts",
            "4",
            "-b",
            "1M",
            "-e",
            "1M",
            "--net-gbps",
            "0.125",
        ],
        &env,
    );
    assert_eq!(f(&r[0], "net_gbps"), 0.125);
    assert!(f(&r[0], "time_us") > 5.0 * fast, "{r:?}");
    // A forced algorithm is what a communicator would run.
    let r = rows(
        &["--hosts", "8", "-b", "8", "-e", "8"],
        &[("OXCCL_ALGO", "ring")],
    );
    assert_eq!(r[0]["algo"], "ring");
    // Rank-ordered reductions have no predicted time.
    let r = rows(
        &["--hosts", "8", "-b", "8", "-e", "8"],
        &[("OXCCL_DETERMINISTIC", "1")],
    );
    assert_eq!(r[0]["algo"], "ordered");
    assert!(r[0]["time_us"].is_null());
}

/// A tune file as `oxccl tune` writes it, with the TCP stack moving `tcp_gbps` per core.
fn tune_file(name: &str, tcp_gbps: f64) -> std::path::PathBuf {
    let f = std::env::temp_dir().join(format!("oxccl-sim-{name}-{}.conf", std::process::id()));
    std::fs::write(
        &f,
        format!(
            "# test\noneshot_max=8192\ncma_min=65536\nshm_lat_us=2\nshm_gbps=4\n\
             reduce_gbps=3\nreduce_cached_gbps=30\ncopy_gbps=3\ncopy_cached_gbps=30\n\
             tcp_lat_us=5\ntcp_gbps={tcp_gbps}\n"
        ),
    )
    .unwrap();
    f
}

/// 4 hosts of one rank, 16 MB, a 1.25 GB/s link.
const FOUR_HOSTS_16M: [&str; 8] = [
    "--hosts",
    "4",
    "-b",
    "16M",
    "-e",
    "16M",
    "--net-gbps",
    "1.25",
];

/// The row's ring on [`FOUR_HOSTS_16M`] is 2(n-1) steps of 4 MB at `gbps` plus the
/// reduction at the tune file's 3 GB/s.
fn ring_is(row: &serde_json::Value, gbps: f64) {
    let s = 16.0 * 1048576.0;
    let ring = row["predicted_us"]["ring"].as_f64().unwrap();
    let want = 6.0 * (30.0 + s / 4.0 / (gbps * 1e3)) + 3.0 * s / 4.0 / 3e3;
    assert!((ring - want).abs() < 1e-6 * want, "{ring} {want}");
}

#[test]
fn tune_file_rates_reach_the_model() {
    let file = tune_file("rates", 0.25);
    let path = file.to_str().unwrap();
    let base = FOUR_HOSTS_16M;
    let without = rows(&base, &[]);
    assert!(without[0]["tcp"].is_null(), "{without:?}");
    let mut args = base.to_vec();
    args.extend(["--tune-file", path]);
    let with = rows(&args, &[]);
    // The stack's 0.25 GB/s per core, not the 1.25 GB/s link, bounds the ring's bytes: its
    // time is 2(n-1) steps of 4 MB at 0.25 GB/s plus the reduction at 3 GB/s.
    assert_eq!(with[0]["tcp"], serde_json::json!([5.0, 0.25]));
    ring_is(&with[0], 0.25);
    assert!(f(&with[0], "time_us") > 3.0 * f(&without[0], "time_us"));
    // The default is the file `oxccl tune` writes (OXCCL_TUNE_FILE).
    let env = rows(&base, &[("OXCCL_TUNE_FILE", path)]);
    assert_eq!(env[0]["predicted_us"], with[0]["predicted_us"]);
    let t = sim(&args, &[]);
    assert!(t.contains(&format!("rates: measured, {path}")), "{t}");
    assert!(
        t.contains("TCP stack 5.0 us per message, 0.25 GB/s per core"),
        "{t}"
    );
    // Ranks sharing cores: every CPU term slower, the choice unchanged.
    args.extend(["--cpus", "1"]);
    let shared = rows(&args, &[]);
    assert_eq!(shared[0]["algo"], with[0]["algo"]);
    assert!(f(&shared[0], "time_us") > 3.0 * f(&with[0], "time_us"));
    let _ = std::fs::remove_file(file);
}

#[test]
fn the_paths_tcp_rate_changes_the_times_not_the_choice() {
    // A loopback rate faster than the link (4 GB/s per core), then the path's 0.25 GB/s.
    let file = tune_file("path", 4.0);
    let path = file.to_str().unwrap();
    let mut args = FOUR_HOSTS_16M.to_vec();
    args.extend(["--tune-file", path]);
    let loopback = rows(&args, &[]);
    let mut slow = args.clone();
    slow.extend(["--tcp-gbps", "0.25"]);
    let on_path = rows(&slow, &[]);
    assert_eq!(on_path[0]["tcp"], serde_json::json!([5.0, 0.25]));
    assert_eq!(on_path[0]["algo"], loopback[0]["algo"]);
    ring_is(&on_path[0], 0.25);
    ring_is(&loopback[0], 1.25);
    let s = 16.0 * 1048576.0;
    // 2 hosts x 2 ranks on 2 cores: hier's network phase runs one stream per host, so
    // the leaders' two streams have a core each (2 steps of 8 MB at 0.25 GB/s).
    let mut hier = slow.clone();
    hier[1] = "2";
    hier.extend(["--ranks-per-host", "2", "--cpus", "2"]);
    let h = rows(&hier, &[]);
    let t = h[0]["predicted_us"]["hier"].as_f64().unwrap();
    let net = 2.0 * (30.0 + s / 2.0 / 250.0);
    assert!(t > net && t < 1.1 * net, "{t} {net}");
    let _ = std::fs::remove_file(file);
}

#[test]
fn tune_file_refused_with_a_reason() {
    let run = |file: &std::path::Path| {
        let out = Command::new(OXCCL)
            .args(["sim", "--hosts", "2", "-b", "8", "-e", "8", "--tune-file"])
            .arg(file)
            .env("OXCCL_TUNE_FILE", "")
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{out:?}");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let missing = std::env::temp_dir().join("oxccl-sim-no-such-file.conf");
    assert!(run(&missing).contains("no such file"));
    let old = tune_file("old", 1.0);
    std::fs::write(&old, "oneshot_max=8192\ncma_min=65536\n").unwrap();
    assert!(run(&old).contains("no measured rates"), "{}", run(&old));
    std::fs::write(&old, "oneshot_max=8192\ncma_min=65536\ntcp_gbps=1\n").unwrap();
    let e = run(&old);
    assert!(e.contains("--tune-file") && e.contains("missing"), "{e}");
    let _ = std::fs::remove_file(old);
    // A rate no host has (a disturbed `oxccl tune`): not used, named with its file; one
    // such rate drops them all.
    let absurd = tune_file("absurd", 1e6);
    let e = run(&absurd);
    assert!(
        e.contains(&format!(
            "{}: tcp_gbps=1000000 is outside",
            absurd.display()
        )) && e.contains("no measured rates"),
        "{e}"
    );
    let _ = std::fs::remove_file(absurd);
}
