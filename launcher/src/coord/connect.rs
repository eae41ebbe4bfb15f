//! The one way warden connects to etcd: the client's options (deadlines,
//! keep-alive, TLS, user and password) are built here and nowhere else,
//! and every new connection is proved by one read before it is handed out.
//!
//! In: an [`EtcdDial`]: the endpoints, the [`EtcdAccess`] (TLS files, user),
//! the request deadline, the HTTP/2 keep-alive, and the key prefix the
//! caller is about to use.
//! Out: a connected `etcd_client::Client` that has completed the TLS
//! handshake, logged in, and read the prefix's own key; or a
//! [`CoordError`] that says which of those failed in words an operator can
//! act on ([`super::diagnose`]): the endpoint and the TLS problem, the user
//! whose password etcd refused, the prefix a user may not read.
//! A first read that etcd's server itself answered with "cannot serve now"
//! (an election: "leader changed", "no leader", "request timed out"; or
//! "too many requests") is asked again within the dial's patience: the
//! endpoint, TLS and login worked to get that answer, and a launcher of a
//! mass start that met an election used to exit on it (issue 30: a
//! 4,096-host join on a 3-member cluster).
//! Never: wait on etcd without a deadline; put the password in an error,
//! a log line or a Debug string; fall back to plain HTTP when TLS fails;
//! ask again after a refusal, a transport error or no answer at all (a
//! wrong endpoint looks like those, and must fail at once).

use std::sync::Arc;
use std::time::Duration;

use etcd_client::{Certificate, Client, ConnectOptions, GetOptions, Identity, TlsOptions};

use super::CoordError;
use super::access::{EtcdAccess, endpoint_scheme_problem};
use super::diagnose;
use super::patience::Patience;

/// What to connect to and how.
#[derive(Debug, Clone, Copy)]
pub(crate) struct EtcdDial<'a> {
    /// The etcd endpoints.
    pub endpoints: &'a [String],
    /// TLS and the user.
    pub access: &'a EtcdAccess,
    /// The deadline of the connection and of every request.
    pub timeout: Duration,
    /// HTTP/2 keep-alive interval (its timeout is `timeout`), for a client
    /// that must notice a dead connection before its lease runs out.
    pub keep_alive: Option<Duration>,
    /// The key prefix the caller uses. The first read is of the one key
    /// named by the prefix itself: it proves the TLS handshake, the login
    /// and the user's permission at once (a role granted the prefix, or
    /// any prefix above it, covers that key), in O(1). A read of the whole
    /// prefix proved the same, but etcd 3.4 walks its index over a range
    /// even to count it: O(N) in a job's hosts, per host joining (issue 30).
    pub probe: &'a str,
    /// How long a first read that etcd answered "cannot serve now" is
    /// asked again (see the module's contract).
    pub patience: Duration,
}

/// Checks each endpoint's scheme against the TLS setting; the error names
/// the field `endpoints`.
pub(crate) fn check_endpoints(endpoints: &[String], access: &EtcdAccess) -> Result<(), CoordError> {
    for e in endpoints {
        if let Some(problem) = endpoint_scheme_problem(e, access.tls.is_some()) {
            return Err(CoordError::Config {
                field: "endpoints",
                value: e.clone(),
                problem: problem.to_owned(),
            });
        }
    }
    Ok(())
}

/// The client's options: deadlines, keep-alive, TLS from the files (read
/// now), the user and password, and a new token when etcd forgot the old
/// one (an etcd restart drops its simple tokens).
pub(crate) fn options(
    access: &EtcdAccess,
    timeout: Duration,
    keep_alive: Option<Duration>,
) -> Result<ConnectOptions, CoordError> {
    let mut options = ConnectOptions::new()
        .with_connect_timeout(timeout)
        .with_timeout(timeout);
    if let Some(interval) = keep_alive {
        options = options.with_keep_alive(interval, timeout);
    }
    if let Some(tls) = &access.tls {
        let material = tls.read()?;
        let mut config = TlsOptions::new().ca_certificate(Certificate::from_pem(material.ca));
        if let Some((cert, key)) = material.identity {
            config = config.identity(Identity::from_pem(cert, key));
        }
        options = options.with_tls(config);
    }
    if let Some(c) = &access.auth {
        options = options
            .with_user(c.user.clone(), c.password.expose().to_owned())
            .with_auto_token_refresh(true);
    }
    Ok(options)
}

/// Connects and reads the one key `dial.probe` (no range, no value sent
/// back), all within the deadline; see the module's contract.
pub(crate) async fn connect(dial: EtcdDial<'_>) -> Result<Client, CoordError> {
    check_endpoints(dial.endpoints, dial.access)?;
    let options = options(dial.access, dial.timeout, dial.keep_alive)?;
    let joined = dial.endpoints.join(",");
    let attempt = diagnose::Attempt {
        user: dial.access.auth.as_ref().map(|c| c.user.as_str()),
        tls: dial.access.tls.is_some(),
        client_cert: dial
            .access
            .tls
            .as_ref()
            .is_some_and(|t| t.identity.is_some()),
        prefix: dial.probe,
    };
    let failed = |source: etcd_client::Error| CoordError::Connect {
        endpoints: joined.clone(),
        problem: diagnose::explain(&source, attempt),
        source: Arc::new(source),
    };
    let timed_out = |op: &'static str| CoordError::Timeout {
        endpoints: joined.clone(),
        op,
        key: dial.probe.to_owned(),
        after: dial.timeout,
    };
    // With a user, connecting logs in (a request); without, it is lazy.
    let mut client =
        match tokio::time::timeout(dial.timeout, Client::connect(dial.endpoints, Some(options)))
            .await
        {
            Ok(Ok(c)) => c,
            Ok(Err(e)) => return Err(failed(e)),
            Err(_) => return Err(timed_out("connect")),
        };
    let mut patience = Patience::new(dial.patience);
    loop {
        let probe = client.get(dial.probe, Some(GetOptions::new().with_count_only()));
        match tokio::time::timeout(dial.timeout, probe).await {
            Ok(Ok(_)) => return Ok(client),
            Ok(Err(e)) if etcd_cannot_serve_now(&e) => {
                let Some(wait) = patience.next_wait() else {
                    return Err(failed(e));
                };
                tracing::warn!(endpoints = %joined, error = %e, ?wait, "etcd cannot serve the connection's first read now (an election, or too busy); asking again");
                tokio::time::sleep(wait).await;
            }
            Ok(Err(e)) => return Err(failed(e)),
            Err(_) => return Err(timed_out("get (first read)")),
        }
    }
}

/// Whether etcd's server answered that it cannot serve the request now,
/// and may later: gRPC `Unavailable` or `ResourceExhausted` with a message
/// of etcd's own ("etcdserver: leader changed", "etcdserver: no leader",
/// "etcdserver: request timed out", "etcdserver: too many requests"). The
/// transport's own `Unavailable` (nothing listening, a reset) carries no
/// such message, and a refusal (a password, a permission) has another
/// code.
pub fn etcd_cannot_serve_now(e: &etcd_client::Error) -> bool {
    match e {
        etcd_client::Error::GRpcStatus(s) => {
            matches!(
                s.code(),
                tonic::Code::Unavailable | tonic::Code::ResourceExhausted
            ) && s.message().starts_with("etcdserver: ")
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::etcd_cannot_serve_now;

    fn status(s: tonic::Status) -> etcd_client::Error {
        etcd_client::Error::GRpcStatus(s)
    }

    /// etcd 3.4's answers (`rpctypes`), and the transport's.
    #[test]
    fn only_etcds_own_cannot_serve_answers_are_asked_again() {
        for msg in [
            "etcdserver: leader changed",
            "etcdserver: no leader",
            "etcdserver: request timed out",
            "etcdserver: request timed out, possibly due to previous leader failure",
        ] {
            assert!(
                etcd_cannot_serve_now(&status(tonic::Status::unavailable(msg))),
                "{msg}"
            );
        }
        assert!(etcd_cannot_serve_now(&status(
            tonic::Status::resource_exhausted("etcdserver: too many requests")
        )));
        for refused in [
            tonic::Status::unavailable(
                "error trying to connect: tcp connect error: Connection refused (os error 111)",
            ),
            tonic::Status::permission_denied("etcdserver: permission denied"),
            tonic::Status::invalid_argument(
                "etcdserver: authentication failed, invalid user ID or password",
            ),
            tonic::Status::failed_precondition("etcdserver: user name not found"),
        ] {
            let e = status(refused);
            assert!(!etcd_cannot_serve_now(&e), "{e}");
        }
    }
}
