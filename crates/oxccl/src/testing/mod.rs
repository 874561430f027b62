//! Internals that tests, the fuzz targets and the CLI reach for; not a stable API.

pub mod fuzzing;
