//! What the front ends write: the report (table and JSON, [`report`]), the per-sample series
//! ([`samples`]) and the SVG plot ([`plot`]).

pub mod plot;
pub mod report;
pub mod samples;
