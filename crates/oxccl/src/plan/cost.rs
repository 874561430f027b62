//! The cost model for ranks on several hosts: per-link latency and bandwidth for shared
//! memory and for the network, the predicted time of each all-reduce algorithm on a
//! topology, and the choice of the fastest.
//!
//! A step that moves `b` bytes over a link costs `α + b/β`. For `n` ranks on `H` hosts of
//! `L` ranks each, a buffer of `S` bytes:
//!
//! | algorithm | predicted time |
//! |---|---|
//! | ring (host order) | `2(n-1) · (α_net + S/n / β_net) + (n-1) · S/n / μ` (each host link carries one ring hop each way) |
//! | hier | `max(T_net, T_loc) + T_loc/K` with `T_loc = 2(L-1) · (α_shm + S/L / β_shm) + (L-1)/L · S/μ`, `T_net = 2(H-1) · (α_net + S/H / β_net) + (H-1)/(HL) · S/μ` (the `L` ranks of a host share its link; `K` pipeline chunks overlap the two) |
//! | tree | `2⌈log2 L⌉ · (α_shm + S/β_shm + S/μ) + (⌈log2 H⌉ + 2·[H not a power of 2]) · (α_net + S/β_net + S/μ)` |
//! | hd | `2 Σ_{k=1..log2 P} (α_net + S/2^k / β_net) + (P-1)/P · S/μ` `= 2·log2 P · α_net + 2(P-1)/P · S/β_net + (P-1)/P · S/μ`, plus `2(α_net + S/β_net) + S/μ` when `n` is not a power of two (`P`: the largest power of two `≤ n`) |
//!
//! `μ` is the rate at which one rank reduces or copies memory (`local_gbps`, or
//! `cached_gbps` for buffers of at most 1 MiB, which stay in the caches); the tree
//! reduces (and copies) the whole buffer at every step, the rings only a `1/n` block.
//! Halving-doubling is charged as if every step crossed the network (as the ring is) and
//! ignores that, in host order, its first `log2 L` steps stay inside a host: an
//! overestimate when hosts have several ranks, exact with one rank per host.
//!
//! On one host this module decides nothing: [`tune::choose`] does.
//! Defaults were measured on the emulated cluster of `scripts/cluster.sh` (10 Gbit/s links);
//! `OXCCL_NET_GBPS` and `OXCCL_NET_LAT_US` set the network's for other networks.

use crate::bootstrap::topo::Topology;
use crate::plan::tune;
use crate::sched::{Algo, CollKind};

/// Latency and bandwidth of one kind of link.
#[derive(Copy, Clone, Debug, PartialEq)]
pub(crate) struct LinkCost {
    /// Per-step latency in microseconds (a message's first byte, a wake-up).
    pub alpha_us: f64,
    /// Bandwidth in GB/s (1e9 bytes per second) of one link in one direction.
    pub gbps: f64,
}

impl LinkCost {
    /// Microseconds to move `bytes` in one step.
    pub(crate) fn time_us(&self, bytes: f64) -> f64 {
        self.alpha_us + bytes / (self.gbps * 1e3)
    }
}

/// Link costs for shared memory and for the network.
#[derive(Copy, Clone, Debug, PartialEq)]
pub(crate) struct CostModel {
    /// Between ranks of one host.
    pub shm: LinkCost,
    /// Between hosts.
    pub net: LinkCost,
    /// GB/s at which one rank reduces or copies memory.
    pub local_gbps: f64,
    /// The same while a call's buffer fits in the core's caches (at most
    /// [`CACHE_BYTES`](Self::CACHE_BYTES)).
    pub cached_gbps: f64,
    /// The TCP stack on this host's CPU (measured by `oxccl tune`): per-message cost and the
    /// bytes one core moves through it per second, sending and receiving. `None`: not
    /// charged (the network's own latency and bandwidth only).
    pub tcp: Option<LinkCost>,
    /// Ranks per core (at least 1): every CPU term that moves bytes (shared-memory link,
    /// reduction, TCP stack) is that many times slower; the TCP stack's by the streams
    /// that run at once per core instead, where fewer ranks than all run one. Per-message costs are not: measured
    /// on loopback they are mostly waiting (a wake-up, the kernel's path), and in a
    /// latency-bound step few ranks are runnable at once (quiet machine, 1 Gbit/s emulated
    /// hosts, 2-8 ranks: 8 B-4 KB rows within 25 % in 14 of 20 without the share on the
    /// per-message cost, 2 of 20 with it, docs/scale.md). 1 where each rank has a core of
    /// its own; `oxccl sim --cpus` sets it for emulated hosts that share one machine's cores.
    pub cpu_share: f64,
}

impl Default for CostModel {
    fn default() -> Self {
        // The built-in rates, also the nominal ones a tune file's are checked against.
        let r = crate::plan::tuning::Rates::NOMINAL;
        CostModel {
            shm: LinkCost {
                alpha_us: r.shm_lat_us,
                gbps: r.shm_gbps,
            },
            net: LinkCost {
                alpha_us: 30.0,
                gbps: 1.2,
            },
            local_gbps: r.reduce_gbps,
            cached_gbps: r.reduce_cached_gbps,
            tcp: None,
            cpu_share: 1.0,
        }
    }
}

fn ceil_log2(x: usize) -> f64 {
    if x <= 1 {
        0.0
    } else {
        f64::from((x - 1).ilog2() + 1)
    }
}

impl CostModel {
    /// Buffers up to this size count as cache-resident ([`cached_gbps`](Self::cached_gbps)).
    pub(crate) const CACHE_BYTES: usize = 1 << 20;

    /// The model a communicator with `cfg` uses: the defaults, with `OXCCL_NET_GBPS` and
    /// `OXCCL_NET_LAT_US` where set.
    pub(crate) fn for_config(cfg: &crate::base::param::Config) -> Self {
        let m = match crate::plan::tuning::Rates::of(cfg) {
            Some(r) => Self::default().with_rates(&r),
            None => Self::default(),
        };
        m.with_net(cfg.net_gbps, cfg.net_lat_us)
    }

    /// The model with this host's measured rates (`oxccl tune`) in place of the built-in
    /// ones: the shared-memory link, reduction (float32 sum), and the TCP stack's cost.
    pub(crate) fn with_rates(mut self, r: &crate::plan::tuning::Rates) -> Self {
        self.shm = LinkCost {
            alpha_us: r.shm_lat_us,
            gbps: r.shm_gbps,
        };
        self.local_gbps = r.reduce_gbps;
        self.cached_gbps = r.reduce_cached_gbps;
        self.tcp = Some(LinkCost {
            alpha_us: r.tcp_lat_us,
            gbps: r.tcp_gbps,
        });
        self
    }

    /// Microseconds of one network step moving `bytes`: the link's latency or the TCP
    /// stack's per-message cost, whichever is larger, and the bytes at the link's rate or
    /// the rate the stack moves them on a (shared) core, whichever is slower: the link and
    /// the CPU work at the same time, the slower one bounds the step.
    ///
    /// `streams`: the TCP streams that run at once in this step across the whole cluster,
    /// out of `n` ranks. Sharing cores ([`cpu_share`](Self::cpu_share)), the stack's rate
    /// is divided among the streams that need it, not among all ranks: a hierarchical
    /// algorithm's network phase runs one stream per host while the other ranks wait or
    /// copy through shared memory.
    fn net_step_us(&self, bytes: f64, streams: usize, n: usize) -> f64 {
        let c = (self.cpu_share * streams.min(n) as f64 / n.max(1) as f64).max(1.0);
        match self.tcp {
            None => self.net.time_us(bytes),
            Some(t) => {
                let gbps = self.net.gbps.min(t.gbps / c);
                self.net.alpha_us.max(t.alpha_us) + bytes / (gbps * 1e3)
            }
        }
    }

    /// Microseconds of one shared-memory step moving `bytes` (all CPU: slower by the share).
    fn shm_step_us(&self, bytes: f64) -> f64 {
        self.shm.alpha_us + bytes / (self.shm.gbps * 1e3) * self.cpu_share.max(1.0)
    }

    /// The model with the network's latency and bandwidth replaced where given.
    pub(crate) fn with_net(mut self, gbps: Option<f64>, lat_us: Option<f64>) -> Self {
        if let Some(g) = gbps {
            self.net.gbps = g;
        }
        if let Some(l) = lat_us {
            self.net.alpha_us = l;
        }
        self
    }

    /// Predicted microseconds of an all-reduce of `bytes` with `algo` on `topo`; `None` when
    /// the algorithm does not run on this topology as itself (hier on hosts of unequal size).
    pub(crate) fn all_reduce_us(&self, algo: Algo, bytes: usize, topo: &Topology) -> Option<f64> {
        let n = topo.host_of.len();
        let h = topo.hosts.len();
        let l = topo.hosts.iter().map(Vec::len).max().unwrap_or(1);
        let s = bytes as f64;
        // Local work runs at cache speed while the whole buffer fits in the caches: the tree,
        // which reduces the whole buffer at every step, was charged 5-10 times its measured
        // local cost at 64-256 KB with the memory rate (4 x 1 emulated hosts).
        let mu = if bytes <= Self::CACHE_BYTES {
            self.cached_gbps
        } else {
            self.local_gbps
        };
        let mem = |bytes: f64| bytes / (mu * 1e3) * self.cpu_share.max(1.0);
        // The TCP streams each algorithm runs at once: the ring and the tree cross between
        // hosts on one link per host (block placement), hier's network phase runs among
        // the host leaders, halving-doubling pairs every rank with one on another host.
        let streams = match algo {
            Algo::HalvingDoubling => n,
            _ => h,
        };
        let net_step = |bytes: f64| self.net_step_us(bytes, streams, n);
        let step = |bytes: f64| {
            if h > 1 {
                net_step(bytes)
            } else {
                self.shm_step_us(bytes)
            }
        };
        let nf = n as f64;
        match algo {
            Algo::Ring => Some(2.0 * (nf - 1.0) * step(s / nf) + (nf - 1.0) * mem(s / nf)),
            Algo::Hier => {
                if topo.hosts.iter().any(|x| x.len() != l) {
                    return None;
                }
                let (lf, hf) = (l as f64, h as f64);
                let local = 2.0 * (lf - 1.0) * self.shm_step_us(s / lf) + mem(s * (lf - 1.0) / lf);
                let net = 2.0 * (hf - 1.0) * net_step(s / hf) + mem(s * (hf - 1.0) / (hf * lf));
                // Pipelined in K chunks: the local phases of neighbouring chunks overlap the
                // network phase; about one chunk's worth stays exposed.
                let k = crate::sched::allreduce_hier::chunks(bytes) as f64;
                Some(net.max(local) + local / k)
            }
            Algo::HalvingDoubling => {
                let p = 1usize << n.max(1).ilog2();
                let pf = p as f64;
                // Step k of each phase moves S/2^(k+1); the owner reduces (P-1)/P of S.
                let phase: f64 = (0..p.ilog2())
                    .map(|k| step(s / f64::from(k + 1).exp2()))
                    .sum();
                let pairs = if n == p { 0.0 } else { 2.0 * step(s) + mem(s) };
                Some(2.0 * phase + mem(s * (pf - 1.0) / pf) + pairs)
            }
            Algo::Tree => {
                let net_steps = ceil_log2(h) + if h.is_power_of_two() { 0.0 } else { 2.0 };
                Some(
                    2.0 * ceil_log2(l) * (self.shm_step_us(s) + mem(s))
                        + net_steps * (net_step(s) + mem(s)),
                )
            }
            _ => None,
        }
    }

    /// The algorithm for one call: on several hosts the all-reduce with the least predicted
    /// time (unless one is forced, or reductions must be rank-ordered); otherwise, and for
    /// every other collective, [`tune::choose`].
    pub(crate) fn choose(
        &self,
        s: &tune::Situation,
        topo: Option<&Topology>,
        forced: Option<Algo>,
    ) -> Algo {
        let forced_fits = forced.is_some_and(|a| tune::feasible(a, s));
        match (s.kind, topo) {
            (CollKind::AllReduce, Some(t))
                if t.hosts.len() > 1 && !forced_fits && !s.deterministic =>
            {
                // On equal predictions the earlier candidate wins (`min_by` keeps the first).
                [Algo::Ring, Algo::Hier, Algo::Tree, Algo::HalvingDoubling]
                    .into_iter()
                    .filter_map(|a| self.all_reduce_us(a, s.input_bytes, t).map(|us| (a, us)))
                    .min_by(|a, b| a.1.total_cmp(&b.1))
                    .map_or(Algo::Ring, |(a, _)| a)
            }
            _ => tune::choose(s, forced),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn topo(host_of: Vec<usize>) -> Topology {
        Topology::of_hosts(host_of)
    }

    fn sit(kind: CollKind, bytes: usize) -> tune::Situation {
        tune::Situation {
            kind,
            input_bytes: bytes,
            direct: false,
            cma: false,
            slot_bytes: 0,
            nranks: 2,
            oneshot_max: 0,
            cma_min: usize::MAX,
            mapped_min: usize::MAX,
            deterministic: false,
        }
    }

    #[test]
    fn chooses_by_size_and_shape() {
        let m = CostModel::default();
        struct M(CostModel);
        impl M {
            fn choose(
                &self,
                kind: CollKind,
                bytes: usize,
                t: Option<&Topology>,
                f: Option<Algo>,
            ) -> Algo {
                self.0.choose(&sit(kind, bytes), t, f)
            }
        }
        let m = M(m);
        let two_by_two = topo(vec![0, 0, 1, 1]);
        let four = topo(vec![0, 1, 2, 3]);
        let one = topo(vec![0, 0, 0, 0]);
        let ar = CollKind::AllReduce;
        assert_eq!(m.choose(ar, 8, Some(&two_by_two), None), Algo::Tree);
        assert_eq!(m.choose(ar, 64 << 20, Some(&two_by_two), None), Algo::Hier);
        assert_eq!(m.choose(ar, 8, Some(&four), None), Algo::Tree);
        // Four hosts of one rank: halving-doubling moves the ring's bytes in 4 steps instead
        // of 6 (this was the ring before it existed).
        assert_eq!(
            m.choose(ar, 64 << 20, Some(&four), None),
            Algo::HalvingDoubling
        );
        // 4 x 1 on the emulated cluster (docs/performance.md): the tree up to 64 KB (116-142 µs against
        // hd's 160-260 and the ring's 178-222), halving-doubling at 512 KB (1026-1176 µs
        // against the ring's 1390-1891 and the tree's 1667-1719).
        assert_eq!(m.choose(ar, 64 << 10, Some(&four), None), Algo::Tree);
        assert_eq!(
            m.choose(ar, 512 << 10, Some(&four), None),
            Algo::HalvingDoubling
        );
        let two = topo(vec![0, 1]);
        assert_eq!(m.choose(ar, 8, Some(&two), None), Algo::Tree);
        // Two ranks: halving-doubling is the ring (same prediction), and the ring is kept.
        assert_eq!(
            m.0.all_reduce_us(Algo::HalvingDoubling, 1 << 20, &two),
            m.0.all_reduce_us(Algo::Ring, 1 << 20, &two)
        );
        assert_eq!(m.choose(ar, 1 << 20, Some(&two), None), Algo::Ring);
        // Three hosts: the extra rank's two whole-buffer steps make it lose to the ring.
        let three = topo(vec![0, 1, 2]);
        assert_eq!(m.choose(ar, 1 << 20, Some(&three), None), Algo::Ring);
        let eight = topo((0..8).collect());
        assert_eq!(
            m.choose(ar, 1 << 20, Some(&eight), None),
            Algo::HalvingDoubling
        );
        // 4 hosts x 2 ranks: tree, then halving-doubling, then hier for large buffers.
        let four_by_two = topo(vec![0, 0, 1, 1, 2, 2, 3, 3]);
        assert_eq!(m.choose(ar, 8, Some(&four_by_two), None), Algo::Tree);
        assert_eq!(
            m.choose(ar, 1 << 20, Some(&four_by_two), None),
            Algo::HalvingDoubling
        );
        assert_eq!(m.choose(ar, 64 << 20, Some(&four_by_two), None), Algo::Hier);
        // Deterministic mode never takes it, forced or not.
        let det = tune::Situation {
            deterministic: true,
            ..sit(ar, 1 << 20)
        };
        assert_eq!(
            m.0.choose(&det, Some(&eight), Some(Algo::HalvingDoubling)),
            Algo::Ordered
        );
        // One host: the intra-host tuner decides.
        assert_eq!(
            m.choose(ar, 8, Some(&one), None),
            tune::choose(&sit(ar, 8), None)
        );
        // Bitwise reproducibility across hosts: rank-ordered, whatever the cost.
        let det = tune::Situation {
            deterministic: true,
            ..sit(ar, 64 << 20)
        };
        assert_eq!(m.0.choose(&det, Some(&two_by_two), None), Algo::Ordered);
        // Forced where it fits; other collectives keep their default.
        assert_eq!(
            m.choose(ar, 8, Some(&two_by_two), Some(Algo::Ring)),
            Algo::Ring
        );
        assert_eq!(
            m.choose(CollKind::Broadcast, 8, Some(&two_by_two), Some(Algo::Tree)),
            Algo::Chain
        );
        // Unequal hosts: no hier.
        let uneven = topo(vec![0, 0, 1, 2]);
        assert_eq!(m.0.all_reduce_us(Algo::Hier, 1 << 20, &uneven), None);
        assert_ne!(m.choose(ar, 64 << 20, Some(&uneven), None), Algo::Hier);
    }

    fn rates(tcp_lat_us: f64, tcp_gbps: f64) -> crate::plan::tuning::Rates {
        crate::plan::tuning::Rates {
            tcp_lat_us,
            tcp_gbps,
            ..crate::plan::tuning::Rates::NOMINAL
        }
    }

    #[test]
    fn the_cpu_bounds_a_step_when_slower_than_the_link() {
        let four = topo(vec![0, 1, 2, 3]);
        let base = CostModel::default().with_net(Some(1.25), Some(30.0));
        // The built-in rates and a TCP stack faster than the link: the same predictions
        // (the link bounds every step).
        let fast = base.with_rates(&rates(5.0, 4.0));
        for algo in [Algo::Ring, Algo::Tree, Algo::HalvingDoubling] {
            for bytes in [8, 64 << 10, 16 << 20] {
                assert_eq!(
                    fast.all_reduce_us(algo, bytes, &four),
                    base.all_reduce_us(algo, bytes, &four),
                    "{algo:?} {bytes}"
                );
            }
        }
        // A stack that moves 0.5 GB/s per core bounds the ring's bytes: 2(n-1) steps of
        // S/n at 0.5 GB/s instead of 1.25, the reduction as before.
        let slow = base.with_rates(&rates(5.0, 0.5));
        let s = (16 << 20) as f64;
        let ring = |m: &CostModel, gbps: f64| {
            let got = m.all_reduce_us(Algo::Ring, 16 << 20, &four).unwrap();
            let want = 6.0 * (30.0 + s / 4.0 / (gbps * 1e3)) + 3.0 * s / 4.0 / 2e3;
            assert!((got - want).abs() < 1e-6 * want, "{got} {want}");
        };
        ring(&base, 1.25);
        ring(&slow, 0.5);
        // A per-message cost above the link's latency replaces it.
        let costly = base.with_rates(&rates(50.0, 4.0));
        let extra = costly.all_reduce_us(Algo::Ring, 8, &four).unwrap()
            - base.all_reduce_us(Algo::Ring, 8, &four).unwrap();
        assert!((extra - 6.0 * (50.0 - 30.0)).abs() < 1e-9, "{extra}");
        // Ranks sharing cores: every CPU term slower by the share; a link-bound step is
        // unchanged until the shared stack is slower than the link.
        let shared = CostModel {
            cpu_share: 4.0,
            ..fast
        };
        let big = 16 << 20;
        let t_fast = fast.all_reduce_us(Algo::Ring, big, &four).unwrap();
        let t_shared = shared.all_reduce_us(Algo::Ring, big, &four).unwrap();
        let want = 6.0 * (30.0 + s / 4.0 / (1e3 * 4.0 / 4.0)) + 4.0 * 3.0 * s / 4.0 / 2e3;
        assert!(t_shared > t_fast && (t_shared - want).abs() < 1e-6 * want);
        let two_by_two = topo(vec![0, 0, 1, 1]);
        assert!(
            shared.all_reduce_us(Algo::Hier, big, &two_by_two).unwrap()
                > fast.all_reduce_us(Algo::Hier, big, &two_by_two).unwrap()
        );
        // Per-message costs are not multiplied by the share: an 8 B ring on shared cores
        // differs from one on cores of their own only by its (tiny) byte terms.
        let costly_shared = CostModel {
            cpu_share: 4.0,
            ..costly
        };
        let small = costly_shared.all_reduce_us(Algo::Ring, 8, &four).unwrap()
            - costly.all_reduce_us(Algo::Ring, 8, &four).unwrap();
        assert!((0.0..1.0).contains(&small), "{small}");
        // Hier's network phase runs one stream per host: on shared cores its stack is
        // divided among the leaders, not among every rank. 2 x 2 on 2 cores (share 2):
        // two streams, one per core, at the stack's full rate; halving-doubling's four
        // streams share the two cores.
        let path = base.with_rates(&rates(5.0, 0.5));
        let on_two_cores = CostModel {
            cpu_share: 2.0,
            ..path
        };
        let b = s / 2.0;
        let step = |m: &CostModel, streams| m.net_step_us(b, streams, 4);
        assert_eq!(step(&on_two_cores, 2), step(&path, 2));
        assert_eq!(step(&path, 2), 30.0 + b / 0.5e3);
        assert!((step(&on_two_cores, 4) - (30.0 + b / 0.25e3)).abs() < 1e-6);
        // And so in the predictions: hier's network phase (two steps of S/2) as on cores of
        // its own, halving-doubling's (two steps of S/2, two of S/4) at half the rate.
        let gap = |a| {
            on_two_cores.all_reduce_us(a, big, &two_by_two).unwrap()
                - path.all_reduce_us(a, big, &two_by_two).unwrap()
        };
        assert!(
            gap(Algo::Hier) < 0.1 * 2.0 * b / 0.5e3,
            "{}",
            gap(Algo::Hier)
        );
        assert!(
            gap(Algo::HalvingDoubling) > 2.0 * (b + b / 2.0) / 0.5e3,
            "{}",
            gap(Algo::HalvingDoubling)
        );
        // Without measured rates nothing of the TCP stack is charged.
        assert_eq!(CostModel::default().tcp, None);
        assert_eq!(fast.shm.alpha_us, 4.0);
    }
}
