//! Where the local agent's socket is, for both sides.
//!
//! The agent binds and the client connects to the same default, so the rule
//! lives in one place: `$WARDEN_SOCKET` (client only), else
//! `$RUNTIME_DIRECTORY` (set by systemd's `RuntimeDirectory=`), else
//! `/run/warden` when running as root, else the user's runtime directory
//! (`$XDG_RUNTIME_DIR/warden`), else `/tmp/warden-$UID`.

use std::path::PathBuf;

/// File name of the agent's gRPC socket inside its runtime directory.
pub const SOCKET_NAME: &str = "wardend.sock";

/// Environment variable a client (and the CLI) honours to find the agent.
pub const SOCKET_ENV: &str = "WARDEN_SOCKET";

/// The directory the agent keeps its socket in when the config names none.
pub fn default_runtime_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("RUNTIME_DIRECTORY") {
        // systemd may list several directories separated by ':'; ours is first.
        let first = dir
            .to_string_lossy()
            .split(':')
            .next()
            .unwrap_or_default()
            .to_owned();
        if !first.is_empty() {
            return PathBuf::from(first);
        }
    }
    // SAFETY: geteuid has no preconditions and cannot fail.
    let uid = unsafe { libc::geteuid() };
    if uid == 0 {
        return PathBuf::from("/run/warden");
    }
    if let Some(dir) = std::env::var_os("XDG_RUNTIME_DIR")
        && !dir.is_empty()
    {
        return PathBuf::from(dir).join("warden");
    }
    PathBuf::from(format!("/tmp/warden-{uid}"))
}

/// The agent's default socket path (what it binds with no `api.socket`).
pub fn default_socket_path() -> PathBuf {
    default_runtime_dir().join(SOCKET_NAME)
}

/// The socket a client should try: `$WARDEN_SOCKET`, else the default.
pub fn client_socket_path() -> PathBuf {
    match std::env::var_os(SOCKET_ENV) {
        Some(p) if !p.is_empty() => PathBuf::from(p),
        _ => default_socket_path(),
    }
}
