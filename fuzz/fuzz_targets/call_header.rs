#![no_main]
//! Fuzz target: see `oxccl::fuzzing::call_header`.
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| oxccl::fuzzing::call_header(data));
