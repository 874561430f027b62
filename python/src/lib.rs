//! `oxccl._oxccl`: the native half of the `oxccl` Python package.
//!
//! The Python half (`oxccl/__init__.py`) hands over the objects that hold the data (numpy
//! arrays, or numpy views of torch CPU tensors); this module takes their memory through the
//! buffer protocol and checks it itself (C-contiguous, writable where the call writes, the
//! element type against the buffer's format and item size, input and output apart), so no
//! address or length comes from Python. Blocking calls run with the GIL released while the
//! buffer views keep the memory exported; queued calls keep the views inside the queued job
//! and release them, under the GIL, when the call has finished.

use std::str::FromStr;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use oxccl::{
    CollKind, Communicator, Config, DataType, Error, P2pCall, P2pOp, RawBufs, ReduceOp,
    SharedBuffer, UniqueId, Work,
};
use pyo3::buffer::PyUntypedBuffer;
use pyo3::prelude::*;
use pyo3::types::{PyCapsule, PyType};

/// An error as it crosses into Python: the C ABI's result code (`oxccl_capi::result::code_of`,
/// the one map from the library's errors to their kinds) and the message. `oxccl._errors`
/// maps the code to the exception class, for this module and the C++ torch backend alike.
#[derive(Clone, Debug)]
struct PyErrInfo {
    code: i32,
    msg: String,
}

impl From<&Error> for PyErrInfo {
    fn from(e: &Error) -> Self {
        PyErrInfo {
            code: oxccl_capi::result::code_of(e) as i32,
            msg: e.to_string(),
        }
    }
}

impl PyErrInfo {
    fn to_py(&self, py: Python<'_>) -> PyErr {
        let cls = py
            .import("oxccl._errors")
            .and_then(|m| m.getattr("for_result"))
            .and_then(|f| f.call1((self.code,)))
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
        code: oxccl_capi::oxcclResult_t::oxcclInvalidArgument as i32,
        msg,
    }
    .to_py(py)
}

/// A Python object's memory, exported through the buffer protocol and checked here: held
/// (and the memory with it) until dropped, which releases it under the GIL.
struct Mem {
    view: PyUntypedBuffer,
    dtype: DataType,
}

impl Mem {
    /// `obj`'s buffer: C-contiguous, writable if `writable`, of a supported element type.
    /// `declared`: the element type when the buffer's format cannot say it (a bfloat16 tensor
    /// seen as 16-bit integers), accepted only for an integer format of the same item size.
    fn take(
        py: Python<'_>,
        obj: &Bound<'_, PyAny>,
        what: &str,
        writable: bool,
        declared: Option<&str>,
    ) -> PyResult<Mem> {
        let view = PyUntypedBuffer::get(obj).map_err(|e| {
            bad_arg(
                py,
                format!(
                    "{what}: expected a numpy array or a torch CPU tensor, got a {} ({e})",
                    obj.get_type()
                        .name()
                        .map_or_else(|_| "?".to_string(), |n| n.to_string())
                ),
            )
        })?;
        if !view.is_c_contiguous() {
            return Err(bad_arg(
                py,
                format!(
                    "{what}: the array is not C-contiguous (strides {:?}); pass np.ascontiguousarray(x)",
                    view.strides()
                ),
            ));
        }
        if writable && view.readonly() {
            return Err(bad_arg(py, format!("{what}: the array is read-only")));
        }
        let format = view.format().to_string_lossy().into_owned();
        let size = view.item_size();
        let found = format_dtype(&format, size);
        let dtype = match declared {
            None => found,
            Some(name) => {
                let d = DataType::from_str(name).map_err(|m| bad_arg(py, format!("{what}: {m}")))?;
                let int_view = matches!(
                    format.trim_start_matches(['@', '=', '<']),
                    "b" | "B" | "h" | "H" | "i" | "I" | "l" | "L" | "q" | "Q"
                );
                (found == Some(d) || (int_view && size == d.size())).then_some(d)
            }
        }
        .ok_or_else(|| {
            bad_arg(
                py,
                format!(
                    "{what}: unsupported element type (buffer format '{format}', {size} bytes{}; supported: {})",
                    declared.map_or_else(String::new, |d| format!(", declared {d}")),
                    DataType::ALL.map(DataType::name).join(" ")
                ),
            )
        })?;
        Ok(Mem { view, dtype })
    }

    fn ptr(&self) -> *mut u8 {
        self.view.buf_ptr().cast()
    }

    fn len(&self) -> usize {
        self.view.len_bytes()
    }

    /// Whether the two share a byte.
    fn overlaps(&self, other: &Mem) -> bool {
        let (a, b) = (self.ptr() as usize, other.ptr() as usize);
        self.len() > 0 && other.len() > 0 && a < b + other.len() && b < a + self.len()
    }

    /// Whether the two are the same bytes.
    fn same(&self, other: &Mem) -> bool {
        self.ptr() == other.ptr() && self.len() == other.len()
    }
}

/// The element type a buffer format (`struct` module syntax, one native-order item) and item
/// size stand for; `None` for another format (int16, big-endian, records, ...).
fn format_dtype(format: &str, size: usize) -> Option<DataType> {
    let f = format.trim_start_matches(['@', '=', '<']);
    Some(match (f, size) {
        ("b", 1) => DataType::I8,
        ("B", 1) => DataType::U8,
        ("?", 1) => DataType::Bool,
        ("H", 2) => DataType::U16,
        ("e", 2) => DataType::F16,
        ("i" | "l" | "q", 4) => DataType::I32,
        ("I" | "L" | "Q", 4) => DataType::U32,
        ("i" | "l" | "q", 8) => DataType::I64,
        ("I" | "L" | "Q", 8) => DataType::U64,
        ("f", 4) => DataType::F32,
        ("d", 8) => DataType::F64,
        _ => return None,
    })
}

/// One call, its buffers taken from the Python objects and checked.
struct CallSpec {
    kind: CollKind,
    dtype: DataType,
    op: ReduceOp,
    root: usize,
    bufs: RawBufs,
    /// The views behind `bufs`: the memory stays exported while they live.
    _mem: Vec<Mem>,
}

// SAFETY: RawBufs is Send; the views (Send) keep the memory behind it valid.
unsafe impl Send for CallSpec {}

#[allow(clippy::too_many_arguments)]
fn spec(
    py: Python<'_>,
    rank: usize,
    kind: &str,
    dtype: Option<&str>,
    op: &str,
    root: usize,
    peer: usize,
    send: Option<&Bound<'_, PyAny>>,
    recv: Option<&Bound<'_, PyAny>>,
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
    let op = ReduceOp::from_str(op).map_err(|m| bad_arg(py, m))?;
    let name = kind.name();
    let s = match send {
        Some(o) => Some(Mem::take(py, o, &format!("{name} input"), false, dtype)?),
        None => None,
    };
    // Written, except in place where only read: reduce off the root, broadcast on it.
    let read_only = matches!(kind, CollKind::Reduce if rank != root)
        || matches!(kind, CollKind::Broadcast if rank == root);
    let r = match recv {
        Some(o) => {
            let in_place = s.is_none() && !matches!(kind, CollKind::Recv { .. });
            let what = if in_place { "buffer" } else { "output" };
            Some(Mem::take(
                py,
                o,
                &format!("{name} {what}"),
                !(in_place && read_only),
                dtype,
            )?)
        }
        None => None,
    };
    let (bufs, dtype, mem) = match (s, r) {
        (None, None) => (
            RawBufs::Separate {
                send: std::ptr::null(),
                send_len: 0,
                recv: std::ptr::null_mut(),
                recv_len: 0,
            },
            DataType::U8,
            vec![],
        ),
        // A receive only writes its buffer: no input.
        (None, Some(r)) if matches!(kind, CollKind::Recv { .. }) => (
            RawBufs::Separate {
                send: std::ptr::null(),
                send_len: 0,
                recv: r.ptr(),
                recv_len: r.len(),
            },
            r.dtype,
            vec![r],
        ),
        (None, Some(r)) => (
            RawBufs::InPlace {
                buf: r.ptr(),
                len: r.len(),
            },
            r.dtype,
            vec![r],
        ),
        (Some(s), None) => (
            RawBufs::Separate {
                send: s.ptr(),
                send_len: s.len(),
                recv: std::ptr::null_mut(),
                recv_len: 0,
            },
            s.dtype,
            vec![s],
        ),
        (Some(s), Some(r)) => {
            if s.dtype != r.dtype {
                return Err(bad_arg(
                    py,
                    format!("{name}: input is {} but output is {}", s.dtype, r.dtype),
                ));
            }
            if s.same(&r) {
                (
                    RawBufs::InPlace {
                        buf: r.ptr(),
                        len: r.len(),
                    },
                    r.dtype,
                    vec![r],
                )
            } else if s.overlaps(&r) {
                return Err(bad_arg(
                    py,
                    format!("{name}: input and output overlap (and are not the same buffer)"),
                ));
            } else {
                let bufs = RawBufs::Separate {
                    send: s.ptr(),
                    send_len: s.len(),
                    recv: r.ptr(),
                    recv_len: r.len(),
                };
                (bufs, r.dtype, vec![s, r])
            }
        }
    };
    Ok(CallSpec {
        kind,
        dtype,
        op,
        root,
        bufs,
        _mem: mem,
    })
}

impl CallSpec {
    /// Runs the call.
    fn run(&self, comm: &Communicator) -> oxccl::Result<()> {
        // SAFETY: `_mem` keeps every buffer exported (valid, and the output writable: checked
        // in `Mem::take`) for as long as `self` lives, which outlasts the call; `spec` refused
        // an output that overlaps the input.
        let bufs = unsafe { self.bufs.as_byte_bufs() };
        comm.call_bytes(self.kind, self.dtype, self.op, self.root, bufs)
    }
}

/// One point-to-point operation as the Python half passes it: `("send" | "recv", peer or
/// None (recv from any), tag, the object holding the data, its element type when the
/// buffer's format cannot say it)`.
type P2pTuple<'py> = (
    String,
    Option<usize>,
    u32,
    Bound<'py, PyAny>,
    Option<String>,
);

/// A point-to-point group, its buffers taken and checked, and the call it is.
struct P2pSpec {
    ops: Vec<(bool, Option<usize>, u32, Mem)>,
    call: P2pCall,
}

/// `call`: None for the user's own messages, else the collective the group is
/// (`"gather"`, `"scatter"`, `"all_to_allv"`: `Communicator::group_p2p_as`).
fn p2p_spec(py: Python<'_>, ops: Vec<P2pTuple<'_>>, call: Option<&str>) -> PyResult<P2pSpec> {
    let call = match call {
        None => P2pCall::User,
        Some(c) => *P2pCall::ALL
            .iter()
            .find(|k| k.is_collective() && k.name() == c)
            .ok_or_else(|| bad_arg(py, format!("unknown point-to-point collective '{c}'")))?,
    };
    let mut v: Vec<(bool, Option<usize>, u32, Mem)> = Vec::with_capacity(ops.len());
    for (kind, peer, tag, obj, dtype) in ops {
        let send = match kind.as_str() {
            "send" => true,
            "recv" => false,
            other => return Err(bad_arg(py, format!("unknown p2p operation '{other}'"))),
        };
        if send && peer.is_none() {
            return Err(bad_arg(py, "a send needs a peer".into()));
        }
        let mem = Mem::take(
            py,
            &obj,
            &format!("p2p {kind} buffer"),
            !send,
            dtype.as_deref(),
        )?;
        if !send {
            // A receive's bytes are written by the library alone: no other operation of the
            // group may read or write them meanwhile.
            if let Some(j) = v.iter().position(|o| o.3.overlaps(&mem)) {
                return Err(bad_arg(
                    py,
                    format!("p2p: operation {} (recv) overlaps operation {j}", v.len()),
                ));
            }
        } else if let Some(j) = v.iter().position(|o| !o.0 && o.3.overlaps(&mem)) {
            return Err(bad_arg(
                py,
                format!(
                    "p2p: operation {} (send) overlaps operation {j} (recv)",
                    v.len()
                ),
            ));
        }
        v.push((send, peer, tag, mem));
    }
    Ok(P2pSpec { ops: v, call })
}

impl P2pSpec {
    /// Runs the group; returns each receive's source (`None` for sends).
    fn run(&self, comm: &Communicator) -> oxccl::Result<Vec<Option<usize>>> {
        let mut ops: Vec<P2pOp<'_>> = self
            .ops
            .iter()
            .map(|(send, peer, tag, mem)| {
                let (p, len) = (mem.ptr(), mem.len());
                if *send {
                    P2pOp::Send {
                        peer: peer.unwrap_or(usize::MAX),
                        tag: *tag,
                        dtype: mem.dtype,
                        buf: if len == 0 {
                            &[]
                        } else {
                            // SAFETY: the view keeps `len` bytes at `p` exported while `self`
                            // lives, which outlasts the group.
                            unsafe { std::slice::from_raw_parts(p, len) }
                        },
                    }
                } else {
                    P2pOp::Recv {
                        peer: *peer,
                        tag: *tag,
                        dtype: mem.dtype,
                        buf: if len == 0 {
                            &mut []
                        } else {
                            // SAFETY: as above, and the view is writable (`Mem::take`) and
                            // overlaps no other operation of the group (`p2p_spec`).
                            unsafe { std::slice::from_raw_parts_mut(p, len) }
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

/// A buffer in shared memory (`Communicator::alloc_shared`), exported through the buffer
/// protocol as writable bytes: `Comm.empty` views it with `numpy.frombuffer`, and the array
/// keeps this object (and the memory) alive.
#[pyclass(frozen, module = "oxccl._oxccl", name = "SharedMemory")]
struct SharedMemory {
    buf: SharedBuffer,
}

#[pymethods]
impl SharedMemory {
    /// Size in bytes.
    fn __len__(&self) -> usize {
        self.buf.len()
    }

    /// The buffer protocol: the bytes, writable, one dimension.
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut pyo3::ffi::Py_buffer,
        flags: std::os::raw::c_int,
    ) -> PyResult<()> {
        let (ptr, len) = {
            let buf = &slf.get().buf;
            (
                buf.as_ptr().cast_mut().cast::<std::ffi::c_void>(),
                buf.len(),
            )
        };
        let len = pyo3::ffi::Py_ssize_t::try_from(len)
            .map_err(|_| pyo3::exceptions::PyBufferError::new_err("buffer too large"))?;
        // SAFETY: CPython passes a `view` to fill; PyBuffer_FillInfo fills it and takes a
        // reference to `slf`, which keeps the mapping (unmapped only when `slf` is dropped)
        // valid for as long as the view exists. The memory is a shared mapping that this
        // module reaches only through raw pointers, so writes through the view alias no Rust
        // reference.
        if unsafe { pyo3::ffi::PyBuffer_FillInfo(view, slf.as_ptr(), ptr, len, 0, flags) } == -1 {
            return Err(PyErr::fetch(slf.py()));
        }
        Ok(())
    }

    /// Nothing to release: the view's reference to this object is dropped by CPython.
    unsafe fn __releasebuffer__(&self, _view: *mut pyo3::ffi::Py_buffer) {}
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

    /// A blocking call, GIL released, on `recv` in place (`send` None) or from `send` into
    /// `recv` (the same memory: in place). Both are objects with a buffer (numpy arrays);
    /// `dtype` is given only where their format cannot say it (bfloat16 seen as 16-bit
    /// integers).
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (kind, op, root, peer, send, recv, dtype=None))]
    fn call(
        &self,
        py: Python<'_>,
        kind: &str,
        op: &str,
        root: usize,
        peer: usize,
        send: Option<Bound<'_, PyAny>>,
        recv: Option<Bound<'_, PyAny>>,
        dtype: Option<&str>,
    ) -> PyResult<()> {
        let rank = self.inner.rank();
        let s = spec(
            py,
            rank,
            kind,
            dtype,
            op,
            root,
            peer,
            send.as_ref(),
            recv.as_ref(),
        )?;
        let comm = &self.inner;
        let (r, s) = py.detach(move || (s.run(comm), s));
        drop(s); // the views, released with the GIL held
        r.map_err(|e| err(py, &e))
    }

    /// Queues a call (arguments as `call`); the buffers stay exported until it has finished;
    /// `callback(None | exception)` then runs on oxccl's stream thread, with the GIL.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (kind, op, root, peer, send, recv, dtype=None, callback=None))]
    fn call_async(
        &self,
        py: Python<'_>,
        kind: &str,
        op: &str,
        root: usize,
        peer: usize,
        send: Option<Bound<'_, PyAny>>,
        recv: Option<Bound<'_, PyAny>>,
        dtype: Option<&str>,
        callback: Option<Py<PyAny>>,
    ) -> PyResult<Handle> {
        let rank = self.inner.rank();
        let s = spec(
            py,
            rank,
            kind,
            dtype,
            op,
            root,
            peer,
            send.as_ref(),
            recv.as_ref(),
        )?;
        Ok(self.queue(s, callback, |s, comm| s.run(comm)))
    }

    /// A point-to-point group (`Communicator::group_p2p`), blocking, GIL released: `ops` are
    /// `("send" | "recv", peer (None: a recv from any rank), tag, array, dtype or None)`;
    /// returns each operation's source rank (None for sends). `call`: None for user messages,
    /// or the collective the group is (`"gather"`, `"scatter"`, `"all_to_allv"`:
    /// `Communicator::group_p2p_as`).
    #[pyo3(signature = (ops, call=None))]
    fn p2p(
        &self,
        py: Python<'_>,
        ops: Vec<P2pTuple<'_>>,
        call: Option<String>,
    ) -> PyResult<Vec<Option<usize>>> {
        let s = p2p_spec(py, ops, call.as_deref())?;
        let comm = &self.inner;
        let r = py.detach(|| s.run(comm));
        drop(s); // the views, released with the GIL held
        r.map_err(|e| err(py, &e))
    }

    /// Queues a point-to-point group (as `p2p`, `call` too) on oxccl's stream; the buffers
    /// stay exported until it has finished, then `callback(None | exception)` runs. Returns
    /// the handle and the object that gives the receives' sources once it has finished.
    #[pyo3(signature = (ops, callback=None, call=None))]
    fn p2p_async(
        &self,
        py: Python<'_>,
        ops: Vec<P2pTuple<'_>>,
        callback: Option<Py<PyAny>>,
        call: Option<String>,
    ) -> PyResult<(Handle, P2pSources)> {
        let s = p2p_spec(py, ops, call.as_deref())?;
        let sources = Arc::new(Mutex::new(None));
        let out = P2pSources {
            sources: Arc::clone(&sources),
        };
        let handle = self.queue(s, callback, move |s, comm| {
            s.run(comm)
                .map(|v| *sources.lock().unwrap_or_else(|e| e.into_inner()) = Some(v))
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
    /// Queues `run(spec)` on oxccl's stream; `spec` (holding the buffer views) is dropped,
    /// under the GIL, after it, and `callback(None | exception)` runs then.
    fn queue<S: Send + 'static>(
        &self,
        spec: S,
        callback: Option<Py<PyAny>>,
        run: impl FnOnce(&S, &Communicator) -> oxccl::Result<()> + Send + 'static,
    ) -> Handle {
        let inflight = Inflight::new();
        let work = self.inner.submit(move |comm| {
            // Counted until the end of this closure, after the callback released the GIL.
            let _inflight = inflight;
            let res = run(&spec, comm);
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
                drop(spec);
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
/// from the environment, except the timeout when `timeout_s` is given (OXCCL_TIMEOUT's bounds:
/// at least a millisecond; longer than its maximum is its maximum). With `watch` (a
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
        // The bounds OXCCL_TIMEOUT is held to; a longer one (torch users pass a year for
        // "none") is the longest.
        let (min, max) = (oxccl::params::MIN_SECS, oxccl::params::MAX_SECS);
        if t.is_nan() || t < min {
            return Err(bad_arg(
                py,
                format!("timeout {t} s is not a number of seconds of at least {min}"),
            ));
        }
        cfg.timeout = std::time::Duration::from_secs_f64(t.min(max));
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
