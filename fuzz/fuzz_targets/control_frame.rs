#![no_main]
//! Fuzz target: see `oxccl::fuzzing::control_frames`.
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| oxccl::fuzzing::control_frames(data));
