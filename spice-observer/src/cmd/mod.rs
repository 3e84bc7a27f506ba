//! Front ends over [`crate::pipeline::Engine`]: each parses its options, arranges the engine's
//! calls and prints; none computes a statistic.

pub mod bench;
pub mod daemon;
pub mod doctor;
pub mod observe;
pub mod service;
pub mod tcpinfo;
pub mod tcpinfo_daemon;
