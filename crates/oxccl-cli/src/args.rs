//! Value parsers of the command-line flags: every value-taking flag has a range, checked by
//! clap before anything runs; an error names the flag (clap), the value and the accepted
//! range (from [`oxccl::params::Kind::range`], the same words as the environment's table).

use oxccl::params::{Kind, Value};

/// The largest rank a flag accepts (a world holds at most 65536 ranks).
pub const MAX_RANK: u64 = 65_535;
/// The most ranks `oxccl run`, `perf` and `tune` start on one host.
pub const MAX_LOCAL_RANKS: u64 = 1024;
/// The most iterations (timed, warm-up, or before an injected failure) `oxccl perf` runs.
pub const MAX_ITERS: u64 = 10_000_000;
/// The largest buffer size `oxccl perf` accepts (1 TiB; what fits this host is checked
/// before any rank starts).
pub const MAX_PERF_BYTES: u64 = 1 << 40;

fn parse(kind: Kind, s: &str) -> Result<Value, String> {
    kind.parse(s).map_err(|why| kind.arg_error(s, &why))
}

/// A whole number from `min` to `max`.
pub fn count(min: u64, max: u64) -> impl Fn(&str) -> Result<usize, String> + Clone {
    move |s| match parse(Kind::Count { min, max }, s)? {
        Value::Count(n) => usize::try_from(n).map_err(|e| e.to_string()),
        v => Err(format!("{v:?} is not a count")),
    }
}

/// A byte size (K, M, G suffixes) from `min` to `max`.
pub fn bytes(min: u64, max: u64) -> impl Fn(&str) -> Result<usize, String> + Clone {
    move |s| match parse(Kind::Bytes { min, max }, s)? {
        Value::Bytes(n) => usize::try_from(n).map_err(|e| e.to_string()),
        v => Err(format!("{v:?} is not a size")),
    }
}

/// A number above 0 (fractions allowed), at most `max` (every flag has a lower bound too:
/// [`number_in`]).
#[cfg(test)]
pub fn number(max: f64) -> impl Fn(&str) -> Result<f64, String> + Clone {
    number_in(0.0, max)
}

/// A number from `min` (above 0; fractions allowed) to `max`.
pub fn number_in(min: f64, max: f64) -> impl Fn(&str) -> Result<f64, String> + Clone {
    move |s| match parse(Kind::Number { min, max }, s)? {
        Value::Number(x) => Ok(x),
        v => Err(format!("{v:?} is not a number")),
    }
}

/// Seconds from [`oxccl::params::MIN_SECS`] (fractions allowed) to `max`.
pub fn seconds(max: f64) -> impl Fn(&str) -> Result<f64, String> + Clone {
    let min = oxccl::params::MIN_SECS;
    move |s| match parse(
        Kind::Seconds {
            zero: false,
            min,
            max,
        },
        s,
    )? {
        Value::Seconds(d) => Ok(d.as_secs_f64()),
        v => Err(format!("{v:?} is not seconds")),
    }
}

/// One of `words` (case-insensitive), as the list spells it.
pub fn word(words: &'static [&'static str]) -> impl Fn(&str) -> Result<String, String> + Clone {
    move |s| match parse(Kind::Enum(words), s)? {
        Value::Choice(w) => Ok(w.to_string()),
        v => Err(format!("{v:?} is not a word")),
    }
}

/// Text of at most `max_len` bytes (a path, a name).
pub fn text(max_len: usize) -> impl Fn(&str) -> Result<String, String> + Clone {
    move |s| match parse(Kind::Text { max_len }, s)? {
        Value::Text(t) => Ok(t),
        v => Err(format!("{v:?} is not text")),
    }
}

/// An algorithm name of [`oxccl::Algo`].
pub fn algo(s: &str) -> Result<String, String> {
    let t = text(64)(s)?;
    t.parse::<oxccl::Algo>()
        .map(|_| t.to_ascii_lowercase())
        .map_err(|e| format!("'{}': {e}", oxccl::params::shown(s)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_and_messages() {
        assert_eq!(count(1, 16)("16").unwrap(), 16);
        for bad in ["0", "17", "-3", "1e99", "18446744073709551616", "", "x"] {
            let e = count(1, 16)(bad).unwrap_err();
            assert!(e.contains("from 1 to 16") && e.contains(bad), "{e}");
        }
        assert_eq!(bytes(0, MAX_PERF_BYTES)("1G").unwrap(), 1 << 30);
        let e = bytes(0, MAX_PERF_BYTES)("18446744073709551615").unwrap_err();
        assert!(e.contains("to 1024G"), "{e}");
        assert_eq!(seconds(10.0)("1.5").unwrap(), 1.5);
        for bad in ["0", "1e99", "inf", "NaN", "-1"] {
            assert!(seconds(10.0)(bad).unwrap_err().contains("above 0"), "{bad}");
        }
        assert_eq!(number(10.0)("2.5").unwrap(), 2.5);
        for bad in ["0", "-1", "11", "inf", "NaN", "x", ""] {
            assert!(
                number(10.0)(bad).unwrap_err().contains("at most 10"),
                "{bad}"
            );
        }
        assert_eq!(word(&["auto", "tcp"])("TCP").unwrap(), "tcp");
        assert!(algo("ring").is_ok() && algo("nope").unwrap_err().contains("nope"));
    }
}
