//! The flight recorder in PyTorch's format: with `OXCCL_FR_DUMP=PREFIX` each rank writes
//! `PREFIX<rank>` (torch's `TORCH_FR_DUMP_TEMP_FILE` convention, e.g.
//! `/tmp/nccl_trace_rank_3`) as the pickled dict that torch's `_dump_nccl_trace` produces, so
//! that torch's analyser reads it unchanged:
//! `python -m torch.distributed.flight_recorder.fr_trace DIR`. Written where the oxccl-format
//! record is (a failed call, a failure reported by the watchdog, `SIGUSR1`), when the
//! communicator is dropped, and at process exit (`exit()`) for those still alive.
//!
//! Each collective is one entry (`profiling_name` `oxccl:<call>`, sizes and dtypes as torch
//! records them, `collective_seq_id` the collective number every rank agrees on). A call that
//! failed or is still running is `started`, a finished one `completed`. Point-to-point calls
//! are left out: the recorder does not keep their peers, which torch's entries name.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::Serialize;

use crate::base::dtype::DataType;
use crate::observe::flight::{CallState, Entry};

/// The version of torch's format written (what torch 2.10's flight recorder writes).
pub(crate) const VERSION: &str = "2.10";

/// Where and how a rank writes its torch-format record.
#[derive(Clone, Debug)]
pub struct TorchDump {
    /// The file prefix (`OXCCL_FR_DUMP`); the rank is appended.
    pub prefix: String,
    /// The communicator's timeout, for the entries' `timeout_ms`.
    pub timeout_ms: u64,
}

/// One entry, with the keys torch's analyser reads.
#[derive(Serialize)]
struct TorchEntry {
    record_id: u64,
    pg_id: u64,
    process_group: (String, String),
    collective_seq_id: u64,
    p2p_seq_id: u64,
    op_id: u64,
    profiling_name: String,
    time_created_ns: u64,
    duration_ms: Option<f64>,
    input_sizes: Vec<Vec<u64>>,
    input_dtypes: Vec<&'static str>,
    output_sizes: Vec<Vec<u64>>,
    output_dtypes: Vec<&'static str>,
    state: &'static str,
    time_discovered_started_ns: Option<u64>,
    time_discovered_completed_ns: Option<u64>,
    retired: bool,
    timeout_ms: u64,
    is_p2p: bool,
    frames: Vec<()>,
}

#[derive(Serialize)]
struct PgConfig {
    name: String,
    desc: &'static str,
    ranks: String,
}

#[derive(Serialize)]
struct PgStatus {
    last_enqueued_collective: i64,
    last_started_collective: i64,
    last_completed_collective: i64,
}

#[derive(Serialize)]
struct Dump {
    version: &'static str,
    comm_lib_version: String,
    pg_config: BTreeMap<String, PgConfig>,
    pg_status: BTreeMap<String, PgStatus>,
    entries: Vec<TorchEntry>,
}

/// torch's name of a data type (`str(torch.float32)` less the `torch.` is not what the
/// recorder writes: it writes c10's `ScalarType` names).
fn torch_dtype(code: u8) -> &'static str {
    match DataType::ALL.get(code as usize) {
        Some(DataType::I8) => "Char",
        Some(DataType::U8) => "Byte",
        Some(DataType::I32) => "Int",
        Some(DataType::U32) => "UInt32",
        Some(DataType::I64) => "Long",
        Some(DataType::U64) => "UInt64",
        Some(DataType::F16) => "Half",
        Some(DataType::Bf16) => "BFloat16",
        Some(DataType::F32) => "Float",
        Some(DataType::F64) => "Double",
        Some(DataType::Bool) => "Bool",
        Some(DataType::U16) => "UInt16",
        None => "Byte",
    }
}

/// (input, output) element counts of a call as torch records them (one tensor each).
fn sizes(call: &str, count: u64, nranks: u64) -> (u64, u64) {
    match call {
        "all_gather" => (count, count * nranks),
        "reduce_scatter" => (count * nranks, count),
        "all_to_all" => (count * nranks, count * nranks),
        _ => (count, count),
    }
}

/// torch's collective name for an oxccl call (`None`: not recorded in torch's format).
fn torch_name(call: &str) -> Option<&'static str> {
    Some(match call {
        "all_reduce" => "all_reduce",
        "broadcast" => "broadcast",
        "reduce" => "reduce",
        "all_gather" => "_all_gather_base",
        "reduce_scatter" => "_reduce_scatter_base",
        "all_to_all" => "all_to_all_single",
        "barrier" => "barrier",
        _ => return None,
    })
}

/// The pickled dump of `entries` (oldest first) of a rank of `nranks` in communicator
/// `comm`.
pub(crate) fn to_pickle(entries: &[Entry], nranks: usize, comm: u64, timeout_ms: u64) -> Vec<u8> {
    let pg = format!("{:08x}", comm as u32);
    let mut out = Vec::new();
    let (mut started, mut completed) = (-1i64, -1i64);
    for e in entries {
        let Some(name) = torch_name(e.call) else {
            continue;
        };
        let (ins, outs) = sizes(e.call, e.fp.count, nranks as u64);
        let (isz, osz) = if e.call == "barrier" {
            (vec![], vec![])
        } else {
            (vec![ins], vec![outs])
        };
        let dt = torch_dtype(e.fp.dtype);
        let done = e.state == CallState::Completed;
        started = started.max(e.mseq as i64);
        if done {
            completed = completed.max(e.mseq as i64);
        }
        let start_ns = e.start_us.saturating_mul(1000);
        out.push(TorchEntry {
            record_id: e.seq.saturating_sub(1),
            pg_id: 0,
            process_group: (pg.clone(), "default_pg".into()),
            collective_seq_id: e.mseq,
            p2p_seq_id: 0,
            op_id: e.mseq,
            profiling_name: format!("oxccl:{name}"),
            time_created_ns: start_ns,
            duration_ms: e.dur_us.filter(|_| done).map(|d| d as f64 / 1000.0),
            input_sizes: vec![isz],
            input_dtypes: vec![dt],
            output_sizes: vec![osz],
            output_dtypes: vec![dt],
            state: if done { "completed" } else { "started" },
            time_discovered_started_ns: Some(start_ns),
            time_discovered_completed_ns: e
                .dur_us
                .filter(|_| done)
                .map(|d| start_ns + d.saturating_mul(1000)),
            retired: e.state != CallState::Running,
            timeout_ms,
            is_p2p: false,
            frames: Vec::new(),
        });
    }
    let ranks = format!(
        "[{}]",
        (0..nranks)
            .map(|r| r.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    );
    let dump = Dump {
        version: VERSION,
        comm_lib_version: format!("oxccl-{}", env!("CARGO_PKG_VERSION")),
        pg_config: BTreeMap::from([(
            pg.clone(),
            PgConfig {
                name: pg.clone(),
                desc: "default_pg",
                ranks,
            },
        )]),
        pg_status: BTreeMap::from([(
            pg,
            PgStatus {
                last_enqueued_collective: started,
                last_started_collective: started,
                last_completed_collective: completed,
            },
        )]),
        entries: out,
    };
    serde_pickle::to_vec(&dump, serde_pickle::SerOptions::new()).unwrap_or_default()
}

impl TorchDump {
    /// The file of `rank`.
    pub fn file(&self, rank: usize) -> PathBuf {
        PathBuf::from(format!("{}{rank}", self.prefix))
    }

    /// Writes the record of `rank` (atomically: a temporary file renamed); errors are logged.
    pub fn write(&self, entries: &[Entry], rank: usize, nranks: usize, comm: u64) {
        let path = self.file(rank);
        let tmp = PathBuf::from(format!("{}.tmp", path.display()));
        let bytes = to_pickle(entries, nranks, comm, self.timeout_ms);
        let res = std::fs::write(&tmp, bytes).and_then(|_| std::fs::rename(&tmp, &path));
        if let Err(e) = res {
            crate::base::debug::announce(&format!(
                "rank {rank}: cannot write the torch-format flight record {}: {}; check that the directory of OXCCL_FR_DUMP exists and is writable (the record is lost)",
                path.display(),
                crate::base::error::with_explanation(&e)
            ));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fault::fingerprint::Fingerprint;
    use crate::{CollKind, ReduceOp};
    use serde_pickle::{HashableValue as H, Value as V};

    #[test]
    fn pickles_torch_keys() {
        let fp = Fingerprint::of(CollKind::AllGather, DataType::F32, ReduceOp::Sum, 5, 0);
        let e = |seq, state| Entry {
            seq,
            call: "all_gather",
            fp,
            mseq: seq,
            algo: "ring",
            start_us: 1000,
            dur_us: Some(7),
            state,
        };
        let bytes = to_pickle(
            &[e(1, CallState::Completed), e(2, CallState::Running)],
            3,
            0xab,
            600_000,
        );
        let v = serde_pickle::value_from_slice(&bytes, Default::default()).unwrap();
        let V::Dict(d) = v else { panic!("{v:?}") };
        let get = |d: &BTreeMap<H, V>, k: &str| d.get(&H::String(k.into())).cloned().unwrap();
        assert_eq!(get(&d, "version"), V::String("2.10".into()));
        let V::List(es) = get(&d, "entries") else {
            panic!()
        };
        assert_eq!(es.len(), 2);
        let V::Dict(e1) = &es[1] else { panic!() };
        assert_eq!(get(e1, "state"), V::String("started".into()));
        assert_eq!(get(e1, "collective_seq_id"), V::I64(2));
        assert_eq!(
            get(e1, "output_sizes"),
            V::List(vec![V::List(vec![V::I64(15)])])
        );
        assert_eq!(
            get(e1, "process_group"),
            V::Tuple(vec![
                V::String("000000ab".into()),
                V::String("default_pg".into())
            ])
        );
        let V::Dict(cfg) = get(&d, "pg_config") else {
            panic!()
        };
        let V::Dict(pg) = get(&cfg, "000000ab") else {
            panic!()
        };
        assert_eq!(get(&pg, "ranks"), V::String("[0, 1, 2]".into()));
    }
}
