//! spice-observer as a library: the kernel capture, the model of every watched socket and
//! channel, the samples and the report. The `spice-observer` binary is a thin front end over
//! it; the integration tests read its outputs into the same typed structs it writes
//! ([`report::Report`]).
//!
//! The tree follows the pipeline:
//! - [`kernel`]: load and attach the kernel programs ([`loader`]), BTF offsets ([`btf`]),
//!   ring records ([`events`]);
//! - [`host`]: the host around the watched processes: sock_diag and /proc ([`sockdiag`]),
//!   target discovery;
//! - [`model`]: sockets, spice-server's window, relay chains and stage placement (pure,
//!   unit-tested);
//! - [`pipeline`]: [`pipeline::Engine`] owns capture → records → model → samples
//!   ([`sampler`]) → snapshot, one per process, shared by the front ends;
//! - [`output`]: [`report`] (table, JSON), [`samples`] (series), [`plot`] (SVG),
//!   [`output::metrics`] (the daemon's Prometheus metrics);
//! - [`cmd`]: the front ends ([`cmd::observe`], [`cmd::daemon`]).
//!
//! The former top-level module paths (`spice_observer::report`, `::loader`, `::sockdiag`, …)
//! are re-exported.

pub mod cmd;
pub mod config;
pub mod host;
pub mod kernel;
pub mod model;
pub mod output;
pub mod pipeline;

pub use host::sockdiag;
pub use kernel::{btf, events, loader};
pub use output::{plot, report, samples};
pub use pipeline::sampler;
