//! Choosing how to run a call: the cost model and the tuner that picks an algorithm per
//! collective and size, and what `oxccl tune` measured for them (`tuning`).

pub mod calibrate;
pub(crate) mod cost;
pub mod predict;
pub(crate) mod tune;
pub(crate) mod tuning;
