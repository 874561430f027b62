//! `oxccl`: the command-line tool of the oxccl collective communication library.
//!
//! - `oxccl perf COLLECTIVE ...`: an nccl-tests-style benchmark (see `perf.rs`).
//! - `oxccl run -n N -- PROGRAM ARGS...`: starts N local ranks (see `launch.rs`).
//! - `oxccl info`: what this host offers (see `info.rs`).
//! - `oxccl trace FILES...`: merges flight recorder files (see `trace.rs`).
//! - `oxccl status ADDR`: asks a running job where every rank is (see `status.rs`).
//! - `oxccl sim`: predicts all_reduce on larger clusters from the cost model (see `sim.rs`).

mod args;
mod info;
mod launch;
mod perf;
mod sim;
mod status;
mod trace;
mod tune;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "oxccl",
    version,
    about = "oxccl collective communication: benchmark, launcher, host info"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Benchmark a collective, as nccl-tests' *_perf (starts --ranks local ranks itself, or
    /// runs as one rank under torchrun, srun, mpirun or `oxccl run`).
    Perf(Box<perf::Args>),
    /// Start N local ranks of a program with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
    /// MASTER_PORT and OXCCL_SECRET set; output lines are prefixed with the rank.
    Run(launch::RunArgs),
    /// Measure this host's intra-host algorithms and save where each is fastest (read by
    /// every communicator of this host afterwards).
    Tune(tune::Args),
    /// Show version, host identity, cores, /dev/shm space, interfaces and usable transports.
    Info,
    /// Merge the flight recorder files of all ranks (OXCCL_FLIGHT_RECORDER) and say which
    /// rank stopped where; with --timeline, merge OXCCL_TRACE timelines.
    Trace(trace::Args),
    /// Ask a running job (started with OXCCL_STATUS) where every rank is: alive, current
    /// call and sequence number, last completed call, ranks behind, recent errors.
    Status(status::Args),
    /// Predict all_reduce on clusters larger than this one (2 to 4096 hosts and more) from
    /// the library's cost model: each algorithm's time, the one it would choose, busbw.
    Sim(sim::Args),
}

fn main() {
    // Commands that start ranks (and `sim`, which reads the model's variables as ranks do)
    // check every variable they and the library read, once, before anything runs (also
    // before clap reads the variables some flags default to): a refused value is one line
    // naming it, the value and the range.
    let sub = std::env::args_os().nth(1);
    if ["perf", "run", "tune", "sim"]
        .iter()
        .any(|c| sub.as_deref() == Some(c.as_ref()))
    {
        use oxccl::params::Scope;
        if let Err(e) = oxccl::params::check_env(&[Scope::Comm, Scope::Process, Scope::Cli]) {
            eprintln!("oxccl: {e}");
            std::process::exit(2);
        }
    }
    let cli = Cli::parse();
    let code = match cli.cmd {
        Cmd::Perf(a) => perf::main(*a),
        Cmd::Run(a) => launch::run_main(a),
        Cmd::Tune(a) => tune::main(a),
        Cmd::Info => info::main(),
        Cmd::Trace(a) => trace::main(a),
        Cmd::Status(a) => status::main(a),
        Cmd::Sim(a) => sim::main(a),
    };
    std::process::exit(code);
}
