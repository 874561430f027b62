//! Shared-memory transport between ranks of one host.
