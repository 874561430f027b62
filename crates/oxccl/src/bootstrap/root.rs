//! Rank 0's side of the rendezvous: it binds the address, admits every rank's join
//! (`root_join.rs`), chooses how the exchanges go (through rank 0, `relay.rs`, or directly,
//! `mesh.rs`), and answers each join: with the peer table, or with the addresses the rank
//! dials for the direct exchanges (a host leader, `host.rs`, with its members' answers too).

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use super::root_join::RootJoin;
use super::{
    encode_ip, host, mesh, set_timeouts, tell_all, unique_id, Answer, Bootstrap, Links, PeerInfo,
    MAX_FRAME, SEQ_LOST, TABLE_LOST, TABLE_RELAY,
};
use crate::base::error::{Error, Result};
use crate::base::param::Config;
use crate::net::accept;
use crate::net::auth::{self, Deadlined, Hello, Purpose};

/// How long rank 0, after a failed rendezvous, still answers ranks that join late with the
/// reason (so that they name the rank at fault, not rank 0 which is gone).
const ROOT_LINGER: Duration = Duration::from_secs(2);

impl Bootstrap {
    fn bind_root(&self) -> Result<TcpListener> {
        if let Some(l) = unique_id::take_parked(self.root) {
            return Ok(l);
        }
        if self.root.port() == 0 {
            return Err(self.rz_err("the rendezvous address has port 0 and no listener of UniqueId::new in this process"));
        }
        let bind = |addr: SocketAddr| -> io::Result<TcpListener> {
            let s = socket2::Socket::new(
                socket2::Domain::for_address(addr),
                socket2::Type::STREAM,
                None,
            )?;
            s.set_reuse_address(true)?;
            s.bind(&addr.into())?;
            s.listen(accept::LISTEN_BACKLOG)?;
            Ok(s.into())
        };
        match bind(self.root) {
            Ok(l) => Ok(l),
            Err(e) if e.kind() == io::ErrorKind::AddrNotAvailable => {
                let any: IpAddr = if self.root.is_ipv4() {
                    Ipv4Addr::UNSPECIFIED.into()
                } else {
                    Ipv6Addr::UNSPECIFIED.into()
                };
                tracing::warn!(
                    "rank 0: {} is not an address of this host; listening on {any}:{} instead",
                    self.root.ip(),
                    self.root.port()
                );
                bind(SocketAddr::new(any, self.root.port())).map_err(|source| Error::Io {
                    rank: 0,
                    context: format!("binding the rendezvous port {}", self.root.port()),
                    source,
                })
            }
            Err(source) => Err(Error::Io {
                rank: 0,
                context: format!("binding the rendezvous address {}", self.root),
                source,
            }),
        }
    }

    /// Rank 0's side of the rendezvous: admits every rank, then answers each with the peer
    /// table (exchanges through rank 0) or with the addresses it dials for the direct
    /// exchanges; returns its own.
    pub(super) fn init_root(
        &mut self,
        me: PeerInfo,
        port: u16,
        exchange_listener: &mut Option<TcpListener>,
        deadline: Instant,
        cfg: &Config,
    ) -> Result<Answer> {
        let n = self.world_size;
        let my_ip = me.ip;
        let listener = self.bind_root()?;
        let RootJoin {
            mut conns,
            infos,
            mut ports,
            via,
            leader,
            accepts,
            messages,
            ..
        } = self.admit_all(listener, me, port, deadline, cfg)?;
        self.traffic.rendezvous_accepts = accepts;
        self.traffic.rendezvous_received = messages;
        let relay =
            self.choose_exchanges(&mut conns, &mut ports, &via, my_ip, exchange_listener, cfg)?;
        let peers: Vec<PeerInfo> = infos.into_iter().flatten().collect();
        let answers = self.answers(relay, &peers, &ports, &via)?;
        let (sent, answer_bytes) = self.send_answers(&mut conns, &leader, &answers)?;
        let direct: Vec<SocketAddr> = (0..answers.rounds)
            .map(|k| answers.addrs[mesh::sends_to(0, k, n)])
            .collect();
        self.links = Links::Root(conns);
        self.root_leaders = leader.iter().map(|&l| AtomicBool::new(l)).collect();
        self.traffic.rendezvous_sent = sent;
        tracing::debug!(
            rank = 0,
            accepted = accepts,
            join_messages = messages,
            answers = sent,
            answer_bytes,
            host_leaders = (1..n).filter(|&r| leader[r]).count(),
            "bootstrap rendezvous at rank 0 (connections accepted, join messages read, answers sent)"
        );
        if relay {
            return Ok(Answer::Table(peers));
        }
        Ok(Answer::Direct(direct))
    }

    /// Accepts on `listener` until every rank has joined (rank 0's own `me` and exchange
    /// `port` are in already); [`RootJoin`] checks each connection. On failure (a refused
    /// join, the deadline) tells everyone why ([`Bootstrap::tell_failure`]).
    fn admit_all(
        &self,
        listener: TcpListener,
        me: PeerInfo,
        port: u16,
        deadline: Instant,
        cfg: &Config,
    ) -> Result<RootJoin> {
        let n = self.world_size;
        let mut join = RootJoin {
            world: n,
            root: self.root,
            conns: (0..n).map(|_| None).collect(),
            infos: vec![None; n],
            ports: vec![0; n],
            via: vec![usize::MAX; n],
            leader: vec![false; n],
            accepts: 0,
            messages: 0,
            joined: 1,
            offender: None,
            start: Instant::now(),
            report_every: cfg.startup_report,
            next_report: None,
        };
        join.infos[0] = Some(me);
        join.ports[0] = port;
        join.next_report = cfg.startup_report.map(|p| join.start + p);
        if n > 1 {
            let keys = accept::Keys {
                secret: self.secret,
                purpose: Purpose::Rendezvous,
                tag: self.comm_tag(),
                rank: 0,
            };
            let res = accept::accept_loop(
                &listener,
                deadline,
                &std::sync::atomic::AtomicBool::new(false),
                &keys,
                &mut join,
            );
            let err = match res {
                Ok(Ok(())) => None,
                Ok(Err(e)) => Some(e),
                Err(accept::AcceptStop::Deadline(strangers)) => {
                    let missing = join.missing();
                    Some(match strangers.summary() {
                        None => Error::Timeout {
                            rank: 0,
                            call: "init",
                            seq: 0,
                            waiting_on: missing,
                            elapsed: self.timeout,
                        },
                        Some(s) => self.rz_err(format!(
                            "init timed out after {:?}, still waiting on rank(s) {}; {s}",
                            self.timeout,
                            crate::base::error::rank_list(&missing)
                        )),
                    })
                }
                Err(accept::AcceptStop::Io(source)) => Some(Error::Io {
                    rank: 0,
                    context: format!("accepting on the rendezvous address {}", self.root),
                    source,
                }),
            };
            if let Some(e) = err {
                self.tell_failure(&mut join, &listener, &keys, deadline, &e);
                return Err(e);
            }
            drop(listener);
        }
        Ok(join)
    }

    /// After a failed rendezvous (`e`): tells everyone who joined (and the offender) why,
    /// then for a little while ([`ROOT_LINGER`]) answers the ranks that join late with the
    /// same news.
    fn tell_failure(
        &self,
        join: &mut RootJoin,
        listener: &TcpListener,
        keys: &accept::Keys,
        deadline: Instant,
        e: &Error,
    ) {
        let mut msg = vec![1u8];
        msg.extend_from_slice(e.to_string().as_bytes());
        for s in join
            .conns
            .iter_mut()
            .flatten()
            .chain(join.offender.as_mut())
        {
            let _ = s.set_write_timeout(Some(Duration::from_secs(1)));
            let _ = auth::write_frame(s, &msg);
        }
        // Ranks that have not joined yet would find nothing listening and blame
        // rank 0: for a little while, answer them with the same news.
        let linger = ROOT_LINGER.min(deadline.saturating_duration_since(Instant::now()));
        if !join.missing().is_empty() && !linger.is_zero() {
            let mut tell = |_: Hello, s: TcpStream, _: SocketAddr| -> Result<bool> {
                let mut d = Deadlined::new(&s, Instant::now() + Duration::from_secs(1));
                let _ = auth::send_verdict(&mut d, auth::Verdict::Accepted)
                    .and_then(|_| auth::read_frame(&mut d, host::MAX_BATCH))
                    .and_then(|_| auth::write_frame(&mut d, &msg));
                Ok(false)
            };
            let _ = accept::accept_loop(
                listener,
                Instant::now() + linger,
                &std::sync::atomic::AtomicBool::new(false),
                keys,
                &mut tell,
            );
        }
    }

    /// Whether the exchanges go through rank 0 (true) or directly. Through rank 0 up to
    /// `OXCCL_BOOTSTRAP_RELAY_MAX` ranks, or when a rank joined without an exchange listener
    /// (its setting differs from rank 0's); directly when ranks joined through their host's
    /// leader (their setting said so; the leader cannot relay the exchanges), with an
    /// exchange listener made now for rank 0 if it has none (into `exchange_listener`, its
    /// port into `ports[0]`). Both at once is an error, told to every rank.
    fn choose_exchanges(
        &self,
        conns: &mut [Option<TcpStream>],
        ports: &mut [u16],
        via: &[usize],
        my_ip: IpAddr,
        exchange_listener: &mut Option<TcpListener>,
        cfg: &Config,
    ) -> Result<bool> {
        let n = self.world_size;
        let unready: Vec<usize> = (1..n).filter(|&r| ports[r] == 0).collect();
        let led: Vec<usize> = (1..n).filter(|&r| via[r] != r).collect();
        let no_listener = &unready;
        if !led.is_empty() && !no_listener.is_empty() {
            let e = self.rz_err(format!(
                "rank(s) {} joined through their host's leader for exchanges directly between \
                 ranks, rank(s) {} without an exchange listener for exchanges through rank 0: \
                 set OXCCL_BOOTSTRAP_RELAY_MAX alike on every rank",
                crate::base::error::rank_list(&led),
                crate::base::error::rank_list(no_listener)
            ));
            let mut msg = vec![1u8];
            msg.extend_from_slice(e.to_string().as_bytes());
            tell_all(conns, usize::MAX, &msg);
            return Err(e);
        }
        let relay =
            n == 1 || (led.is_empty() && (n <= cfg.bootstrap_relay_max || !unready.is_empty()));
        if !relay && ports[0] == 0 {
            // Ranks joined through their host's leader (their setting says direct, rank 0's
            // says through rank 0): follow them, with an exchange listener made now.
            let l = mesh::listen(my_ip).map_err(|source| Error::Io {
                rank: 0,
                context: format!("listening on {my_ip} for the bootstrap's exchange links"),
                source,
            })?;
            ports[0] = l.local_addr().map(|a| a.port()).unwrap_or(0);
            *exchange_listener = Some(l);
            tracing::warn!(
                "rank 0: {n} ranks exchange directly although OXCCL_BOOTSTRAP_RELAY_MAX is {} \
                 here: rank(s) {} joined through their host's leader (set the variable alike on \
                 every rank)",
                cfg.bootstrap_relay_max,
                crate::base::error::rank_list(&led)
            );
        }
        if relay && n > cfg.bootstrap_relay_max && n > 1 {
            tracing::warn!(
                "rank 0: {n} ranks exchange through rank 0 although OXCCL_BOOTSTRAP_RELAY_MAX \
                 is {} here: rank(s) {} joined without an exchange listener (set the variable \
                 alike on every rank)",
                cfg.bootstrap_relay_max,
                crate::base::error::rank_list(&unready)
            );
        }
        Ok(relay)
    }

    /// What rank 0 answers the joins with, from every rank's `peers` entry, exchange
    /// listener port (`ports`) and the rank whose connection it joined through (`via`); an
    /// error when an answer would exceed the bootstrap's frame limit.
    fn answers<'a>(
        &'a self,
        relay: bool,
        peers: &[PeerInfo],
        ports: &[u16],
        via: &'a [usize],
    ) -> Result<Answers<'a>> {
        let n = self.world_size;
        let addrs: Vec<SocketAddr> = peers
            .iter()
            .zip(ports)
            .map(|(i, &port)| SocketAddr::new(i.ip, port))
            .collect();
        let mut table = Vec::new();
        if relay {
            for p in peers {
                p.encode(&mut table);
            }
        }
        let rounds = if relay { 0 } else { mesh::rounds(n) };
        if 1 + 4 + table.len() + 4 + self.root_says.len() + 19 * rounds > MAX_FRAME {
            return Err(self.rz_err(if relay {
                "the peer table exceeds the bootstrap frame limit"
            } else {
                "rank 0's settings exceed the bootstrap frame limit"
            }));
        }
        Ok(Answers {
            n,
            relay,
            table,
            addrs,
            rounds,
            via,
            says: &self.root_says,
        })
    }

    /// Sends every rank that joined its answer (a host leader its members' too); returns
    /// how many answers and bytes went out. When a rank died after joining, tells the
    /// others that it is that rank, not rank 0, and fails.
    fn send_answers(
        &self,
        conns: &mut [Option<TcpStream>],
        leader: &[bool],
        answers: &Answers<'_>,
    ) -> Result<(u64, u64)> {
        let mut sent = 0u64;
        let mut answer_bytes = 0u64;
        for r in 0..conns.len() {
            if let Some(s) = &mut conns[r] {
                let a = if leader[r] {
                    answers.for_leader(r)
                } else {
                    answers.for_rank(r)
                };
                sent += 1;
                answer_bytes += 4 + a.len() as u64;
                if let Err(e) = set_timeouts(s, self.timeout).and_then(|_| auth::write_frame(s, &a))
                {
                    let err = self.lost(r, "init", e);
                    // Rank r died after joining: tell the others that it is r, not rank 0.
                    // Those below r have their answer and read this as the answer to their
                    // first exchange (through rank 0) or while they make their exchange
                    // links; those above still wait for it.
                    let mut report = (r as u32).to_le_bytes().to_vec();
                    report.extend_from_slice(err.to_string().as_bytes());
                    let mut as_exchange = SEQ_LOST.to_le_bytes().to_vec();
                    as_exchange.extend_from_slice(&report);
                    let mut as_table = vec![TABLE_LOST];
                    as_table.extend_from_slice(&report);
                    let (below, above) = conns.split_at_mut(r);
                    tell_all(below, r, &as_exchange);
                    tell_all(above, 0, &as_table);
                    return Err(err);
                }
            }
        }
        Ok((sent, answer_bytes))
    }
}

/// Rank 0's answers to the joins ([`Bootstrap::answers`]).
struct Answers<'a> {
    /// The world size.
    n: usize,
    /// Whether the exchanges go through rank 0.
    relay: bool,
    /// The encoded peer table (through rank 0; empty directly).
    table: Vec<u8>,
    /// Every rank's exchange listener address, by rank.
    addrs: Vec<SocketAddr>,
    /// The rounds of a direct exchange (0 through rank 0).
    rounds: usize,
    /// By rank, the rank whose connection it joined through (itself, or its host's leader).
    via: &'a [usize],
    /// Rank 0's settings ([`Bootstrap::root_says`]).
    says: &'a [u8],
}

impl Answers<'_> {
    /// Rank `r`'s answer: the peer table (through rank 0), or the addresses of the ranks it
    /// sends to, one per round (O(log n) bytes, not the whole peer table: that is the first
    /// exchange); then rank 0's settings.
    fn for_rank(&self, r: usize) -> Vec<u8> {
        let n = self.n;
        if self.relay {
            let mut a = vec![TABLE_RELAY];
            a.extend_from_slice(&(n as u32).to_le_bytes());
            a.extend_from_slice(&self.table);
            a.extend_from_slice(&(self.says.len() as u32).to_le_bytes());
            a.extend_from_slice(self.says);
            return a;
        }
        let mut a = vec![0u8];
        a.extend_from_slice(&(n as u32).to_le_bytes());
        for k in 0..mesh::rounds(n) {
            let to = self.addrs[mesh::sends_to(r, k, n)];
            encode_ip(to.ip(), &mut a);
            a.extend_from_slice(&to.port().to_le_bytes());
        }
        a.extend_from_slice(&(self.says.len() as u32).to_le_bytes());
        a.extend_from_slice(self.says);
        a
    }

    /// A host leader's answer: every rank's that joined through it, the leader's first.
    fn for_leader(&self, l: usize) -> Vec<u8> {
        let n = self.n;
        let ranks: Vec<usize> = std::iter::once(l)
            .chain((1..n).filter(|&r| r != l && self.via[r] == l))
            .collect();
        let mut a = vec![host::TABLE_HOST];
        a.extend_from_slice(&(ranks.len() as u32).to_le_bytes());
        for r in ranks {
            let one = self.for_rank(r);
            a.extend_from_slice(&(r as u32).to_le_bytes());
            a.extend_from_slice(&(one.len() as u32).to_le_bytes());
            a.extend_from_slice(&one);
        }
        a
    }
}
