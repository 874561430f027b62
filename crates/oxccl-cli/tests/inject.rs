//! `oxccl perf --kill-rank / --stall-rank / --cut-rank`: a rank of a real 3-rank job fails at
//! a chosen iteration; the survivors must see it, shrink, re-run with no wrong element and agree
//! bitwise, and the whole run must succeed.

use std::process::Command;

const OXCCL: &str = env!("CARGO_BIN_EXE_oxccl");

fn perf(args: &[&str]) -> Command {
    let mut c = Command::new(OXCCL);
    c.args([
        "perf",
        "all_reduce",
        "-b",
        "64K",
        "-e",
        "64K",
        "--ranks",
        "3",
    ])
    .args(args)
    .env("OXCCL_TIMEOUT", "60");
    c
}

fn text(o: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn run(args: &[&str]) -> String {
    let o = perf(args).output().unwrap();
    let out = text(&o);
    assert!(o.status.success(), "{args:?} failed:\n{out}");
    out
}

/// The line of `out` that starts with `start`.
fn line<'a>(out: &'a str, start: &str) -> &'a str {
    out.lines()
        .find(|l| l.starts_with(start))
        .unwrap_or_else(|| panic!("no line starting with {start:?}:\n{out}"))
}

#[test]
fn survivors_detect_shrink_and_agree() {
    for (args, victim) in [
        (vec!["--kill-rank", "1", "--at-iter", "5"], "rank 1 killed"),
        (
            vec!["--stall-rank", "2", "--at-iter", "3", "--stall-secs", "4"],
            "rank 2 stalled",
        ),
    ] {
        let out = run(&args);
        assert!(out.contains(victim), "{out}");
        if args[0] == "--kill-rank" {
            // A real SIGKILL, which this command's launcher expected.
            assert!(
                out.contains("rank 1 killed (SIGKILL)")
                    && out.contains("rank 1 was killed by signal 9 (SIGKILL), as expected"),
                "{out}"
            );
        }
        let seen = out.matches("failure seen at iteration").count();
        assert_eq!(seen, 2, "both survivors report the failure:\n{out}");
        assert!(
            out.contains("re-run on 2 survivors: 0 wrong element(s)")
                && out.contains("bitwise identical on every survivor"),
            "{out}"
        );
    }
}

/// 3 ranks, rank 2 killed, the survivors shrink to 2, then a replacement process joins with
/// `grow`: the 3-rank all_reduce must match the reference and agree bitwise on every rank.
#[test]
fn a_replacement_grows_back_and_agrees() {
    let out = run(&["--kill-rank", "2", "--at-iter", "5", "--grow"]);
    assert!(
        out.contains("re-run on 2 survivors: 0 wrong element(s)"),
        "{out}"
    );
    assert!(
        out.contains("# grow: a replacement joined as rank 2"),
        "{out}"
    );
    assert!(
        out.contains("re-run on 3 ranks after grow: 0 wrong element(s)")
            && out.contains("bitwise identical on every rank"),
        "{out}"
    );
}

/// `--cut-rank` over TCP, the cut rank in the middle and at rank 0 (which hosts the control
/// star): every packet to the cut rank's sockets is dropped, nothing is closed. Every survivor
/// must lose the cut rank by heartbeat silence (not by a closed socket, not by the 60 s call
/// timeout), the cut rank must fail too, and the survivors must shrink and agree.
#[test]
fn a_silent_partition_is_seen_by_every_rank_and_the_survivors_agree() {
    for victim in [1usize, 0] {
        let v = victim.to_string();
        let out = run(&["--cut-rank", &v, "--at-iter", "4", "--transport", "tcp"]);
        assert!(
            out.contains(&format!("rank {victim} cut off (silent TCP partition)")),
            "{out}"
        );
        for r in (0..3).filter(|&r| r != victim) {
            // At iteration 4, or 5 where the cut rank's last sends still arrived.
            let l = line(&out, &format!("rank {r}: failure seen at iteration "));
            assert!(
                l.contains(&format!("lost peer rank {victim}")) && l.contains("no heartbeat"),
                "{l}"
            );
        }
        let l = line(
            &out,
            &format!("rank {victim} (cut): failure seen at iteration 4"),
        );
        assert!(
            l.contains("lost peer rank") && l.contains("no heartbeat"),
            "{l}"
        );
        assert!(
            out.contains("re-run on 2 survivors: 0 wrong element(s)")
                && out.contains("bitwise identical on every survivor"),
            "{out}"
        );
    }
}

/// Shared memory has no packets to drop: `--cut-rank` without the TCP transport is refused
/// before any rank starts.
#[test]
fn a_cut_needs_tcp() {
    for t in [&["--transport", "shm"][..], &[]] {
        let mut args = vec!["--cut-rank", "1"];
        args.extend_from_slice(t);
        let o = perf(&args).env_remove("OXCCL_TRANSPORT").output().unwrap();
        let out = text(&o);
        assert_eq!(o.status.code(), Some(2), "{out}");
        assert!(
            out.contains("--cut-rank needs the TCP transport") && !out.contains("failure seen"),
            "{out}"
        );
    }
}

/// `oxccl run --expect-kill R`: rank R's SIGKILL does not stop the other ranks (they get
/// `OXCCL_LAUNCH_EXPECTS_KILL=R`); without the flag, or when another rank is the one killed,
/// the job stops as before.
#[test]
fn the_launcher_keeps_the_survivors_of_an_expected_sigkill() {
    let script = "if [ $RANK = 1 ]; then kill -9 $$; fi; sleep 5; \
                  echo survived $RANK $OXCCL_LAUNCH_EXPECTS_KILL";
    let go = |extra: &[&str]| {
        let o = Command::new(OXCCL)
            .args(["run", "-n", "3"])
            .args(extra)
            .args(["--", "sh", "-c", script])
            .output()
            .unwrap();
        (o.status.success(), text(&o))
    };
    let (ok, out) = go(&["--expect-kill", "1"]);
    assert!(
        ok && out.contains("rank 1 was killed by signal 9 (SIGKILL), as expected")
            && out.contains("[0] survived 0 1")
            && out.contains("[2] survived 2 1"),
        "{out}"
    );
    for extra in [&[][..], &["--expect-kill", "2"]] {
        let (ok, out) = go(extra);
        assert!(
            !ok && out.contains("rank 1 was killed by signal 9 (SIGKILL) first")
                && !out.contains("survived"),
            "{extra:?}: {out}"
        );
    }
}

/// A victim rank out of range is said once, not once per rank: by `oxccl
/// perf` before it starts any rank, and under `oxccl run` by rank 0 only.
#[test]
fn a_victim_out_of_range_is_reported_once() {
    let o = perf(&["--kill-rank", "5"]).output().unwrap();
    let out = text(&o);
    assert_eq!(o.status.code(), Some(2), "{out}");
    assert_eq!(
        out.matches("--kill-rank 5: rank 5 is not one of 3 ranks")
            .count(),
        1,
        "{out}"
    );
    let want = "--kill-rank 5: rank 5 is not one of 4 ranks";
    let o = Command::new(OXCCL)
        .args([
            "run",
            "-n",
            "4",
            OXCCL,
            "perf",
            "all_reduce",
            "-b",
            "1K",
            "-e",
            "1K",
        ])
        .args(["--kill-rank", "5"])
        .env("OXCCL_TIMEOUT", "60")
        .output()
        .unwrap();
    let out = text(&o);
    assert!(!o.status.success(), "{out}");
    assert_eq!(out.matches(want).count(), 1, "{out}");
}
