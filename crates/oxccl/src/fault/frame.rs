//! The control plane's wire frames (see [`crate::fault::control`]): `u32` length (LE, of
//! what follows), type byte, payload. Types: 1 heartbeat (no payload), 2 failure (`u32`
//! origin, kind byte, `u32` lost peer or `u32::MAX`, UTF-8 message), 3 goodbye, 4 the hub's
//! goodbye (`u32` next hub, then the `u32` ranks it still watched). Frames over [`MAX_FRAME`]
//! are a protocol violation.

use crate::base::error::FailureKind;

/// Largest control frame accepted (length field).
pub const MAX_FRAME: usize = 8 << 10;
const T_HEARTBEAT: u8 = 1;
const T_FAIL: u8 = 2;
const T_BYE: u8 = 3;
const T_HANDOVER: u8 = 4;
const NO_PEER: u32 = u32::MAX;
const MAX_MSG: usize = 4000;

/// A decoded control frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    /// "I am alive."
    Heartbeat,
    /// A failure: `origin` failed with `kind`; `peer` is the lost rank for a lost peer.
    Fail {
        /// The failing (or reporting) rank.
        origin: u32,
        /// What happened.
        kind: FailureKind,
        /// The lost rank, for [`FailureKind::PeerLost`].
        peer: Option<u32>,
        /// The error's text.
        msg: String,
    },
    /// "I dropped my communicator."
    Bye,
    /// The goodbye of a star's hub: "I dropped my communicator; rank `next` is the hub now,
    /// and `live` are the ranks I still watched (`next` among them)".
    Handover {
        /// The new hub.
        next: u32,
        /// The ranks the old hub still watched: the new hub expects each to connect.
        live: Vec<u32>,
    },
}

impl Frame {
    /// The wire form.
    pub fn encode(&self) -> Vec<u8> {
        let mut body = Vec::new();
        match self {
            Frame::Heartbeat => body.push(T_HEARTBEAT),
            Frame::Bye => body.push(T_BYE),
            Frame::Handover { next, live } => {
                body.push(T_HANDOVER);
                body.extend_from_slice(&next.to_le_bytes());
                // At most what fits a frame (2047 ranks: a star has at most
                // `OXCCL_BOOTSTRAP_RELAY_MAX` of them).
                for r in live.iter().take((MAX_FRAME - 5) / 4) {
                    body.extend_from_slice(&r.to_le_bytes());
                }
            }
            Frame::Fail {
                origin,
                kind,
                peer,
                msg,
            } => {
                body.push(T_FAIL);
                body.extend_from_slice(&origin.to_le_bytes());
                body.push(kind.code());
                body.extend_from_slice(&peer.unwrap_or(NO_PEER).to_le_bytes());
                let mut end = msg.len().min(MAX_MSG);
                while !msg.is_char_boundary(end) {
                    end -= 1;
                }
                body.extend_from_slice(&msg.as_bytes()[..end]);
            }
        }
        let mut out = (body.len() as u32).to_le_bytes().to_vec();
        out.extend_from_slice(&body);
        out
    }

    /// Takes one frame from the front of `buf`: `Ok(Some((frame, bytes used)))`, `Ok(None)`
    /// when more bytes are needed, `Err` when the bytes cannot be a frame.
    pub fn decode(buf: &[u8]) -> Result<Option<(Frame, usize)>, String> {
        if buf.len() < 4 {
            return Ok(None);
        }
        let len = u32::from_le_bytes(buf[..4].try_into().expect("4 bytes")) as usize;
        if len == 0 || len > MAX_FRAME {
            return Err(format!("control frame of {len} bytes (1 to {MAX_FRAME})"));
        }
        if buf.len() < 4 + len {
            return Ok(None);
        }
        let body = &buf[4..4 + len];
        let f = match body[0] {
            T_HEARTBEAT if len == 1 => Frame::Heartbeat,
            T_BYE if len == 1 => Frame::Bye,
            T_HANDOVER if len >= 5 && (len - 5).is_multiple_of(4) => Frame::Handover {
                next: u32::from_le_bytes(body[1..5].try_into().expect("4 bytes")),
                live: body[5..]
                    .chunks_exact(4)
                    .map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")))
                    .collect(),
            },
            T_FAIL if len >= 10 => {
                let origin = u32::from_le_bytes(body[1..5].try_into().expect("4 bytes"));
                let kind = FailureKind::from_code(body[5]);
                let peer = u32::from_le_bytes(body[6..10].try_into().expect("4 bytes"));
                Frame::Fail {
                    origin,
                    kind,
                    peer: (peer != NO_PEER).then_some(peer),
                    msg: String::from_utf8_lossy(&body[10..]).into_owned(),
                }
            }
            t => return Err(format!("control frame of type {t} and {len} bytes")),
        };
        Ok(Some((f, 4 + len)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_and_reject_junk() {
        for f in [
            Frame::Heartbeat,
            Frame::Bye,
            Frame::Handover {
                next: 2,
                live: vec![2, 3, 7],
            },
            Frame::Handover {
                next: 1,
                live: vec![],
            },
            Frame::Fail {
                origin: 3,
                kind: FailureKind::Mismatch,
                peer: None,
                msg: "rank 3: call #2 mismatch".into(),
            },
            Frame::Fail {
                origin: 0,
                kind: FailureKind::PeerLost,
                peer: Some(5),
                msg: "é".repeat(3000),
            },
        ] {
            let b = f.encode();
            let (g, n) = Frame::decode(&b).unwrap().unwrap();
            assert_eq!(n, b.len());
            if let Frame::Fail { msg, .. } = &g {
                assert!(msg.len() <= MAX_MSG);
            } else {
                assert_eq!(g, f);
            }
            assert_eq!(Frame::decode(&b[..b.len() - 1]).unwrap(), None);
        }
        assert!(Frame::decode(&[0, 0, 0, 0]).is_err());
        assert!(Frame::decode(&[255, 255, 255, 255]).is_err());
        assert!(Frame::decode(&[1, 0, 0, 0, 9]).is_err());
        assert!(Frame::decode(&[2, 0, 0, 0, 1, 1]).is_err());
        assert!(Frame::decode(&[3, 0, 0, 0, 4, 1, 0]).is_err());
        assert!(Frame::decode(&[6, 0, 0, 0, 4, 1, 0, 0, 0, 2]).is_err());
    }
}
