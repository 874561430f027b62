//! `oxccl._oxccl`: the native half of the `oxccl` Python package.
//!
//! The Python half (`oxccl/__init__.py`) checks arrays and tensors (type, dtype, contiguity,
//! device, lengths) and passes their addresses here as integers, with the objects that own
//! the memory. Blocking calls run with the GIL released while the caller's frame keeps the
//! objects alive; queued calls keep them (the `keepalive` argument) inside the queued job and
//! release them, under the GIL, when the call has finished.

use std::str::FromStr;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use oxccl::{
    CollKind, Communicator, Config, DataType, Error, P2pCall, P2pOp, RawBufs, ReduceOp,
    SharedBuffer, UniqueId, Work,
};
use pyo3::prelude::*;
use pyo3::types::{PyCapsule, PyType};

/// The Python exception class (in `oxccl._errors`) for an oxccl error.
fn error_class(e: &Error) -> &'static str {
    match e {
        Error::Timeout { .. } => "TimeoutError",
        Error::PeerLost { .. } | Error::Connect { .. } => "PeerLostError",
        Error::Mismatch { .. } => "MismatchError",
        Error::InvalidArgument { .. } | Error::Env(_) => "InvalidArgumentError",
        Error::Aborted { .. } => "AbortedError",
        _ => "Error",
    }
}

/// An error as it crosses into Python: the class name and the message.
#[derive(Clone, Debug)]
struct PyErrInfo {
    class: &'static str,
    msg: String,
}

impl From<&Error> for PyErrInfo {
    fn from(e: &Error) -> Self {
        PyErrInfo {
            class: error_class(e),
            msg: e.to_string(),
        }
    }
}

impl PyErrInfo {
    fn to_py(&self, py: Python<'_>) -> PyErr {
        let cls = py
            .import("oxccl._errors")
            .and_then(|m| m.getattr(self.class))
            .and_then(|c| c.cast_into::<PyType>().map_err(PyErr::from));
        match cls {
            Ok(cls) => PyErr::from_type(cls, self.msg.clone()),
            Err(e) => e,
        }
    }
}

fn err(py: Python<'_>, e: &Error) -> PyErr {
    PyErrInfo::from(e).to_py(py)
}

fn bad_arg(py: Python<'_>, msg: String) -> PyErr {
    PyErrInfo {
        class: "InvalidArgumentError",
        msg,
    }
    .to_py(py)
}

/// One call's description, as the Python half passes it.
struct CallSpec {
    kind: CollKind,
    dtype: DataType,
    op: ReduceOp,
    root: usize,
    bufs: RawBufs,
}

// SAFETY: RawBufs is Send; the rest is plain data.
unsafe impl Send for CallSpec {}

#[allow(clippy::too_many_arguments)]
fn spec(
    py: Python<'_>,
    kind: &str,
    dtype: &str,
    op: &str,
    root: usize,
    peer: usize,
    send: (usize, usize),
    recv: (usize, usize),
    in_place: bool,
) -> PyResult<CallSpec> {
    let kind = match kind {
        "all_reduce" => CollKind::AllReduce,
        "broadcast" => CollKind::Broadcast,
        "reduce" => CollKind::Reduce,
        "all_gather" => CollKind::AllGather,
        "reduce_scatter" => CollKind::ReduceScatter,
        "all_to_all" => CollKind::AllToAll,
        "send" => CollKind::Send { peer },
        "recv" => CollKind::Recv { peer },
        "sendrecv" => CollKind::SendRecv {
            to: peer,
            from: root,
        },
        "barrier" => CollKind::Barrier,
        other => return Err(bad_arg(py, format!("unknown collective '{other}'"))),
    };
    let dtype = DataType::from_str(dtype).map_err(|m| bad_arg(py, m))?;
    let op = ReduceOp::from_str(op).map_err(|m| bad_arg(py, m))?;
    let bufs = if in_place {
        RawBufs::InPlace {
            buf: recv.0 as *mut u8,
            len: recv.1,
        }
    } else {
        RawBufs::Separate {
            send: send.0 as *const u8,
            send_len: send.1,
            recv: recv.0 as *mut u8,
            recv_len: recv.1,
        }
    };
    Ok(CallSpec {
        kind,
        dtype,
        op,
        root,
        bufs,
    })
}

impl CallSpec {
    /// Runs the call.
    ///
    /// # Safety
    ///
    /// The buffers must be valid for the call (see [`RawBufs::as_byte_bufs`]).
    unsafe fn run(self, comm: &Communicator) -> oxccl::Result<()> {
        // SAFETY: forwarded from the caller.
        let bufs = unsafe { self.bufs.as_byte_bufs() };
        comm.call_bytes(self.kind, self.dtype, self.op, self.root, bufs)
    }
}

/// One point-to-point operation as the Python half passes it: `("send" | "recv", peer or
/// None (recv from any), tag, dtype, address, bytes)`.
type P2pTuple = (String, Option<usize>, u32, String, usize, usize);

/// A point-to-point group on raw addresses (plain integers: `Send`), and the call it is.
struct P2pSpec {
    ops: Vec<(bool, Option<usize>, u32, DataType, usize, usize)>,
    call: P2pCall,
}

/// `call`: None for the user's own messages, else the collective the group is
/// (`"gather"`, `"scatter"`, `"all_to_allv"`: `Communicator::group_p2p_as`).
fn p2p_spec(py: Python<'_>, ops: Vec<P2pTuple>, call: Option<&str>) -> PyResult<P2pSpec> {
    let call = match call {
        None => P2pCall::User,
        Some(c) => *P2pCall::ALL
            .iter()
            .find(|k| k.is_collective() && k.name() == c)
            .ok_or_else(|| bad_arg(py, format!("unknown point-to-point collective '{c}'")))?,
    };
    let mut v = Vec::with_capacity(ops.len());
    for (kind, peer, tag, dtype, addr, len) in ops {
        let send = match kind.as_str() {
            "send" => true,
            "recv" => false,
            other => return Err(bad_arg(py, format!("unknown p2p operation '{other}'"))),
        };
        if send && peer.is_none() {
            return Err(bad_arg(py, "a send needs a peer".into()));
        }
        let dtype = DataType::from_str(&dtype).map_err(|m| bad_arg(py, m))?;
        v.push((send, peer, tag, dtype, addr, len));
    }
    Ok(P2pSpec { ops: v, call })
}

impl P2pSpec {
    /// Runs the group; returns each receive's source (`None` for sends).
    ///
    /// # Safety
    ///
    /// Every address must point to `len` bytes that stay valid (and, for receives, unaliased
    /// and writable) for the call.
    unsafe fn run(&self, comm: &Communicator) -> oxccl::Result<Vec<Option<usize>>> {
        let mut ops: Vec<P2pOp<'_>> = self
            .ops
            .iter()
            .map(|&(send, peer, tag, dtype, addr, len)| {
                if send {
                    P2pOp::Send {
                        peer: peer.unwrap_or(usize::MAX),
                        tag,
                        dtype,
                        // SAFETY: forwarded from the caller (empty buffers need no memory).
                        buf: if len == 0 {
                            &[]
                        } else {
                            unsafe { std::slice::from_raw_parts(addr as *const u8, len) }
                        },
                    }
                } else {
                    P2pOp::Recv {
                        peer,
                        tag,
                        dtype,
                        // SAFETY: forwarded from the caller.
                        buf: if len == 0 {
                            &mut []
                        } else {
                            unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, len) }
                        },
                        from: None,
                    }
                }
            })
            .collect();
        comm.group_p2p_as(self.call, &mut ops)?;
        Ok(ops
            .iter()
            .map(|op| match op {
                P2pOp::Recv { from, .. } => *from,
                P2pOp::Send { .. } => None,
            })
            .collect())
    }
}

/// The sources of a queued point-to-point group's receives, once it has finished.
#[pyclass(frozen, module = "oxccl._oxccl", name = "P2pSources")]
struct P2pSources {
    sources: Arc<Mutex<Option<Vec<Option<usize>>>>>,
}

#[pymethods]
impl P2pSources {
    /// Each operation's source rank (None for sends), or None before the group finished.
    fn get(&self) -> Option<Vec<Option<usize>>> {
        self.sources
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

/// A buffer in shared memory (`Communicator::alloc_shared`); `Comm.empty` views it as a numpy
/// array through its address and keeps this object alive as long as the array.
#[pyclass(frozen, module = "oxccl._oxccl", name = "SharedMemory")]
struct SharedMemory {
    buf: SharedBuffer,
}

#[pymethods]
impl SharedMemory {
    /// Address of the first byte.
    #[getter]
    fn address(&self) -> usize {
        self.buf.as_ptr() as usize
    }

    /// Size in bytes.
    fn __len__(&self) -> usize {
        self.buf.len()
    }
}

/// A communicator (use `oxccl.init`, which wraps this in `oxccl.Comm`).
#[pyclass(frozen, module = "oxccl._oxccl", name = "RawComm")]
struct RawComm {
    inner: Arc<Communicator>,
}

#[pymethods]
impl RawComm {
    /// This process's rank in the communicator.
    #[getter]
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    /// The number of ranks.
    #[getter]
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }

    /// This rank's index among the ranks of its host.
    #[getter]
    fn local_rank(&self) -> usize {
        self.inner.local_rank()
    }

    /// The number of ranks on this host.
    #[getter]
    fn local_size(&self) -> usize {
        self.inner.local_size()
    }

    /// The transports this rank's links use, e.g. `"shm"`, `"shm+tcp"`, or `"none"`.
    #[getter]
    fn transport(&self) -> String {
        self.inner.transport_summary()
    }

    /// The number of calls queued on the communicator's stream and not finished yet.
    fn pending(&self) -> u64 {
        self.inner.pending_calls()
    }

    /// A zeroed shared buffer of `nbytes` bytes.
    fn alloc_shared(&self, py: Python<'_>, nbytes: usize) -> PyResult<SharedMemory> {
        let buf = self.inner.alloc_shared(nbytes).map_err(|e| err(py, &e))?;
        Ok(SharedMemory { buf })
    }

    /// A blocking call on raw addresses, GIL released. The caller keeps the memory alive.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (kind, dtype, op, root, peer, send, recv, in_place))]
    fn call(
        &self,
        py: Python<'_>,
        kind: &str,
        dtype: &str,
        op: &str,
        root: usize,
        peer: usize,
        send: (usize, usize),
        recv: (usize, usize),
        in_place: bool,
    ) -> PyResult<()> {
        let s = spec(py, kind, dtype, op, root, peer, send, recv, in_place)?;
        let comm = &self.inner;
        // SAFETY: the Python caller (oxccl.Comm) holds references to the arrays whose memory
        // these addresses point into, for the duration of this call, and checked the lengths.
        let r = py.detach(|| unsafe { s.run(comm) });
        r.map_err(|e| err(py, &e))
    }

    /// Queues a call on raw addresses; `keepalive` (the arrays) is held until the call has
    /// finished; `callback(None | exception)` then runs on oxccl's stream thread, with the GIL.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (kind, dtype, op, root, peer, send, recv, in_place, keepalive, callback=None))]
    fn call_async(
        &self,
        py: Python<'_>,
        kind: &str,
        dtype: &str,
        op: &str,
        root: usize,
        peer: usize,
        send: (usize, usize),
        recv: (usize, usize),
        in_place: bool,
        keepalive: Py<PyAny>,
        callback: Option<Py<PyAny>>,
    ) -> PyResult<Handle> {
        let s = spec(py, kind, dtype, op, root, peer, send, recv, in_place)?;
        // SAFETY: `keepalive` owns the memory behind every address and lives until after the
        // call; the Python caller checked the lengths and does not touch the output until
        // completion.
        Ok(self.queue(keepalive, callback, move |comm| unsafe { s.run(comm) }))
    }

    /// A point-to-point group (`Communicator::group_p2p`), blocking, GIL released: `ops` are
    /// `("send" | "recv", peer (None: a recv from any rank), tag, dtype, address, bytes)`;
    /// returns each operation's source rank (None for sends). The caller keeps the memory
    /// alive. `call`: None for user messages, or the collective the group is (`"gather"`,
    /// `"scatter"`, `"all_to_allv"`: `Communicator::group_p2p_as`).
    #[pyo3(signature = (ops, call=None))]
    fn p2p(
        &self,
        py: Python<'_>,
        ops: Vec<P2pTuple>,
        call: Option<String>,
    ) -> PyResult<Vec<Option<usize>>> {
        let s = p2p_spec(py, ops, call.as_deref())?;
        let comm = &self.inner;
        // SAFETY: the Python caller (oxccl.Comm) holds the arrays behind these addresses for
        // the duration of this call and checked the lengths.
        let r = py.detach(|| unsafe { s.run(comm) });
        r.map_err(|e| err(py, &e))
    }

    /// Queues a point-to-point group (as `p2p`, `call` too) on oxccl's stream; `keepalive`
    /// is held until it has finished, then `callback(None | exception)` runs. Returns the
    /// handle and the object that gives the receives' sources once it has finished.
    #[pyo3(signature = (ops, keepalive, callback=None, call=None))]
    fn p2p_async(
        &self,
        py: Python<'_>,
        ops: Vec<P2pTuple>,
        keepalive: Py<PyAny>,
        callback: Option<Py<PyAny>>,
        call: Option<String>,
    ) -> PyResult<(Handle, P2pSources)> {
        let s = p2p_spec(py, ops, call.as_deref())?;
        let sources = Arc::new(Mutex::new(None));
        let out = P2pSources {
            sources: Arc::clone(&sources),
        };
        let handle = self.queue(keepalive, callback, move |comm| {
            // SAFETY: `keepalive` owns the memory behind every address until after the call.
            let r = unsafe { s.run(comm) };
            r.map(|v| *sources.lock().unwrap_or_else(|e| e.into_inner()) = Some(v))
        });
        Ok((handle, out))
    }

    /// A new C handle (`oxcclComm_t` of `oxccl.h`, as an address) of this communicator, for
    /// C/C++ code calling through the `_C_API` capsule; that code frees it with
    /// `comm_destroy`.
    fn c_comm(&self) -> usize {
        oxccl_capi::comm_into_handle(Arc::clone(&self.inner)) as usize
    }

    /// Waits until every queued call has finished (GIL released).
    fn synchronize(&self, py: Python<'_>) {
        let comm = &self.inner;
        py.detach(|| comm.synchronize());
    }

    /// `Communicator::close` (GIL released): waits for the queued calls, says goodbye to the
    /// other ranks and frees the links, whoever else holds the communicator (C handles,
    /// queued calls); later calls fail. Idempotent.
    fn close(&self, py: Python<'_>) {
        let comm = &self.inner;
        py.detach(|| comm.close());
    }

    /// `Communicator::abort`: every blocked and later call fails at once; the other ranks
    /// are told.
    fn abort(&self) {
        self.inner.abort();
    }

    /// `ncclCommSplit`: a new communicator of the ranks with the same color (None or a
    /// negative color: none), ordered by key then rank.
    #[pyo3(signature = (color, key))]
    fn split(&self, py: Python<'_>, color: Option<i64>, key: i64) -> PyResult<Option<RawComm>> {
        let color = match color {
            Some(c) if c >= 0 => Some(
                u32::try_from(c)
                    .map_err(|_| bad_arg(py, format!("color {c} does not fit 32 bits")))?,
            ),
            _ => None,
        };
        let comm = &self.inner;
        let r = py.detach(|| comm.split(color, key));
        match r {
            Ok(c) => Ok(c.map(|c| RawComm { inner: Arc::new(c) })),
            Err(e) => Err(err(py, &e)),
        }
    }
}

impl RawComm {
    /// Queues `run` on oxccl's stream; `keepalive` is dropped (under the GIL) after it, and
    /// `callback(None | exception)` runs then.
    fn queue(
        &self,
        keepalive: Py<PyAny>,
        callback: Option<Py<PyAny>>,
        run: impl FnOnce(&Communicator) -> oxccl::Result<()> + Send + 'static,
    ) -> Handle {
        let inflight = Inflight::new();
        let work = self.inner.submit(move |comm| {
            // Counted until the end of this closure, after the callback released the GIL.
            let _inflight = inflight;
            let res = run(comm);
            let info = res.as_ref().err().map(PyErrInfo::from);
            Python::attach(|py| {
                if let Some(cb) = callback {
                    let arg = match &info {
                        None => py.None(),
                        Some(i) => i.to_py(py).into_value(py).into_any(),
                    };
                    if let Err(e) = cb.call1(py, (arg,)) {
                        e.write_unraisable(py, None);
                    }
                }
                drop(keepalive);
            });
            Ok(info.map_or(Ok(()), Err))
        });
        Handle::new(work)
    }
}

/// What a queued call hands back: its error, if any, ready for Python.
type CallResult = Result<(), PyErrInfo>;

/// The handle of a queued call.
#[pyclass(frozen, module = "oxccl._oxccl", name = "RawHandle")]
struct Handle {
    work: Mutex<Option<Work<CallResult>>>,
    result: Mutex<Option<Result<(), PyErrInfo>>>,
}

impl Handle {
    fn new(work: Work<CallResult>) -> Handle {
        Handle {
            work: Mutex::new(Some(work)),
            result: Mutex::new(None),
        }
    }
}

#[pymethods]
impl Handle {
    /// True once the call has finished.
    fn is_completed(&self) -> bool {
        if self
            .result
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
        {
            return true;
        }
        self.work
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .is_none_or(|w| w.is_completed())
    }

    /// Waits for the call (GIL released); raises its error, if any.
    fn wait(&self, py: Python<'_>) -> PyResult<()> {
        let work = self.work.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(w) = work {
            let r = py
                .detach(|| w.wait())
                .unwrap_or_else(|e| Err(PyErrInfo::from(&e)));
            *self.result.lock().unwrap_or_else(|e| e.into_inner()) = Some(r);
        }
        // Another thread may be waiting on the same handle: wait until it has stored the result.
        loop {
            if let Some(r) = self
                .result
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .as_ref()
            {
                return r.clone().map_err(|i| i.to_py(py));
            }
            py.detach(|| std::thread::sleep(std::time::Duration::from_millis(1)));
        }
    }
}

/// Joins a communicator launched by torchrun, `oxccl run`, Slurm, Open MPI or PMI.
#[pyfunction]
fn init_from_env(py: Python<'_>) -> PyResult<RawComm> {
    py.detach(Communicator::from_env)
        .map(|c| RawComm { inner: Arc::new(c) })
        .map_err(|e| err(py, &e))
}

/// Joins the communicator of `unique_id` (a string from `new_unique_id`) as `rank`; settings
/// from the environment, except the timeout when `timeout_s` is given. With `watch` (a
/// communicator) and `group` (`group[i]`: the rank in `watch` of the new rank `i`), `watch`
/// watches the init: a rank of the group lost there fails the init at once and, later, the
/// new communicator (`Communicator::init_watched`).
#[pyfunction]
#[pyo3(signature = (unique_id, rank, world_size, timeout_s=None, watch=None, group=None))]
fn init_with_id(
    py: Python<'_>,
    unique_id: &str,
    rank: usize,
    world_size: usize,
    timeout_s: Option<f64>,
    watch: Option<PyRef<'_, RawComm>>,
    group: Option<Vec<usize>>,
) -> PyResult<RawComm> {
    let id = UniqueId::from_str(unique_id).map_err(|e| err(py, &e))?;
    let mut cfg = Config::from_env().map_err(|e| err(py, &e))?;
    if let Some(t) = timeout_s {
        if !(t.is_finite() && t > 0.0) {
            return Err(bad_arg(
                py,
                format!("timeout {t} s is not a positive number"),
            ));
        }
        cfg.timeout = std::time::Duration::from_secs_f64(t.min(1e9));
    }
    let watched = match (watch, group) {
        (None, None) => None,
        (Some(w), Some(g)) => {
            if g.len() != world_size {
                return Err(bad_arg(
                    py,
                    format!("group has {} ranks, world_size is {world_size}", g.len()),
                ));
            }
            Some((Arc::clone(&w.inner), g))
        }
        _ => return Err(bad_arg(py, "watch and group go together".to_string())),
    };
    py.detach(|| match watched {
        Some((w, g)) => w.init_watched(&id, rank, g, cfg),
        None => Communicator::init_with_config(&id, rank, world_size, cfg),
    })
    .map(|c| RawComm { inner: Arc::new(c) })
    .map_err(|e| err(py, &e))
}

/// A fresh unique id, as `ncclGetUniqueId`, listening on `ip` (default: this host's default
/// address). Rank 0 must call `init_with_id` with it in this process.
#[pyfunction]
#[pyo3(signature = (ip=None))]
fn new_unique_id(py: Python<'_>, ip: Option<&str>) -> PyResult<String> {
    let id = match ip {
        None => UniqueId::new(),
        Some(ip) => {
            let ip = ip
                .parse()
                .map_err(|_| bad_arg(py, format!("'{ip}' is not an IP address")))?;
            UniqueId::new_on(ip)
        }
    };
    id.map(|id| id.to_string()).map_err(|e| err(py, &e))
}

/// The string form of an id for a rendezvous at `addr` (`host:port`, rank 0 binds it) with
/// `secret` (32 hex digits).
#[pyfunction]
fn unique_id_for(py: Python<'_>, addr: &str, secret: &str) -> PyResult<String> {
    let sa = std::net::ToSocketAddrs::to_socket_addrs(addr)
        .ok()
        .and_then(|mut a| a.next())
        .ok_or_else(|| bad_arg(py, format!("cannot resolve address '{addr}' (host:port)")))?;
    let id = format!("oxccl1:{sa}:{secret}");
    UniqueId::from_str(&id).map_err(|e| err(py, &e))?;
    Ok(id)
}

/// Queued calls whose completion callback may still take the GIL, over every communicator
/// (a communicator's Python object may be gone while its calls still run: they hold the
/// communicator). At exit, `wait_inflight` lets them finish before the interpreter does: a
/// thread that takes the GIL during finalization is ended by Python mid-call.
static INFLIGHT: (Mutex<usize>, Condvar) = (Mutex::new(0), Condvar::new());

/// One queued call, counted in [`INFLIGHT`] from its submission until it is dropped (after its
/// callback ran, or unrun).
struct Inflight;

impl Inflight {
    fn new() -> Self {
        *INFLIGHT.0.lock().unwrap_or_else(|e| e.into_inner()) += 1;
        Inflight
    }
}

impl Drop for Inflight {
    fn drop(&mut self) {
        let mut n = INFLIGHT.0.lock().unwrap_or_else(|e| e.into_inner());
        *n = n.saturating_sub(1);
        INFLIGHT.1.notify_all();
    }
}

/// Waits (GIL released) until no queued call can still take the GIL, or `timeout_s` passes.
/// Returns how many are still in flight.
#[pyfunction]
fn wait_inflight(py: Python<'_>, timeout_s: f64) -> usize {
    py.detach(|| {
        // NaN and negative: no wait; huge: capped (from_secs_f64 panics past ~1.8e19 s).
        let secs = if timeout_s > 0.0 {
            timeout_s.min(1e7)
        } else {
            0.0
        };
        let deadline = Instant::now() + Duration::from_secs_f64(secs);
        let mut n = INFLIGHT.0.lock().unwrap_or_else(|e| e.into_inner());
        while *n > 0 {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            n = INFLIGHT
                .1
                .wait_timeout(n, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        *n
    })
}

/// The Rust core of the `oxccl` package: communicators on raw buffer addresses. Use the
/// `oxccl` module, which wraps these in numpy- and torch-friendly objects.
#[pymodule]
fn _oxccl(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<RawComm>()?;
    m.add_class::<Handle>()?;
    m.add_class::<SharedMemory>()?;
    m.add_class::<P2pSources>()?;
    m.add_function(wrap_pyfunction!(init_from_env, m)?)?;
    m.add_function(wrap_pyfunction!(wait_inflight, m)?)?;
    m.add_function(wrap_pyfunction!(init_with_id, m)?)?;
    m.add_function(wrap_pyfunction!(new_unique_id, m)?)?;
    m.add_function(wrap_pyfunction!(unique_id_for, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    // The C ABI's function table (oxccl.h's `oxcclApi_t`), as numpy's `_ARRAY_API`: C++ code
    // (the torch backend) calls this library instance through it.
    let api = std::ptr::NonNull::from(&oxccl_capi::API).cast::<std::ffi::c_void>();
    // SAFETY: the table is a static: valid for the life of the process.
    let capsule = unsafe { PyCapsule::new_with_pointer(m.py(), api, c"oxccl._C_API") }?;
    m.add("_C_API", capsule)?;
    Ok(())
}
