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
