#![no_main]
//! Fuzz target: see `oxccl::fuzzing::handshake`.
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| oxccl::fuzzing::handshake(data));
