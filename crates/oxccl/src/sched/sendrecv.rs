//! Point-to-point: send, receive, or both at once (a one-step schedule). A rank that sends to
//! and receives from itself copies locally.

use super::{Buf, BufRange, Coll, CollKind, Combine, Local, Schedule, Xfer};

/// The direct schedule for a send, a receive or a sendrecv.
pub(crate) fn schedule(c: &Coll) -> Schedule {
    let bytes = c.count * c.dtype.size();
    let input = BufRange::new(Buf::Input, 0, bytes);
    let output = BufRange::new(Buf::Output, 0, bytes);
    let mut s = Schedule::new("direct");
    match c.kind {
        CollKind::SendRecv { to, from } if to == c.rank && from == c.rank => {
            s.push_local(Local::Copy {
                src: input,
                dst: output,
            });
        }
        CollKind::SendRecv { to, from } => s.push_xfers([
            Xfer::Send {
                peer: to,
                src: input,
            },
            Xfer::Recv {
                peer: from,
                dst: output,
                combine: Combine::Store,
            },
        ]),
        CollKind::Send { peer } => s.push_xfers([Xfer::Send { peer, src: input }]),
        CollKind::Recv { peer } => s.push_xfers([Xfer::Recv {
            peer,
            dst: output,
            combine: Combine::Store,
        }]),
        _ => {}
    }
    s
}
