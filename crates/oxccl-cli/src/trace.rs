//! `oxccl trace`: reads the flight recorder files of all ranks (`OXCCL_FLIGHT_RECORDER`)
//! and says which rank stopped where, and which ranks disagreed on a call; with
//! `--timeline`, merges the per-rank Chrome traces of `OXCCL_TRACE` into one file.

use oxccl::rank_list;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::Value;

/// Arguments of `oxccl trace`.
#[derive(clap::Args)]
pub struct Args {
    /// Flight recorder files, directories holding them, or the OXCCL_FLIGHT_RECORDER prefix
    /// (every PREFIX.*.json); with --timeline, OXCCL_TRACE files or prefixes.
    #[arg(required = true)]
    inputs: Vec<String>,
    /// Merge Chrome/Perfetto timelines (OXCCL_TRACE files) instead.
    #[arg(long)]
    timeline: bool,
    /// Where to write the merged timeline (default: stdout).
    #[arg(short, long)]
    output: Option<PathBuf>,
}

/// Every file an input names: itself, the .json files of a directory, or PREFIX.*.json.
fn expand(input: &str) -> Vec<PathBuf> {
    let p = Path::new(input);
    if p.is_file() {
        return vec![p.to_path_buf()];
    }
    let (dir, prefix) = if p.is_dir() {
        (p.to_path_buf(), String::new())
    } else {
        let dir = p
            .parent()
            .filter(|d| !d.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        let base = p
            .file_name()
            .map_or(String::new(), |f| f.to_string_lossy().into_owned());
        let base = base.strip_suffix(".json").unwrap_or(&base).to_string();
        (dir.to_path_buf(), format!("{base}."))
    };
    let mut v: Vec<PathBuf> = std::fs::read_dir(&dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|f| {
                    let name = f
                        .file_name()
                        .map_or(String::new(), |n| n.to_string_lossy().into_owned());
                    name.starts_with(&prefix) && name.ends_with(".json")
                })
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// The largest flight record or trace read: a record holds a bounded ring of calls per
/// communicator, far below this; a bigger file, a FIFO or a device is refused unread.
const MAX_RECORD_BYTES: u64 = 256 << 20;

pub fn main(a: Args) -> i32 {
    let files: Vec<PathBuf> = a.inputs.iter().flat_map(|i| expand(i)).collect();
    if files.is_empty() {
        eprintln!("oxccl trace: no files found for {:?}", a.inputs);
        return 2;
    }
    let mut docs = Vec::new();
    for f in &files {
        match oxccl::read_bounded(f, MAX_RECORD_BYTES)
            .map_err(|e| e.to_string())
            .and_then(|t| t.ok_or_else(|| "no such file".to_string()))
            .and_then(|t| serde_json::from_str::<Value>(&t).map_err(|e| e.to_string()))
        {
            Ok(v) => docs.push((f.clone(), v)),
            Err(e) => {
                eprintln!("oxccl trace: {}: {e}", f.display());
                return 2;
            }
        }
    }
    if a.timeline {
        return merge_timelines(&docs, a.output.as_deref());
    }
    let mut comms: BTreeMap<String, Vec<&Value>> = BTreeMap::new();
    for (_, d) in &docs {
        if d.get("entries").is_none() {
            continue;
        }
        let comm = d["comm"].as_str().unwrap_or("?").to_string();
        comms.entry(comm).or_default().push(d);
    }
    if comms.is_empty() {
        eprintln!(
            "oxccl trace: no flight recorder files among the inputs (timelines need --timeline)"
        );
        return 2;
    }
    for (comm, ranks) in comms {
        print!("{}", analyze(&comm, &ranks));
    }
    0
}

fn merge_timelines(docs: &[(PathBuf, Value)], out: Option<&Path>) -> i32 {
    let mut events = Vec::new();
    for (f, d) in docs {
        match d.get("traceEvents").and_then(|e| e.as_array()) {
            Some(e) => events.extend(e.iter().cloned()),
            None => {
                eprintln!("oxccl trace: {} is not a Chrome trace", f.display());
                return 2;
            }
        }
    }
    let merged = serde_json::json!({ "displayTimeUnit": "ns", "traceEvents": events });
    let text = merged.to_string();
    match out {
        Some(p) => {
            if let Err(e) = std::fs::write(p, text) {
                eprintln!("oxccl trace: {}: {e}", p.display());
                return 2;
            }
            println!(
                "{} events from {} files written to {}",
                events_len(&merged),
                docs.len(),
                p.display()
            );
        }
        None => println!("{text}"),
    }
    0
}

fn events_len(v: &Value) -> usize {
    v["traceEvents"].as_array().map_or(0, |a| a.len())
}

/// One rank's call, as recorded.
struct Rec {
    seq: u64,
    fp: String,
    p2p: bool,
    mseq: u64,
    state: String,
    error: Option<String>,
}

fn recs(d: &Value) -> Vec<Rec> {
    d["entries"]
        .as_array()
        .map(|es| {
            es.iter()
                .map(|e| Rec {
                    seq: e["seq"].as_u64().unwrap_or(0),
                    fp: e["fingerprint"].as_str().unwrap_or("?").to_string(),
                    p2p: e["kind"].as_u64() == Some(15),
                    mseq: e["mseq"].as_u64().unwrap_or(0),
                    state: e["state"].as_str().unwrap_or("?").to_string(),
                    error: e["error"].as_str().map(str::to_string),
                })
                .collect()
        })
        .unwrap_or_default()
}

/// The report for one communicator.
pub fn analyze(comm: &str, ranks: &[&Value]) -> String {
    let mut out = String::new();
    let world = ranks
        .iter()
        .filter_map(|d| d["world_size"].as_u64())
        .max()
        .unwrap_or(0) as usize;
    let mut by_rank: BTreeMap<usize, (&Value, Vec<Rec>)> = BTreeMap::new();
    for d in ranks {
        let r = d["rank"].as_u64().unwrap_or(0) as usize;
        by_rank.insert(r, (d, recs(d)));
    }
    out.push_str(&format!(
        "communicator {comm}: {} of {world} rank(s) recorded\n",
        by_rank.len()
    ));
    let missing: Vec<usize> = (0..world).filter(|r| !by_rank.contains_key(r)).collect();
    // Per rank: where it is.
    let mut last_done: BTreeMap<usize, u64> = BTreeMap::new();
    for (r, (d, recs)) in &by_rank {
        let done = recs
            .iter()
            .filter(|c| !c.p2p && c.state == "completed")
            .map(|c| c.mseq)
            .max()
            .unwrap_or(0);
        last_done.insert(*r, done);
        let now = match recs.last() {
            Some(c) if c.state != "completed" => format!(
                "{} in call #{} {} (collective #{}){}",
                c.state,
                c.seq,
                c.fp,
                c.mseq,
                c.error.as_ref().map_or(String::new(), |e| format!(": {e}"))
            ),
            Some(c) => format!("idle after call #{} {}", c.seq, c.fp),
            None => "no calls recorded".into(),
        };
        out.push_str(&format!(
            "  rank {r} (pid {}, written on {}): collectives completed up to #{done}; {now}\n",
            d["pid"],
            d["reason"].as_str().unwrap_or("?")
        ));
    }
    // Disagreements: one collective number, different calls.
    let mut by_mseq: BTreeMap<u64, Vec<(usize, &str)>> = BTreeMap::new();
    for (r, (_, recs)) in &by_rank {
        for c in recs.iter().filter(|c| !c.p2p) {
            by_mseq.entry(c.mseq).or_default().push((*r, &c.fp));
        }
    }
    let mut mismatches = 0;
    for (m, calls) in &by_mseq {
        // The call most ranks made is the expected one; the others are named, whatever
        // their rank numbers (the odd one out may well be rank 0).
        let mut groups: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
        for (r, f) in calls {
            groups.entry(f).or_default().push(*r);
        }
        if groups.len() < 2 {
            continue;
        }
        mismatches += 1;
        let mut groups: Vec<(&str, Vec<usize>)> = groups.into_iter().collect();
        // Largest group first; ties: the group holding the lowest rank.
        groups.sort_by_key(|(_, rs)| (std::cmp::Reverse(rs.len()), rs[0]));
        let (expected, same) = &groups[0];
        let odd: Vec<String> = groups[1..]
            .iter()
            .map(|(f, rs)| format!("rank(s) {} called {f}", rank_list(rs)))
            .collect();
        out.push_str(&format!(
            "MISMATCH at collective #{m}: rank(s) {} called {expected}; {}\n",
            rank_list(same),
            odd.join("; ")
        ));
    }
    if !missing.is_empty() {
        out.push_str(&format!(
            "NO RECORD from rank(s) {}: dead, or never wrote one (it is the likely culprit)\n",
            rank_list(&missing)
        ));
    }
    // Ranks waiting in a collective that others have not started.
    let running: Vec<(usize, &Rec)> = by_rank
        .iter()
        .filter_map(|(r, (_, recs))| {
            recs.last()
                .filter(|c| c.state == "running" && !c.p2p)
                .map(|c| (*r, c))
        })
        .collect();
    if let Some(m) = running.iter().map(|(_, c)| c.mseq).max() {
        let waiting: Vec<usize> = running
            .iter()
            .filter(|(_, c)| c.mseq == m)
            .map(|(r, _)| *r)
            .collect();
        let absent: Vec<usize> = by_rank
            .iter()
            .filter(|(r, (_, recs))| {
                !waiting.contains(r) && !recs.iter().any(|c| !c.p2p && c.mseq >= m)
            })
            .map(|(r, _)| *r)
            .chain(missing.iter().copied())
            .collect();
        let what = &running
            .iter()
            .find(|(_, c)| c.mseq == m)
            .expect("some")
            .1
            .fp;
        if !absent.is_empty() {
            out.push_str(&format!(
                "WAITING: rank(s) {} wait in collective #{m} {what} for rank(s) {}, which never called it\n",
                rank_list(&waiting),
                rank_list(&absent)
            ));
        }
    }
    if let (Some(min), Some(max)) = (last_done.values().min(), last_done.values().max()) {
        if min < max {
            let behind: Vec<usize> = last_done
                .iter()
                .filter(|(_, d)| *d == min)
                .map(|(r, _)| *r)
                .collect();
            out.push_str(&format!(
                "STOPPED: rank(s) {} completed only up to collective #{min}; the others reached #{max}\n",
                rank_list(&behind)
            ));
        } else if mismatches == 0 && missing.is_empty() {
            out.push_str(&format!("all recorded ranks completed collective #{min}\n"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn doc(rank: usize, fps: &[&str]) -> Value {
        let entries: Vec<Value> = fps
            .iter()
            .enumerate()
            .map(|(i, f)| {
                serde_json::json!({
                    "seq": i + 1, "mseq": i + 1, "kind": 1, "fingerprint": f,
                    "state": "completed"
                })
            })
            .collect();
        serde_json::json!({
            "comm": "c", "rank": rank, "world_size": 4, "pid": 100 + rank,
            "reason": "error", "entries": entries
        })
    }

    #[test]
    fn a_mismatch_names_the_odd_rank_even_when_it_is_rank_0() {
        let docs: Vec<Value> = (0..4)
            .map(|r| doc(r, &["ar:8", if r == 0 { "bc:10" } else { "bc:12" }]))
            .collect();
        let refs: Vec<&Value> = docs.iter().collect();
        let out = analyze("c", &refs);
        assert!(
            out.contains("MISMATCH at collective #2: rank(s) [1, 2, 3] called bc:12; rank(s) [0] called bc:10"),
            "{out}"
        );
        assert!(!out.contains("MISMATCH at collective #1"), "{out}");
    }
}
