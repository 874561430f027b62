//! `oxccl status ADDR`: asks a running job's status agent (`OXCCL_STATUS`, see
//! `oxccl::status`) where every rank is, and prints it as a table or JSON; with `--watch`,
//! asks again every SECS seconds and prints only what changed.
//!
//! The answer is authenticated: `oxccl status` sends a nonce and accepts only an answer whose
//! MAC proves the agent knows the job's secret (`--secret`, else `OXCCL_SECRET`, else the one
//! derived from `OXCCL_ROOT`/`MASTER_ADDR:MASTER_PORT` and the launcher's job id as the job
//! derived it). Anything else on the port is reported as not this job's agent.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

use clap::Args as ClapArgs;
use oxccl::params::MAX_SECS;
use serde_json::Value;

/// `oxccl status` arguments.
#[derive(ClapArgs)]
pub struct Args {
    /// The agent: rank 0's OXCCL_STATUS (`PORT` on this host, or `HOST:PORT`).
    #[arg(value_parser = crate::args::text(300))]
    addr: String,
    /// Print the agent's JSON instead of a table.
    #[arg(long)]
    json: bool,
    /// Ask again every SECS seconds, printing only changes (Ctrl-C to stop).
    #[arg(long, value_name = "SECS", value_parser = crate::args::seconds(MAX_SECS))]
    watch: Option<f64>,
    /// How long to wait for the agent, in seconds.
    #[arg(long, value_name = "SECS", default_value_t = 5.0, value_parser = crate::args::seconds(MAX_SECS))]
    timeout: f64,
    /// The job's secret (32 hex digits); default: OXCCL_SECRET, else derived from the
    /// environment as the job derived it.
    #[arg(long, value_name = "HEX", value_parser = crate::args::text(64))]
    secret: Option<String>,
}

fn fetch(addr: SocketAddr, secret: &[u8; 16], timeout: Duration) -> Result<Value, String> {
    let line = oxccl::status::ask(addr, "status", Some(secret), timeout).map_err(|e| {
        if e.kind() == std::io::ErrorKind::PermissionDenied {
            format!("{addr}: {e}")
        } else {
            format!("no answer from {addr}: {e}")
        }
    })?;
    let v: Value =
        serde_json::from_str(&line).map_err(|e| format!("{addr} answered '{line}': {e}"))?;
    if let Some(e) = v.get("error").and_then(Value::as_str) {
        return Err(format!("{addr}: {e}"));
    }
    Ok(v)
}

/// Every link's counters in an answer: (rank, peer) -> (bytes sent, bytes received), read
/// once per table.
type Counters = HashMap<(u64, u64), (Option<u64>, Option<u64>)>;

fn counters(ranks: &[Value]) -> Counters {
    let mut c = Counters::new();
    for r in ranks {
        let Some(rank) = r["rank"].as_u64() else {
            continue;
        };
        for l in r["links"].as_array().into_iter().flatten() {
            if let Some(peer) = l["peer"].as_u64() {
                c.insert((rank, peer), (l["sent"].as_u64(), l["received"].as_u64()));
            }
        }
    }
    c
}

/// Bytes rank `from` handed to its link to `to` that `to` has not taken yet (`None` where a
/// side did not answer or does not count its link). The two counters are read a few
/// milliseconds apart: a busy link may show bytes that have just arrived.
fn in_flight(c: &Counters, from: u64, to: u64) -> Option<u64> {
    let sent = c.get(&(from, to))?.0?;
    let taken = c.get(&(to, from))?.1?;
    Some(sent.saturating_sub(taken))
}

/// The links worth a line under a rank that is in a call: bytes in flight either way, or no
/// progress for over a second while the call has run that long. At most four, then a count.
fn link_lines(r: &Value, c: &Counters) -> Vec<String> {
    let Some(me) = r["rank"].as_u64() else {
        return Vec::new();
    };
    let running = r["current"]["running_ms"].as_u64();
    let Some(running) = running else {
        return Vec::new();
    };
    let mut lines = Vec::new();
    for l in r["links"].as_array().into_iter().flatten() {
        let Some(peer) = l["peer"].as_u64() else {
            continue;
        };
        let out = in_flight(c, me, peer).unwrap_or(0);
        let back = in_flight(c, peer, me).unwrap_or(0);
        let ago = l["progress_ms_ago"].as_u64();
        let idle = running > 1000 && ago.is_none_or(|a| a > 1000);
        if out == 0 && back == 0 && !idle {
            continue;
        }
        let progress = ago.map_or("no bytes moved yet".to_string(), |a| {
            format!("last progress {a} ms ago")
        });
        lines.push(format!(
            "link to rank {peer} ({}): {out} B sent not yet taken by rank {peer}, {back} B from it not yet taken; {progress}",
            l["transport"].as_str().unwrap_or("?")
        ));
    }
    if lines.len() > 4 {
        let more = lines.len() - 4;
        lines.truncate(4);
        lines.push(format!("and {more} more link(s)"));
    }
    lines
}

/// One rank's line of the table (`c`: every rank's link counters, for the links' far ends).
fn rank_line(r: &Value, c: &Counters) -> String {
    let rank = r["rank"].as_u64().map_or("?".into(), |n| n.to_string());
    if r["alive"] != Value::Bool(true) {
        return format!(
            "{rank:>5}  {:<5}  {}",
            // Null: the agent did not answer, but the rank is not lost.
            if r["alive"].is_null() { "?" } else { "no" },
            r["error"].as_str().unwrap_or("no answer")
        );
    }
    let state = match &r["current"] {
        Value::Object(c) => format!(
            "in {} #{} (collective #{}, {} for {} ms)",
            c["call"].as_str().unwrap_or("?"),
            c["seq"],
            c["coll_seq"],
            c["algo"].as_str().unwrap_or("?"),
            c["running_ms"]
        ),
        _ => format!("idle after #{}", r["reached"]),
    };
    let done = match &r["last_completed"] {
        Value::Object(d) => format!("#{} {}", d["seq"], d["call"].as_str().unwrap_or("?")),
        _ => "-".into(),
    };
    let health = r["health"].as_str().unwrap_or("?");
    let mut line = format!(
        "{rank:>5}  {:<5}  {:<7}  {:<20}  {:<48}  {:<20}  {}",
        "yes",
        r["pid"],
        r["host"].as_str().unwrap_or("?"),
        state,
        done,
        health
    );
    for c in r["comms"].as_array().into_iter().flatten() {
        if c["comm"] == r["comm"] && c["rank"] == r["rank"] {
            continue;
        }
        let now = match &c["current"] {
            Value::Object(x) => format!("in {} #{}", x["call"].as_str().unwrap_or("?"), x["seq"]),
            _ => format!("idle after #{}", c["reached"]),
        };
        line += &format!(
            "\n{:>7}also communicator {} (rank {} of {}): {now}, {}",
            "",
            c["comm"].as_str().unwrap_or("?"),
            c["rank"],
            c["world_size"],
            c["health"].as_str().unwrap_or("?")
        );
    }
    for l in link_lines(r, c) {
        line += &format!("\n{:>7}{l}", "");
    }
    if let Some(errs) = r["recent_errors"].as_array() {
        for e in errs.iter().take(3) {
            line += &format!(
                "\n{:>7}error in {} #{}: {}",
                "",
                e["call"].as_str().unwrap_or("?"),
                e["seq"],
                e["error"].as_str().unwrap_or("?")
            );
        }
    }
    line
}

/// The table, without the times that change at every query (for --watch's comparison).
fn table(v: &Value, with_times: bool) -> String {
    let behind: Vec<String> = v["behind"]
        .as_array()
        .map(|a| a.iter().map(|r| r.to_string()).collect())
        .unwrap_or_default();
    let unreachable: Vec<String> = v["unreachable"]
        .as_array()
        .map(|a| a.iter().map(|r| r.to_string()).collect())
        .unwrap_or_default();
    let mut s = format!(
        "{} ranks; highest call reached #{}; {}{}\n",
        v["world_size"],
        v["max_seq"],
        if behind.is_empty() {
            "no rank behind".to_string()
        } else {
            format!("behind it: rank(s) {}", behind.join(", "))
        },
        if unreachable.is_empty() {
            String::new()
        } else {
            format!(
                "; the agent of rank(s) {} did not answer (busy or unreachable; the rank is not lost)",
                unreachable.join(", ")
            )
        }
    );
    s += &format!(
        "{:>5}  {:<5}  {:<7}  {:<20}  {:<48}  {:<20}  {}\n",
        "rank", "alive", "pid", "host", "now", "last completed", "health"
    );
    let ranks: &[Value] = v["ranks"].as_array().map_or(&[], Vec::as_slice);
    let c = counters(ranks);
    for r in ranks {
        let mut r = r.clone();
        if !with_times {
            if let Some(c) = r.get_mut("current").and_then(Value::as_object_mut) {
                c.insert("running_ms".into(), Value::String("…".into()));
            }
        }
        s += &rank_line(&r, &c);
        s.push('\n');
    }
    s
}

/// Entry point.
pub fn main(a: Args) -> i32 {
    let addr = match oxccl::status::parse_addr(&a.addr) {
        Ok(x) => x,
        Err(e) => {
            eprintln!("oxccl status: {e}");
            return 2;
        }
    };
    let secret = match a.secret.as_deref() {
        Some(h) => oxccl::status::parse_secret(h)
            .ok_or_else(|| "--secret must be 32 hex digits (16 bytes)".to_string()),
        None => oxccl::status::secret_from_env(),
    };
    let secret = match secret {
        Ok(s) => s,
        Err(e) => {
            eprintln!("oxccl status: cannot authenticate the agent: {e}");
            return 2;
        }
    };
    let timeout = Duration::from_secs_f64(a.timeout);
    let mut last = String::new();
    loop {
        let shown = match fetch(addr, &secret, timeout) {
            Ok(v) if a.json => (v.to_string(), {
                let mut v = v;
                v["time_us"] = Value::Null;
                table(&v, false)
            }),
            Ok(v) => (table(&v, true), table(&v, false)),
            Err(e) => {
                if a.watch.is_none() {
                    eprintln!("oxccl status: {e}");
                    return 1;
                }
                (format!("unreachable: {e}"), format!("unreachable: {e}"))
            }
        };
        match a.watch {
            None => {
                println!("{}", shown.0.trim_end());
                return 0;
            }
            Some(secs) => {
                if shown.1 != last {
                    let now = std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .map_or(0, |d| d.as_secs());
                    println!("== {now} (unix seconds)\n{}", shown.0.trim_end());
                    last = shown.1;
                }
                std::thread::sleep(Duration::from_secs_f64(secs));
            }
        }
    }
}
