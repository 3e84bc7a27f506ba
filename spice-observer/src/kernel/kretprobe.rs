//! Return probes with room for every thread inside the probed function.
//!
//! A kretprobe keeps one instance per call in progress, taken at the function's entry and given
//! back at its return; a call that finds none left gets no return probe, and the kernel only
//! counts it as missed (`kernel/kprobes.c`, `pre_handler_kretprobe`). The number of instances
//! is the probe's `maxactive`. perf's `kprobe` PMU, which aya uses, has no field for it and so
//! takes the default: max(10, 2 × possible CPUs) on a preemptible kernel (`register_kretprobe`).
//! `tcp_sendmsg` and `tcp_recvmsg` sleep while the socket has no room or no data, so every
//! blocked reader or writer of the host holds an instance: in the 6.12 guest (2 vCPUs, so 10
//! instances) the kernel-path test that runs twelve peer pairs at once lost the return of a
//! watched call, and the framing of that direction began mid-stream.
//!
//! The tracefs interface takes `maxactive` in its definition line,
//! `r[MAXACTIVE][:[GROUP/]EVENT] SYMBOL` (Documentation/trace/kprobetrace.rst; at most
//! [`MAXACTIVE`], `KRETPROBE_MAXACTIVE_MAX` in kernel/trace/trace_kprobe.c). So the return
//! probes of hook set `kprobes` are defined there, as event `GROUP/spice_<pid>_<program>`, opened
//! with `perf_event_open(2)` as a tracepoint event (type `PERF_TYPE_TRACEPOINT`, config = the
//! event's `id`) and given the program with `BPF_LINK_CREATE` (attach type `BPF_PERF_EVENT`,
//! Linux 5.15; the hook set needs `bpf_loop`, 5.17, anyway). The link holds the perf event, so
//! it can be pinned like any other. The event definition is removed when the [`Event`] is
//! dropped, if nothing uses it any more (a pinned link does), and definitions left by processes
//! that are gone are removed at the next load of the hook set ([`remove_stale`]).

use std::{
    ffi::CString,
    fs,
    io::Write,
    mem,
    os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd},
    path::{Path, PathBuf},
};

use anyhow::{Context, Result, bail};
use aya_obj::generated::{
    PERF_FLAG_FD_CLOEXEC, bpf_attach_type, bpf_attr, bpf_cmd, perf_event_attr, perf_type_id,
};
use log::debug;

/// The largest `maxactive` the kernel accepts in a definition line (`KRETPROBE_MAXACTIVE_MAX`,
/// kernel/trace/trace_kprobe.c). Each instance is a few tens of bytes of kernel memory
/// (`struct kretprobe_instance`), so a probe with all of them costs about 200 KiB.
pub const MAXACTIVE: u32 = 4096;

/// The tracefs group of the observer's probe events (`events/<GROUP>/…`).
pub const GROUP: &str = "spice_observer";

/// Where a kernel offers `kprobe_events` (tracefs, or tracefs under debugfs on older setups).
pub const KPROBE_EVENTS: [&str; 2] = [
    "/sys/kernel/tracing/kprobe_events",
    "/sys/kernel/debug/tracing/kprobe_events",
];

/// The tracefs directory holding the first of [`KPROBE_EVENTS`] that exists, if any.
pub fn tracefs() -> Option<PathBuf> {
    KPROBE_EVENTS
        .iter()
        .map(Path::new)
        .find(|p| p.exists())
        .and_then(Path::parent)
        .map(Path::to_path_buf)
}

/// One return-probe event defined in tracefs; removed on drop when unused.
#[derive(Debug)]
pub struct Event {
    /// The tracefs directory holding `kprobe_events`.
    tracefs: PathBuf,
    /// `spice_<pid>_<program>`.
    name: String,
}

impl Event {
    /// The probe's (hits, misses) from tracefs `kprobe_profile` (lines `GROUP/EVENT hits
    /// misses`; a miss is a call that found no free instance); `None` if not listed.
    pub fn profile(&self) -> Option<(u64, u64)> {
        let text = fs::read_to_string(self.tracefs.join("kprobe_profile")).ok()?;
        let full = format!("{GROUP}/{}", self.name);
        text.lines().find_map(|l| {
            let mut f = l.split_whitespace();
            (f.next()? == full).then_some(())?;
            Some((f.next()?.parse().ok()?, f.next()?.parse().ok()?))
        })
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        if let Some((hits, misses)) = self.profile() {
            if misses > 0 {
                log::warn!(
                    "kretprobe {GROUP}/{}: {misses} of {hits} calls found no free instance \
                     (maxactive {MAXACTIVE}); their bytes were found untraced at the next call",
                    self.name
                );
            } else {
                debug!("kretprobe {GROUP}/{}: {hits} calls, none missed", self.name);
            }
        }
        match remove(&self.tracefs, &self.name) {
            Ok(()) => debug!("removed kprobe event {GROUP}/{}", self.name),
            // EBUSY: a pinned link still uses it; the next agent's remove_stale takes it once
            // it is unused.
            Err(e) => debug!("kprobe event {GROUP}/{} kept: {e}", self.name),
        }
    }
}

/// A return probe on `func` running program `prog` (a loaded kprobe program), defined in
/// `tracefs` ([`tracefs`]): the `BPF_LINK_CREATE` link's descriptor and the event it holds.
/// Errors: a definition the kernel refuses (unknown or unprobeable `func`), or
/// `perf_event_open` / `BPF_LINK_CREATE` failing (with the errno).
pub fn attach(
    tracefs: &Path,
    prog: BorrowedFd<'_>,
    program: &str,
    func: &str,
) -> Result<(OwnedFd, Event)> {
    let events = tracefs.join("kprobe_events");
    let tracefs = tracefs.to_path_buf();
    let name = format!("spice_{}_{program}", std::process::id());
    // A definition of the same name left by this process (a second load in one run).
    let _ = remove(&tracefs, &name);
    let line = format!("r{MAXACTIVE}:{GROUP}/{name} {func}\n");
    fs::OpenOptions::new()
        .append(true)
        .open(&events)
        .and_then(|mut f| f.write_all(line.as_bytes()))
        .with_context(|| format!("defining `{}` in {}", line.trim_end(), events.display()))?;
    let event = Event { tracefs, name };
    let id_path = event
        .tracefs
        .join("events")
        .join(GROUP)
        .join(&event.name)
        .join("id");
    let id: u64 = fs::read_to_string(&id_path)
        .with_context(|| format!("reading {}", id_path.display()))?
        .trim()
        .parse()
        .with_context(|| format!("parsing {}", id_path.display()))?;
    let perf = perf_event_open_tracepoint(id)
        .with_context(|| format!("perf_event_open of tracepoint event {GROUP}/{}", event.name))?;
    let link = link_create(prog, perf.as_fd())
        .with_context(|| format!("BPF_LINK_CREATE for kretprobe/{func}"))?;
    // The link holds the perf event: its descriptor is not needed any more.
    drop(perf);
    Ok((link, event))
}

/// Pins the link `fd` at `path` (`BPF_OBJ_PIN`; `path` on a BPF filesystem).
pub fn pin(fd: BorrowedFd<'_>, path: &Path) -> Result<()> {
    let c = CString::new(path.as_os_str().as_encoded_bytes())?;
    // SAFETY: a zeroed bpf_attr is valid; the fields BPF_OBJ_PIN reads are set.
    let mut attr = unsafe { mem::zeroed::<bpf_attr>() };
    let u = unsafe { &mut attr.__bindgen_anon_4 };
    u.bpf_fd = fd.as_raw_fd() as u32;
    u.pathname = c.as_ptr() as u64;
    sys_bpf(bpf_cmd::BPF_OBJ_PIN, &mut attr)
        .with_context(|| format!("pinning {}", path.display()))?;
    Ok(())
}

/// Removes the definitions of this group whose process (`spice_<pid>_…`) is gone and that
/// nothing uses (the kernel refuses to remove a used one with EBUSY; a pinned link uses it).
/// Returns how many it left.
pub fn remove_stale(tracefs: &Path) -> usize {
    let Ok(text) = fs::read_to_string(tracefs.join("kprobe_events")) else {
        return 0;
    };
    let mut left = 0;
    for name in stale_names(&text, &|pid| Path::new(&format!("/proc/{pid}")).exists()) {
        match remove(tracefs, &name) {
            Ok(()) => debug!("removed stale kprobe event {GROUP}/{name}"),
            Err(e) => {
                debug!("stale kprobe event {GROUP}/{name} kept: {e}");
                left += 1;
            }
        }
    }
    left
}

/// [`remove_stale`] after the pins of the links that held the events were removed: the
/// kernel may release such a link after the unlink returns (Linux 6.12 puts a link's last
/// reference from a workqueue, `bpf_link_put`, and the perf event's file after that), so the
/// events stay busy for a moment. Tries again every 20 ms for up to `wait`; returns how many
/// are left then.
pub fn remove_stale_after_unpin(tracefs: &Path, wait: std::time::Duration) -> usize {
    let t0 = std::time::Instant::now();
    loop {
        let left = remove_stale(tracefs);
        if left == 0 || t0.elapsed() >= wait {
            return left;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// The event names in `kprobe_events` text (lines `r4096:GROUP/NAME SYMBOL`) that belong to
/// [`GROUP`] and name a process for which `alive` is false.
fn stale_names(text: &str, alive: &dyn Fn(u32) -> bool) -> Vec<String> {
    text.lines()
        .filter_map(|l| l.split_whitespace().next()?.split_once(':'))
        .filter_map(|(_, ev)| ev.strip_prefix(GROUP)?.strip_prefix('/'))
        .filter(|name| {
            name.strip_prefix("spice_")
                .and_then(|r| r.split('_').next())
                .and_then(|p| p.parse::<u32>().ok())
                .is_some_and(|pid| !alive(pid))
        })
        .map(str::to_string)
        .collect()
}

/// Writes `-:GROUP/NAME` to `kprobe_events`.
fn remove(tracefs: &Path, name: &str) -> std::io::Result<()> {
    fs::OpenOptions::new()
        .append(true)
        .open(tracefs.join("kprobe_events"))?
        .write_all(format!("-:{GROUP}/{name}\n").as_bytes())
}

/// `perf_event_open(2)` of tracepoint event `id` on every task of CPU 0 (a BPF program attached
/// to a trace event runs wherever the event fires, whatever the perf event's CPU).
fn perf_event_open_tracepoint(id: u64) -> Result<OwnedFd> {
    // SAFETY: a zeroed perf_event_attr is valid.
    let mut attr = unsafe { mem::zeroed::<perf_event_attr>() };
    attr.type_ = perf_type_id::PERF_TYPE_TRACEPOINT as u32;
    attr.size = mem::size_of::<perf_event_attr>() as u32;
    attr.config = id;
    attr.__bindgen_anon_1.sample_period = 1;
    attr.__bindgen_anon_2.wakeup_events = 1;
    // SAFETY: the attr outlives the call; the result is a new descriptor or -1.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_perf_event_open,
            &attr as *const perf_event_attr,
            -1i32,
            0i32,
            -1i32,
            PERF_FLAG_FD_CLOEXEC as libc::c_ulong,
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error().into());
    }
    // SAFETY: a descriptor the kernel just returned, owned by no one else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// `BPF_LINK_CREATE` of program `prog` on perf event `perf` (attach type `BPF_PERF_EVENT`).
fn link_create(prog: BorrowedFd<'_>, perf: BorrowedFd<'_>) -> Result<OwnedFd> {
    // SAFETY: a zeroed bpf_attr is valid; the fields BPF_LINK_CREATE reads are set.
    let mut attr = unsafe { mem::zeroed::<bpf_attr>() };
    attr.link_create.__bindgen_anon_1.prog_fd = prog.as_raw_fd() as u32;
    attr.link_create.__bindgen_anon_2.target_fd = perf.as_raw_fd() as u32;
    attr.link_create.attach_type = bpf_attach_type::BPF_PERF_EVENT as u32;
    let fd = sys_bpf(bpf_cmd::BPF_LINK_CREATE, &mut attr)?;
    // SAFETY: a descriptor the kernel just returned, owned by no one else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

fn sys_bpf(cmd: bpf_cmd, attr: &mut bpf_attr) -> Result<i64> {
    // SAFETY: attr is a valid bpf_attr of the size passed.
    let r = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd as libc::c_int,
            attr as *mut bpf_attr,
            mem::size_of::<bpf_attr>() as u32,
        )
    };
    if r < 0 {
        bail!(std::io::Error::last_os_error());
    }
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stale_definitions_are_ours_and_of_dead_processes() {
        let text = "r4096:spice_observer/spice_100_spice_kretprobe_recv tcp_recvmsg\n\
                    r4096:spice_observer/spice_200_spice_kretprobe_send tcp_sendmsg\n\
                    r16:other/spice_100_x tcp_recvmsg\n\
                    p:kprobes/aya_100_p_tcp_sendmsg_0x0_1 tcp_sendmsg\n\
                    r4096:spice_observer/junk tcp_sendmsg\n";
        let got = stale_names(text, &|pid| pid == 200);
        assert_eq!(got, vec!["spice_100_spice_kretprobe_recv".to_string()]);
        assert!(stale_names("", &|_| false).is_empty());
    }
}
