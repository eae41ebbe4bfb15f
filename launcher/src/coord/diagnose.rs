//! etcd's and the transport's answers to a new connection, turned into
//! what an operator must change: a pure function of the error, so a table
//! of the answers etcd 3.4 and 3.5 give tests it.
//!
//! In: the `etcd_client::Error` of a connect or first read, the user it
//! logged in as (if any), the key prefix it read.
//! Out: one sentence naming the cause (wrong password, a user without the
//! role, authentication off or on, a TLS handshake refused and why, plain
//! HTTP to a TLS port, nothing listening) followed by what etcd or the
//! transport said.
//! Never: contain the password (it is never given here).

use std::error::Error as _;

/// How the failed connection was made.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Attempt<'a> {
    /// The user it logged in as.
    pub user: Option<&'a str>,
    /// TLS was on.
    pub tls: bool,
    /// A client certificate was shown.
    pub client_cert: bool,
    /// The key prefix it read.
    pub prefix: &'a str,
}

/// Why a connection failed, with what etcd said: see the module's contract.
pub(crate) fn explain(e: &etcd_client::Error, attempt: Attempt<'_>) -> String {
    let said = chain(e);
    let cause = cause(e, &said, attempt);
    match cause {
        Some(c) => format!("{c} ({said})"),
        None => said,
    }
}

fn cause(e: &etcd_client::Error, said: &str, attempt: Attempt<'_>) -> Option<String> {
    let lower = said.to_ascii_lowercase();
    let (user, prefix) = (attempt.user, attempt.prefix);
    let who = user.unwrap_or("(none)");
    if let etcd_client::Error::GRpcStatus(status) = e {
        let msg = status.message();
        if msg.contains("authentication failed") {
            return Some(format!(
                "etcd refused user {who}: wrong user name or password"
            ));
        }
        if msg.contains("user name is empty") {
            return Some(
                "etcd has authentication on and no user was given (--etcd-user, with --etcd-password-file or $WARDEN_ETCD_PASSWORD)"
                    .to_owned(),
            );
        }
        if msg.contains("user name not found") {
            return Some(format!(
                "etcd does not know user {who} (a client certificate's common name counts as the user when no user is given)"
            ));
        }
        if msg.contains("authentication is not enabled") {
            return Some(format!(
                "etcd has authentication off, yet user {who} was given: leave --etcd-user out, or turn authentication on in etcd"
            ));
        }
        if msg.contains("permission denied") && user.is_none() {
            return Some(format!(
                "etcd refused to let a client without a user read {prefix}: give --etcd-user and its password"
            ));
        }
        if msg.contains("permission denied") {
            return Some(format!(
                "etcd user {who} may not read or write {prefix}: grant it a role with readwrite on that prefix (etcdctl role grant-permission ROLE readwrite {prefix} --prefix)"
            ));
        }
        if msg.contains("invalid auth token") {
            return Some(format!(
                "etcd refused the login token of user {who} (its password changed, or etcd restarted)"
            ));
        }
    }
    let closed = lower.contains("frame")
        || lower.contains("protocol error")
        || lower.contains("connection reset")
        || lower.contains("connection closed")
        || lower.contains("broken pipe");
    // The server's alert about the client's certificate, when the client
    // reads it before the hang-up (not one about the server's).
    let alerted = lower.contains("received fatal alert");
    if (closed || alerted) && attempt.tls {
        // TLS 1.3: the server judges the client's certificate after the
        // client thinks the handshake done, and alerts or just hangs up.
        return Some(if attempt.client_cert {
            "etcd ended the TLS handshake: it refused this client's certificate (is it signed by the CA etcd trusts, its --trusted-ca-file? --etcd-cert, --etcd-key)".to_owned()
        } else {
            "etcd ended the TLS handshake: it wants a client certificate (--client-cert-auth): give --etcd-cert and --etcd-key".to_owned()
        });
    }
    const TLS_WORDS: [&str; 6] = [
        "certificate",
        "tls",
        "handshake",
        "unknownissuer",
        "badsignature",
        "notvalidforname",
    ];
    if TLS_WORDS.iter().any(|w| lower.contains(w)) {
        return Some("the TLS handshake with etcd failed: check the CA (--etcd-cacert), the client certificate and key (--etcd-cert, --etcd-key) and the endpoint's name against etcd's server certificate".to_owned());
    }
    if lower.contains("connection refused") {
        return Some("nothing listens at the endpoint".to_owned());
    }
    if closed {
        return Some("etcd closed the connection: if it serves TLS, give its CA (--etcd-cacert) and https:// endpoints".to_owned());
    }
    None
}

/// The error and every source below it, `: `-joined, each said once (the
/// transport's errors repeat their source in their own text).
pub(crate) fn chain(e: &etcd_client::Error) -> String {
    // etcd_client's error names no source: start below it by hand.
    let (mut out, mut next): (String, Option<&(dyn std::error::Error + 'static)>) = match e {
        etcd_client::Error::GRpcStatus(s) => {
            (format!("{:?}: {}", s.code(), s.message()), s.source())
        }
        etcd_client::Error::TransportError(t) => (t.to_string(), t.source()),
        etcd_client::Error::IoError(io) => (io.to_string(), io.source()),
        other => (other.to_string(), None),
    };
    while let Some(s) = next {
        let text = s.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        next = s.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(code: tonic::Code, msg: &str) -> etcd_client::Error {
        etcd_client::Error::GRpcStatus(tonic::Status::new(code, msg))
    }

    #[test]
    fn etcds_answers_are_named() {
        let a = Attempt {
            user: Some("warden"),
            tls: true,
            client_cert: true,
            prefix: "/warden/jobs/j/",
        };
        let none = Attempt { user: None, ..a };
        let cases = [
            (
                status(
                    tonic::Code::InvalidArgument,
                    "etcdserver: authentication failed, invalid user ID or password",
                ),
                a,
                "etcd refused user warden: wrong user name or password",
            ),
            (
                status(
                    tonic::Code::PermissionDenied,
                    "etcdserver: permission denied",
                ),
                a,
                "may not read or write /warden/jobs/j/",
            ),
            (
                status(
                    tonic::Code::PermissionDenied,
                    "etcdserver: permission denied",
                ),
                none,
                "give --etcd-user",
            ),
            (
                status(
                    tonic::Code::InvalidArgument,
                    "etcdserver: user name is empty",
                ),
                none,
                "authentication on and no user",
            ),
            (
                status(
                    tonic::Code::FailedPrecondition,
                    "etcdserver: authentication is not enabled",
                ),
                a,
                "authentication off",
            ),
        ];
        for (e, attempt, want) in cases {
            let got = explain(&e, attempt);
            assert!(got.contains(want), "{got}");
            assert!(got.contains("etcdserver:"), "etcd's own words kept: {got}");
        }
    }
}
