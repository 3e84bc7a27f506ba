//! spice-observer as a library: the kernel capture, the model of every watched socket and
//! channel, the samples and the report. The `spice-observer` binary is a thin front end over
//! it; the integration tests read its outputs into the same typed structs it writes
//! ([`report::Report`]).
//!
//! Pipeline, in order: [`loader`] (load and attach the kernel programs, the ring and maps) →
//! [`events`] (decode ring records) → [`model`] (sockets, channels, spice-server's window,
//! relay chains and stage placement) → [`sampler`] (TCP positions at each sample) →
//! [`report`] / [`plot`] / [`samples`] (output). [`observe`] arranges them for one observation.

pub mod btf;
pub mod cmd;
pub mod config;
pub mod events;
pub mod host;
pub mod loader;
pub mod metrics;
pub mod model;
pub mod observe;
pub mod plot;
pub mod report;
pub mod sampler;
pub mod samples;
pub mod sockdiag;
