//! Host-wide pieces of the coming `spice-observer daemon` (issue 7): one daemon per
//! hypervisor, watching every SPICE server and relay on the host by itself.
//!
//! Done so far: [`discovery`], which finds the SPICE servers (QEMU, Xspice) and the configured
//! relays among the host's processes and reports which started and which exited since the
//! previous scan. Not here yet: the daemon loop that attaches the observer to what discovery
//! reports, and the Prometheus exporter.
//!
//! [`privilege`]: the capabilities the daemon needs, and the drop after attach.

pub mod discovery;
pub mod privilege;
pub mod sockdiag;
