//! Choosing how to run a call: the cost model and the tuner that pick an algorithm per
//! collective and size, what `oxccl tune` measured for them (`tuning`), and the call's plan
//! made from them ([`call_plan`]).

pub mod calibrate;
pub(crate) mod call_plan;
pub(crate) mod cost;
pub mod predict;
pub(crate) mod tune;
pub(crate) mod tuning;
