//! Builds the kernel programs (`spice-ebpf`) for the BPF target with the pinned nightly and
//! bpf-linker, and leaves the object in `OUT_DIR/spice-ebpf` for `include_bytes_aligned!`.
//!
//! The nightly is pinned because bpf-linker is built against LLVM 22 and must read the
//! nightly's bitcode (same LLVM major, see README "Kernel and toolchain"). `cargo xtask setup`
//! installs both. Set `AYA_BUILD_SKIP=1` to skip the kernel build (then `spice-observer`
//! cannot load its programs; only useful for `cargo check` / unit tests of pure logic).
//!
//! Quiet build: aya-build forwards every line of the inner cargo's output as a
//! `cargo:warning=` line, which cargo prints as a warning (about 200 lines). This script
//! points its own stdout at a log file while aya-build runs, passes the `cargo:rerun-if-*`
//! instructions on to cargo, and keeps the rest in `OUT_DIR/spice-ebpf-build.log`. On failure
//! the log goes to stderr, which cargo shows.
use std::{
    fs::File,
    io::{BufRead, BufReader, Write},
    os::fd::AsRawFd,
    path::PathBuf,
};

use aya_build::{Package, Toolchain};

/// The nightly toolchain whose LLVM (22.1.4) matches bpf-linker's LLVM 22.
pub const EBPF_TOOLCHAIN: &str = "nightly-2026-05-19";

/// The BPF instruction set the programs are generated for: v3 (32-bit ALU and jumps, and the
/// atomic instructions, e.g. compare-and-exchange; Linux 5.12+ verifies all of it).
pub const EBPF_CPU: &str = "v3";

/// bpf-linker does the BPF code generation, with the `--cpu` rustc passes it (`-C
/// target-cpu`, "generic" by default). aya-build sets the inner build's rustflags itself
/// (`CARGO_ENCODED_RUSTFLAGS`, which overrides every other rustflags source), so the CPU is
/// chosen by a linker wrapper instead: `OUT_DIR/bpf-linker-wrapper` runs bpf-linker with
/// `--cpu generic` replaced by [`EBPF_CPU`], and the inner cargo finds it through
/// `CARGO_TARGET_BPFEL_UNKNOWN_NONE_LINKER`.
fn linker_wrapper(out: &std::path::Path) -> anyhow::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let path = out.join("bpf-linker-wrapper");
    let script = format!(
        "#!/bin/sh\n# Written by spice-observer/build.rs: bpf-linker with --cpu {EBPF_CPU}.\n\
         prev=\n\
         for a in \"$@\"; do\n\
         \x20 shift\n\
         \x20 case \"$prev:$a\" in\n\
         \x20   --cpu:generic) a={EBPF_CPU} ;;\n\
         \x20   *:--cpu=generic) a=--cpu={EBPF_CPU} ;;\n\
         \x20 esac\n\
         \x20 set -- \"$@\" \"$a\"\n\
         \x20 prev=$a\n\
         done\n\
         exec bpf-linker \"$@\"\n"
    );
    std::fs::write(&path, script)?;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755))?;
    // SAFETY: the build script is single-threaded here; the variable is read by the inner
    // cargo that aya-build starts.
    unsafe { std::env::set_var("CARGO_TARGET_BPFEL_UNKNOWN_NONE_LINKER", &path) };
    Ok(())
}

fn build() -> anyhow::Result<()> {
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    linker_wrapper(&out)?;
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

/// Runs `f` with file descriptor 1 pointing at `log`; restores it afterwards.
fn with_stdout_to(log: &File, f: impl FnOnce() -> anyhow::Result<()>) -> anyhow::Result<()> {
    std::io::stdout().flush()?;
    // SAFETY: plain fd duplication; fd 1 is restored before returning.
    let saved = unsafe { libc::dup(1) };
    anyhow::ensure!(saved >= 0, "dup(1): {}", std::io::Error::last_os_error());
    anyhow::ensure!(
        unsafe { libc::dup2(log.as_raw_fd(), 1) } >= 0,
        "dup2: {}",
        std::io::Error::last_os_error()
    );
    let result = f();
    std::io::stdout().flush()?;
    unsafe {
        libc::dup2(saved, 1);
        libc::close(saved);
    }
    result
}

fn main() -> anyhow::Result<()> {
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let log_path = out.join("spice-ebpf-build.log");
    let log = File::create(&log_path)?;
    let result = with_stdout_to(&log, build);
    drop(log);
    let mut text = String::new();
    for line in BufReader::new(File::open(&log_path)?).lines() {
        let line = line?;
        if line.starts_with("cargo:rerun-if-") {
            println!("{line}");
        }
        text.push_str(line.strip_prefix("cargo:warning=").unwrap_or(&line));
        text.push('\n');
    }
    if let Err(e) = result {
        eprintln!("{text}");
        eprintln!(
            "the kernel programs did not build (log: {})",
            log_path.display()
        );
        return Err(e);
    }
    Ok(())
}
