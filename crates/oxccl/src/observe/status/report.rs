//! What an agent answers: this process's state (`local`) and the whole job's, gathered from
//! every rank's agent (`status`), as JSON written with serde.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::client::ask;
use super::{Member, Shared, Source, IO_TIMEOUT, NOT_THIS_JOB, SETTLE};
use crate::observe::flight::CallState;

/// Microseconds since the Unix epoch.
fn now_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// A communicator's tag as the answers write it: 16 hex digits.
fn tag_hex<S: serde::Serializer>(tag: &u64, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&format!("{tag:016x}"))
}

/// One communicator's state: where its rank is (the members of a `local` answer, and each
/// entry of its `comms`).
#[derive(Serialize)]
struct CommState<'a> {
    #[serde(serialize_with = "tag_hex")]
    comm: u64,
    rank: usize,
    world_size: usize,
    /// `"ok"`, or the error the communicator failed with.
    health: String,
    current: Option<Current>,
    last_completed: Option<LastCompleted>,
    /// The sequence number of the last call begun (0 before any).
    reached: u64,
    /// The last 8 failed calls, the latest first.
    recent_errors: Vec<RecentError<'a>>,
    links: Vec<LinkState<'a>>,
}

/// The call a rank is in.
#[derive(Serialize)]
struct Current {
    seq: u64,
    call: &'static str,
    coll_seq: u64,
    algo: &'static str,
    running_ms: u64,
}

/// The last call a rank completed.
#[derive(Serialize)]
struct LastCompleted {
    seq: u64,
    call: &'static str,
    ms_ago: u64,
}

/// A failed call.
#[derive(Serialize)]
struct RecentError<'a> {
    seq: u64,
    call: &'static str,
    error: &'a str,
}

/// One link of a communicator.
#[derive(Serialize)]
struct LinkState<'a> {
    peer: usize,
    transport: &'static str,
    host: &'a str,
    ip: String,
    pid: u32,
    /// Absent where the link is not counted.
    #[serde(flatten)]
    counts: Option<LinkCounts>,
}

/// A counted link's bytes and last progress.
#[derive(Serialize)]
struct LinkCounts {
    sent: u64,
    received: u64,
    progress_ms_ago: Option<u64>,
}

/// The state of communicator `src` (its flight recorder's `entries`).
fn comm_state<'a>(src: &'a Source, entries: &'a [crate::observe::flight::Entry]) -> CommState<'a> {
    let current = entries
        .iter()
        .rev()
        .find(|e| e.state == CallState::Running)
        .map(|e| Current {
            seq: e.seq,
            call: e.call,
            coll_seq: e.mseq,
            algo: e.algo,
            running_ms: now_us().saturating_sub(e.start_us) / 1000,
        });
    let last_completed = entries
        .iter()
        .rev()
        .find(|e| e.state == CallState::Completed)
        .map(|e| LastCompleted {
            seq: e.seq,
            call: e.call,
            ms_ago: now_us().saturating_sub(e.start_us + e.dur_us.unwrap_or(0)) / 1000,
        });
    let recent_errors = entries
        .iter()
        .filter_map(|e| match &e.state {
            CallState::Failed(m) => Some(RecentError {
                seq: e.seq,
                call: e.call,
                error: m,
            }),
            _ => None,
        })
        .rev()
        .take(8)
        .collect();
    let links = src
        .links
        .iter()
        .map(|l| LinkState {
            peer: l.peer,
            transport: l.transport,
            host: &l.host,
            ip: l.ip.to_string(),
            pid: l.pid,
            counts: l.stats.as_ref().map(|st| LinkCounts {
                sent: st.sent(),
                received: st.received(),
                progress_ms_ago: st.last_progress_ms_ago(),
            }),
        })
        .collect();
    CommState {
        comm: src.comm,
        rank: src.rank,
        world_size: src.nranks,
        health: match src.health.failure() {
            None => "ok".to_string(),
            Some(_) => src.health.error(src.rank, "status", 0).to_string(),
        },
        current,
        last_completed,
        reached: entries.last().map_or(0, |e| e.seq),
        recent_errors,
        links,
    }
}

/// A `local` answer: this process, one communicator's state at the top, every one under
/// `comms`.
#[derive(Serialize)]
struct Local<'a> {
    pid: u32,
    host: String,
    agent: String,
    alive: bool,
    #[serde(flatten)]
    main: Option<CommState<'a>>,
    comms: Vec<CommState<'a>>,
}

/// An answer that says what went wrong.
#[derive(Serialize)]
struct ErrorAnswer<'a> {
    error: &'a str,
}

/// `{"error":MSG}`.
pub(super) fn error_json(msg: &str) -> String {
    to_json(&ErrorAnswer { error: msg })
}

/// `v` as one line of JSON.
fn to_json(v: &impl Serialize) -> String {
    serde_json::to_string(v).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"))
}

/// This process's state as one JSON object: communicator `comm` (tag, rank) if it has it,
/// else its first, at the top; every communicator of the process under `comms`.
pub(super) fn local_json(sh: &Shared, comm: Option<(u64, usize)>) -> String {
    let members = sh.members.lock().unwrap_or_else(|e| e.into_inner());
    let srcs: Vec<Source> = members.iter().map(|m| m.src.clone()).collect();
    drop(members);
    local_of(&srcs, comm, sh.addr)
}

/// [`local_json`] of these communicators.
fn local_of(srcs: &[Source], comm: Option<(u64, usize)>, agent: SocketAddr) -> String {
    let host = rustix::system::uname()
        .nodename()
        .to_string_lossy()
        .into_owned();
    let main = comm
        .and_then(|(c, r)| srcs.iter().find(|s| s.comm == c && s.rank == r))
        .or(srcs.first());
    // Each state from its own read of the recorder, the top one's first.
    let main_entries = main.map(|m| (m, m.recorder.entries()));
    let entries: Vec<_> = srcs.iter().map(|c| c.recorder.entries()).collect();
    to_json(&Local {
        pid: std::process::id(),
        host,
        agent: agent.to_string(),
        alive: true,
        main: main_entries.as_ref().map(|(m, e)| comm_state(m, e)),
        comms: srcs
            .iter()
            .zip(&entries)
            .map(|(c, e)| comm_state(c, e))
            .collect(),
    })
}

/// The field of an answer that [`settle`] reads: the call its rank reached.
#[derive(Deserialize)]
struct Reached {
    reached: Option<u64>,
}

/// The call an answer's rank reached (its top-level `reached`), if it says.
pub(super) fn reached_of(answer: &str) -> Option<u64> {
    serde_json::from_str::<Reached>(answer).ok()?.reached
}

/// Asks every rank in `ranks` of `m` for its state, in parallel (64 at a time).
fn gather(sh: &Shared, m: &Member, ranks: &[usize]) -> Vec<Result<String, String>> {
    let mut answers = Vec::with_capacity(ranks.len());
    for chunk in ranks.chunks(64) {
        std::thread::scope(|sc| {
            let hs: Vec<_> = chunk
                .iter()
                .map(|&r| {
                    let addr = m.peers.get(r).copied().flatten();
                    sc.spawn(move || {
                        if r == m.src.rank {
                            return Ok(local_json(sh, Some((m.src.comm, r))));
                        }
                        let Some(a) = addr else {
                            return Err("no status agent (OXCCL_STATUS unset on that rank)".into());
                        };
                        let req = format!("local {:016x} {r}", m.src.comm);
                        ask(a, &req, Some(&sh.secret), IO_TIMEOUT).map_err(|e| {
                            if e.kind() == std::io::ErrorKind::PermissionDenied {
                                format!("{a}: {NOT_THIS_JOB}")
                            } else {
                                format!("no answer from {a}: {e}")
                            }
                        })
                    })
                })
                .collect();
            answers.extend(hs.into_iter().map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("agent query panicked".into()))
            }));
        });
    }
    answers
}

/// Decides who is behind from every rank's first answer (`answers`, by rank), asking the
/// ranks below the highest call seen again (`again`, answers in the order asked) every 20 ms
/// within `settle`. Returns the answers last seen, the highest call they reach, and the ranks
/// behind: those without an answer, and those whose last answer is below the highest call
/// seen when it was asked for.
///
/// The highest call is taken anew after each round: ranks asked again may have gone on
/// past it (a sample once showed ranks 0 and 1 in call #6, asked again, with the highest
/// call still the 5 of the first answers and nobody behind, while rank 2, stopped after
/// call #5, was).
pub(super) fn settle(
    mut answers: Vec<Result<String, String>>,
    mut again: impl FnMut(&[usize]) -> Vec<Result<String, String>>,
    settle: Duration,
) -> (Vec<Result<String, String>>, u64, Vec<usize>) {
    let reached = |a: &Result<String, String>| a.as_ref().ok().and_then(|s| reached_of(s));
    let max_of =
        |answers: &[Result<String, String>]| answers.iter().filter_map(reached).max().unwrap_or(0);
    // Per rank: the highest call seen when its last answer was asked for.
    let mut target = vec![max_of(&answers); answers.len()];
    // One moment: a rank below the highest call seen may only be a call behind for an instant;
    // ask it again until it reaches that call or `settle` passes. Past `settle`, one last
    // round asks only the ranks never asked against the highest call seen (so that one
    // slow round does not leave a rank judged against an older one).
    let start = Instant::now();
    let mut last_round = false;
    loop {
        let max = max_of(&answers);
        let mut lagging: Vec<usize> = (0..answers.len())
            .filter(|&r| answers[r].is_ok() && reached(&answers[r]).is_some_and(|x| x < max))
            .collect();
        if start.elapsed() >= settle {
            lagging.retain(|&r| target[r] < max);
            if last_round {
                break;
            }
            last_round = true;
        }
        if lagging.is_empty() {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
        for (r, a) in lagging.iter().zip(again(&lagging)) {
            if a.is_ok() {
                answers[*r] = a;
                target[*r] = max;
            }
        }
    }
    let behind = (0..answers.len())
        .filter(|&r| reached(&answers[r]).is_none_or(|x| x < target[r]))
        .collect();
    let max = max_of(&answers);
    (answers, max, behind)
}

/// A `status` answer: every rank's state of one communicator.
#[derive(Serialize)]
struct Job<'a> {
    world_size: usize,
    #[serde(serialize_with = "tag_hex")]
    comm: u64,
    asked_rank: usize,
    time_us: u64,
    max_seq: u64,
    behind: Vec<usize>,
    unreachable: Vec<usize>,
    ranks: Vec<RankAnswer<'a>>,
}

/// One rank's entry of a `status` answer.
#[derive(Serialize)]
#[serde(untagged)]
enum RankAnswer<'a> {
    /// Its agent's `local` answer, as it came.
    Answered(&'a serde_json::value::RawValue),
    /// No answer: why.
    Silent {
        rank: usize,
        /// `false`: not this job's agent, or no agent; `null`: busy or unreachable, and
        /// not lost by the asked rank's communicator.
        alive: Option<bool>,
        addr: Option<String>,
        error: String,
    },
}

/// Every rank's state of this process's first communicator, gathered from their agents
/// (each bounded by [`IO_TIMEOUT`]; ranks that seem behind asked again within [`SETTLE`]),
/// as one JSON object.
pub(super) fn job_json(sh: &Shared) -> String {
    let members = sh.members.lock().unwrap_or_else(|e| e.into_inner());
    let Some(m) = members.first().map(|m| Member {
        id: m.id,
        src: m.src.clone(),
        peers: m.peers.clone(),
    }) else {
        return error_json("no communicator (the job is shutting down)");
    };
    drop(members);
    let all: Vec<usize> = (0..m.src.nranks).collect();
    let first = gather(sh, &m, &all);
    let (answers, max, behind) = settle(first, |ranks| gather(sh, &m, ranks), SETTLE);
    // A rank whose agent did not answer, which this communicator has not lost: its agent is
    // busy (strangers may hold it) or unreachable, which says nothing of the rank itself.
    let lost = m.src.health.failure().and_then(|f| match f {
        crate::fault::health::Failure::Lost { peer, .. } => Some(peer),
        _ => None,
    });
    let unreachable: Vec<usize> = (0..answers.len())
        .filter(|&r| {
            // (An answer that failed authentication is no agent of this job: that rank's
            // own agent is not there.)
            answers[r]
                .as_ref()
                .is_err_and(|e| !e.contains(NOT_THIS_JOB))
                && m.peers.get(r).is_some_and(Option::is_some)
        })
        .filter(|&r| lost != Some(r))
        .collect();
    let behind: Vec<usize> = behind
        .into_iter()
        .filter(|r| !unreachable.contains(r))
        .collect();
    let ranks = answers
        .iter()
        .enumerate()
        .map(|(r, a)| {
            let e = match a {
                // An answer is one line of JSON (its MAC checked); one that is not is said as
                // an error.
                Ok(j) => match serde_json::from_str(j) {
                    Ok(raw) => return RankAnswer::Answered(raw),
                    Err(e) => format!("malformed answer ({e})"),
                },
                Err(e) => e.clone(),
            };
            let addr = m.peers.get(r).copied().flatten().map(|a| a.to_string());
            let (alive, error) = if unreachable.contains(&r) {
                (
                    None,
                    format!(
                        "agent busy or unreachable ({e}); rank {} has not lost it",
                        m.src.rank
                    ),
                )
            } else {
                (Some(false), e)
            };
            RankAnswer::Silent {
                rank: r,
                alive,
                addr,
                error,
            }
        })
        .collect();
    to_json(&Job {
        world_size: m.src.nranks,
        comm: m.src.comm,
        asked_rank: m.src.rank,
        time_us: now_us(),
        max_seq: max,
        behind,
        unreachable,
        ranks,
    })
}
