#![no_main]
//! Fuzz target: see `oxccl::testing::fuzzing::call_header`.
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| oxccl::testing::fuzzing::call_header(data));
