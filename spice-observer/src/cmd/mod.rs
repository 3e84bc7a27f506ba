//! Front ends of the `spice-observer` binary that live in the library.

pub mod daemon;
// TEMPORARY: the engine API over the observe pieces until the `engine` branch lands.
mod engine_shim;
