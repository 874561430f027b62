//! The simulator ([`super`]) on multi-host placements: host-ordered rings and chains,
//! the hierarchical, tree and halving-doubling all-reduce, against references, for many host layouts.

use std::sync::Arc;

use super::{bytes, check, make_bufs, reduce_of, run};
use crate::base::dtype::DataType;
use crate::base::op::ReduceOp;
use crate::bootstrap::topo::Topology;
use crate::sched::{Algo, Coll, CollKind};

fn val(rank: usize, i: usize) -> i64 {
    ((rank * 5 + i * 7) % 13) as i64 - 6
}

fn reduce_ref(n: usize, i: usize, op: ReduceOp) -> i64 {
    reduce_of(val, n, i, op)
}

/// A topology from the host of each rank.
fn topo(host_of: &[usize]) -> Arc<Topology> {
    let nh = host_of.iter().max().map_or(0, |m| m + 1);
    let mut hosts = vec![Vec::new(); nh];
    for (r, &h) in host_of.iter().enumerate() {
        hosts[h].push(r);
    }
    // Hosts numbered by first appearance, as Topology::new does.
    let mut order: Vec<usize> = (0..nh).collect();
    order.sort_by_key(|&h| hosts[h][0]);
    let hosts: Vec<Vec<usize>> = order.iter().map(|&h| hosts[h].clone()).collect();
    let mut host_of = vec![0; host_of.len()];
    for (i, h) in hosts.iter().enumerate() {
        for &r in h {
            host_of[r] = i;
        }
    }
    Arc::new(Topology { host_of, hosts })
}

fn colls(kind: CollKind, t: &Arc<Topology>, count: usize, op: ReduceOp, root: usize) -> Vec<Coll> {
    let n = t.host_of.len();
    (0..n)
        .map(|rank| Coll {
            kind,
            rank,
            nranks: n,
            count,
            dtype: DataType::I64,
            op,
            root,
            chunk_bytes: 16,
            topo: Some(t.clone()),
            blocks: None,
        })
        .collect()
}

const LAYOUTS: &[&[usize]] = &[
    &[0],
    &[0, 1],
    &[0, 0],
    &[0, 0, 1, 1],
    &[0, 1, 0, 1],
    &[0, 1, 2, 3],
    &[0, 0, 0, 1, 1, 1],
    &[0, 1, 2, 0, 1, 2],
    &[0, 0, 1, 2],
    &[0, 1, 1, 2, 2, 2],
    &[0, 0, 1, 1, 2, 2, 3, 3],
    &[0, 1, 2, 3, 4, 0, 1, 2, 3, 4],
    &[0, 0, 0, 0, 1, 1, 1, 1],
];

#[test]
fn all_reduce_on_every_layout() {
    for layout in LAYOUTS {
        let t = topo(layout);
        let what = format!("layout={layout:?}");
        for count in [0usize, 1, 3, 8, 13, 40] {
            for op in ReduceOp::ALL {
                for algo in [Algo::Ring, Algo::Hier, Algo::Tree, Algo::HalvingDoubling] {
                    check(
                        algo,
                        &colls(CollKind::AllReduce, &t, count, op, 0),
                        val,
                        &what,
                    );
                }
            }
        }
    }
}

#[test]
fn rings_and_chains_on_every_layout() {
    for layout in LAYOUTS {
        let t = topo(layout);
        let n = layout.len();
        let what = format!("layout={layout:?}");
        for count in [0usize, 1, 5, 9] {
            let sum = ReduceOp::Sum;
            check(
                Algo::Ring,
                &colls(CollKind::AllGather, &t, count, sum, 0),
                val,
                &what,
            );
            check(
                Algo::Ring,
                &colls(CollKind::ReduceScatter, &t, count, sum, 0),
                val,
                &what,
            );
            for root in 0..n {
                check(
                    Algo::Chain,
                    &colls(CollKind::Broadcast, &t, count, sum, root),
                    val,
                    &what,
                );
                let max = ReduceOp::Max;
                check(
                    Algo::Chain,
                    &colls(CollKind::Reduce, &t, count, max, root),
                    val,
                    &what,
                );
            }
        }
    }
}

/// Bytes a host sends to other hosts over one whole all-reduce.
fn network_bytes(algo: Algo, layout: &[usize], count: usize) -> usize {
    let t = topo(layout);
    colls(CollKind::AllReduce, &t, count, ReduceOp::Sum, 0)
        .iter()
        .filter(|c| t.host_of[c.rank] == 0)
        .map(|c| {
            algo.schedule(c)
                .steps
                .iter()
                .flat_map(|s| &s.xfers)
                .map(|x| match *x {
                    crate::sched::Xfer::Send { peer, src } if t.host_of[peer] != 0 => src.len,
                    _ => 0,
                })
                .sum::<usize>()
        })
        .sum()
}

#[test]
fn hierarchy_saves_network_bytes() {
    let count = 1200; // 9600 bytes
    let s = count * 8;
    // 2 hosts x 2 ranks: a host-ordered ring puts 2(n-1)/n = 1.5 S on each host's link, the
    // hierarchical all-reduce 2(H-1)/H = 1 S.
    assert_eq!(network_bytes(Algo::Ring, &[0, 0, 1, 1], count), s * 3 / 2);
    assert_eq!(network_bytes(Algo::Hier, &[0, 0, 1, 1], count), s);
    // Round-robin placement: the host-ordered ring still crosses once.
    assert_eq!(network_bytes(Algo::Ring, &[0, 1, 0, 1], count), s * 3 / 2);
    // 4 hosts x 2 ranks: ring 2*7/8 S = 1.75 S, hier 2*3/4 S = 1.5 S.
    let l = [0, 0, 1, 1, 2, 2, 3, 3];
    assert_eq!(network_bytes(Algo::Ring, &l, count), s * 7 / 4);
    assert_eq!(network_bytes(Algo::Hier, &l, count), s * 3 / 2);
    // Tree: the leader of host 0 exchanges the whole buffer log2(4) = 2 times.
    assert_eq!(network_bytes(Algo::Tree, &l, count), 2 * s);
    // Halving-doubling in host order: the first step (S/2) stays inside the host, so each
    // host link carries 2(H-1)/H S, as hier's, whatever the placement.
    assert_eq!(
        network_bytes(Algo::HalvingDoubling, &[0, 0, 1, 1], count),
        s
    );
    assert_eq!(
        network_bytes(Algo::HalvingDoubling, &[0, 1, 0, 1], count),
        s
    );
    assert_eq!(network_bytes(Algo::HalvingDoubling, &l, count), s * 3 / 2);
    // One rank per host: the ring's 2(n-1)/n S.
    assert_eq!(
        network_bytes(Algo::HalvingDoubling, &[0, 1, 2, 3], count),
        s * 3 / 2
    );
}

#[test]
fn pipelined_hier_on_large_buffers() {
    // Enough elements for several pipeline chunks.
    let count = 5 * (2 << 20) / 8 + 3;
    assert!(crate::sched::allreduce_hier::chunks(count * 8) > 1);
    for layout in [&[0usize, 0, 1, 1][..], &[0, 1, 0, 1], &[0, 0, 0, 1, 1, 1]] {
        let t = topo(layout);
        let n = layout.len();
        for op in [ReduceOp::Sum, ReduceOp::Avg] {
            let cs = colls(CollKind::AllReduce, &t, count, op, 0);
            let mut bufs = make_bufs(
                n,
                |r| bytes(&(0..count).map(|i| val(r, i)).collect::<Vec<_>>()),
                |_| vec![0; count * 8],
            );
            run(Algo::Hier, &cs, &mut bufs);
            let want = bytes(&(0..count).map(|i| reduce_ref(n, i, op)).collect::<Vec<_>>());
            for (r, b) in bufs.iter().enumerate() {
                assert!(b.output == want, "hier layout={layout:?} op={op} rank={r}");
            }
        }
    }
}
