//! TLS: what the libssl hooks could do for each watched process, and (for sockets whose
//! framing runs on TLS plaintext) where plaintext offsets sit in TCP sequence space.

/// What the libssl hooks (uprobes on SSL_write, SSL_read and friends, see
/// `spice_ebpf_common::event::tls_func`) could do for one watched process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TlsAttach {
    /// uprobes attached on this library file (the path as the process maps it).
    Attached { library: String },
    /// The process maps no libssl: it is linked statically, uses another TLS library, or
    /// has not loaded one yet. Its TLS plaintext cannot be hooked.
    NoLibrary,
    /// Attaching to `library` failed with `error`.
    Failed { library: String, error: String },
    /// The hooks were turned off (`--no-tls-hooks`).
    Disabled,
}

impl TlsAttach {
    /// Short state name for JSON and metric labels: `attached`, `no_libssl`, `failed`,
    /// `disabled`.
    pub fn state(&self) -> &'static str {
        match self {
            Self::Attached { .. } => "attached",
            Self::NoLibrary => "no_libssl",
            Self::Failed { .. } => "failed",
            Self::Disabled => "disabled",
        }
    }
}
