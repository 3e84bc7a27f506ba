//! The kernel side as the agent sees it: loading and attaching the programs ([`loader`]),
//! kernel struct offsets from BTF ([`btf`]) and the ring's records ([`events`]).

pub mod btf;
pub mod events;
pub mod loader;
