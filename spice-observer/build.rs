//! Builds the kernel programs (`spice-ebpf`) for the BPF target with the pinned nightly and
//! bpf-linker, and leaves the object in `OUT_DIR/spice-ebpf` for `include_bytes_aligned!`.
//!
//! The nightly is pinned because bpf-linker is built against LLVM 22 and must read the
//! nightly's bitcode (same LLVM major, see README "Kernel and toolchain"). `cargo xtask setup`
//! installs both. Set `AYA_BUILD_SKIP=1` to skip the kernel build (then `spice-observer`
//! cannot load its programs; only useful for `cargo check` / unit tests of pure logic).
use aya_build::{Package, Toolchain};

/// The nightly toolchain whose LLVM (22.1.4) matches bpf-linker's LLVM 22.
pub const EBPF_TOOLCHAIN: &str = "nightly-2026-05-19";

fn main() -> anyhow::Result<()> {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../spice-ebpf");
    println!(
        "cargo:rerun-if-changed={}",
        concat!(env!("CARGO_MANIFEST_DIR"), "/../spice-ebpf-common/src")
    );
    aya_build::build_ebpf(
        [Package {
            name: "spice-ebpf",
            root_dir: root,
            ..Default::default()
        }],
        Toolchain::Custom(EBPF_TOOLCHAIN),
    )
}
