//! The privileged test run's output, echoed as it comes and summarised at the end: each
//! failing test with its own error message, so that the message is in the last lines of a
//! long CI log (where a log's tail is all one sees) rather than among thousands of lines of
//! observer output.

use std::{
    io::{BufRead, BufReader, Write},
    process::Command,
};

use anyhow::{Context, Result};

/// At most this many lines of one failure's message are kept.
const MESSAGE_LINES: usize = 12;
/// Longer lines are cut to this many characters in the summary (a daemon's whole log can
/// follow `Error:` on one line).
const LINE_CHARS: usize = 400;

/// What a `cargo test -- --nocapture --test-threads=1` run's merged output says about its
/// failures: per test, the last `Error: …` (a test returning `Err`) or panic message, and the
/// names libtest lists as failed.
#[derive(Debug, Default)]
pub struct Summary {
    /// The `Running tests/x.rs (…)` line's file, for the test now running.
    binary: String,
    /// The test whose `test NAME ... ` line came last.
    current: String,
    /// (binary, test, message lines) per test that printed an error or a panic.
    messages: Vec<(String, String, Vec<String>)>,
    /// Lines still to take into the newest message (0: not inside one).
    taking: usize,
    /// After the second `failures:` line: the indented names that follow are the failures.
    in_failure_list: bool,
    failures_seen: u32,
    /// (binary, test) listed as failed.
    failed: Vec<(String, String)>,
}

impl Summary {
    /// Takes one line of output (without its newline).
    pub fn line(&mut self, l: &str) {
        let t = l.trim_end();
        if let Some(rest) = t.trim_start().strip_prefix("Running ") {
            self.binary = rest.split(" (").next().unwrap_or(rest).to_string();
            self.in_failure_list = false;
            self.failures_seen = 0;
            return;
        }
        if let Some(rest) = t.strip_prefix("test ")
            && let Some((name, _)) = rest.split_once(" ... ")
            && !name.contains(' ')
        {
            self.current = name.to_string();
            self.taking = 0;
            // With --nocapture the test's own output begins on this line.
            let (_, after) = rest.split_once(" ... ").unwrap_or_default();
            self.line(after);
            return;
        }
        if t == "failures:" {
            self.failures_seen += 1;
            self.in_failure_list = self.failures_seen >= 2;
            self.taking = 0;
            return;
        }
        if self.in_failure_list {
            if let Some(name) = t.strip_prefix("    ")
                && !name.is_empty()
                && !name.contains(' ')
            {
                self.failed.push((self.binary.clone(), name.to_string()));
                return;
            }
            if !t.is_empty() {
                self.in_failure_list = false;
            }
        }
        let starts =
            t.starts_with("Error: ") || (t.starts_with("thread '") && t.contains(" panicked at "));
        if starts {
            // The newest message of a test replaces an earlier one (the last is its end).
            self.messages
                .retain(|(b, n, _)| !(b == &self.binary && n == &self.current));
            self.messages
                .push((self.binary.clone(), self.current.clone(), Vec::new()));
            self.taking = MESSAGE_LINES;
        }
        if self.taking > 0 {
            if t == "Stack backtrace:"
                || t == "stack backtrace:"
                || t.starts_with("note: run with `RUST_BACKTRACE")
                || t == "FAILED"
                || t == "ok"
            {
                self.taking = 0;
                return;
            }
            let cut: String = t.chars().take(LINE_CHARS).collect();
            let more = if cut.len() < t.len() { " […]" } else { "" };
            if let Some((_, _, m)) = self.messages.last_mut() {
                m.push(format!("{cut}{more}"));
            }
            self.taking -= 1;
        }
    }

    /// The end-of-run text: per failed test, its file, name and message (or a note that it
    /// printed none). Empty when nothing failed.
    pub fn report(&self) -> String {
        let mut out = String::new();
        for (b, n) in &self.failed {
            out.push_str(&format!("=== FAILED {n} ({b})\n"));
            match self.messages.iter().find(|(mb, mn, _)| mb == b && mn == n) {
                Some((_, _, m)) => {
                    // Without the blank lines that end it.
                    let end = m.iter().rposition(|l| !l.is_empty()).map_or(0, |i| i + 1);
                    for l in &m[..end] {
                        out.push_str(l);
                        out.push('\n');
                    }
                }
                None => {
                    out.push_str("(no `Error:` or panic line seen; see the test's output above)\n")
                }
            }
        }
        out
    }
}

/// Runs `cmd` with stdout and stderr merged into one pipe (their order kept), echoing each
/// line to stdout, and on failure prints [`Summary::report`] before erroring.
pub fn run_summarized(cmd: &mut Command) -> Result<()> {
    eprintln!("+ {cmd:?}");
    let (reader, writer) = std::io::pipe().context("creating a pipe")?;
    cmd.stdout(writer.try_clone()?).stderr(writer);
    let mut child = cmd.spawn().with_context(|| format!("spawning {cmd:?}"))?;
    // The parent's copies of the write end must go, or the read never ends.
    cmd.stdout(std::process::Stdio::null());
    cmd.stderr(std::process::Stdio::null());
    let mut summary = Summary::default();
    let mut out = std::io::stdout().lock();
    for l in BufReader::new(reader).split(b'\n') {
        let l = l.context("reading the test output")?;
        let l = String::from_utf8_lossy(&l);
        let _ = writeln!(out, "{l}");
        summary.line(&l);
    }
    let _ = out.flush();
    let status = child.wait()?;
    if !status.success() {
        let report = summary.report();
        if !report.is_empty() {
            let _ = writeln!(out, "\nfailing tests, each with its message:\n{report}");
        }
    }
    crate::check(status, cmd)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn summarize(text: &str) -> Summary {
        let mut s = Summary::default();
        for l in text.lines() {
            s.line(l);
        }
        s
    }

    #[test]
    fn an_error_return_is_reported_with_its_file_and_without_the_backtrace() {
        let s = summarize(
            "     Running tests/restart.rs (target/debug/deps/restart-1)\n\
             \n\
             running 2 tests\n\
             test a_passing_one ... daemon! something\n\
             Error: not this one\n\
             ok\n\
             test restart_layout ... daemon! [INFO] found x\n\
             daemon! more\n\
             Error: the daemon did not find socat (pid 7)\n\
             \n\
             Caused by:\n\
             \x20   no such line within 5s:\n\
             \n\
             Stack backtrace:\n\
             \x20  0: std::rt::lang_start\n\
             FAILED\n\
             \n\
             failures:\n\
             \n\
             failures:\n\
             \x20   restart_layout\n\
             \n\
             test result: FAILED. 1 passed; 1 failed\n",
        );
        let r = s.report();
        assert_eq!(
            r,
            "=== FAILED restart_layout (tests/restart.rs)\n\
             Error: the daemon did not find socat (pid 7)\n\
             \n\
             Caused by:\n\
             \x20   no such line within 5s:\n"
        );
    }

    #[test]
    fn a_panic_and_a_child_runs_prefixed_lines() {
        let s = summarize(
            "     Running tests/kernel_paths.rs (x)\n\
             test ci_true ... --- child exited 101:\n\
             child| test split ... FAILED\n\
             child| Error: expected\n\
             ---\n\
             ok\n\
             test stalls ... thread 'stalls' (123) panicked at tests/x.rs:5:9:\n\
             assertion failed: n == 3\n\
             note: run with `RUST_BACKTRACE=1` environment variable to display a backtrace\n\
             FAILED\n\
             \n\
             failures:\n\
             \n\
             failures:\n\
             \x20   stalls\n\
             \n",
        );
        assert_eq!(
            s.report(),
            "=== FAILED stalls (tests/kernel_paths.rs)\n\
             thread 'stalls' (123) panicked at tests/x.rs:5:9:\n\
             assertion failed: n == 3\n"
        );
    }

    #[test]
    fn a_failure_without_a_message_says_so_and_nothing_failed_is_empty() {
        let s = summarize(
            "     Running tests/a.rs (x)\ntest quiet ... FAILED\n\nfailures:\n\nfailures:\n    quiet\n\n",
        );
        assert!(
            s.report()
                .contains("=== FAILED quiet (tests/a.rs)\n(no `Error:`")
        );
        assert_eq!(summarize("test x ... ok\n").report(), "");
    }
}
