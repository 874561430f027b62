//! Mutual authentication of every connection (rendezvous and data) by the shared secret.
