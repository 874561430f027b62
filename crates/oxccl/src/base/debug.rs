//! Debug output by subsystem, as NCCL's `NCCL_DEBUG` / `NCCL_DEBUG_SUBSYS`.
//!
//! `OXCCL_DEBUG=warn|info|debug|trace` switches logging on (to stderr, each line prefixed by
//! the process id); `OXCCL_DEBUG_SUBSYS=init,bootstrap,shm,net,coll,tune` (comma-separated,
//! default all) limits it to subsystems. oxccl installs a subscriber only if the program has
//! none; a program with its own `tracing` subscriber filters on the targets below.

/// The `tracing` targets of each subsystem name accepted by `OXCCL_DEBUG_SUBSYS`.
pub(crate) const SUBSYSTEMS: &[(&str, &[&str])] = &[
    ("init", &["oxccl::comm", "oxccl::bootstrap::topo"]),
    ("bootstrap", &["oxccl::bootstrap", "oxccl::net"]),
    ("shm", &["oxccl::transport::shm", "oxccl::direct::shm"]),
    ("net", &["oxccl::transport::tcp"]),
    (
        "coll",
        &[
            "oxccl::exec",
            "oxccl::sched",
            "oxccl::direct::exec",
            "oxccl::direct::cma",
            "oxccl::direct::oneshot",
        ],
    ),
    ("tune", &["oxccl::plan::tune"]),
];

/// The filter directives for a level and a subsystem list (`None` = all subsystems).
pub(crate) fn directives(level: &str, subsys: Option<&str>) -> Result<String, String> {
    let level = level.trim().to_ascii_lowercase();
    if !["error", "warn", "info", "debug", "trace"].contains(&level.as_str()) {
        return Err(format!(
            "OXCCL_DEBUG={level}: expected warn, info, debug or trace"
        ));
    }
    let Some(subsys) = subsys.filter(|s| !s.trim().is_empty() && !s.eq_ignore_ascii_case("all"))
    else {
        return Ok(format!("oxccl={level}"));
    };
    let mut out = Vec::new();
    for name in subsys.split(',').map(|s| s.trim().to_ascii_lowercase()) {
        let targets = SUBSYSTEMS
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, t)| *t)
            .ok_or_else(|| {
                let names: Vec<_> = SUBSYSTEMS.iter().map(|(n, _)| *n).collect();
                format!(
                    "OXCCL_DEBUG_SUBSYS: unknown subsystem '{name}' (known: {})",
                    names.join(", ")
                )
            })?;
        out.extend(targets.iter().map(|t| format!("{t}={level}")));
    }
    Ok(out.join(","))
}

/// Installs a stderr subscriber per `OXCCL_DEBUG`/`OXCCL_DEBUG_SUBSYS`, once per process, if
/// `OXCCL_DEBUG` is set and the program has no subscriber of its own. A malformed setting is
/// reported on stderr and ignored (logging must never stop a job).
pub(crate) fn init_from_env() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        use crate::base::param::table::{DEBUG, DEBUG_SUBSYS};
        let (level, subsys) = match (DEBUG.choice(), DEBUG_SUBSYS.text()) {
            (Ok(None), _) => return,
            (Ok(Some(level)), Ok(subsys)) => (level, subsys),
            // Reported once here; `Config::from_env` refuses it at init.
            (Err(e), _) | (_, Err(e)) => return eprintln!("oxccl: {e}"),
        };
        match directives(level, subsys.as_deref()) {
            Ok(d) => {
                let pid = std::process::id();
                let _ = tracing_subscriber::fmt()
                    .with_env_filter(tracing_subscriber::EnvFilter::new(d))
                    .with_writer(std::io::stderr)
                    .with_target(true)
                    .with_thread_names(false)
                    .fmt_fields(tracing_subscriber::fmt::format::DefaultFields::new())
                    .event_format(tracing_subscriber::fmt::format().with_ansi(false).compact())
                    .try_init()
                    .map(|_| tracing::info!(target: "oxccl::comm", pid, "oxccl debug output on"));
            }
            Err(e) => eprintln!("oxccl: {e}"),
        }
    });
}

/// Tells the user something they must see whatever `OXCCL_DEBUG` says (a warning about the
/// setup, what a start-up waits for): through `tracing` when a subscriber is installed, else
/// on stderr as `oxccl: MSG`.
pub(crate) fn announce(msg: &str) {
    #[cfg(test)]
    ANNOUNCED
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push(msg.to_string());
    if tracing::dispatcher::has_been_set() {
        tracing::warn!(target: "oxccl::init", "{msg}");
    } else {
        eprintln!("oxccl: {msg}");
    }
}

/// Every line [`announce`] printed in this test process, for tests that check them.
#[cfg(test)]
pub(crate) static ANNOUNCED: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builds_directives() {
        assert_eq!(directives("info", None).unwrap(), "oxccl=info");
        assert_eq!(
            directives("DEBUG", Some("shm,net")).unwrap(),
            "oxccl::transport::shm=debug,oxccl::direct::shm=debug,oxccl::transport::tcp=debug"
        );
        assert!(directives("loud", None).is_err());
        assert!(directives("info", Some("gpu"))
            .unwrap_err()
            .contains("known: init"));
    }
}
