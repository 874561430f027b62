//! TCP transport.

use crate::bootstrap::Exchange;
use crate::error::Result;
use crate::param::Config;
use crate::transport::Link;

/// Placeholder until the TCP transport lands.
pub fn connect(
    _ex: &mut dyn Exchange,
    _peers: &[(usize, std::net::IpAddr)],
    _secret: &[u8; 16],
    _cfg: &Config,
) -> Result<Vec<(usize, Box<dyn Link>)>> {
    todo!("tcp")
}
