//! What the front ends write: the report (table and JSON, [`report`]), the per-sample series
//! ([`samples`]), the SVG plot ([`plot`]) and the daemon's Prometheus metrics ([`metrics`]).

pub mod metrics;
pub mod plot;
pub mod report;
pub mod samples;
