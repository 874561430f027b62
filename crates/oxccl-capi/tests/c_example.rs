//! Builds examples/allreduce.c against include/oxccl.h and liboxccl_capi.so with the
//! system's C compiler and runs it (two ranks, forked).

use std::path::PathBuf;
use std::process::Command;

#[test]
fn c_example_runs() {
    let here = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    // The test runs as target/<profile>/deps/c_example-HASH. `cargo test` alone leaves the
    // cdylib beside it in deps/; `cargo build` also copies it up to target/<profile>.
    let exe = std::env::current_exe().unwrap();
    let deps = exe.parent().unwrap().to_path_buf();
    let lib_dir = [deps.clone(), deps.parent().unwrap().to_path_buf()]
        .into_iter()
        .find(|d| d.join("liboxccl_capi.so").exists())
        .unwrap_or_else(|| panic!("no liboxccl_capi.so in {} or its parent", deps.display()));
    let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("oxccl_c_example");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let build = Command::new(&cc)
        .arg(here.join("examples/allreduce.c"))
        .arg("-I")
        .arg(here.join("include"))
        .arg("-Wall")
        .arg("-Werror")
        .arg("-L")
        .arg(&lib_dir)
        .arg("-loxccl_capi")
        .arg(format!("-Wl,-rpath,{}", lib_dir.display()))
        .arg("-o")
        .arg(&out)
        .output()
        .expect("running the C compiler");
    assert!(
        build.status.success(),
        "{cc} failed: {}",
        String::from_utf8_lossy(&build.stderr)
    );
    let run = Command::new(&out)
        .env("OXCCL_TIMEOUT", "30")
        .output()
        .expect("running the C example");
    let stdout = String::from_utf8_lossy(&run.stdout);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    for rank in 0..2 {
        assert!(
            stdout.contains(&format!("rank {rank}: oxccl C example ok")),
            "{stdout}"
        );
        assert!(
            stdout.contains(&format!("rank {rank}: oxccl: unknown data type 99")),
            "{stdout}"
        );
    }
}
