//! Gather, scatter and all_to_allv (`Communicator::group_p2p_as`: collectives whose blocks
//! may differ in size) with 1, 2, 3 and more ranks as threads over the in-memory transport,
//! checked against a plain reference: rank `r`'s block for rank `p` holds values that say
//! `r`, `p` and the element, and must arrive whole and in place. They run as the `flat`
//! schedule. Small link queues make every block wait on flow control; blocks of several
//! hundred kilobytes stream through them.

use std::time::Duration;

use oxccl::check::Case;
use oxccl::testing::transport::mem;
use oxccl::{CollKind, Communicator, Config, DataType, Error, P2pCall, P2pOp, ReduceOp};

/// Runs `body(rank, comm)` on `n` threads, each with its own communicator (links with queues
/// of `cap` bytes; a direct area too where `direct`).
fn ranks(n: usize, cap: usize, direct: bool, body: impl Fn(usize, &Communicator) + Sync) {
    let groups = mem::group(n, cap);
    let mut areas: Vec<Option<oxccl::testing::link::MemDirect>> = (0..n).map(|_| None).collect();
    if direct {
        areas = oxccl::testing::link::mem_group(n)
            .into_iter()
            .map(Some)
            .collect();
    }
    std::thread::scope(|s| {
        let handles: Vec<_> = groups
            .into_iter()
            .zip(areas)
            .enumerate()
            .map(|(rank, (links, area))| {
                let body = &body;
                s.spawn(move || {
                    let cfg = Config {
                        timeout: Duration::from_secs(60),
                        ..Config::default()
                    };
                    let mut comm = Communicator::from_links(rank, n, links, cfg).unwrap();
                    if let Some(a) = area {
                        comm = comm.with_direct(Box::new(a));
                    }
                    body(rank, &comm);
                    comm.barrier().unwrap(); // every rank counted the same collectives
                })
            })
            .collect();
        for h in handles {
            h.join().expect("rank thread panicked");
        }
    });
}

fn send(peer: usize, buf: &[u32]) -> P2pOp<'_> {
    P2pOp::Send {
        peer,
        tag: 0,
        dtype: DataType::U32,
        buf: bytemuck::cast_slice(buf),
    }
}

fn recv(peer: usize, buf: &mut [u32]) -> P2pOp<'_> {
    P2pOp::Recv {
        peer: Some(peer),
        tag: 0,
        dtype: DataType::U32,
        buf: bytemuck::cast_slice_mut(buf),
        from: None,
    }
}

/// The block rank `from` has for rank `to`: `len` values naming both and the element.
fn block(from: usize, to: usize, len: usize) -> Vec<u32> {
    (0..len)
        .map(|i| (from as u32) << 24 | (to as u32) << 16 | (i as u32 & 0xffff))
        .collect()
}

/// Elements rank `a` sends rank `b` in the uneven cases (zero for some pairs), scaled by
/// `big`.
fn uneven(a: usize, b: usize, big: usize) -> usize {
    ((a * 3 + b * 5) % 4) * big
}

const SIZES: [usize; 3] = [1, 37, 70_000];

/// Gather to every root in turn, blocks of one size and of sizes that differ by rank (some
/// empty); the root's own block comes through a send to itself.
fn gather(n: usize, direct: bool) {
    ranks(n, 4096, direct, |rank, comm| {
        for big in SIZES {
            for even in [true, false] {
                let len = |r: usize| if even { big } else { uneven(r, 0, big) };
                for root in 0..n {
                    let mine = block(rank, root, len(rank));
                    if rank == root {
                        let mut outs: Vec<Vec<u32>> = (0..n).map(|r| vec![0; len(r)]).collect();
                        let mut ops = vec![send(root, &mine)];
                        ops.extend(outs.iter_mut().enumerate().map(|(p, o)| recv(p, o)));
                        comm.group_p2p_as(P2pCall::Gather, &mut ops).unwrap();
                        for (p, o) in outs.iter().enumerate() {
                            assert_eq!(*o, block(p, root, len(p)), "n={n} root={root} from {p}");
                        }
                    } else {
                        comm.group_p2p_as(P2pCall::Gather, &mut [send(root, &mine)])
                            .unwrap();
                    }
                    assert_eq!(comm.last_algo(), "flat");
                }
            }
        }
    });
}

/// Scatter from every root in turn, as [`gather`].
fn scatter(n: usize, direct: bool) {
    ranks(n, 4096, direct, |rank, comm| {
        for big in SIZES {
            for even in [true, false] {
                let len = |r: usize| if even { big } else { uneven(0, r, big) };
                for root in 0..n {
                    let mut out = vec![0u32; len(rank)];
                    if rank == root {
                        let ins: Vec<Vec<u32>> = (0..n).map(|p| block(root, p, len(p))).collect();
                        let mut ops: Vec<P2pOp<'_>> =
                            ins.iter().enumerate().map(|(p, b)| send(p, b)).collect();
                        ops.push(recv(root, &mut out));
                        comm.group_p2p_as(P2pCall::Scatter, &mut ops).unwrap();
                    } else {
                        comm.group_p2p_as(P2pCall::Scatter, &mut [recv(root, &mut out)])
                            .unwrap();
                    }
                    assert_eq!(out, block(root, rank, len(rank)), "n={n} root={root}");
                    assert_eq!(comm.last_algo(), "flat");
                }
            }
        }
    });
}

/// all_to_allv with blocks of one size and of sizes that differ by pair (some empty), the
/// rank's own block through a send to itself.
fn all_to_allv(n: usize, direct: bool) {
    ranks(n, 4096, direct, |rank, comm| {
        for big in SIZES {
            for even in [true, false] {
                let len = |a: usize, b: usize| if even { big } else { uneven(a, b, big) };
                let outs: Vec<Vec<u32>> = (0..n).map(|p| block(rank, p, len(rank, p))).collect();
                let mut ins: Vec<Vec<u32>> = (0..n).map(|p| vec![0; len(p, rank)]).collect();
                let mut ops: Vec<P2pOp<'_>> =
                    outs.iter().enumerate().map(|(p, b)| send(p, b)).collect();
                ops.extend(ins.iter_mut().enumerate().map(|(p, b)| recv(p, b)));
                comm.group_p2p_as(P2pCall::AllToAllV, &mut ops).unwrap();
                for (p, b) in ins.iter().enumerate() {
                    assert_eq!(*b, block(p, rank, len(p, rank)), "n={n} from {p}");
                }
                assert_eq!(comm.last_algo(), "flat");
            }
        }
    });
}

#[test]
fn gather_matches_reference() {
    for n in [1, 2, 3, 5] {
        gather(n, false);
    }
    gather(3, true);
}

#[test]
fn scatter_matches_reference() {
    for n in [1, 2, 3, 5] {
        scatter(n, false);
    }
    scatter(3, true);
}

#[test]
fn all_to_allv_matches_reference() {
    for n in [1, 2, 3, 5] {
        all_to_allv(n, false);
    }
    all_to_allv(4, true);
}

/// Blocks of one size through `call_bytes` (what `oxccl perf gather` and friends run), in
/// and out of place, every root, element types of every size, checked against
/// `oxccl::check`'s reference.
#[test]
fn equal_blocks_through_call_bytes_match_reference() {
    for (n, direct) in [(1, false), (2, false), (3, false), (5, false), (3, true)] {
        ranks(n, 4096, direct, |rank, comm| {
            let mut kinds = vec![(CollKind::AllToAllV, 0)];
            for root in 0..n {
                kinds.push((CollKind::Gather, root));
                kinds.push((CollKind::Scatter, root));
            }
            for (kind, root) in kinds {
                for dtype in [DataType::U8, DataType::F16, DataType::F32, DataType::F64] {
                    for count in [0, 1, 13, 70_001] {
                        for in_place in [false, true] {
                            let case = Case {
                                kind,
                                dtype,
                                op: ReduceOp::Sum,
                                root,
                                count,
                                in_place,
                                rank,
                                nranks: n,
                            };
                            let mut bufs = case.buffers(None).unwrap();
                            let (send, recv) = bufs.get();
                            case.fill(send, recv);
                            case.call(comm, send, recv)
                                .unwrap_or_else(|e| panic!("{case:?}: {e}"));
                            assert_eq!(case.wrong(recv), 0, "rank {rank}: {case:?}");
                            assert_eq!(comm.last_algo(), "flat", "{case:?}");
                        }
                    }
                }
            }
        });
    }
}

/// Buffers that do not fit the root's blocks are refused before anything moves, naming the
/// lengths.
#[test]
fn unequal_buffers_through_call_bytes_are_refused() {
    ranks_failing(2, |rank, comm| {
        let send = vec![0u8; 8];
        let mut recv = vec![0u8; 12];
        let e = comm
            .call_bytes(
                CollKind::Gather,
                DataType::U8,
                ReduceOp::Sum,
                rank, // each rank its own root: refused on both before any message
                oxccl::ByteBufs::Separate {
                    send: &send,
                    recv: &mut recv,
                },
            )
            .unwrap_err();
        assert!(
            matches!(&e, Error::InvalidArgument { msg, .. } if msg.contains("the root's recv has 12 elements; expected world size 2 x send 8")),
            "{e}"
        );
    });
}

/// The flight recorder names each of these calls and the schedule that ran it.
#[test]
fn the_flight_recorder_names_the_flat_schedule() {
    ranks(2, 4096, false, |rank, comm| {
        let mine = block(rank, 0, 3);
        let mut outs = vec![vec![0u32; 3]; 2];
        if rank == 0 {
            let [o0, o1] = &mut outs[..] else {
                unreachable!()
            };
            comm.group_p2p_as(
                P2pCall::Gather,
                &mut [send(0, &mine), recv(0, o0), recv(1, o1)],
            )
            .unwrap();
        } else {
            comm.group_p2p_as(P2pCall::Gather, &mut [send(0, &mine)])
                .unwrap();
        }
        let mut out = vec![0u32; 3];
        let root_sends: Vec<Vec<u32>> = (0..2).map(|p| block(1, p, 3)).collect();
        if rank == 1 {
            comm.group_p2p_as(
                P2pCall::Scatter,
                &mut [
                    send(0, &root_sends[0]),
                    send(1, &root_sends[1]),
                    recv(1, &mut out),
                ],
            )
            .unwrap();
        } else {
            comm.group_p2p_as(P2pCall::Scatter, &mut [recv(1, &mut out)])
                .unwrap();
        }
        let json = comm.flight_record();
        for call in ["gather", "scatter"] {
            let entry = json
                .lines()
                .find(|l| l.contains(&format!("\"call\":\"{call}\"")))
                .unwrap_or_else(|| panic!("no {call} in {json}"));
            assert!(entry.contains("\"algo\":\"flat\""), "{entry}");
        }
    });
}

/// A block whose length differs between its sender and its receiver is a mismatch that the
/// receiver names before any of its bytes land; the call's number is taken, and the
/// communicator fails (as for any collective whose ranks disagree).
#[test]
fn a_block_of_another_length_is_a_mismatch_before_data_moves() {
    ranks_failing(2, |rank, comm| {
        if rank == 0 {
            let mut g = vec![7u32; 4];
            let e = comm
                .group_p2p_as(P2pCall::Gather, &mut [recv(1, &mut g)])
                .unwrap_err();
            let msg = e.to_string();
            assert!(e.is_mismatch(), "{msg}");
            assert!(
                msg.contains("gather, receiving 4 x uint32 from rank 1 (its collective #1")
                    && msg.contains("a message of gather(5 x uint32) as its collective #1"),
                "{msg}"
            );
            assert_eq!(g, vec![7; 4], "nothing received");
        } else {
            let _ = comm.group_p2p_as(P2pCall::Gather, &mut [send(0, &block(1, 0, 5))]);
        }
    });
}

/// Arguments a gather refuses on the rank that passes them, before anything moves and
/// without taking a number.
#[test]
fn bad_arguments_are_refused_where_they_are_passed() {
    ranks_failing(1, |_, comm| {
        let mut b = vec![0u32; 4];
        let mut tagged = [P2pOp::Recv {
            peer: Some(0),
            tag: 3,
            dtype: DataType::U32,
            buf: bytemuck::cast_slice_mut(&mut b),
            from: None,
        }];
        let e = comm.group_p2p_as(P2pCall::Gather, &mut tagged).unwrap_err();
        assert!(
            matches!(&e, Error::InvalidArgument { msg, .. } if msg.contains("no tags")),
            "{e}"
        );
        let mut any = [P2pOp::Recv {
            peer: None,
            tag: 0,
            dtype: DataType::U32,
            buf: bytemuck::cast_slice_mut(&mut b),
            from: None,
        }];
        let e = comm.group_p2p_as(P2pCall::Scatter, &mut any).unwrap_err();
        assert!(
            matches!(&e, Error::InvalidArgument { msg, .. } if msg.contains("named ranks only")),
            "{e}"
        );
        let src = [1u32; 3];
        let e = comm
            .group_p2p_as(P2pCall::AllToAllV, &mut [send(0, &src), recv(0, &mut b)])
            .unwrap_err();
        assert!(
            matches!(&e, Error::InvalidArgument { msg, .. } if msg.contains("send to itself of 3 x uint32 into a receive of 4 x uint32")),
            "{e}"
        );
        let e = comm
            .group_p2p_as(P2pCall::AllToAllV, &mut [send(1, &src)])
            .unwrap_err();
        assert!(
            matches!(&e, Error::InvalidArgument { msg, .. } if msg.contains("peer 1 is out of range")),
            "{e}"
        );
        // None of them took a number: this gather is collective #1 (its own block only).
        let mut out = vec![0u32; 3];
        comm.group_p2p_as(P2pCall::Gather, &mut [send(0, &src), recv(0, &mut out)])
            .unwrap();
        assert_eq!(out, src);
    });
}

/// As [`ranks`] without the closing barrier (the communicators may have failed).
fn ranks_failing(n: usize, body: impl Fn(usize, &Communicator) + Sync) {
    let groups = mem::group(n, 4096);
    std::thread::scope(|s| {
        for (rank, links) in groups.into_iter().enumerate() {
            let body = &body;
            s.spawn(move || {
                let cfg = Config {
                    timeout: Duration::from_secs(5),
                    ..Config::default()
                };
                let comm = Communicator::from_links(rank, n, links, cfg).unwrap();
                body(rank, &comm);
            });
        }
    });
}
