//! The authenticated socket layer shared by the rendezvous (`bootstrap`) and the TCP
//! transport: the handshake ([`auth`]) and the listener that admits strangers ([`accept`]).

pub(crate) mod accept;
pub mod auth;
