//! The kernel side as the agent sees it: loading and attaching the programs ([`loader`]),
//! kernel struct offsets from BTF ([`btf`]), the ring's records ([`events`]) and the libssl
//! uprobes attached per watched process ([`tls`]). `stack` checks, in a unit test, that every
//! program's deepest call chain fits the verifier's stack limit.

pub mod btf;
pub mod events;
pub mod kretprobe;
pub mod loader;
mod stack;
pub mod tls;
