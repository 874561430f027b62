//! A deterministic, single-threaded simulator that runs every rank's schedule over in-memory
//! queues, whole messages at a time. It checks what each algorithm computes, with no
//! transport and no threads (the executor's streaming and flow control are tested with the
//! in-memory transport instead).
//!
//! A send completes only once the receiver has taken its message (a rendezvous, no
//! buffering): what the executor does for single-copy transfers, which lend the sender's
//! memory (`exec/single_copy.rs`), and the worst case of rings smaller than the messages. An
//! algorithm that relied on buffering would deadlock here.

mod hosts;

use std::collections::{HashMap, HashSet, VecDeque};

use crate::base::dtype::DataType;
use crate::base::op::ReduceOp;
use crate::base::reduce;
use crate::sched::{Algo, Buf, BufRange, Coll, CollKind, Combine, Local, Schedule, Xfer};

/// One rank's buffers.
#[derive(Clone, Debug, Default)]
pub(crate) struct Bufs {
    /// Input bytes.
    pub(crate) input: Vec<u8>,
    /// Output bytes.
    pub(crate) output: Vec<u8>,
    /// Scratch bytes.
    pub(crate) scratch: Vec<u8>,
}

impl Bufs {
    fn get(&self, r: BufRange) -> &[u8] {
        let b = match r.buf {
            Buf::Input => &self.input,
            Buf::Output => &self.output,
            Buf::Scratch => &self.scratch,
        };
        &b[r.off..r.off + r.len]
    }
    fn get_mut(&mut self, r: BufRange) -> &mut [u8] {
        let b = match r.buf {
            Buf::Input => &mut self.input,
            Buf::Output => &mut self.output,
            Buf::Scratch => &mut self.scratch,
        };
        &mut b[r.off..r.off + r.len]
    }
}

fn local(b: &mut Bufs, l: &Local, dtype: DataType, op: ReduceOp, n: usize) {
    match *l {
        Local::Copy { src, dst } => {
            let data = b.get(src).to_vec();
            b.get_mut(dst).copy_from_slice(&data);
        }
        Local::DivideByRanks(r) => reduce::divide_by(dtype, b.get_mut(r), n),
        Local::Reduce { dst, src } => {
            let data = b.get(src).to_vec();
            reduce::reduce_inplace(dtype, op, b.get_mut(dst), &data);
        }
    }
}

/// Runs the schedules of every rank (`colls[r]`, `bufs[r]`) to completion. Panics on deadlock.
pub(crate) fn run(algo: Algo, colls: &[Coll], bufs: &mut [Bufs]) {
    let scheds: Vec<Schedule> = colls.iter().map(|c| algo.schedule(c)).collect();
    run_schedules(&scheds, colls, bufs)
}

/// A message in flight: its number and bytes.
type Msg = (u64, Vec<u8>);

/// Runs `scheds[r]` for every rank `r` (calls `colls`, buffers `bufs`). Panics on deadlock.
fn run_schedules(scheds: &[Schedule], colls: &[Coll], bufs: &mut [Bufs]) {
    let n = colls.len();
    for (r, s) in scheds.iter().enumerate() {
        s.validate(r).unwrap();
        bufs[r].scratch = vec![0; s.scratch_bytes];
    }
    // Messages in flight, each with its number; the numbers of those taken.
    let mut queues: HashMap<(usize, usize), VecDeque<Msg>> = HashMap::new();
    let mut taken: HashSet<u64> = HashSet::new();
    let mut sent = 0u64;
    let mut pc = vec![0usize; n];
    let mut done: Vec<Vec<bool>> = vec![Vec::new(); n];
    // The number of each send's message once posted.
    let mut posted: Vec<Vec<Option<u64>>> = vec![Vec::new(); n];
    loop {
        let mut progress = false;
        for r in 0..n {
            let Some(step) = scheds[r].steps.get(pc[r]) else {
                continue;
            };
            let (dtype, op) = (colls[r].dtype, colls[r].op);
            if done[r].is_empty() {
                for l in &step.before {
                    local(&mut bufs[r], l, dtype, op, n);
                }
                done[r] = vec![false; step.xfers.len()];
                posted[r] = vec![None; step.xfers.len()];
                progress = true;
            }
            for (i, x) in step.xfers.iter().enumerate() {
                if done[r][i] {
                    continue;
                }
                match *x {
                    Xfer::Send { peer, src } => match posted[r][i] {
                        None => {
                            queues
                                .entry((r, peer))
                                .or_default()
                                .push_back((sent, bufs[r].get(src).to_vec()));
                            posted[r][i] = Some(sent);
                            sent += 1;
                            progress = true;
                        }
                        Some(id) if taken.contains(&id) => {
                            done[r][i] = true;
                            progress = true;
                        }
                        Some(_) => {}
                    },
                    Xfer::Recv { peer, dst, combine } => {
                        let Some((id, msg)) = queues.entry((peer, r)).or_default().pop_front()
                        else {
                            continue;
                        };
                        taken.insert(id);
                        assert_eq!(
                            msg.len(),
                            dst.len,
                            "rank {r} step {}: message from {peer} has wrong size",
                            pc[r]
                        );
                        match combine {
                            Combine::Store => bufs[r].get_mut(dst).copy_from_slice(&msg),
                            Combine::Reduce { with } => {
                                let a = bufs[r].get(with).to_vec();
                                reduce::reduce_into(dtype, op, bufs[r].get_mut(dst), &a, &msg);
                            }
                        }
                        done[r][i] = true;
                        progress = true;
                    }
                }
            }
            if done[r].iter().all(|d| *d) {
                for l in &step.after {
                    local(&mut bufs[r], l, dtype, op, n);
                }
                done[r].clear();
                pc[r] += 1;
                progress = true;
            }
        }
        if pc.iter().zip(scheds).all(|(p, s)| *p == s.steps.len()) {
            assert!(queues.values().all(|q| q.is_empty()), "messages left over");
            return;
        }
        assert!(progress, "deadlock: ranks stuck at steps {pc:?}");
    }
}

/// Buffers for `n` ranks: rank r's input and output bytes.
pub(crate) fn make_bufs(
    n: usize,
    input: impl Fn(usize) -> Vec<u8>,
    output: impl Fn(usize) -> Vec<u8>,
) -> Vec<Bufs> {
    (0..n)
        .map(|r| Bufs {
            input: input(r),
            output: output(r),
            ..Default::default()
        })
        .collect()
}

/// The reduction over `n` ranks of `val(rank, i)`, with the integer kernels' wrapping.
pub(crate) fn reduce_of(val: fn(usize, usize) -> i64, n: usize, i: usize, op: ReduceOp) -> i64 {
    let vals = (0..n).map(|r| val(r, i));
    match op {
        ReduceOp::Sum => vals.sum(),
        ReduceOp::Avg => vals.sum::<i64>() / n as i64,
        ReduceOp::Prod => vals.fold(1i64, |a, b| a.wrapping_mul(b)),
        ReduceOp::Min => vals.min().unwrap(),
        ReduceOp::Max => vals.max().unwrap(),
        ReduceOp::BAnd => vals.fold(-1, |a, b| a & b),
        ReduceOp::BOr => vals.fold(0, |a, b| a | b),
        ReduceOp::BXor => vals.fold(0, |a, b| a ^ b),
        ReduceOp::PreMulSum(_) => unreachable!("inputs are scaled before a schedule runs"),
    }
}

/// Runs `algo` on `colls` (one per rank, all the same call) over the inputs `val(rank, i)` and
/// checks every rank's output against the plain reference; `what` names the case in failures.
pub(crate) fn check(algo: Algo, colls: &[Coll], val: fn(usize, usize) -> i64, what: &str) {
    let n = colls.len();
    let Coll {
        kind,
        count,
        op,
        root,
        ..
    } = colls[0].clone();
    let c = count.max(1);
    let seq = |f: &dyn Fn(usize) -> i64, len: usize| bytes(&(0..len).map(f).collect::<Vec<_>>());
    let (in_len, out_len) = match kind {
        CollKind::ReduceScatter => (n * count, count),
        CollKind::AllGather => (count, n * count),
        CollKind::AllToAll => (n * count, n * count),
        _ => (count, count),
    };
    let mut bufs = make_bufs(
        n,
        |r| {
            if kind == CollKind::Broadcast && r != root {
                vec![]
            } else {
                seq(&|i| val(r, i), in_len)
            }
        },
        |r| {
            vec![
                0;
                if kind == CollKind::Reduce && r != root {
                    0
                } else {
                    out_len * 8
                }
            ]
        },
    );
    run(algo, colls, &mut bufs);
    for (r, b) in bufs.iter().enumerate() {
        let want = match kind {
            CollKind::AllReduce => seq(&|i| reduce_of(val, n, i, op), count),
            CollKind::ReduceScatter => seq(&|i| reduce_of(val, n, r * count + i, op), count),
            CollKind::Reduce if r == root => seq(&|i| reduce_of(val, n, i, op), count),
            CollKind::Broadcast => seq(&|i| val(root, i), count),
            CollKind::AllGather => seq(&|j| val(j / c, j % c), n * count),
            // Block p of rank r's output is block r of rank p's input.
            CollKind::AllToAll => seq(&|j| val(j / c, r * count + j % c), n * count),
            _ => continue,
        };
        assert_eq!(
            b.output,
            want,
            "{} {algo} {what} count={count} op={op} root={root} rank={r}",
            kind.name()
        );
    }
}

fn val(rank: usize, i: usize) -> i64 {
    ((rank * 7 + i * 3) % 11) as i64 - 5
}

pub(crate) fn bytes(v: &[i64]) -> Vec<u8> {
    bytemuck::cast_slice(v).to_vec()
}

fn coll(kind: CollKind, rank: usize, n: usize, count: usize, op: ReduceOp, root: usize) -> Coll {
    Coll {
        kind,
        rank,
        nranks: n,
        count,
        dtype: DataType::I64,
        op,
        root,
        chunk_bytes: 24,
        topo: None,
        blocks: None,
    }
}

/// Rank `rank`'s call of `kind` over `n` ranks with `blocks` (bytes of u8 elements).
pub(crate) fn coll_with_blocks(
    kind: CollKind,
    rank: usize,
    n: usize,
    blocks: crate::sched::Blocks,
) -> Coll {
    Coll {
        dtype: DataType::U8,
        blocks: Some(std::sync::Arc::new(blocks)),
        ..coll(kind, rank, n, 0, ReduceOp::Sum, 0)
    }
}

/// Runs the flat schedule of `kind` with each rank's blocks (`blocks_of(rank)`) over inputs
/// whose every byte says which rank and offset it is, and checks against the plain
/// reference: the k-th block rank `r` receives from rank `p` is the k-th block `p` sends `r`,
/// and output bytes no block covers stay as they were.
pub(crate) fn check_blocks(
    kind: CollKind,
    n: usize,
    blocks_of: impl Fn(usize) -> crate::sched::Blocks,
) {
    let all: Vec<crate::sched::Blocks> = (0..n).map(&blocks_of).collect();
    let colls: Vec<Coll> = (0..n)
        .map(|r| coll_with_blocks(kind, r, n, all[r].clone()))
        .collect();
    let byte = |r: usize, i: usize| (r * 31 + i * 7 + 1) as u8;
    let mut bufs = make_bufs(
        n,
        |r| (0..colls[r].input_bytes()).map(|i| byte(r, i)).collect(),
        |r| vec![0xee; colls[r].output_bytes()],
    );
    let inputs: Vec<Vec<u8>> = bufs.iter().map(|b| b.input.clone()).collect();
    run(Algo::Flat, &colls, &mut bufs);
    for r in 0..n {
        let mut want = vec![0xeeu8; colls[r].output_bytes()];
        for p in 0..n {
            for (&(so, sl), &(ro, rl)) in all[p].send[r].iter().zip(&all[r].recv[p]) {
                assert_eq!(
                    sl,
                    rl,
                    "{} n={n}: block {p} -> {r} differs in length",
                    kind.name()
                );
                want[ro..ro + rl].copy_from_slice(&inputs[p][so..so + sl]);
            }
        }
        assert_eq!(bufs[r].output, want, "{} n={n} rank={r}", kind.name());
    }
}

#[test]
fn every_algorithm_matches_reference() {
    for n in 1..=9usize {
        let what = format!("n={n}");
        let all = |kind, count, op, root| -> Vec<Coll> {
            (0..n).map(|r| coll(kind, r, n, count, op, root)).collect()
        };
        for count in [0usize, 1, 2, 5, 9, 17, 64] {
            for op in ReduceOp::ALL {
                let colls = all(CollKind::AllReduce, count, op, 0);
                for algo in [Algo::Ring, Algo::Ordered, Algo::HalvingDoubling] {
                    check(algo, &colls, val, &what);
                }
                let colls = all(CollKind::ReduceScatter, count, op, 0);
                for algo in [Algo::Ring, Algo::Ordered] {
                    check(algo, &colls, val, &what);
                }
                for root in 0..n {
                    let colls = all(CollKind::Reduce, count, op, root);
                    for algo in [Algo::Chain, Algo::Ordered] {
                        check(algo, &colls, val, &what);
                    }
                }
            }
            for root in 0..n {
                let colls = all(CollKind::Broadcast, count, ReduceOp::Sum, root);
                check(Algo::Chain, &colls, val, &what);
            }
            check(
                Algo::Ring,
                &all(CollKind::AllGather, count, ReduceOp::Sum, 0),
                val,
                &what,
            );
            check(
                Algo::Pairwise,
                &all(CollKind::AllToAll, count, ReduceOp::Sum, 0),
                val,
                &what,
            );
        }
        check(
            Algo::Dissemination,
            &all(CollKind::Barrier, 0, ReduceOp::Sum, 0),
            val,
            &what,
        );
    }
}

#[test]
fn bytes_on_the_wire() {
    // Ring all-reduce sends 2(n-1)/n of the buffer; chain broadcast sends it once per hop.
    let n = 4;
    let c = coll(CollKind::AllReduce, 1, n, 400, ReduceOp::Sum, 0);
    assert_eq!(Algo::Ring.schedule(&c).bytes_sent(), 2 * (n - 1) * 100 * 8);
    let c = coll(CollKind::Broadcast, 0, n, 400, ReduceOp::Sum, 0);
    assert_eq!(Algo::Chain.schedule(&c).bytes_sent(), 400 * 8);
    let c = coll(CollKind::Broadcast, 3, n, 400, ReduceOp::Sum, 0);
    assert_eq!(
        Algo::Chain.schedule(&c).bytes_sent(),
        0,
        "the last rank of the chain only receives"
    );
}

/// A send completes only once its message is taken: two ranks that each send before they
/// receive, in separate steps, deadlock (over rings, they would only for messages larger than
/// a ring).
#[test]
#[should_panic(expected = "deadlock")]
fn sends_wait_for_their_receivers() {
    let colls: Vec<Coll> = (0..2)
        .map(|r| coll(CollKind::AllGather, r, 2, 1, ReduceOp::Sum, 0))
        .collect();
    let scheds: Vec<Schedule> = (0..2)
        .map(|r| {
            let mut s = Schedule::new("send-first");
            s.push_xfers([Xfer::Send {
                peer: 1 - r,
                src: BufRange::new(Buf::Input, 0, 8),
            }]);
            s.push_xfers([Xfer::Recv {
                peer: 1 - r,
                dst: BufRange::new(Buf::Output, 8 * (1 - r), 8),
                combine: Combine::Store,
            }]);
            s
        })
        .collect();
    let mut bufs = vec![Bufs::default(); 2];
    for b in &mut bufs {
        b.input = vec![1; 8];
        b.output = vec![0; 16];
    }
    run_schedules(&scheds, &colls, &mut bufs);
}
