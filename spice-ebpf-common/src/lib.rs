//! Types and SPICE framing shared by spice-observer's kernel programs and its agent.
//!
//! `no_std`, no allocation, no panicking paths in the code the kernel uses: everything here
//! must pass the BPF verifier when compiled for `bpfel-unknown-none`.
//!
//! * [`protocol`]: SPICE wire constants and names.
//! * [`framing`]: the per-direction framing state machine (link phase, mini/full headers).
//! * [`window`]: spice-server's ACK-window rule, run by the kernel per socket.
//! * [`event`]: ring-buffer records and kernel map values.
//! * [`config`]: kernel struct offsets passed in at load time, and kernel counters.
#![no_std]

pub mod config;
pub mod event;
pub mod framing;
pub mod protocol;
pub mod window;

#[cfg(any(test, feature = "std"))]
extern crate std;

#[cfg(any(test, feature = "std"))]
pub mod wire;
