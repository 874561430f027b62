//! `oxccl perf --kill-rank / --stall-rank`: a rank of a real 3-rank job fails at a chosen
//! iteration; the survivors must see it, shrink, re-run with no wrong element and agree
//! bitwise, and the whole run must succeed.

use std::process::Command;

const OXCCL: &str = env!("CARGO_BIN_EXE_oxccl");

fn run(args: &[&str]) -> String {
    let o = Command::new(OXCCL)
        .args([
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
        .env("OXCCL_TIMEOUT", "60")
        .output()
        .unwrap();
    let out = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(o.status.success(), "{args:?} failed:\n{out}");
    out
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
