#![no_main]
//! Fuzz target: see `oxccl::testing::fuzzing::control_frames`.
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| oxccl::testing::fuzzing::control_frames(data));
