//! Failure handling of a communicator, in one place: its [`Health`], its watchdog
//! ([`crate::fault::control`]), its flight recorder ([`crate::observe::flight`]) and timeline
//! ([`crate::observe::timeline`]), its timeout, and the public calls built on them:
//! [`Communicator::abort`], [`Communicator::shrink`], [`Communicator::check`],
//! [`Communicator::set_timeout`].
//!
//! The [`Communicator`] holds one [`Supervisor`]; the path of a call
//! ([`crate::comm::collectives`]) calls [`Supervisor::begin`] / [`Supervisor::end`] around it.

use std::net::{IpAddr, SocketAddr, TcpListener};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

use crate::base::error::{Error, Result};
use crate::base::param::Config;
use crate::bootstrap::{Bootstrap, UniqueId};
use crate::comm::Communicator;
use crate::fault::control::{Handoff, WatchSettings, Watchdog};
use crate::fault::fingerprint::CallPrint;
use crate::fault::health::{Failure, Health};
use crate::observe::flight::Recorder;
use crate::observe::flight_torch::TorchDump;
use crate::observe::metrics::{Identity, Metrics};
use crate::observe::status::StatusAgent;
use crate::observe::timeline::Timeline;
use crate::transport::counted::LinkStats;

/// What [`Communicator::shrink`] needs: every rank's pre-opened rendezvous listener address,
/// and this rank's listener.
#[derive(Debug)]
struct ShrinkPlan {
    addrs: Vec<SocketAddr>,
    listener: Mutex<Option<TcpListener>>,
    secret: [u8; 16],
}

/// How long a call that lost a link waits for another rank's report of the cause.
pub(crate) const CAUSE_GRACE: Duration = Duration::from_millis(300);

/// A communicator's failure-handling state: it oversees every call (begin, end, failure),
/// keeps the health, watchdog, recorder and timeout; see the module documentation.
#[derive(Debug)]
pub(crate) struct Supervisor {
    rank: usize,
    health: Arc<Health>,
    recorder: Arc<Recorder>,
    timeline: Option<Timeline>,
    metrics: Option<Arc<Metrics>>,
    timeout_ns: AtomicU64,
    shrink: Option<ShrinkPlan>,
    status: Option<StatusAgent>,
    // Last: dropped after the rest (it says goodbye to the peers); taken out by
    // [`Supervisor::close`] (or at exit, [`crate::comm::exit`], which holds it weakly).
    watchdog: Arc<Mutex<Option<Watchdog>>>,
}

impl Supervisor {
    /// Without a rendezvous (links made elsewhere, e.g. threads of one process): failures
    /// are seen only where they happen; no watchdog, no shrink.
    pub(crate) fn local(rank: usize, nranks: usize, cfg: &Config) -> Supervisor {
        Supervisor {
            rank,
            health: Arc::new(Health::new()),
            recorder: Recorder::new(
                rank,
                nranks,
                0,
                cfg.flight_entries,
                cfg.flight_recorder.clone(),
                torch_dump(cfg),
            ),
            timeline: cfg.trace.as_deref().map(|p| Timeline::new(rank, p)),
            metrics: metrics(cfg, 0, rank, nranks, 1),
            timeout_ns: AtomicU64::new(cfg.timeout.as_nanos().min(u64::MAX as u128) as u64),
            shrink: None,
            status: None,
            watchdog: Arc::default(),
        }
    }

    /// For a communicator made by a rendezvous, first step: opens this rank's listener for a
    /// later [`Communicator::shrink`] and says where in [`SupervisorPrep::message`], which
    /// every rank must exchange (`comm/init.rs` has it ride in the shared-memory transport's
    /// first exchange) and hand to [`SupervisorPrep::finish`].
    pub(crate) fn prepare(boot: &Bootstrap, cfg: &Config) -> SupervisorPrep {
        let (rank, nranks) = (boot.rank(), boot.world_size());
        let mut g = Supervisor::local(rank, nranks, cfg);
        g.recorder = Recorder::new(
            rank,
            nranks,
            boot.comm_tag(),
            cfg.flight_entries,
            cfg.flight_recorder.clone(),
            torch_dump(cfg),
        );
        let mut hosts: Vec<&str> = boot.peers().iter().map(|p| p.host_id.as_str()).collect();
        hosts.sort_unstable();
        hosts.dedup();
        g.metrics = metrics(cfg, boot.comm_tag(), rank, nranks, hosts.len());
        let my_ip: IpAddr = boot.peers()[rank].ip;
        let listener = TcpListener::bind(SocketAddr::new(my_ip, 0));
        let port = listener
            .as_ref()
            .ok()
            .and_then(|l| l.local_addr().ok())
            .map_or(0u16, |a| a.port());
        let status = status_plan(cfg, rank, my_ip);
        let status_port = match &status {
            StatusPlan::Join(a) => a.port(),
            StatusPlan::Listen(l) => l.local_addr().map_or(0, |a| a.port()),
            StatusPlan::Off => 0,
        };
        // The watchdog's control listener, where this rank accepts the others should it
        // become the hub of the star (its hub left: `fault/control.rs`); a graph needs none.
        let control = (boot.is_star() && nranks > 2)
            .then(|| TcpListener::bind(SocketAddr::new(my_ip, 0)).ok())
            .flatten();
        let control_port = control
            .as_ref()
            .and_then(|l| l.local_addr().ok())
            .map_or(0u16, |a| a.port());
        let mut mine = port.to_le_bytes().to_vec();
        mine.extend_from_slice(&status_port.to_le_bytes());
        mine.extend_from_slice(&control_port.to_le_bytes());
        SupervisorPrep {
            g,
            listener,
            status,
            control,
            mine,
        }
    }
}

/// A [`Supervisor`] half made ([`Supervisor::prepare`]): waiting for every rank's ports.
pub(crate) struct SupervisorPrep {
    g: Supervisor,
    listener: std::io::Result<TcpListener>,
    status: StatusPlan,
    control: Option<TcpListener>,
    mine: Vec<u8>,
}

impl SupervisorPrep {
    /// This rank's message: its shrink listener's and status agent's ports.
    pub(crate) fn message(&self) -> Vec<u8> {
        self.mine.clone()
    }

    /// Second step, with every rank's [`message`](Self::message) `ports`: records the
    /// others' addresses, starts the status agent and hands the rendezvous connections to a
    /// new watchdog. `stats` holds the counters of this rank's link to each peer (none for
    /// itself), shown by the status agent.
    pub(crate) fn finish(
        self,
        boot: &mut Bootstrap,
        cfg: &Config,
        stats: &[Option<Arc<LinkStats>>],
        ports: Vec<Vec<u8>>,
    ) -> Result<Supervisor> {
        let SupervisorPrep {
            mut g,
            listener,
            status,
            control,
            ..
        } = self;
        let (rank, nranks) = (boot.rank(), boot.world_size());
        if ports.len() != nranks {
            return Err(Error::Protocol {
                rank,
                peer: 0,
                call: "init",
                seq: 0,
                msg: format!("{} port messages for {nranks} ranks", ports.len()),
            });
        }
        let status_addrs: Vec<Option<SocketAddr>> = ports
            .iter()
            .zip(boot.peers())
            .map(|(p, info)| {
                let port = p.get(2..4).map_or(0, |b| u16::from_le_bytes([b[0], b[1]]));
                (port != 0).then_some(SocketAddr::new(info.ip, port))
            })
            .collect();
        let port_at = |at: usize| -> Vec<SocketAddr> {
            ports
                .iter()
                .zip(boot.peers())
                .map(|(p, info)| {
                    let port = p
                        .get(at..at + 2)
                        .map_or(0, |b| u16::from_le_bytes([b[0], b[1]]));
                    SocketAddr::new(info.ip, port)
                })
                .collect()
        };
        let addrs = port_at(0);
        let control_addrs = port_at(4);
        g.shrink = Some(ShrinkPlan {
            addrs,
            listener: Mutex::new(listener.ok()),
            secret: *boot.secret(),
        });
        let src = crate::observe::status::Source {
            comm: boot.comm_tag(),
            rank,
            nranks,
            recorder: g.recorder.clone(),
            health: g.health.clone(),
            links: Arc::new(link_infos(boot, cfg, stats)),
        };
        match status {
            StatusPlan::Off => {}
            StatusPlan::Join(a) => {
                g.status = StatusAgent::join_running(a, src, status_addrs);
                if g.status.is_none() {
                    tracing::warn!(rank, %a, "the status agent of this process stopped during init; no status for this communicator");
                }
            }
            StatusPlan::Listen(l) => match StatusAgent::start(l, *boot.secret(), src, status_addrs) {
                Ok(a) => g.status = Some(a),
                Err(e) => crate::base::debug::announce(&format!(
                    "warning: cannot start the status agent of rank {rank}: {e}; the status agent is off for this rank"
                )),
            },
        }
        let handoff = control.map(|l| Handoff {
            listener: Some(l),
            addrs: control_addrs,
            secret: *boot.secret(),
            tag: boot.comm_tag(),
            answer_within: cfg
                .heartbeat
                .unwrap_or(crate::fault::control::DEFAULT_ANSWER),
        });
        let (conns, graph) = boot.take_connections();
        if !conns.is_empty() {
            let rec = g.recorder.clone();
            let w = Watchdog::start(
                rank,
                conns,
                graph,
                g.health.clone(),
                WatchSettings {
                    heartbeat: cfg.heartbeat,
                    // Ranks leave init at different times (no exchange ends it): a peer's
                    // first heartbeat may come as late as init's own bound.
                    first_heard: cfg.timeout,
                },
                Box::new(move || rec.dump("failure reported by the watchdog")),
                handoff,
            )
            .map_err(|source| Error::Io {
                rank,
                context: "starting the watchdog thread".into(),
                source,
            })?;
            g.watchdog = Arc::new(Mutex::new(Some(w)));
        }
        Ok(g)
    }
}

impl Supervisor {
    /// The health shared with the executor.
    pub(crate) fn health(&self) -> &Health {
        &self.health
    }

    /// The same, shared (to pass failures on to a split communicator's).
    pub(crate) fn health_arc(&self) -> &Arc<Health> {
        &self.health
    }

    /// Fails fast when the communicator has failed (one atomic load when healthy).
    #[inline]
    pub(crate) fn check(&self, call: &'static str, seq: u64) -> Result<()> {
        if self.health.is_failed() {
            return Err(self.health.error(self.rank, call, seq));
        }
        Ok(())
    }

    /// The timeout in force for calls.
    pub(crate) fn timeout(&self) -> Duration {
        Duration::from_nanos(self.timeout_ns.load(Ordering::Relaxed))
    }

    /// Records the start of a call; returns the buffer for its step times when the timeline
    /// is on.
    pub(crate) fn begin(
        &self,
        seq: u64,
        call: &'static str,
        print: &CallPrint,
        algo: &'static str,
    ) -> Option<(Instant, Vec<Instant>)> {
        if let Some(m) = &self.metrics {
            m.begin();
        }
        self.recorder.begin(
            seq,
            call,
            print.fp,
            print.send_seq.max(print.recv_seq),
            algo,
        );
        self.timeline.as_ref().map(|_| (Instant::now(), Vec::new()))
    }

    /// Records the end of a call; a fatal error marks the communicator failed, tells the
    /// other ranks and writes the flight recorder. Returns the call's result, where a lost
    /// link is replaced by its cause when another rank reports one within [`CAUSE_GRACE`]
    /// (a rank that found a mismatch and exited closes its links before its report arrives).
    pub(crate) fn end(
        &self,
        seq: u64,
        call: &'static str,
        print: &CallPrint,
        algo: &'static str,
        timing: Option<(Instant, Vec<Instant>)>,
        mut res: Result<()>,
    ) -> Result<()> {
        if let Err(e @ (Error::PeerLost { .. } | Error::Protocol { .. })) = &res {
            let t = Instant::now();
            while !self.health.is_failed() && t.elapsed() < CAUSE_GRACE {
                std::thread::sleep(Duration::from_millis(2));
            }
            if crate::fault::watchdog::is_cause(self.health.failure().as_ref(), e) {
                res = Err(self.health.error(self.rank, call, seq));
            }
        }
        let err = res.as_ref().err();
        self.recorder.end_as(seq, algo, err.map(|e| e.to_string()));
        if let Some(m) = &self.metrics {
            m.end(seq, call, &print.fp, err.is_some());
            if let Some(e) = err {
                m.failed_with(call, e.failure_kind());
            }
        }
        if let (Some(t), Some((start, steps))) = (&self.timeline, timing) {
            t.record(
                seq,
                call,
                print.fp,
                algo,
                start,
                steps,
                err.map(|e| e.to_string()),
            );
        }
        if let Some(e) = err.filter(|e| e.is_fatal()) {
            self.failed(e);
        }
        res
    }

    fn watchdog(&self) -> std::sync::MutexGuard<'_, Option<Watchdog>> {
        self.watchdog.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The watchdog, weakly, for the exit hook ([`crate::comm::exit`]); `None` without one
    /// (no peer to say goodbye to).
    pub(crate) fn watchdog_weak(&self) -> Option<Weak<Mutex<Option<Watchdog>>>> {
        self.watchdog()
            .is_some()
            .then(|| Arc::downgrade(&self.watchdog))
    }

    /// Stops the watchdog (it says goodbye to the peers), as dropping the communicator does:
    /// for [`Communicator::close`].
    pub(crate) fn close(&self) {
        let w = self.watchdog().take();
        drop(w);
    }

    /// This rank failed with `e`: remember it, tell everyone, write the flight recorder.
    pub(crate) fn failed(&self, e: &Error) {
        let first = self.health.fail(Failure::Local { msg: e.to_string() });
        if first {
            if let Some(w) = self.watchdog().as_ref() {
                w.report(e);
            }
            self.recorder.dump(&e.to_string());
        }
    }
}

/// This rank's links as init made them (for the status agent): the same plan as init's.
fn link_infos(
    boot: &Bootstrap,
    cfg: &Config,
    stats: &[Option<Arc<LinkStats>>],
) -> Vec<crate::observe::status::LinkInfo> {
    use crate::bootstrap::topo::{plan_links, Topology};
    let peers = boot.peers();
    let topo = Topology::new(peers);
    let Ok((shm, tcp)) = plan_links(boot.rank(), peers, &topo, cfg.transport) else {
        return Vec::new();
    };
    let info = |r: usize, transport| {
        peers.get(r).map(|p| crate::observe::status::LinkInfo {
            peer: r,
            transport,
            host: p.hostname.clone(),
            ip: p.ip,
            pid: p.pid,
            stats: stats.get(r).cloned().flatten(),
        })
    };
    let mut v: Vec<_> = shm
        .iter()
        .filter_map(|&(r, _)| info(r, "shm"))
        .chain(tcp.iter().filter_map(|&(r, _)| info(r, "tcp")))
        .collect();
    v.sort_by_key(|l| l.peer);
    v
}

/// Where this rank's status agent will be, when `OXCCL_STATUS` is set.
enum StatusPlan {
    /// No agent.
    Off,
    /// This process's agent already running there (another communicator started it).
    Join(SocketAddr),
    /// A new agent on this listener.
    Listen(TcpListener),
}

/// This rank's status agent when `OXCCL_STATUS` is set: rank 0 on its address, the others
/// on an ephemeral port of `my_ip`; a communicator of a process whose agent already runs
/// (on that address, or on `my_ip`) joins it. A failure is a warning on stderr: the job goes
/// on without it.
fn status_plan(cfg: &Config, rank: usize, my_ip: IpAddr) -> StatusPlan {
    use crate::observe::status;
    let Some(v) = cfg.status.as_deref() else {
        return StatusPlan::Off;
    };
    let addr = if rank == 0 {
        match status::parse_addr(v) {
            Ok(a) => a,
            Err(e) => {
                crate::base::debug::announce(&format!(
                    "warning: OXCCL_STATUS: {e}; the status agent is off for rank {rank}"
                ));
                return StatusPlan::Off;
            }
        }
    } else {
        SocketAddr::new(my_ip, 0)
    };
    // Only a process's first communicator listens: a later one joins its agent (for rank 0,
    // the one on OXCCL_STATUS's address if this process has it), so that a split whose rank
    // 0 is another process than the job's rank 0 does not try the job's port.
    let exact = if rank == 0 {
        StatusAgent::running(|a| a == addr)
    } else {
        None
    };
    let running = exact.or_else(|| StatusAgent::running(|a| status::serves(a, my_ip)));
    if let Some(a) = running {
        return StatusPlan::Join(a);
    }
    status::listen(rank, addr).map_or(StatusPlan::Off, StatusPlan::Listen)
}

/// The torch-format flight record of a communicator when `OXCCL_FR_DUMP` is set.
fn torch_dump(cfg: &Config) -> Option<TorchDump> {
    cfg.fr_dump.clone().map(|prefix| TorchDump {
        prefix,
        timeout_ms: cfg.timeout.as_millis().min(u64::MAX as u128) as u64,
    })
}

impl Drop for Supervisor {
    fn drop(&mut self) {
        // At exit (the communicator is dropped): the torch-format record, if asked for and
        // there is something to say (not for the placeholder guard `Communicator::init`
        // replaces).
        if !self.recorder.is_empty() {
            self.recorder.dump_torch();
        }
    }
}

/// The metrics of a communicator when `OXCCL_METRICS` is set.
fn metrics(
    cfg: &Config,
    comm: u64,
    rank: usize,
    nranks: usize,
    nnodes: usize,
) -> Option<Arc<Metrics>> {
    if let Some(port) = cfg.metrics_port.as_deref() {
        metrics_server(port, rank);
    }
    if cfg.metrics.is_none() && cfg.metrics_port.is_none() {
        return None;
    }
    let id = Identity {
        comm,
        rank,
        nranks,
        nnodes,
    };
    Some(Metrics::with_files(
        id,
        cfg.metrics.as_deref(),
        cfg.metrics_interval,
    ))
}

/// Starts this process's `/metrics` server (`OXCCL_METRICS_PORT`) unless it runs; a failure
/// is one warning on stderr: the job goes on without it.
fn metrics_server(v: &str, rank: usize) {
    static WARNED: std::sync::Once = std::sync::Once::new();
    let res = crate::observe::status::parse_addr(v).and_then(|a| {
        crate::observe::metrics::serve(a).map_err(|e| format!("cannot listen on {a}: {e}"))
    });
    if let Err(e) = res {
        WARNED.call_once(|| {
            crate::base::debug::announce(&format!(
                "warning: OXCCL_METRICS_PORT: {e}; /metrics is off for this process (rank {rank}): \
                 free the port or give each process on this host its own"
            ))
        });
    }
}

impl Communicator {
    /// Stops the communicator: every call blocked on it (in any thread) returns an error at
    /// once, later calls fail, and the other ranks are told (their calls fail too, naming
    /// this rank). Returns promptly in any state; the communicator can then only be dropped
    /// (or [`shrink`](Self::shrink)ed by the others).
    ///
    /// In a forked child that inherited the communicator it does nothing: the peers are the
    /// parent's.
    pub fn abort(&self) {
        if self.own_process("abort").is_err() {
            return;
        }
        let g = self.supervisor();
        let msg = format!("rank {} called abort()", self.rank());
        if g.health.fail(Failure::Aborted { msg: msg.clone() }) {
            if let Some(w) = g.watchdog().as_ref() {
                w.report(&Error::Aborted {
                    rank: self.rank(),
                    msg,
                });
            }
            g.recorder.dump("abort()");
        }
    }

    /// Closes the communicator as dropping it would, for a communicator that others still
    /// hold (an `Arc` shared with queued calls, C handles or bindings: torch's
    /// `destroy_process_group`): waits until the calls queued so far have finished (each
    /// bounded by its timeout) and a call running on another thread has returned, then says
    /// goodbye to the other ranks (they see this rank leave, not die) and frees its links and
    /// shared memory. Every later call fails at once ([`Error::Aborted`], "closed"); closing
    /// again does nothing. (As NCCL's `ncclCommFinalize` followed by `ncclCommDestroy`.)
    ///
    /// In a forked child that inherited the communicator it does nothing (the links and the
    /// goodbye are the parent's); dropping it there leaks them.
    pub fn close(&self) {
        if self.own_process("close").is_err() {
            return;
        }
        self.synchronize();
        let mut st = self.lock();
        if st.closed {
            return;
        }
        st.closed = true;
        if st.broken.is_none() {
            st.broken = Some(format!("rank {} closed this communicator", self.rank()));
        }
        // Goodbye first, as in a drop: then the links.
        self.supervisor().close();
        st.release();
    }

    /// `Ok` while the communicator is healthy; else the error the next call would return
    /// (a lost peer, another rank's failure, an abort), without making a call (as NCCL's
    /// `ncclCommGetAsyncError`). The watchdog keeps this up to date between calls.
    /// In a forked child that inherited the communicator: the error every call returns
    /// there.
    pub fn check(&self) -> Result<()> {
        self.own_process("check")?;
        self.supervisor().check("check", 0)
    }

    /// Sets the timeout of this communicator's calls (instead of `OXCCL_TIMEOUT`).
    pub fn set_timeout(&self, timeout: Duration) {
        self.supervisor().timeout_ns.store(
            timeout.as_nanos().clamp(1, u64::MAX as u128) as u64,
            Ordering::Relaxed,
        );
    }

    /// The timeout in force for calls.
    pub fn timeout(&self) -> Duration {
        self.supervisor().timeout()
    }

    /// Where this rank's status agent (`OXCCL_STATUS`, [`crate::observe::status`]) listens, if it runs.
    pub fn status_addr(&self) -> Option<SocketAddr> {
        self.supervisor().status.as_ref().map(|a| a.addr())
    }

    /// The flight recorder as JSON (what `OXCCL_FLIGHT_RECORDER` writes).
    pub fn flight_record(&self) -> String {
        self.supervisor().recorder.to_json("requested")
    }

    /// Builds a communicator of the ranks not in `exclude` (typically lost ones), so that
    /// work can go on without them (as NCCL 2.27's `ncclCommShrink`). Every surviving rank
    /// must call it with the same `exclude`; excluded ranks must not. Ranks keep their order:
    /// the new rank of a survivor is its index among the survivors. The lowest survivor hosts
    /// the new rendezvous on a port it opened at init. Each communicator can be shrunk once
    /// (shrink the new one for later failures). Works on a failed communicator.
    pub fn shrink(&self, exclude: &[usize]) -> Result<Communicator> {
        self.own_process("shrink")?;
        let (rank, n) = (self.rank(), self.world_size());
        let bad = |msg: String| Error::InvalidArgument {
            rank,
            call: "shrink",
            seq: 0,
            msg,
        };
        let mut ex: Vec<usize> = exclude.to_vec();
        ex.sort_unstable();
        ex.dedup();
        if let Some(r) = ex.iter().find(|&&r| r >= n) {
            return Err(bad(format!("rank {r} is not in a world of {n}")));
        }
        if ex.contains(&rank) {
            return Err(bad(format!("rank {rank} excludes itself")));
        }
        let plan = self.supervisor().shrink.as_ref().ok_or_else(|| {
            bad(
                "this communicator was not made by a rendezvous (from_links): it cannot shrink"
                    .into(),
            )
        })?;
        let survivors: Vec<usize> = (0..n).filter(|r| !ex.contains(r)).collect();
        let new_rank = survivors
            .iter()
            .position(|&r| r == rank)
            .expect("not excluded");
        let root = survivors[0];
        let addr = plan.addrs[root];
        if addr.port() == 0 {
            return Err(bad(format!("rank {root} has no shrink listener")));
        }
        if root == rank {
            let l = plan
                .listener
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .take()
                .ok_or_else(|| {
                    bad("this communicator was already shrunk: shrink the new one".into())
                })?;
            crate::bootstrap::park_listener(addr, l);
        }
        let mut h = Sha256::new();
        h.update(b"oxccl-shrink");
        h.update(plan.secret);
        for r in &ex {
            h.update((*r as u64).to_le_bytes());
        }
        let digest = h.finalize();
        let mut secret = [0u8; 16];
        secret.copy_from_slice(&digest[..16]);
        let mut cfg = self.config().clone();
        cfg.timeout = self.timeout();
        tracing::info!(rank, new_rank, excluded = ?ex, %addr, "shrink");
        Communicator::init_with_config(
            &UniqueId::with_addr(addr, secret),
            new_rank,
            survivors.len(),
            cfg,
        )
    }
}
