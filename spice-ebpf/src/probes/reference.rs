//! Reference programs for `cargo xtask bench`: empty programs on the hooks the observer's
//! socket programs use (`tp_btf/sock_send_length`, `tp_btf/sock_recv_length`), and on
//! `raw_tracepoint/sys_enter`, where the observer has none (what a program on every syscall
//! would cost). Their run time per call (`bpf_stats`) is the floor any
//! program on that hook costs: the kernel's dispatch into a BPF program and back, plus what
//! `bpf_stats` itself adds. The observer never attaches them (`observe` and `daemon` load only
//! the programs they name); the hidden `spice-observer bench reference` attaches them alone.
//! `spice-observer doctor` uses the same empty body for its probe programs
//! (`spice_probe_fentry`, `spice_probe_kprobe`, and `spice_ref_sys_enter` for raw
//! tracepoints): attached for a moment to learn whether the kernel allows that family.

/// The whole body of a reference program: nothing, return 0.
#[inline(always)]
pub fn nothing() -> i32 {
    0
}
