//! Failure detection and agreement: each rank's health, the control plane between ranks
//! (heartbeats, aborts) and the call fingerprints that detect mismatched calls.

pub mod control;
pub mod fingerprint;
pub(crate) mod frame;
pub mod health;
pub(crate) mod watchdog;
