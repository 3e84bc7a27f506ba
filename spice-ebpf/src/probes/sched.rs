//! `tp_btf/sched_process_fork` and `tp_btf/sched_process_exit`: follow the children a watched
//! process forks after watching starts (socat forks one per connection) and forget exited ones.

use aya_ebpf::helpers::{bpf_get_current_comm, bpf_get_current_pid_tgid, bpf_ktime_get_ns};
use spice_ebpf_common::{
    config::{counter, watch},
    event::{EventHeader, ProcEvent, kind},
};

use crate::{
    kernel::{konf, read_at},
    maps::{
        KPROBE_CALLS, TLS_CALLS, TLS_SCRATCH, WATCHED_TGIDS, count, maybe_watched,
        set_maybe_watched, write_record,
    },
};

/// Writes a FORK or EXIT record to the rings `route` names (the watch value's flags).
fn proc_event(kind_: u8, tgid: u32, pid: u32, route: u8) {
    let ts_ns = unsafe { bpf_ktime_get_ns() };
    let comm = bpf_get_current_comm().unwrap_or_default();
    write_record::<ProcEvent>(route, |p| unsafe {
        p.write(ProcEvent {
            hdr: EventHeader {
                kind: kind_,
                dir: 0,
                flags: 0,
                _pad: 0,
                tgid,
                ts_ns,
                cookie: 0,
            },
            pid,
            _pad: 0,
            comm,
        })
    });
}

/// `child` is the new `struct task_struct *`; runs in the parent.
#[inline(always)]
pub fn on_fork(child: *const u8) {
    let tgid = (bpf_get_current_pid_tgid() >> 32) as u32;
    if !maybe_watched(tgid) {
        return;
    }
    let Some(root) = WATCHED_TGIDS.get_ptr(&tgid) else {
        return;
    };
    // The whole value: the root and who reads the records (the child's go to the same rings).
    let root = unsafe { *root };
    let child_pid: i32 = read_at(child, konf!(task_pid));
    let child_tgid: i32 = read_at(child, konf!(task_tgid));
    if child_pid != child_tgid || child_tgid <= 0 {
        return; // a new thread: already covered by its tgid
    }
    // The filter first: the child's hooks must never see its entry without it.
    set_maybe_watched(child_tgid as u32);
    if WATCHED_TGIDS
        .insert(&(child_tgid as u32), &root, 0)
        .is_err()
    {
        count(counter::WATCH_MAP_FULL);
        return;
    }
    proc_event(kind::FORK, tgid, child_tgid as u32, watch::route(root));
}

/// Runs in the exiting thread.
#[inline(always)]
pub fn on_exit() {
    let pid_tgid = bpf_get_current_pid_tgid();
    let tgid = (pid_tgid >> 32) as u32;
    let pid = pid_tgid as u32;
    // A process that never passed the filter has no entry in any of these maps.
    if !maybe_watched(tgid) {
        return;
    }
    let Some(w) = WATCHED_TGIDS.get_ptr(&tgid) else {
        return;
    };
    let route = watch::route(unsafe { *w });
    // A thread that exits inside a hooked libssl call never reaches its return.
    let _ = TLS_CALLS.remove(&pid_tgid);
    let _ = TLS_SCRATCH.remove(&pid_tgid);
    let _ = KPROBE_CALLS.remove(&pid_tgid);
    if pid == tgid {
        let _ = WATCHED_TGIDS.remove(&tgid);
        proc_event(kind::EXIT, tgid, tgid, route);
    }
}
