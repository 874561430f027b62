//! Entry points for the fuzz targets in `fuzz/` (and their bounded stable run in the
//! tests): every decoder of bytes that come from the network, fed arbitrary input. Each
//! must return (an error or a value) without panicking, allocating beyond its limit, or
//! hanging.

use std::io::{self, Read, Write};

use crate::fault::control::Frame;
use crate::fault::fingerprint::{CallPrint, Fingerprint, Header, HEADER_BYTES};
use crate::net::auth::{self, Hello, Purpose};

/// A call header as the executor receives it, checked against a call.
pub fn call_header(data: &[u8]) {
    let n = data.len().min(HEADER_BYTES);
    let mut h = [0u8; HEADER_BYTES];
    h[..n].copy_from_slice(&data[..n]);
    let print = CallPrint {
        fp: Fingerprint::default(),
        send_seq: 1,
        recv_seq: 1,
        call_seq: 1,
    };
    if let Ok(hd) = Header::decode(&h) {
        let _ = print.check(&hd);
        let _ = hd.fp.to_string();
        assert_eq!(Header::decode(&hd.encode()), Ok(hd));
    }
    let _ = Header::decode(data);
}

/// A stream of watchdog control frames.
pub fn control_frames(data: &[u8]) {
    let mut at = 0;
    while at < data.len() {
        match Frame::decode(&data[at..]) {
            Ok(Some((f, n))) => {
                assert!(n > 0 && n <= data.len() - at);
                let _ = f.encode();
                at += n;
            }
            Ok(None) | Err(_) => break,
        }
    }
}

/// Rendezvous frames (length-prefixed), join messages, peer records and port exchanges.
pub fn rendezvous_messages(data: &[u8]) {
    let mut r = data;
    while let Ok(f) = auth::read_frame(&mut r, 1 << 16) {
        let _ = crate::bootstrap::parse_join(&f);
        let mut p = &f[..];
        let _ = crate::bootstrap::PeerInfo::decode(&mut p);
        let _ = crate::transport::tcp::decode_blob(&f);
    }
    let _ = crate::bootstrap::parse_join(data);
    let _ = crate::transport::tcp::decode_blob(data);
}

/// A stream that reads `data` and swallows writes.
struct Scripted<'a> {
    data: &'a [u8],
}

impl Read for Scripted<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.data.read(buf)
    }
}

impl Write for Scripted<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Both sides of the authentication handshake against arbitrary peer bytes (the first
/// byte picks the side).
pub fn handshake(data: &[u8]) {
    let secret = [7u8; 16];
    let Some((&side, rest)) = data.split_first() else {
        return;
    };
    let mut s = Scripted { data: rest };
    if side & 1 == 0 {
        let _ = auth::server_handshake(&mut s, &secret, Purpose::Data, 42, 0, "fuzz");
    } else {
        let hello = Hello {
            rank: 1,
            purpose: Purpose::Rendezvous,
            tag: 42,
        };
        let _ = auth::client_handshake(&mut s, &secret, &hello, 1, "fuzz");
    }
}

/// A fuzz target's body.
pub type Target = fn(&[u8]);

/// Every target by name (for the stable runner and the tests).
pub const TARGETS: [(&str, Target); 4] = [
    ("call_header", call_header),
    ("control_frame", control_frames),
    ("rendezvous_messages", rendezvous_messages),
    ("handshake", handshake),
];
