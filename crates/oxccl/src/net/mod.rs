//! The authenticated socket layer shared by the rendezvous (`bootstrap`) and the TCP
//! transport: the handshake ([`auth`]), the listener that admits strangers ([`accept`]) and the
//! dial that connects, authenticates and retries ([`dial`]).

pub(crate) mod accept;
pub mod auth;
pub(crate) mod dial;
