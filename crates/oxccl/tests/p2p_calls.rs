//! Point-to-point messages belong to one call: a collective made of messages
//! ([`Communicator::group_p2p_as`]: gather, scatter, uneven all_to_all) never hands its
//! messages to another call's receive, nor takes another call's, whatever the order they
//! arrive in and whatever a rank refused before (ranks as threads over the in-memory
//! transport).

use std::time::Duration;

use oxccl::testing::transport::mem;
use oxccl::{Communicator, Config, DataType, Error, P2pCall, P2pOp};

/// Runs `body(rank, comm)` on `n` threads, each with its own communicator (`timeout`).
fn ranks(n: usize, timeout: Duration, body: impl Fn(usize, &Communicator) + Sync) {
    let groups = mem::group(n, 1024);
    std::thread::scope(|s| {
        let handles: Vec<_> = groups
            .into_iter()
            .enumerate()
            .map(|(rank, links)| {
                let body = &body;
                s.spawn(move || {
                    let cfg = Config {
                        timeout,
                        ..Config::default()
                    };
                    let comm = Communicator::from_links(rank, n, links, cfg).unwrap();
                    body(rank, &comm);
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

/// A block that says who sent it for which call.
fn block(rank: usize, what: u32) -> Vec<u32> {
    vec![what * 100 + rank as u32; 4]
}

const USER: u32 = 1;
const GATHER: u32 = 2;
const SCATTER: u32 = 3;
const A2A: u32 = 4;

/// A user message sent before a gather (scatter, uneven all_to_all) with the same tag, size
/// and type, received after it: each receive gets its own call's message, where a receive
/// that took the first message of its source and tag would swap them.
#[test]
fn each_receive_gets_its_own_calls_message() {
    ranks(3, Duration::from_secs(60), |rank, comm| {
        let n = 3;
        // gather to 0: ranks 1 and 2 send a user message first
        if rank == 0 {
            let (mut g1, mut g2) = (vec![0u32; 4], vec![0u32; 4]);
            comm.group_p2p_as(P2pCall::Gather, &mut [recv(1, &mut g1), recv(2, &mut g2)])
                .unwrap();
            assert_eq!(g1, block(1, GATHER));
            assert_eq!(g2, block(2, GATHER));
            for p in [1, 2] {
                let mut u = vec![0u32; 4];
                comm.recv(&mut u, p).unwrap();
                assert_eq!(u, block(p, USER), "user message from {p}");
            }
        } else {
            comm.group_p2p(&mut [send(0, &block(rank, USER))]).unwrap();
            comm.group_p2p_as(P2pCall::Gather, &mut [send(0, &block(rank, GATHER))])
                .unwrap();
        }
        // scatter from 0: rank 0 sends user messages first
        if rank == 0 {
            for p in [1, 2] {
                comm.group_p2p(&mut [send(p, &block(p, USER))]).unwrap();
            }
            let (b1, b2) = (block(1, SCATTER), block(2, SCATTER));
            comm.group_p2p_as(P2pCall::Scatter, &mut [send(1, &b1), send(2, &b2)])
                .unwrap();
        } else {
            let mut s = vec![0u32; 4];
            comm.group_p2p_as(P2pCall::Scatter, &mut [recv(0, &mut s)])
                .unwrap();
            assert_eq!(s, block(rank, SCATTER));
            let mut u = vec![0u32; 4];
            comm.recv(&mut u, 0).unwrap();
            assert_eq!(u, block(rank, USER));
        }
        // uneven all_to_all: everyone sends a user message to everyone first
        let mine: Vec<Vec<u32>> = (0..n).map(|_| block(rank, USER)).collect();
        for p in (0..n).filter(|&p| p != rank) {
            comm.group_p2p(&mut [send(p, &mine[p])]).unwrap();
        }
        let outs: Vec<Vec<u32>> = (0..n).map(|_| block(rank, A2A)).collect();
        let mut ins = vec![vec![0u32; 4]; n];
        let mut ops = Vec::new();
        for (p, (o, i)) in outs.iter().zip(ins.iter_mut()).enumerate() {
            if p != rank {
                ops.push(send(p, o));
                ops.push(recv(p, i));
            }
        }
        comm.group_p2p_as(P2pCall::AllToAllV, &mut ops).unwrap();
        for p in (0..n).filter(|&p| p != rank) {
            assert_eq!(ins[p], block(p, A2A), "all_to_allv block from {p}");
            let mut u = vec![0u32; 4];
            comm.recv(&mut u, p).unwrap();
            assert_eq!(u, block(p, USER), "user message from {p}");
        }
        comm.barrier().unwrap(); // every rank counted the same collectives
    });
}

/// A gather refused on its root (a bad argument there only) takes no number: the root's
/// retry is the same gather, and the peer waits in it (its sends cannot run ahead into
/// later calls) until the root has begun it.
#[test]
fn a_gather_refused_on_its_root_is_retried() {
    let both = std::sync::Barrier::new(2);
    ranks(2, Duration::from_secs(60), |rank, comm| {
        if rank == 0 {
            let mut g = vec![0u32; 4];
            let e = comm
                .group_p2p_as(P2pCall::Gather, &mut [recv(7, &mut g)])
                .unwrap_err();
            assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
            both.wait(); // rank 1 is about to begin its gather
            std::thread::sleep(Duration::from_millis(200));
            comm.group_p2p_as(P2pCall::Gather, &mut [recv(1, &mut g)])
                .unwrap();
            assert_eq!(g, block(1, GATHER));
            let mut u = vec![0u32; 4];
            comm.recv(&mut u, 1).unwrap();
            assert_eq!(u, block(1, USER));
        } else {
            both.wait();
            let t = std::time::Instant::now();
            comm.group_p2p_as(P2pCall::Gather, &mut [send(0, &block(1, GATHER))])
                .unwrap();
            assert!(
                t.elapsed() >= Duration::from_millis(100),
                "the gather returned before its root had begun it ({:?})",
                t.elapsed()
            );
            comm.group_p2p(&mut [send(0, &block(1, USER))]).unwrap();
        }
        comm.barrier().unwrap();
    });
}

/// Two ranks in different collectives made of messages: both fail with a mismatch that
/// names both calls and both numbers, without taking the other's bytes.
#[test]
fn another_collectives_message_is_a_mismatch() {
    ranks(2, Duration::from_secs(20), |rank, comm| {
        let mut b = vec![0u32; 4];
        let e = if rank == 0 {
            comm.group_p2p_as(P2pCall::Gather, &mut [recv(1, &mut b)])
        } else {
            comm.group_p2p_as(P2pCall::Scatter, &mut [recv(0, &mut b)])
        }
        .unwrap_err();
        let msg = e.to_string();
        assert!(e.is_mismatch(), "{msg}");
        assert!(
            msg.contains("gather (its collective #1") || msg.contains("scatter (its collective #1"),
            "{msg}"
        );
        assert!(
            msg.contains("a message of gather(0 x uint8) as its collective #1")
                || msg.contains("a message of scatter(0 x uint8) as its collective #1"),
            "{msg}"
        );
        assert_eq!(b, vec![0; 4], "nothing received");
    });
}

/// A user receive that finds the message of a collective this rank is already past (its
/// own gather #1 did not receive from that peer) fails instead of returning its bytes.
#[test]
fn a_user_receive_fails_on_a_past_collectives_message() {
    ranks(2, Duration::from_secs(3), |rank, comm| {
        if rank == 0 {
            comm.group_p2p_as(P2pCall::Gather, &mut []).unwrap(); // gather #1, receives nothing
            let mut u = vec![0u32; 4];
            let e = comm.recv_tagged(&mut u, 1, 0).unwrap_err();
            let msg = e.to_string();
            assert!(e.is_mismatch(), "{msg}");
            assert!(
                msg.contains("rank 0: call #2 mismatch")
                    && msg.contains("a point-to-point receive, after beginning its collective #1")
                    && msg.contains(
                        "rank 1 called a message of gather(4 x uint32) as its collective #1"
                    ),
                "{msg}"
            );
            assert_eq!(u, vec![0; 4], "nothing received");
        } else {
            // waits for the root's word that it has begun the gather, which never comes
            // (until the root's communicator is dropped or the timeout)
            let e = comm
                .group_p2p_as(P2pCall::Gather, &mut [send(0, &block(1, GATHER))])
                .unwrap_err();
            assert!(
                matches!(e, Error::Timeout { .. } | Error::PeerLost { .. }),
                "{e}"
            );
        }
    });
}

/// A receive from any rank reads a collective's message that came early (the peer is
/// already in the next gather): it keeps it for that gather and takes the user message.
#[test]
fn an_early_collective_message_waits_for_its_call() {
    ranks(3, Duration::from_secs(60), |rank, comm| {
        match rank {
            0 => {
                std::thread::sleep(Duration::from_millis(100)); // rank 2's gather comes first
                let mut u = vec![0u32; 4];
                let from = comm.recv_any(&mut u, 0).unwrap();
                assert_eq!((from, u), (1, block(1, USER)));
                let (mut g1, mut g2) = (vec![0u32; 4], vec![0u32; 4]);
                comm.group_p2p_as(P2pCall::Gather, &mut [recv(1, &mut g1), recv(2, &mut g2)])
                    .unwrap();
                assert_eq!((g1, g2), (block(1, GATHER), block(2, GATHER)));
            }
            1 => {
                std::thread::sleep(Duration::from_millis(300));
                comm.group_p2p(&mut [send(0, &block(1, USER))]).unwrap();
                comm.group_p2p_as(P2pCall::Gather, &mut [send(0, &block(1, GATHER))])
                    .unwrap();
            }
            _ => comm
                .group_p2p_as(P2pCall::Gather, &mut [send(0, &block(2, GATHER))])
                .unwrap(),
        }
        comm.barrier().unwrap();
    });
}
