//! What `oxccl tune` measured on this host, for the planner: the thresholds where one
//! algorithm overtakes another ([`Tuning`], saved in the tune file) and the cost model's rates
//! ([`Rates`]). [`Config::from_env`] starts from them; the environment's variables override
//! the thresholds.

use crate::base::error::{Error, Result};
use crate::base::param::table;
use crate::base::param::{Config, CMA_MIN_DEFAULT, ONESHOT_MAX_DEFAULT, RATE_COUNT};

impl Config {
    /// Reads every `OXCCL_*` setting from the environment; unset ones keep their defaults,
    /// or the values `oxccl tune` measured on this host ([`Tuning::load`]; the variables
    /// override them). Every variable the library reads (also those read once per process)
    /// is checked against the table first: a value it refuses is an error naming the
    /// variable, the value and the accepted range.
    pub fn from_env() -> Result<Config> {
        table::check_env(&[table::Scope::Comm, table::Scope::Process])?;
        let mut c = Config::default();
        // Measured thresholds (`oxccl tune`) first; explicit variables override them.
        if let Some(t) = Tuning::load()? {
            c.oneshot_max = t.two_rank_oneshot_max();
            c.cma_min = t.cma_min;
            c.rates = t.rates.map(|r| r.raw());
        }
        Config::from_env_over(c)
    }
}

/// What `oxccl tune` measured on this host: the sizes where one algorithm overtakes another.
/// Saved as `key=value` lines in `OXCCL_TUNE_FILE` (default `~/.cache/oxccl/tune.conf`) and
/// read by [`Config::from_env`]; `OXCCL_ONESHOT_MAX` and `OXCCL_CMA_MIN` override it.
#[derive(Clone, Debug, PartialEq)]
pub struct Tuning {
    /// Largest input (bytes) that one-shot handles fastest, with [`Tuning::ranks`] ranks
    /// (what a communicator makes of it: [`Tuning::two_rank_oneshot_max`]).
    pub oneshot_max: usize,
    /// Smallest input (bytes) from which single-copy is fastest.
    pub cma_min: usize,
    /// How many ranks `oxccl tune` measured with (`ranks=`). `None` in files written before
    /// tune saved it, which [`Tuning::read`] takes as measured with the count the file's
    /// first comment names, else 2, with a warning.
    pub ranks: Option<usize>,
    /// The rates the multi-host cost model uses (`plan/cost.rs`), measured on this host;
    /// `None` in files written before `oxccl tune` measured them.
    pub rates: Option<Rates>,
}

/// What one rank does per second on this host, measured by `oxccl tune` for the cost
/// model of multi-host all_reduce (`plan/cost.rs`) and `oxccl sim`: the shared-memory
/// link, reduction and copy of float32 sums, and the TCP stack over loopback. Rates are in
/// GB/s (1e9 bytes per second), latencies in microseconds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Rates {
    /// Per-step latency of the shared-memory link (from the ring's time at 8 B).
    pub shm_lat_us: f64,
    /// Bandwidth of the shared-memory link (from the ring's time at the largest size).
    pub shm_gbps: f64,
    /// `dst += src` of float32 on buffers larger than the caches (bytes of `dst` per second).
    pub reduce_gbps: f64,
    /// The same on buffers that fit in the caches.
    pub reduce_cached_gbps: f64,
    /// Memory copy on buffers larger than the caches.
    pub copy_gbps: f64,
    /// Memory copy on buffers that fit in the caches.
    pub copy_cached_gbps: f64,
    /// One-way time of a small message over loopback TCP (half a ping-pong's round trip).
    pub tcp_lat_us: f64,
    /// Bytes per second one core moves through the TCP stack, sending and receiving
    /// (one thread writing to and reading from one loopback connection).
    pub tcp_gbps: f64,
}

/// A [`Rates`] field, for reading and writing the file.
type RateField = fn(&mut Rates) -> &mut f64;

impl Rates {
    /// The file's keys, in the order they are written, with each field.
    const KEYS: [(&'static str, RateField); RATE_COUNT] = [
        ("shm_lat_us", |r| &mut r.shm_lat_us),
        ("shm_gbps", |r| &mut r.shm_gbps),
        ("reduce_gbps", |r| &mut r.reduce_gbps),
        ("reduce_cached_gbps", |r| &mut r.reduce_cached_gbps),
        ("copy_gbps", |r| &mut r.copy_gbps),
        ("copy_cached_gbps", |r| &mut r.copy_cached_gbps),
        ("tcp_lat_us", |r| &mut r.tcp_lat_us),
        ("tcp_gbps", |r| &mut r.tcp_gbps),
    ];

    /// What the cost model assumes without a tune file (`plan/cost.rs` takes its
    /// shared-memory link and reduction rates from here), and typical values for the rates
    /// it has no built-in use for (copy; the loopback TCP stack). A tune file's rate more than
    /// [`Tuning::TRUST_FACTOR`] times away from its nominal value, either way, is not used.
    pub const NOMINAL: Rates = Rates {
        shm_lat_us: 4.0,
        shm_gbps: 3.0,
        reduce_gbps: 2.0,
        reduce_cached_gbps: 10.0,
        copy_gbps: 4.0,
        copy_cached_gbps: 20.0,
        tcp_lat_us: 10.0,
        tcp_gbps: 2.0,
    };

    /// The rates as [`Config::rates`] carries them: in the file's order.
    pub fn raw(&self) -> [f64; RATE_COUNT] {
        let mut r = *self;
        Self::KEYS.map(|(_, f)| *f(&mut r))
    }

    /// The rates [`Config::rates`] carries (`None`: the model's built-in ones).
    pub fn of(cfg: &Config) -> Option<Rates> {
        let raw = cfg.rates?;
        let mut r = Rates::NOMINAL;
        for ((_, f), v) in Self::KEYS.iter().zip(raw) {
            *f(&mut r) = v;
        }
        Some(r)
    }

    /// Every rate as `(key, value)`, in the file's order.
    pub fn entries(&self) -> Vec<(&'static str, f64)> {
        let mut r = *self;
        Self::KEYS.iter().map(|(k, f)| (*k, *f(&mut r))).collect()
    }
}

/// `why` when `value` lies outside `lo..=hi`: `KEY=VALUE is outside LO to HI (RULE)`.
fn outside(key: &str, value: f64, lo: f64, hi: f64, rule: &str) -> Option<String> {
    (!(lo..=hi).contains(&value)).then(|| {
        let shown = if value >= table::MAX_THRESHOLD as f64 {
            format!("{value} (never)")
        } else {
            format!("{value}")
        };
        format!("{key}={shown} is outside {lo} to {hi} ({rule})")
    })
}

/// Announces `msg` once per process (a tune file is read by every communicator).
fn warn_once(msg: String) {
    static SEEN: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
    let mut seen = SEEN.lock().unwrap_or_else(|e| e.into_inner());
    if !seen.contains(&msg) {
        crate::base::debug::announce(&msg);
        seen.push(msg);
    }
}

impl Tuning {
    /// How far from its built-in value (a factor, either way) a threshold or a rate in a tune
    /// file may lie and still be used: a file from an `oxccl tune` run that other processes
    /// disturbed (single-copy never the fastest, link latencies of milliseconds) must not
    /// make a host worse than no file would. 32, not 16: on a quiet 2-core VM (load 0.6)
    /// four `oxccl tune` runs saved `cma_min` 2 MiB, 2 MiB, 1 MiB and never (ring and
    /// single-copy within noise of each other from 512 KiB on); under three busy loops
    /// `shm_lat_us` came out 1000 to 5400 µs.
    pub const TRUST_FACTOR: f64 = 32.0;
    /// The largest `oneshot_max` a tune file may set: one-shot carries at most a slot of the
    /// direct area (64 KiB).
    pub const ONESHOT_MAX_LIMIT: usize = 64 << 10;
    /// The most ranks a `ranks=` line may name.
    pub const MAX_RANKS: usize = 1 << 16;
    /// The largest tune file read (`oxccl tune` writes about 400 bytes): a bigger one, or a
    /// FIFO or device (`/dev/zero`), is refused before it is read.
    pub const MAX_FILE_BYTES: u64 = 1 << 20;

    /// The measured `oneshot_max` as `OXCCL_ONESHOT_MAX` means it: the limit with two
    /// ranks, which a communicator of `n` ranks multiplies by `n - 1`. A crossover `V`
    /// measured with `N` ranks is `V / (N - 1)` of it, rounded up so that `N` ranks take one-shot
    /// up to `V` again; other rank counts scale as the built-in value does (one handshake
    /// replaces the ring's `2(n-1)` steps). Files without a rank count: as measured with 2.
    pub fn two_rank_oneshot_max(&self) -> usize {
        let peers = self.ranks.unwrap_or(2).max(2) - 1;
        self.oneshot_max.div_ceil(peers)
    }

    /// The rank count an old file's first comment names (`oxccl tune on HOST, N ranks`),
    /// for files written before `ranks=`.
    fn ranks_in_comment(text: &str) -> Option<usize> {
        let first = text.lines().find_map(|l| l.trim().strip_prefix('#'))?;
        let head = first.trim().strip_prefix("oxccl tune on ")?;
        let (before, _) = head.split_once(" ranks")?;
        before
            .rsplit(' ')
            .next()?
            .parse()
            .ok()
            .filter(|n| (1..=Self::MAX_RANKS).contains(n))
    }

    /// Every value of `self` this library does not use, as `(key, why)`: a threshold more
    /// than [`Tuning::TRUST_FACTOR`] times away from its built-in value (`oneshot_max`
    /// beyond a slot, [`Tuning::ONESHOT_MAX_LIMIT`]; `cma_min` "never"), a rate more than
    /// that away from [`Rates::NOMINAL`]. `oxccl tune` refuses to save such values, and
    /// [`Tuning::read`] ignores them.
    pub fn implausible(&self) -> Vec<(&'static str, String)> {
        let f = Self::TRUST_FACTOR;
        let mut out = Vec::new();
        let thresholds = [
            (
                "oneshot_max",
                self.oneshot_max,
                ONESHOT_MAX_DEFAULT,
                Self::ONESHOT_MAX_LIMIT,
                format!("the built-in 32 KiB ÷/× {f}, at most a slot"),
            ),
            (
                "cma_min",
                self.cma_min,
                CMA_MIN_DEFAULT,
                CMA_MIN_DEFAULT * f as usize,
                format!("the built-in 64 KiB ÷/× {f}"),
            ),
        ];
        for (key, v, default, hi, rule) in thresholds {
            let lo = (default as f64 / f) as usize;
            if let Some(why) = outside(key, v as f64, lo as f64, hi as f64, &rule) {
                out.push((key, why));
            }
        }
        if let Some(r) = &self.rates {
            for ((key, v), (_, nominal)) in r.entries().into_iter().zip(Rates::NOMINAL.entries()) {
                let rule = format!("the nominal {nominal} ÷/× {f}");
                if let Some(why) = outside(key, v, nominal / f, nominal * f, &rule) {
                    out.push((key, why));
                }
            }
        }
        out
    }

    /// `self` without the values [`Tuning::implausible`] finds, and those values as
    /// `(key, why)`: a threshold takes its built-in value, and one implausible rate drops
    /// them all (the cost model's built-in ones stand).
    pub fn trusted(mut self) -> (Tuning, Vec<(&'static str, String)>) {
        let doubts = self.implausible();
        for (key, _) in &doubts {
            match *key {
                "oneshot_max" => self.oneshot_max = ONESHOT_MAX_DEFAULT,
                "cma_min" => self.cma_min = CMA_MIN_DEFAULT,
                _ => self.rates = None,
            }
        }
        (self, doubts)
    }

    /// Where the measured tuning lives (`None` when `OXCCL_TUNE_FILE` is set empty: no file).
    pub fn path() -> Option<std::path::PathBuf> {
        if let Some(p) = std::env::var_os(table::TUNE_FILE.name) {
            return (!p.is_empty()).then(|| p.into());
        }
        let base = std::env::var_os("XDG_CACHE_HOME")
            .map(std::path::PathBuf::from)
            .or_else(|| {
                std::env::var_os("HOME").map(|h| std::path::PathBuf::from(h).join(".cache"))
            })?;
        Some(base.join("oxccl").join("tune.conf"))
    }

    /// The saved tuning, if any; a malformed file is an error naming it.
    pub fn load() -> Result<Option<Tuning>> {
        match Self::path() {
            Some(path) => Self::read(&path),
            None => Ok(None),
        }
    }

    /// The tuning saved in `path` (`None` when there is no such file); a malformed file is
    /// an error naming it. Values outside sane bounds ([`Tuning::implausible`]) are not
    /// used: a warning names the file and the key, once per process, and the threshold
    /// takes its built-in value (the rates: none of them).
    pub fn read(path: &std::path::Path) -> Result<Option<Tuning>> {
        let text = match crate::base::file::read_bounded(path, Self::MAX_FILE_BYTES) {
            Ok(Some(t)) => t,
            Ok(None) => return Ok(None),
            Err(e) => return Err(Error::Env(format!("tune file {}: {e}", path.display()))),
        };
        let t = Self::parse(&text).map_err(|e| {
            Error::Env(format!(
                "{}: {e} (rerun `oxccl tune` or delete it)",
                path.display()
            ))
        })?;
        let (mut t, dropped) = t.trusted();
        if t.ranks.is_none() {
            let (n, from) = match Self::ranks_in_comment(&text) {
                Some(n) => (n, "as its first comment says"),
                None => (2, "no comment says otherwise"),
            };
            warn_once(format!(
                "{}: no ranks= line (written before `oxccl tune` saved how many ranks it \
                 measured with): oneshot_max={} taken as measured with {n} ranks ({from}); \
                 rerun `oxccl tune`",
                path.display(),
                t.oneshot_max
            ));
            t.ranks = Some(n);
        }
        for (key, why) in dropped {
            let instead = if Rates::KEYS.iter().any(|(k, _)| *k == key) {
                "no rate of the file is used"
            } else {
                "the built-in value is used"
            };
            warn_once(format!(
                "{}: {why}: not used, {instead} (a disturbed `oxccl tune`? rerun it on a quiet \
                 machine, or delete the file)",
                path.display()
            ));
        }
        Ok(Some(t))
    }

    /// Parses the `key=value` form (`#` starts a comment).
    pub fn parse(text: &str) -> std::result::Result<Tuning, String> {
        let (mut oneshot, mut cma, mut ranks) = (None, None, None);
        let mut rates = Rates {
            shm_lat_us: f64::NAN,
            shm_gbps: f64::NAN,
            reduce_gbps: f64::NAN,
            reduce_cached_gbps: f64::NAN,
            copy_gbps: f64::NAN,
            copy_cached_gbps: f64::NAN,
            tcp_lat_us: f64::NAN,
            tcp_gbps: f64::NAN,
        };
        let mut rates_seen = 0;
        for line in text
            .lines()
            .map(|l| l.split('#').next().unwrap_or("").trim())
            .filter(|l| !l.is_empty())
        {
            let (k, v) = line
                .split_once('=')
                .ok_or_else(|| format!("'{line}' is not key=value"))?;
            if let Some((key, field)) = Rates::KEYS.iter().find(|(key, _)| *key == k.trim()) {
                let x: f64 = v
                    .trim()
                    .parse()
                    .ok()
                    .filter(|x: &f64| x.is_finite() && *x > 0.0 && *x <= 1e9)
                    .ok_or_else(|| {
                        format!(
                            "{key}={}: expected a number above 0, at most 1e9",
                            table::shown(v.trim())
                        )
                    })?;
                let slot = field(&mut rates);
                if slot.is_nan() {
                    rates_seen += 1;
                }
                *slot = x;
                continue;
            }
            if k.trim() == "ranks" {
                let n = v
                    .trim()
                    .parse()
                    .ok()
                    .filter(|n| (1..=Self::MAX_RANKS).contains(n))
                    .ok_or_else(|| {
                        format!(
                            "ranks={}: expected a whole number from 1 to {}",
                            table::shown(v.trim()),
                            Self::MAX_RANKS
                        )
                    })?;
                ranks = Some(n);
                continue;
            }
            let (key, param) = match k.trim() {
                "oneshot_max" => ("oneshot_max", &table::ONESHOT_MAX),
                "cma_min" => ("cma_min", &table::CMA_MIN),
                other => return Err(format!("unknown key '{}'", table::shown(other))),
            };
            let v = match param.parse(v) {
                Ok(table::Value::Bytes(b)) => usize::try_from(b).map_err(|e| e.to_string())?,
                Ok(_) => return Err(format!("{key}: not a size")),
                Err(why) => {
                    return Err(format!(
                        "{key}={}: {why}; expected {}",
                        table::shown(v.trim()),
                        param.range()
                    ))
                }
            };
            match key {
                "oneshot_max" => oneshot = Some(v),
                "cma_min" => cma = Some(v),
                other => return Err(format!("unknown key '{other}'")),
            }
        }
        // The rates come all together or not at all (files of older versions have none).
        let rates = match rates_seen {
            0 => None,
            n if n == Rates::KEYS.len() => Some(rates),
            _ => {
                let missing: Vec<&str> = rates
                    .entries()
                    .into_iter()
                    .filter(|(_, v)| v.is_nan())
                    .map(|(k, _)| k)
                    .collect();
                return Err(format!("{} missing", missing.join(", ")));
            }
        };
        Ok(Tuning {
            oneshot_max: oneshot.ok_or("oneshot_max missing")?,
            cma_min: cma.ok_or("cma_min missing")?,
            ranks,
            rates,
        })
    }

    /// The file's text.
    pub fn render(&self, comment: &str) -> String {
        let mut s = format!(
            "# {comment}\noneshot_max={}\ncma_min={}\n",
            self.oneshot_max, self.cma_min
        );
        if let Some(n) = self.ranks {
            s.push_str(&format!(
                "# the ranks the thresholds were measured with\nranks={n}\n"
            ));
        }
        if let Some(r) = &self.rates {
            s.push_str("# rates for the multi-host cost model (oxccl sim, plan/cost.rs)\n");
            for (k, v) in r.entries() {
                s.push_str(&format!("{k}={v}\n"));
            }
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// [`Config::rates`] carries every rate, in order.
    #[test]
    fn rates_ride_in_the_config() {
        let r = Rates {
            shm_lat_us: 1.5,
            tcp_gbps: 1.75,
            ..Rates::NOMINAL
        };
        let cfg = Config {
            rates: Some(r.raw()),
            ..Config::default()
        };
        assert_eq!(Rates::of(&cfg), Some(r));
        assert_eq!(Rates::of(&Config::default()), None);
    }

    /// The warnings this test process announced about the file `path`.
    fn announced_about(path: &std::path::Path) -> Vec<String> {
        crate::base::debug::ANNOUNCED
            .lock()
            .unwrap()
            .iter()
            .filter(|m| m.starts_with(&path.display().to_string()))
            .cloned()
            .collect()
    }

    #[test]
    fn tuning_file() {
        let t = Tuning {
            oneshot_max: 4096,
            cma_min: 1 << 20,
            ranks: Some(2),
            rates: None,
        };
        assert_eq!(Tuning::parse(&t.render("measured")).unwrap(), t);
        // With the cost model's rates: every one reads back; all or none must be there.
        let rates = Rates {
            shm_lat_us: 1.5,
            shm_gbps: 3.25,
            reduce_gbps: 2.0,
            reduce_cached_gbps: 9.5,
            copy_gbps: 4.0,
            copy_cached_gbps: 20.0,
            tcp_lat_us: 12.125,
            tcp_gbps: 1.75,
        };
        let full = Tuning {
            rates: Some(rates),
            ..t.clone()
        };
        let text = full.render("measured");
        assert_eq!(Tuning::parse(&text).unwrap(), full);
        assert!(text.contains("tcp_gbps=1.75\n"), "{text}");
        let partial: String = text
            .lines()
            .filter(|l| !l.starts_with("tcp_"))
            .map(|l| format!("{l}\n"))
            .collect();
        let e = Tuning::parse(&partial).unwrap_err();
        assert!(e.contains("tcp_lat_us, tcp_gbps missing"), "{e}");
        for bad in ["0", "-1", "nan", "inf", "x", "2e9"] {
            let e = Tuning::parse(&text.replace("tcp_gbps=1.75", &format!("tcp_gbps={bad}")))
                .unwrap_err();
            assert!(e.starts_with("tcp_gbps="), "{bad}: {e}");
        }
        assert!(Tuning::parse("oneshot_max=1\n").is_err());
        assert!(Tuning::parse("oneshot_max=1\ncma_min=2\nfoo=3").is_err());
        // "never" as oxccl tune writes it reads back
        let never = Tuning {
            oneshot_max: 0,
            cma_min: table::MAX_THRESHOLD as usize,
            ranks: None,
            rates: None,
        };
        assert_eq!(Tuning::parse(&never.render("never")).unwrap(), never);
        for bad in ["0", "x", "65537"] {
            let e = Tuning::parse(&format!("oneshot_max=1\ncma_min=2\nranks={bad}")).unwrap_err();
            assert!(e.starts_with("ranks="), "{bad}: {e}");
        }
    }

    /// `oneshot_max` measured with n ranks: a communicator takes it as n-1 times its
    /// two-rank limit (the measured size again at n ranks), and a file from before `ranks=`
    /// says its rank count only in its comment: read from there, with a warning.
    #[test]
    fn oneshot_max_says_the_ranks_it_was_measured_with() {
        let four = Tuning {
            oneshot_max: 64 << 10,
            cma_min: 1 << 20,
            ranks: Some(4),
            rates: None,
        };
        let text = four.render("oxccl tune on host, 4 ranks");
        assert!(text.contains("\nranks=4\n"), "{text}");
        assert_eq!(Tuning::parse(&text).unwrap(), four);
        // 21846 with two ranks; 3 x 21846 >= 64 KiB with four.
        assert_eq!(four.two_rank_oneshot_max(), 21846);
        assert!(3 * four.two_rank_oneshot_max() >= 64 << 10);
        let two = Tuning {
            ranks: Some(2),
            ..four.clone()
        };
        assert_eq!(two.two_rank_oneshot_max(), 64 << 10);
        let one = Tuning {
            ranks: Some(1),
            ..four.clone()
        };
        assert_eq!(one.two_rank_oneshot_max(), 64 << 10);

        let path = std::env::temp_dir().join(format!("oxccl-old-tune-{}.conf", std::process::id()));
        let old: String = text
            .lines()
            .filter(|l| !l.contains("ranks=") && !l.contains("measured with"))
            .map(|l| format!("{l}\n"))
            .collect();
        std::fs::write(&path, &old).unwrap();
        for _ in 0..2 {
            let read = Tuning::read(&path).unwrap().unwrap();
            assert_eq!(read.ranks, Some(4), "from the comment: {old}");
            assert_eq!(read.two_rank_oneshot_max(), 21846);
        }
        std::fs::write(&path, old.replace("4 ranks", "many ranks")).unwrap();
        assert_eq!(Tuning::read(&path).unwrap().unwrap().ranks, Some(2));
        let said = announced_about(&path);
        assert_eq!(said.len(), 2, "once per file content: {said:?}");
        assert!(
            said[0].contains("taken as measured with 4 ranks"),
            "{said:?}"
        );
        assert!(
            said[1].contains("taken as measured with 2 ranks"),
            "{said:?}"
        );
        let _ = std::fs::remove_file(path);
    }

    /// A tune file from a disturbed `oxccl tune` (single-copy never the fastest, a link
    /// latency of 56 ms) is read without its implausible values, each named once.
    #[test]
    fn implausible_values_of_a_tune_file_are_not_used() {
        let path =
            std::env::temp_dir().join(format!("oxccl-implausible-{}.conf", std::process::id()));
        let good = Rates {
            shm_lat_us: 2.0,
            ..Rates::NOMINAL
        };
        let t = Tuning {
            oneshot_max: 16 << 10,
            cma_min: table::MAX_THRESHOLD as usize,
            ranks: Some(2),
            rates: Some(good),
        };
        std::fs::write(&path, t.render("loaded")).unwrap();
        let read = Tuning::read(&path).unwrap().unwrap();
        assert_eq!(
            read.cma_min, CMA_MIN_DEFAULT,
            "never single-copy is not used"
        );
        assert_eq!(read.oneshot_max, 16 << 10, "a sane threshold stays");
        assert_eq!(read.rates, Some(good), "sane rates stay");
        let bad = Tuning {
            oneshot_max: 1 << 20,
            cma_min: 128 << 10,
            ranks: Some(2),
            rates: Some(Rates {
                shm_lat_us: 56_000.0,
                ..good
            }),
        };
        std::fs::write(&path, bad.render("loaded")).unwrap();
        for _ in 0..2 {
            let read = Tuning::read(&path).unwrap().unwrap();
            assert_eq!(read.oneshot_max, ONESHOT_MAX_DEFAULT, "past a slot");
            assert_eq!(read.cma_min, 128 << 10);
            assert_eq!(read.rates, None, "one absurd rate drops them all");
        }
        let said = announced_about(&path);
        assert_eq!(said.len(), 3, "once each, naming file and key: {said:?}");
        for key in [
            "cma_min=1099511627776 (never)",
            "oneshot_max=1048576",
            "shm_lat_us=56000",
        ] {
            assert!(said.iter().any(|m| m.contains(key)), "{key}: {said:?}");
        }
        assert!(bad.implausible().len() == 2 && t.implausible().len() == 1);
        let _ = std::fs::remove_file(path);
    }
}
