//! `Config::from_env` against the table, in a process of its own (it sets variables): every
//! variable a communicator or the library reads, fed garbage, negative, zero, huge and empty
//! values, either is accepted (and lands in the `Config` within its range) or is an error
//! naming it, the value and the range. One test function: nothing else runs while it sets
//! the environment.

use oxccl::params::{Scope, PARAMS};
use oxccl::Config;

const HOSTILE: &[&str] = &[
    "garbage",
    "-3",
    "0",
    "1e99",
    "18446744073709551615",
    "18446744073709551616",
    "99999999999",
    "inf",
    "",
    "1K",
    "1.5",
];

#[test]
fn from_env_refuses_or_accepts_every_value() {
    std::env::set_var("OXCCL_TUNE_FILE", "");
    let (mut ok, mut refused) = (0, 0);
    for p in PARAMS
        .iter()
        .filter(|p| matches!(p.scope, Scope::Comm | Scope::Process))
    {
        let before = std::env::var_os(p.name);
        for v in HOSTILE {
            std::env::set_var(p.name, v);
            let table = p.parse_set(v);
            match Config::from_env() {
                Ok(c) => {
                    // The table accepted it too (or it is this test's own empty tune file).
                    assert!(
                        table.is_ok(),
                        "{}={v:?}: from_env accepted what the table refuses",
                        p.name
                    );
                    ok += 1;
                    if p.name == "OXCCL_TIMEOUT" && !v.is_empty() {
                        assert!(c.timeout.as_secs_f64() <= oxccl::params::MAX_SECS);
                    }
                }
                Err(e) => {
                    let m = e.to_string();
                    assert!(
                        table.is_err(),
                        "{}={v:?}: the table accepts it but from_env says {m}",
                        p.name
                    );
                    assert!(
                        m.contains(p.name) && m.contains(&p.range()) && m.len() < 400,
                        "{}={v:?}: {m}",
                        p.name
                    );
                    refused += 1;
                }
            }
        }
        match before {
            Some(b) => std::env::set_var(p.name, b),
            None => std::env::remove_var(p.name),
        }
    }
    assert!(ok > 50 && refused > 100, "{ok} accepted, {refused} refused");
}
