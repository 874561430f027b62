#![no_main]
//! Fuzz target: see `oxccl::fuzzing::rendezvous_messages`.
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| oxccl::fuzzing::rendezvous_messages(data));
