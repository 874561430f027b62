#![no_main]
//! Fuzz target: see `oxccl::testing::fuzzing::handshake`.
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| oxccl::testing::fuzzing::handshake(data));
