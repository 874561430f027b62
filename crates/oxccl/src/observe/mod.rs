//! What a communicator tells about itself: the flight recorder (and its torch-format dump),
//! the call timeline, the metrics and the status agent answering `oxccl status`.

pub mod flight;
pub(crate) mod flight_torch;
pub mod metrics;
pub mod status;
pub(crate) mod timeline;
