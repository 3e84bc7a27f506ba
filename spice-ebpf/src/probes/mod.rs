//! Hook families of the hook sets. Each file is named after what it hooks; the
//! entry points in `main.rs` only unpack the context and call these.

pub mod kprobes;
pub mod reference;
pub mod sched;
pub mod sock_calls;
pub mod sockops;
pub mod syscalls;
pub mod tcp_state;
pub mod tls;
