//! The C ABI called from Rust, two ranks on two threads of one process: every reduction op
//! against a plain reference, in-place forms, a wait that times out and then succeeds, a
//! failed queued call reported to the waiter and the callback with its text, bad arguments.

use std::ffi::{c_void, CStr};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::mpsc;
use std::time::Duration;

use oxccl_capi::comm::*;
use oxccl_capi::group::*;
use oxccl_capi::p2p::*;
use oxccl_capi::result::*;
use oxccl_capi::work::*;
use oxccl_capi::{oxcclComm, oxcclResult_t::*, oxcclWork};

const INT32: i32 = 2;
const FLOAT32: i32 = 7;

fn last_error() -> String {
    // SAFETY: oxcclGetLastError returns a NUL-terminated string valid until the next call.
    unsafe { CStr::from_ptr(oxcclGetLastError()) }
        .to_string_lossy()
        .into_owned()
}

fn ok(r: oxccl_capi::oxcclResult_t) {
    assert_eq!(r, oxcclSuccess, "{}", last_error());
}

/// Runs `f(rank, comm)` on two ranks (threads) of one communicator.
fn two_ranks(f: impl Fn(usize, *mut oxcclComm) + Send + Sync + Copy + 'static) {
    std::env::set_var("OXCCL_TIMEOUT", "20");
    let mut id = oxcclUniqueId {
        internal: [0; UNIQUE_ID_BYTES],
    };
    ok(oxcclGetUniqueId(&mut id));
    let (tx, rx) = mpsc::channel::<[std::ffi::c_char; UNIQUE_ID_BYTES]>();
    tx.send(id.internal).unwrap();
    let peer = std::thread::spawn(move || {
        let id = oxcclUniqueId {
            internal: rx.recv().unwrap(),
        };
        let mut comm = std::ptr::null_mut();
        ok(oxcclCommInitRank(&mut comm, 2, &id, 1));
        f(1, comm);
        ok(oxcclCommDestroy(comm));
    });
    let mut comm = std::ptr::null_mut();
    ok(oxcclCommInitRank(&mut comm, 2, &id, 0));
    f(0, comm);
    ok(oxcclCommDestroy(comm));
    peer.join().unwrap();
}

#[test]
fn every_op_and_in_place_forms_match_a_reference() {
    two_ranks(|rank, comm| {
        let inputs =
            |r: usize| -> Vec<i32> { (0..7).map(|i| (i * 3 + r as i32 * 5) % 11 + 1).collect() };
        let (a, b) = (inputs(0), inputs(1));
        let refs: [fn(i32, i32) -> i32; 8] = [
            |x, y| x + y,
            |x, y| x * y,
            |x, y| x.max(y),
            |x, y| x.min(y),
            |x, y| (x + y) / 2,
            |x, y| x & y,
            |x, y| x | y,
            |x, y| x ^ y,
        ];
        for (op, f) in refs.iter().enumerate() {
            let send = inputs(rank);
            let mut out = vec![0i32; 7];
            ok(oxcclAllReduce(
                send.as_ptr().cast(),
                out.as_mut_ptr().cast(),
                7,
                INT32,
                op as i32,
                comm,
            ));
            let want: Vec<i32> = a.iter().zip(&b).map(|(&x, &y)| f(x, y)).collect();
            assert_eq!(out, want, "op {op}");
        }
        // all_gather in place: this rank's block already sits in the output
        let mut all = vec![0.0f32; 6];
        all[rank * 3..rank * 3 + 3].copy_from_slice(&[rank as f32 + 1.0; 3]);
        let mine = all[rank * 3..].as_ptr();
        ok(oxcclAllGather(
            mine.cast(),
            all.as_mut_ptr().cast(),
            3,
            FLOAT32,
            comm,
        ));
        assert_eq!(all, [1.0, 1.0, 1.0, 2.0, 2.0, 2.0]);
        // reduce_scatter in place: the result lands in this rank's block
        let mut buf: Vec<f32> = (0..4).map(|i| i as f32).collect();
        let recv = buf[rank * 2..].as_mut_ptr();
        ok(oxcclReduceScatter(
            buf.as_ptr().cast(),
            recv.cast(),
            2,
            FLOAT32,
            0,
            comm,
        ));
        assert_eq!(
            &buf[rank * 2..rank * 2 + 2],
            &[2.0 * (rank * 2) as f32, 2.0 * (rank * 2 + 1) as f32]
        );
        // bad arguments: an error code and a text, nothing sent
        assert_eq!(
            oxcclAllReduce(buf.as_ptr().cast(), recv.cast(), 1, FLOAT32, 8, comm),
            oxcclInvalidArgument
        );
        assert!(
            last_error().contains("unknown reduction op 8"),
            "{}",
            last_error()
        );
        assert_eq!(
            oxcclAllReduce(buf.as_ptr().cast(), recv.cast(), 1, 42, 0, comm),
            oxcclInvalidArgument
        );
        assert_eq!(oxcclBarrier(std::ptr::null()), oxcclInvalidArgument);
        assert!(last_error().contains("NULL"), "{}", last_error());
        ok(oxcclBarrier(comm));
    });
}

#[test]
fn null_buffers_with_a_count_and_impossible_lengths_are_refused() {
    const UINT8: i32 = 1;
    two_ranks(|rank, comm| {
        let null = std::ptr::null_mut::<c_void>();
        let mut x = [rank as f32 + 1.0; 7];
        // in place on NULL with 1000 elements: was read as an empty buffer, a success
        assert_eq!(
            oxcclAllReduce(null.cast(), null.cast(), 1000, FLOAT32, 0, comm),
            oxcclInvalidArgument
        );
        assert!(last_error().contains("NULL"), "{}", last_error());
        assert_eq!(
            oxcclAllReduce(x.as_ptr().cast(), null.cast(), 7, FLOAT32, 0, comm),
            oxcclInvalidArgument
        );
        assert_eq!(
            oxcclAllGather(null.cast(), null.cast(), 3, FLOAT32, comm),
            oxcclInvalidArgument
        );
        assert_eq!(
            oxcclAllToAll(null.cast(), null.cast(), 2, INT32, comm),
            oxcclInvalidArgument
        );
        // lengths no buffer can have (no overflow in the element size: bytes)
        let p = x.as_mut_ptr().cast::<u8>();
        assert_eq!(
            oxcclAllReduce(p, p, usize::MAX, UINT8, 0, comm),
            oxcclInvalidArgument
        );
        assert!(last_error().contains("larger"), "{}", last_error());
        assert_eq!(
            oxcclAllToAll(p, p, usize::MAX / 2 + 1, UINT8, comm),
            oxcclInvalidArgument
        );
        assert_eq!(
            oxcclAllReduce(p, p, usize::MAX / 2, FLOAT32, 0, comm),
            oxcclInvalidArgument
        );
        // NCCL's NULLs that are fine: a broadcast's send and a reduce's receive buffer off
        // the root
        let send = if rank == 0 { x.as_ptr() } else { null.cast() };
        let mut y = [0.0f32; 7];
        ok(oxcclBroadcast(
            send.cast(),
            y.as_mut_ptr().cast(),
            7,
            FLOAT32,
            0,
            comm,
        ));
        assert_eq!(y, [1.0; 7]);
        let recv = if rank == 1 {
            y.as_mut_ptr()
        } else {
            null.cast()
        };
        ok(oxcclReduce(
            x.as_ptr().cast(),
            recv.cast(),
            7,
            FLOAT32,
            0,
            1,
            comm,
        ));
        if rank == 1 {
            assert_eq!(y, [3.0; 7]);
        }
        // the communicator still works
        ok(oxcclAllReduce(p, p, 7, FLOAT32, 0, comm));
        assert_eq!(x, [3.0; 7]);
    });
}

/// An in-place float sum of `x`, queued as a one-call group.
fn queue_sum(x: &mut [f32], comm: *mut oxcclComm) -> *mut oxcclWork {
    let mut w = std::ptr::null_mut();
    ok(oxcclGroupStart());
    ok(oxcclAllReduce(
        x.as_ptr().cast(),
        x.as_mut_ptr().cast(),
        x.len(),
        FLOAT32,
        0,
        comm,
    ));
    ok(oxcclGroupEnd(&mut w));
    w
}

static CALLBACK: AtomicI32 = AtomicI32::new(-1);
static CALLBACK_TEXT_OK: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_done(_arg: *mut c_void, r: oxccl_capi::oxcclResult_t) {
    if last_error().contains("all_reduce") {
        CALLBACK_TEXT_OK.store(1, Ordering::SeqCst);
    }
    CALLBACK.store(r as i32, Ordering::SeqCst);
}

#[test]
fn queued_work_times_out_then_completes_and_reports_failures() {
    two_ranks(|rank, comm| {
        // rank 1 joins late: rank 0's short wait times out, a second wait succeeds
        if rank == 1 {
            std::thread::sleep(Duration::from_millis(300));
        }
        let mut x = vec![1.0f32; 8];
        let mut w = queue_sum(&mut x[..8], comm);
        if rank == 0 {
            assert_eq!(oxcclWorkWait(w, 0.05), oxcclTimeout);
            assert!(
                last_error().contains("did not complete within"),
                "{}",
                last_error()
            );
            let mut done = 7;
            ok(oxcclWorkTest(w, &mut done));
            assert_eq!(done, 0);
        }
        ok(oxcclWorkWait(w, -1.0));
        ok(oxcclWorkFree(w));
        assert_eq!(x, [2.0; 8]);
        // lengths that differ between ranks: the queued call fails on both, the waiter and
        // the callback get the code, the callback also the text
        let n = 4 + rank;
        w = queue_sum(&mut x[..n], comm);
        if rank == 0 {
            ok(oxcclWorkOnComplete(w, Some(on_done), std::ptr::null_mut()));
        }
        let r = oxcclWorkWait(w, -1.0);
        assert_ne!(r, oxcclSuccess);
        assert!(last_error().contains("all_reduce"), "{}", last_error());
        ok(oxcclWorkFree(w));
        if rank == 0 {
            while CALLBACK.load(Ordering::SeqCst) < 0 {
                std::thread::sleep(Duration::from_millis(1));
            }
            assert_eq!(CALLBACK.load(Ordering::SeqCst), r as i32);
            assert_eq!(CALLBACK_TEXT_OK.load(Ordering::SeqCst), 1);
        }
    });
}

#[test]
fn group_misuse_is_an_error() {
    assert_eq!(oxcclGroupEnd(std::ptr::null_mut()), oxcclInvalidArgument);
    assert!(
        last_error().contains("without oxcclGroupStart"),
        "{}",
        last_error()
    );
    // an empty group hands back no work
    let mut w: *mut oxcclWork = std::ptr::dangling_mut();
    ok(oxcclGroupStart());
    ok(oxcclGroupEnd(&mut w));
    assert!(w.is_null());
}

#[test]
fn all_reduce_on_mem_alloc_buffers_matches_a_reference() {
    use oxccl_capi::mem::*;
    two_ranks(|rank, comm| {
        let n = 100_000usize; // 400 KB: the single-copy path, peers map the block
                              // Both ranks share this process's pool: a block one frees may go to the other (the
                              // C example, one process per rank, checks that a freed block comes back).
        for round in 0..3 {
            let mut p: *mut c_void = std::ptr::null_mut();
            ok(oxcclMemAlloc(&mut p, n * 4));
            assert!(!p.is_null() && (p as usize).is_multiple_of(4096));
            // SAFETY: a fresh block of n f32s, this thread's alone until freed.
            let x = unsafe { std::slice::from_raw_parts_mut(p.cast::<f32>(), n) };
            let val = |r: usize, i: usize| (i % 97 + r * 1000 + round) as f32;
            for (i, v) in x.iter_mut().enumerate() {
                *v = val(rank, i);
            }
            ok(oxcclAllReduce(p.cast(), p.cast(), n, FLOAT32, 0, comm));
            for (i, v) in x.iter().enumerate() {
                assert_eq!(*v, val(0, i) + val(1, i), "element {i}, round {round}");
            }
            ok(oxcclBarrier(comm)); // the peer has read this rank's block before it is freed
            ok(oxcclMemFree(p));
        }
        if rank == 0 {
            // A pointer not from oxcclMemAlloc (or freed twice, if the peer's is cached).
            let v = [0u8; 8];
            assert_eq!(
                oxcclMemFree(v.as_ptr() as *mut c_void),
                oxcclInvalidArgument
            );
            assert!(
                last_error().contains("not a live block"),
                "{}",
                last_error()
            );
            assert_eq!(oxcclMemAlloc(std::ptr::null_mut(), 8), oxcclInvalidArgument);
            ok(oxcclMemFree(std::ptr::null_mut()));
        }
    });
}

#[test]
fn set_timeout_changes_what_the_communicator_reports_and_refuses_nonsense() {
    two_ranks(|_, comm| {
        let mut s = 0.0;
        ok(oxcclCommTimeout(comm, &mut s));
        assert_eq!(s, 20.0); // OXCCL_TIMEOUT, set by two_ranks
        ok(oxcclCommSetTimeout(comm, 2.5));
        ok(oxcclCommTimeout(comm, &mut s));
        assert_eq!(s, 2.5);
        for bad in [0.0, -1.0, 1e-4, 2e7, f64::NAN, f64::INFINITY] {
            assert_eq!(
                oxcclCommSetTimeout(comm, bad),
                oxcclInvalidArgument,
                "{bad}"
            );
            assert!(
                last_error().contains("oxcclCommSetTimeout"),
                "{}",
                last_error()
            );
        }
        ok(oxcclCommTimeout(comm, &mut s));
        assert_eq!(s, 2.5);
        assert_eq!(
            oxcclCommSetTimeout(std::ptr::null(), 1.0),
            oxcclInvalidArgument
        );
        // the calls go on, under the new bound
        let x = [1.0f32; 4];
        let mut out = [0.0f32; 4];
        ok(oxcclAllReduce(
            x.as_ptr().cast(),
            out.as_mut_ptr().cast(),
            4,
            FLOAT32,
            0,
            comm,
        ));
        assert_eq!(out, [2.0; 4]);
    });
}

fn op(send: bool, peer: i32, tag: u32, buf: &mut [i32]) -> oxcclP2pOp {
    oxcclP2pOp {
        send: i32::from(send),
        peer,
        tag,
        datatype: INT32,
        buff: buf.as_mut_ptr().cast(),
        count: buf.len(),
        source: 7,
    }
}

#[test]
fn p2p_groups_match_by_tag_report_the_source_and_queue_in_groups() {
    two_ranks(|rank, comm| {
        let other = 1 - rank as i32;
        // Both ranks send first, with two tags, in one blocking group; the receives name the
        // tags in the other order, one from any rank.
        let mut a: Vec<i32> = (0..5000).map(|i| i + 100 * rank as i32).collect();
        let mut b: Vec<i32> = vec![-(rank as i32); 3];
        let (mut ra, mut rb) = (vec![0i32; 5000], vec![0i32; 3]);
        let mut ops = [
            op(true, other, 1, &mut a),
            op(true, other, 2, &mut b),
            op(false, -1, 2, &mut rb),
            op(false, other, 1, &mut ra),
        ];
        ok(oxcclP2p(ops.as_mut_ptr(), ops.len(), 0, comm));
        assert_eq!(ra, (0..5000).map(|i| i + 100 * other).collect::<Vec<_>>());
        assert_eq!(rb, vec![-other; 3]);
        let sources: Vec<i32> = ops.iter().map(|o| o.source).collect();
        assert_eq!(sources, vec![-1, -1, other, other]);

        // A gather to rank 0 (oxcclP2pGather), queued in a group: the sources come with the
        // work.
        let mut mine = vec![rank as i32 + 40; 2];
        let mut got = vec![0i32; 2];
        let mut ops = if rank == 0 {
            vec![op(false, 1, 0, &mut got)]
        } else {
            vec![op(true, 0, 0, &mut mine)]
        };
        let mut w = std::ptr::null_mut();
        ok(oxcclGroupStart());
        ok(oxcclP2p(ops.as_mut_ptr(), ops.len(), 1, comm));
        ok(oxcclGroupEnd(&mut w));
        ok(oxcclWorkWait(w, -1.0));
        ok(oxcclWorkFree(w));
        if rank == 0 {
            assert_eq!(got, vec![41; 2]);
            assert_eq!(ops[0].source, 1);
        } else {
            assert_eq!(ops[0].source, -1);
        }
        // the communicator goes on
        let x = [1.0f32; 2];
        let mut out = [0.0f32; 2];
        ok(oxcclAllReduce(
            x.as_ptr().cast(),
            out.as_mut_ptr().cast(),
            2,
            FLOAT32,
            0,
            comm,
        ));
        assert_eq!(out, [2.0; 2]);
    });
}

#[test]
fn p2p_refuses_bad_operations_before_any_data_moves() {
    two_ranks(|rank, comm| {
        let mut x = vec![rank as i32; 4];
        let refused = |ops: &mut [oxcclP2pOp], call: i32, want: &str| {
            assert_eq!(
                oxcclP2p(ops.as_mut_ptr(), ops.len(), call, comm),
                oxcclInvalidArgument,
                "{want}"
            );
            let e = last_error();
            assert!(
                e.contains(want) && e.contains(&format!("rank {rank}")),
                "{want}: {e}"
            );
        };
        refused(&mut [op(true, 2, 0, &mut x)], 0, "peer 2 is not a rank");
        refused(&mut [op(true, -1, 0, &mut x)], 0, "peer -1 is not a rank");
        refused(&mut [op(false, -1, 0, &mut x)], 1, "peer -1 is not a rank");
        refused(
            &mut [op(false, 1 - rank as i32, 3, &mut x)],
            2,
            "tag 3 in a collective",
        );
        let mut bad = op(true, 0, 0, &mut x);
        bad.send = 2;
        refused(&mut [bad], 0, "send is 2");
        let mut null = op(true, 0, 0, &mut x);
        null.buff = std::ptr::null_mut();
        refused(&mut [null], 0, "the buffer is NULL");
        let mut dt = op(true, 0, 0, &mut x);
        dt.datatype = 99;
        assert_eq!(oxcclP2p(&mut dt, 1, 0, comm), oxcclInvalidArgument);
        assert_eq!(
            oxcclP2p(&mut op(true, 0, 0, &mut x), 1, 9, comm),
            oxcclInvalidArgument
        );
        assert!(
            last_error().contains("unknown point-to-point call 9"),
            "{}",
            last_error()
        );
        assert_eq!(
            oxcclP2p(std::ptr::null_mut(), 1, 0, comm),
            oxcclInvalidArgument
        );
        assert_eq!(
            oxcclP2p(&mut op(true, 0, 0, &mut x), 1, 0, std::ptr::null()),
            oxcclInvalidArgument
        );
        // nothing moved: the ranks are still in step
        let y = [1.0f32; 2];
        let mut out = [0.0f32; 2];
        ok(oxcclAllReduce(
            y.as_ptr().cast(),
            out.as_mut_ptr().cast(),
            2,
            FLOAT32,
            0,
            comm,
        ));
        assert_eq!(out, [2.0; 2]);
    });
}

#[test]
fn the_table_is_version_4_and_ends_with_p2p() {
    let api = &oxccl_capi::table::API;
    assert_eq!(api.version, 4);
    assert_eq!(
        api.size as usize,
        std::mem::size_of::<oxccl_capi::oxcclApi>()
    );
    // Entries are only appended: a version-3 caller's table ends where comm_set_timeout ends.
    let base = api as *const _ as usize;
    let v3_end = &api.comm_set_timeout as *const _ as usize + std::mem::size_of::<usize>();
    assert_eq!(&api.p2p as *const _ as usize, v3_end);
    assert_eq!(
        api.size as usize,
        v3_end - base + std::mem::size_of::<usize>()
    );
}
