//! The kernel side as the agent sees it: loading and attaching the programs ([`loader`]),
//! kernel struct offsets from BTF ([`btf`]), the ring's records ([`events`]) and the libssl
//! uprobes attached per watched process ([`tls`]).

pub mod btf;
pub mod events;
pub mod loader;
pub mod tls;
