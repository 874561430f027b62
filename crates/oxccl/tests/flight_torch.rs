//! Flight records in PyTorch's format (`OXCCL_FR_DUMP`): a 3-rank job (ranks as threads,
//! joined by a real rendezvous) where rank 2 skips the third all_reduce and leaves. Each rank
//! writes `PREFIX<rank>`; the files must hold torch's keys, and, where a Python with torch is
//! found (`OXCCL_TEST_PYTHON`, else `.venv/bin/python` of the repository, else `python3`),
//! torch's own analyser (`python -m torch.distributed.flight_recorder.fr_trace DIR`) must read
//! them and name the collective rank 2 did not join. Without torch that part is skipped, with
//! a message.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use oxccl::{Communicator, Config, ReduceOp, UniqueId};
use serde_pickle::{HashableValue as H, Value as V};

fn get(d: &V, k: &str) -> V {
    let V::Dict(d) = d else {
        panic!("not a dict: {d:?}")
    };
    d.get(&H::String(k.into()))
        .cloned()
        .unwrap_or_else(|| panic!("no key {k}"))
}

/// Runs the job; returns the directory of the dumps.
fn job() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("oxccl-fr-torch-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let prefix = format!("{}/nccl_trace_rank_", dir.display());
    let id = UniqueId::new_on("127.0.0.1".parse().unwrap()).unwrap();
    let n = 3;
    std::thread::scope(|s| {
        for r in 0..n {
            let (id, prefix) = (id.clone(), prefix.clone());
            s.spawn(move || {
                let cfg = Config {
                    // Rank 2 leaves cleanly: the others wait for it until this timeout.
                    timeout: Duration::from_secs(3),
                    fr_dump: Some(prefix),
                    ..Config::default()
                };
                let comm = Communicator::init_with_config(&id, r, n, cfg).unwrap();
                let mut x = vec![1.0f32; 64];
                for _ in 0..2 {
                    comm.all_reduce_in_place(&mut x, ReduceOp::Sum).unwrap();
                }
                if r != 2 {
                    // Rank 2 skips this one and leaves: the others fail.
                    let e = comm.all_reduce_in_place(&mut x, ReduceOp::Sum).unwrap_err();
                    assert!(e.to_string().contains('2'), "{e}");
                }
                drop(comm);
            });
        }
    });
    dir
}

fn python_with_torch() -> Option<PathBuf> {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let candidates = [
        std::env::var_os("OXCCL_TEST_PYTHON").map(PathBuf::from),
        Some(repo.join(".venv/bin/python")),
        Some(PathBuf::from("python3")),
    ];
    candidates.into_iter().flatten().find(|p| {
        Command::new(p)
            .args(["-c", "import torch.distributed.flight_recorder.fr_trace"])
            .output()
            .is_ok_and(|o| o.status.success())
    })
}

#[test]
fn torch_reads_the_records_and_names_the_skipped_collective() {
    let dir = job();
    for r in 0..3 {
        let bytes = std::fs::read(dir.join(format!("nccl_trace_rank_{r}"))).unwrap();
        let d = serde_pickle::value_from_slice(&bytes, Default::default()).unwrap();
        assert_eq!(get(&d, "version"), V::String("2.10".into()));
        let V::List(es) = get(&d, "entries") else {
            panic!()
        };
        // Ranks 0 and 1 started the third all_reduce; rank 2 did two.
        let want = if r == 2 { 2 } else { 3 };
        assert_eq!(es.len(), want, "rank {r}: {es:?}");
        let last = es.last().unwrap();
        assert_eq!(get(last, "collective_seq_id"), V::I64(want as i64));
        let state = if r == 2 { "completed" } else { "started" };
        assert_eq!(get(last, "state"), V::String(state.into()), "rank {r}");
        assert_eq!(
            get(last, "profiling_name"),
            V::String("oxccl:all_reduce".into())
        );
    }
    let Some(py) = python_with_torch() else {
        eprintln!("SKIPPED the torch analyser check: no Python with torch (set OXCCL_TEST_PYTHON)");
        let _ = std::fs::remove_dir_all(&dir);
        return;
    };
    let out = Command::new(&py)
        .args(["-m", "torch.distributed.flight_recorder.fr_trace"])
        .arg(&dir)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("fr_trace says:\n{text}");
    assert!(out.status.success(), "fr_trace failed:\n{text}");
    assert!(
        text.contains("Not all ranks joining collective, sequence number: 3")
            && text.contains("missing ranks: {2}"),
        "fr_trace did not name the skipped collective:\n{text}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A process that ends with `exit()` without dropping its communicator (as an interpreter
/// may): its torch-format record and its metrics are still written.
#[test]
#[ignore = "the child of written_at_exit_without_drop (started by it)"]
fn exit_child() {
    let Ok(dir) = std::env::var("OXCCL_EXIT_CHILD_DIR") else {
        return;
    };
    let cfg = Config {
        fr_dump: Some(format!("{dir}/nccl_trace_rank_")),
        metrics: Some(dir),
        metrics_interval: Duration::from_secs(3600),
        ..Config::default()
    };
    let comm = Communicator::from_links(0, 1, Vec::new(), cfg).unwrap();
    let mut x = vec![1.0f32; 8];
    comm.all_reduce_in_place(&mut x, ReduceOp::Sum).unwrap();
    std::mem::forget(comm);
    std::process::exit(0);
}

#[test]
fn written_at_exit_without_drop() {
    let dir = std::env::temp_dir().join(format!("oxccl-fr-exit-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let st = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "exit_child", "--ignored", "--test-threads=1"])
        .env("OXCCL_EXIT_CHILD_DIR", &dir)
        .stdout(std::process::Stdio::null())
        .status()
        .unwrap();
    assert!(st.success());
    let bytes = std::fs::read(dir.join("nccl_trace_rank_0")).expect("no torch record at exit");
    let d = serde_pickle::value_from_slice(&bytes, Default::default()).unwrap();
    let V::List(es) = get(&d, "entries") else {
        panic!()
    };
    assert_eq!(es.len(), 1);
    assert_eq!(get(&es[0], "state"), V::String("completed".into()));
    let prom: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .filter(|e| e.path().extension().is_some_and(|x| x == "prom"))
        .collect();
    assert_eq!(prom.len(), 1, "no metrics at exit");
    let text = std::fs::read_to_string(prom[0].path()).unwrap();
    assert!(
        text.contains("oxccl_collective_calls_total{") && text.contains("collective=\"AllReduce\""),
        "{text}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
