//! Predictions for clusters this host cannot run: the time of each all-reduce algorithm on
//! `H` hosts of `L` ranks, from the run-time cost model (`plan/cost.rs`), and the
//! algorithm a communicator of that shape would choose (the same choice function the
//! library calls for every call). `oxccl sim` prints them.

use crate::base::error::{Error, Result};
use crate::base::param::Config;
use crate::bootstrap::topo::Topology;
use crate::plan::cost::CostModel;
use crate::plan::tune;
use crate::plan::tuning::Rates;
use crate::sched::{Algo, CollKind};

/// The most ranks a prediction covers (a world holds at most 65536 ranks).
pub const MAX_WORLD: usize = 65_536;

/// The algorithms the cost model predicts, in the order the choice prefers on ties.
pub const MODELLED: [Algo; 4] = [Algo::Ring, Algo::Hier, Algo::Tree, Algo::HalvingDoubling];

/// The run-time cost model and choice settings of a communicator, for predictions.
#[derive(Clone, Debug)]
pub struct Predictor {
    model: CostModel,
    forced: Option<Algo>,
    oneshot_max: usize,
    cma_min: usize,
    deterministic: bool,
    /// Cores shared by every rank of the cluster ([`Predictor::with_cpus`]).
    cpus: Option<f64>,
    /// The TCP stack's rate on the hosts' path ([`Predictor::with_path_tcp_gbps`]).
    path_tcp_gbps: Option<f64>,
}

/// One prediction: every modelled algorithm's time and the one the library would run.
#[derive(Clone, Debug, PartialEq)]
pub struct Prediction {
    /// Predicted microseconds of each algorithm of [`MODELLED`], in that order; `None`
    /// where it does not run on this shape as itself (hier on hosts of unequal size).
    pub times_us: Vec<(Algo, Option<f64>)>,
    /// The algorithm a communicator of this shape runs for this call.
    pub chosen: Algo,
    /// The predicted microseconds of `chosen` (`None` when the model has no time for it,
    /// e.g. the rank-ordered reduction of `OXCCL_DETERMINISTIC=1`).
    pub chosen_us: Option<f64>,
}

impl Predictor {
    /// The model and choice settings a communicator made with `cfg` uses at run time:
    /// `OXCCL_NET_GBPS`, `OXCCL_NET_LAT_US`, `OXCCL_ALGO`, `OXCCL_DETERMINISTIC`.
    pub fn from_config(cfg: &Config) -> Result<Predictor> {
        let forced = cfg
            .algo
            .as_deref()
            .map(|a| {
                a.parse::<Algo>()
                    .map_err(|e| Error::Env(format!("OXCCL_ALGO: {e}")))
            })
            .transpose()?;
        Ok(Predictor {
            model: CostModel::for_config(cfg),
            forced,
            oneshot_max: cfg.oneshot_max,
            cma_min: cfg.cma_min,
            deterministic: cfg.deterministic,
            cpus: None,
            path_tcp_gbps: None,
        })
    }

    /// The same with the network's bandwidth (GB/s, 1e9 bytes per second, one direction of
    /// one host's link) and per-step latency (microseconds) replaced where given.
    pub fn with_net(mut self, gbps: Option<f64>, lat_us: Option<f64>) -> Predictor {
        self.model = self.model.with_net(gbps, lat_us);
        self
    }

    /// The same with this host's measured rates (the tune file's, `oxccl tune`) in place of
    /// the ones `cfg` gave (its tune file's, or the built-in values).
    pub fn with_rates(mut self, rates: &Rates) -> Predictor {
        let (net, share) = (self.model.net, self.model.cpu_share);
        self.model = CostModel::default().with_rates(rates);
        self.model.net = net;
        self.model.cpu_share = share;
        self
    }

    /// The same for emulated hosts that share `cpus` cores in all (every host's ranks and
    /// TCP stack on one machine): every CPU term is `ranks / cpus` times slower where there
    /// are more ranks than cores. `None`: each rank has a core of its own. Only the times
    /// change; the choice stays the run-time one (a communicator does not know its hosts
    /// share cores).
    pub fn with_cpus(mut self, cpus: Option<f64>) -> Predictor {
        self.cpus = cpus.filter(|c| *c > 0.0);
        self
    }

    /// The same with the TCP stack moving `gbps` GB/s per core on the path between the
    /// hosts, in place of the rate `oxccl tune` measured over loopback. Emulated hosts
    /// (`scripts/cluster.sh`) send through a veth pair, a bridge and two tbf qdiscs, which
    /// cost more CPU per byte than loopback: their rate is the path's TCP throughput with
    /// both directions at once over the cores it ran on (`IPERF_ARGS=--bidir
    /// scripts/cluster.sh iperf`). As with [`with_cpus`](Self::with_cpus), only the times
    /// change, not the choice (a communicator's model has the tune file's rate).
    pub fn with_path_tcp_gbps(mut self, gbps: Option<f64>) -> Predictor {
        self.path_tcp_gbps = gbps.filter(|g| *g > 0.0);
        self
    }

    /// `(per-message µs, GB/s)` of the TCP stack the model charges (`None`: not charged,
    /// no measured rates).
    pub fn tcp(&self) -> Option<(f64, f64)> {
        self.timed_model().tcp.map(|t| (t.alpha_us, t.gbps))
    }

    /// The model the times come from: the run-time one with the path's TCP rate.
    fn timed_model(&self) -> CostModel {
        let mut m = self.model;
        if let Some(g) = self.path_tcp_gbps {
            let alpha_us = m.tcp.map_or(0.0, |t| t.alpha_us);
            m.tcp = Some(crate::plan::cost::LinkCost { alpha_us, gbps: g });
        }
        m
    }

    /// `(latency µs, GB/s)` of the network link the model assumes.
    pub fn net(&self) -> (f64, f64) {
        (self.model.net.alpha_us, self.model.net.gbps)
    }

    /// `(latency µs, GB/s)` of the shared-memory link the model assumes.
    pub fn shm(&self) -> (f64, f64) {
        (self.model.shm.alpha_us, self.model.shm.gbps)
    }

    /// `(memory GB/s, cache-resident GB/s)`: how fast one rank reduces or copies.
    pub fn local(&self) -> (f64, f64) {
        (self.model.local_gbps, self.model.cached_gbps)
    }

    /// The predicted all-reduce of `bytes` (one rank's buffer) on `hosts` hosts of
    /// `ranks_per_host` ranks each (ranks placed by host, as launchers do). Fewer than 2
    /// hosts, no ranks, or more than [`MAX_WORLD`] ranks is an error: on one host the
    /// measured tuner decides (`oxccl tune`), not this model.
    pub fn all_reduce(
        &self,
        hosts: usize,
        ranks_per_host: usize,
        bytes: usize,
    ) -> Result<Prediction> {
        let topo = block_topology(hosts, ranks_per_host)?;
        let mut timed = self.timed_model();
        if let Some(c) = self.cpus {
            timed.cpu_share = (topo.host_of.len() as f64 / c).max(1.0);
        }
        let times_us: Vec<(Algo, Option<f64>)> = MODELLED
            .iter()
            .map(|&a| (a, timed.all_reduce_us(a, bytes, &topo)))
            .collect();
        // What a communicator of this shape knows when it chooses (collectives.rs): ranks on
        // several hosts have no direct area.
        let situation = tune::Situation {
            kind: CollKind::AllReduce,
            input_bytes: bytes,
            direct: false,
            cma: false,
            slot_bytes: 0,
            nranks: topo.host_of.len(),
            oneshot_max: self.oneshot_max,
            cma_min: self.cma_min,
            // No direct area across hosts: no single-copy through shared buffers.
            mapped_min: usize::MAX,
            deterministic: self.deterministic,
        };
        let chosen = self.model.choose(&situation, Some(&topo), self.forced);
        let chosen_us = times_us
            .iter()
            .find(|(a, _)| *a == chosen)
            .and_then(|(_, t)| *t);
        Ok(Prediction {
            times_us,
            chosen,
            chosen_us,
        })
    }
}

/// `hosts` hosts of `per` ranks each, rank `r` on host `r / per`.
fn block_topology(hosts: usize, per: usize) -> Result<Topology> {
    let bad = |msg: String| Error::Env(msg);
    if hosts < 2 {
        return Err(bad(format!(
            "{hosts} host(s): predictions need at least 2 hosts (on one host `oxccl tune` measures)"
        )));
    }
    if per == 0 {
        return Err(bad("0 ranks per host".into()));
    }
    let n = hosts
        .checked_mul(per)
        .filter(|&n| n <= MAX_WORLD)
        .ok_or_else(|| {
            bad(format!(
                "{hosts} hosts x {per} ranks is more than {MAX_WORLD} ranks"
            ))
        })?;
    let host_of: Vec<usize> = (0..n).map(|r| r / per).collect();
    let all: Vec<usize> = (0..n).collect();
    let hosts = all.chunks(per).map(<[usize]>::to_vec).collect();
    Ok(Topology { host_of, hosts })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_choice_as_the_cost_model() {
        let cfg = Config::default();
        let p = Predictor::from_config(&cfg).unwrap();
        let m = CostModel::for_config(&cfg);
        for (h, l) in [(2, 1), (4, 1), (4, 2), (8, 8), (3, 2), (4096, 8)] {
            let topo = block_topology(h, l).unwrap();
            assert_eq!(topo.hosts.len(), h);
            assert!(topo.hosts.iter().all(|x| x.len() == l));
            for bytes in [8, 1 << 20, 256 << 20] {
                let got = p.all_reduce(h, l, bytes).unwrap();
                let s = tune::Situation {
                    kind: CollKind::AllReduce,
                    input_bytes: bytes,
                    direct: false,
                    cma: false,
                    slot_bytes: 0,
                    nranks: h * l,
                    oneshot_max: cfg.oneshot_max,
                    cma_min: cfg.cma_min,
                    mapped_min: usize::MAX,
                    deterministic: false,
                };
                assert_eq!(
                    got.chosen,
                    m.choose(&s, Some(&topo), None),
                    "{h}x{l} {bytes}"
                );
                // The chosen one is the fastest prediction.
                let best = got
                    .times_us
                    .iter()
                    .filter_map(|(_, t)| *t)
                    .fold(f64::INFINITY, f64::min);
                assert_eq!(got.chosen_us, Some(best), "{h}x{l} {bytes}");
            }
        }
    }

    #[test]
    fn settings_reach_the_choice() {
        let cfg = Config {
            algo: Some("ring".into()),
            ..Config::default()
        };
        let p = Predictor::from_config(&cfg).unwrap();
        assert_eq!(p.all_reduce(8, 1, 8).unwrap().chosen, Algo::Ring);
        let det = Config {
            deterministic: true,
            ..Config::default()
        };
        let got = Predictor::from_config(&det)
            .unwrap()
            .all_reduce(8, 1, 8)
            .unwrap();
        assert_eq!((got.chosen, got.chosen_us), (Algo::Ordered, None));
        let bad = Config {
            algo: Some("nope".into()),
            ..Config::default()
        };
        assert!(Predictor::from_config(&bad).is_err());
        // A slower network makes every prediction slower.
        let p = Predictor::from_config(&Config::default()).unwrap();
        let slow = p.clone().with_net(Some(0.1), Some(300.0));
        assert_eq!(slow.net(), (300.0, 0.1));
        let (a, b) = (
            p.all_reduce(4, 2, 1 << 20).unwrap(),
            slow.all_reduce(4, 2, 1 << 20).unwrap(),
        );
        for (x, y) in a.times_us.iter().zip(&b.times_us) {
            assert!(y.1.unwrap() > x.1.unwrap(), "{x:?} {y:?}");
        }
    }

    #[test]
    fn shapes_refused() {
        let p = Predictor::from_config(&Config::default()).unwrap();
        for (h, l) in [
            (1, 8),
            (0, 1),
            (2, 0),
            (65_537, 1),
            (4096, 17),
            (usize::MAX, 2),
        ] {
            assert!(p.all_reduce(h, l, 8).is_err(), "{h}x{l}");
        }
        assert!(p.all_reduce(2, 32_768, 8).is_ok());
    }

    #[test]
    fn rates_and_shared_cores() {
        let p = Predictor::from_config(&Config::default()).unwrap();
        assert_eq!(p.tcp(), None);
        let r = Rates {
            shm_lat_us: 2.0,
            shm_gbps: 5.0,
            reduce_gbps: 3.0,
            reduce_cached_gbps: 30.0,
            copy_gbps: 3.0,
            copy_cached_gbps: 30.0,
            tcp_lat_us: 6.0,
            tcp_gbps: 0.8,
        };
        // The same rates through the config (the tune file) and through with_rates.
        let via_cfg = Predictor::from_config(&Config {
            rates: Some(r.raw()),
            ..Config::default()
        })
        .unwrap();
        let measured = p.clone().with_rates(&r);
        assert_eq!(measured.tcp(), Some((6.0, 0.8)));
        assert_eq!(
            (measured.shm(), measured.local()),
            ((2.0, 5.0), (3.0, 30.0))
        );
        for bytes in [8, 1 << 20, 64 << 20] {
            assert_eq!(
                via_cfg.all_reduce(4, 2, bytes).unwrap(),
                measured.all_reduce(4, 2, bytes).unwrap()
            );
        }
        // The network given on the command line survives the rates, in either order.
        let net = p.clone().with_net(Some(0.125), Some(40.0)).with_rates(&r);
        assert_eq!(net.net(), (40.0, 0.125));
        // 8 ranks on 2 shared cores: slower, but the choice is the run-time one.
        let shared = measured.clone().with_cpus(Some(2.0));
        for bytes in [8, 1 << 20, 64 << 20] {
            let (a, b) = (
                measured.all_reduce(8, 1, bytes).unwrap(),
                shared.all_reduce(8, 1, bytes).unwrap(),
            );
            assert_eq!(a.chosen, b.chosen);
            assert!(b.chosen_us.unwrap() > a.chosen_us.unwrap(), "{bytes}");
        }
        // As many cores as ranks: no change.
        assert_eq!(
            measured
                .clone()
                .with_cpus(Some(8.0))
                .all_reduce(8, 1, 1 << 20)
                .unwrap(),
            measured.all_reduce(8, 1, 1 << 20).unwrap()
        );
    }
}
