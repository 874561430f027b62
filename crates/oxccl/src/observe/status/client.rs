//! The client's side: `oxccl status` asks an agent ([`ask`]) and checks that the answer's MAC
//! proves the job's secret, which it finds as a process of the job would
//! ([`secret_from_env`]).

use std::fmt::Write as _;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use super::{MAC_CONTEXT, MAX_ANSWER, NOT_THIS_JOB};
use crate::net::auth;

/// Parses a secret written as 32 hex digits (surrounding whitespace allowed), as the
/// bootstrap reads `OXCCL_SECRET`.
pub fn parse_secret(s: &str) -> Option<[u8; 16]> {
    crate::bootstrap::parse_secret_hex(s.trim())
}

/// `b` as lowercase hex digits.
pub(super) fn hex(b: &[u8]) -> String {
    b.iter()
        .fold(String::with_capacity(2 * b.len()), |mut s, x| {
            let _ = write!(s, "{x:02x}");
            s
        })
}

/// The job's secret as a process started with this environment has it (for `oxccl status`):
/// `OXCCL_SECRET`, else the one derived from the rendezvous address and the launcher's job
/// id (as [`crate::Communicator::from_env`] derives it).
pub fn secret_from_env() -> Result<[u8; 16], String> {
    let get = |n: &str| std::env::var(n).ok();
    if let Some(s) = get(crate::base::param::table::SECRET.name) {
        return parse_secret(&s)
            .ok_or_else(|| "OXCCL_SECRET must be 32 hex digits (16 bytes)".to_string());
    }
    // The derivation does not depend on the rank: stand in for one where none is set.
    let has_root = get("OXCCL_ROOT").is_some() || get("MASTER_ADDR").is_some();
    if !has_root {
        return Err("no job secret: set OXCCL_SECRET (or --secret) to the job's, or OXCCL_ROOT/MASTER_ADDR and MASTER_PORT as the job had them".into());
    }
    let launcher = ["RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK"]
        .iter()
        .any(|v| get(v).is_some());
    crate::bootstrap::env::LaunchEnv::from_vars(|n| match n {
        "RANK" if !launcher => Some("0".into()),
        "WORLD_SIZE" if !launcher => Some("1".into()),
        _ => get(n),
    })
    .map(|e| e.secret)
    .map_err(|e| e.to_string())
}

/// What the MAC of `answer` to request `word` with `nonce` covers (the module docs): the
/// parts of one [`auth::mac_tag`], in order.
pub(super) fn mac_parts<'a>(nonce: &'a [u8; 16], word: &'a str, answer: &'a str) -> [&'a [u8]; 5] {
    [
        MAC_CONTEXT,
        nonce,
        word.as_bytes(),
        b"\0",
        answer.as_bytes(),
    ]
}

/// Asks the agent at `addr` for `request`, with a fresh nonce: the answer line once its MAC
/// proves the agent knows `secret` (an error of kind `PermissionDenied` saying
/// [`NOT_THIS_JOB`] otherwise); bounded in time and size. Without `secret`, no nonce is sent
/// and the answer is taken as it is.
pub fn ask(
    addr: SocketAddr,
    request: &str,
    secret: Option<&[u8; 16]>,
    timeout: Duration,
) -> std::io::Result<String> {
    let deadline = Instant::now() + timeout;
    let s = TcpStream::connect_timeout(&addr, timeout)?;
    s.set_write_timeout(Some(timeout))?;
    let mut words = request.split_whitespace();
    let word = words.next().unwrap_or("").to_string();
    let rest: Vec<&str> = words.collect();
    let mut nonce = [0u8; 16];
    let line = match secret {
        Some(_) => {
            getrandom::fill(&mut nonce).map_err(|e| std::io::Error::other(e.to_string()))?;
            let mut l = format!("{word} {}", hex(&nonce));
            for w in rest {
                l.push(' ');
                l.push_str(w);
            }
            l
        }
        None => request.to_string(),
    };
    (&s).write_all(format!("{line}\n").as_bytes())?;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 16384];
    loop {
        let left = deadline
            .checked_duration_since(Instant::now())
            .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::TimedOut, "timed out"))?;
        s.set_read_timeout(Some(left.max(Duration::from_millis(1))))?;
        let n = (&s).read(&mut chunk)?;
        if n == 0 {
            break;
        }
        buf.extend_from_slice(&chunk[..n]);
        if buf.len() > MAX_ANSWER {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                "answer too long",
            ));
        }
    }
    let text = String::from_utf8_lossy(&buf);
    let mut lines = text.lines();
    let answer = lines.next().unwrap_or("").to_string();
    if answer.is_empty() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            "no answer",
        ));
    }
    let Some(secret) = secret else {
        return Ok(answer);
    };
    let denied = || std::io::Error::new(std::io::ErrorKind::PermissionDenied, NOT_THIS_JOB);
    let tag = lines
        .next()
        .and_then(|l| l.strip_prefix("mac "))
        .map(str::trim)
        .filter(|t| t.len() == 64)
        .ok_or_else(denied)?;
    let tag: Vec<u8> = (0..32)
        .map(|i| u8::from_str_radix(&tag[2 * i..2 * i + 2], 16))
        .collect::<Result<_, _>>()
        .map_err(|_| denied())?;
    if !auth::mac_matches(secret, &mac_parts(&nonce, &word, &answer), &tag) {
        return Err(denied());
    }
    Ok(answer)
}
