//! Host-side stub: the kernel programs live in `main.rs` and only build for the BPF target
//! (`bpfel-unknown-none`, driven by `spice-observer/build.rs` through aya-build).
#![no_std]
