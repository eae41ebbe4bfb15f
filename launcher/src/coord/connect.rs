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
//! So is a first read that got no answer within the deadline while an
//! endpoint takes TCP connections: etcd is there but slow (a mass start's
//! load, a machine starved of CPU: a spare's join failed on one 2 s read
//! in a loaded CI run).
//! Once etcd was there (a read with no answer, or "cannot serve now"), a
//! read whose connection the client's own keep-alive closed on the silent
//! server is one more.
//! Never: wait on etcd without a deadline; put the password in an error,
//! a log line or a Debug string; fall back to plain HTTP when TLS fails;
//! ask again after a refusal, a transport error, or no answer from
//! endpoints that take no connection (a wrong endpoint looks like those,
//! and must fail at once).

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
    // The server is etcd's, not one that closes plain connections at once
    // (which neither answers a read nor leaves one unanswered): a read of
    // this dial went unanswered, or etcd answered "cannot serve now". The
    // client's own keep-alive may then close the connection under a later
    // read ([`closed_under_a_read`]).
    let mut etcd_there = false;
    loop {
        let asked = std::time::Instant::now();
        let probe = client.get(dial.probe, Some(GetOptions::new().with_count_only()));
        match tokio::time::timeout(dial.timeout, probe).await {
            Ok(Ok(_)) => return Ok(client),
            Ok(Err(e)) if etcd_cannot_serve_now(&e) => {
                etcd_there = true;
                let Some(wait) = patience.next_wait() else {
                    return Err(failed(e));
                };
                tracing::warn!(endpoints = %joined, error = %e, ?wait, "etcd cannot serve the connection's first read now (an election, or too busy); asking again");
                tokio::time::sleep(wait).await;
            }
            // The connection closed under the read once etcd was known to
            // be there, or after this read's own deadline: the keep-alive
            // gave up on a silent server. (A server that closes plain
            // connections does so at once, and never answers.)
            Ok(Err(e))
                if closed_under_a_read(&e) && (etcd_there || asked.elapsed() >= dial.timeout) =>
            {
                if listening(dial.endpoints, dial.timeout).await
                    && let Some(wait) = patience.next_wait()
                {
                    tracing::warn!(endpoints = %joined, error = %e, ?wait, "the connection to etcd closed under its first read while etcd was slow to answer (the keep-alive gave up); asking again");
                    tokio::time::sleep(wait).await;
                    continue;
                }
                // Silence to the end: the deadline's error, not the
                // close's (whose words are about TLS).
                return Err(timed_out("get (first read)"));
            }
            Ok(Err(e)) if !client_timed_out(&e) => return Err(failed(e)),
            // No answer within the deadline: the client's own (a timed-out
            // request) or this one's.
            Ok(Err(_)) | Err(_) => {
                etcd_there = true;
                if listening(dial.endpoints, dial.timeout).await
                    && let Some(wait) = patience.next_wait()
                {
                    tracing::warn!(endpoints = %joined, after = ?dial.timeout, ?wait, "etcd takes connections but did not answer the connection's first read in time (busy); asking again");
                    tokio::time::sleep(wait).await;
                    continue;
                }
                return Err(timed_out("get (first read)"));
            }
        }
    }
}

/// Whether the client gave up waiting for an answer: its request deadline
/// (tonic's `Cancelled`, "Timeout expired"), or its HTTP/2 keep-alive
/// pings unanswered (`Unavailable`, the transport's "keep-alive timed
/// out"). A server that sends nothing looks like these; a refusal or a
/// broken handshake does not.
fn client_timed_out(e: &etcd_client::Error) -> bool {
    let etcd_client::Error::GRpcStatus(s) = e else {
        return false;
    };
    match s.code() {
        tonic::Code::Cancelled => s.message().contains("Timeout expired"),
        tonic::Code::Unavailable => caused_by(s, "keep-alive timed out"),
        _ => false,
    }
}

/// Whether an error below `s` (not its own message) says `words`.
fn caused_by(s: &tonic::Status, words: &str) -> bool {
    let mut cause = std::error::Error::source(s);
    while let Some(c) = cause {
        if c.to_string().contains(words) {
            return true;
        }
        cause = c.source();
    }
    false
}

/// Whether a read ended because its connection closed under it (tonic's
/// `Cancelled` over hyper's "connection closed"). The client's HTTP/2
/// keep-alive closes a connection whose pings a silent server does not
/// answer, and the read in flight ends so; but a server that closes every
/// plain connection (it wants TLS) ends a read the same way, at once.
/// [`connect`] takes it as silence only once etcd was known to be there
/// (a read of the same dial got no answer, or etcd's own "cannot serve
/// now": a server that closes connections does neither), or once the read
/// itself waited its whole deadline (a runtime starved for longer than the
/// keep-alive's interval and timeout sees the close before its deadline).
/// A loaded CI run's join failed on it while etcd was paused.
fn closed_under_a_read(e: &etcd_client::Error) -> bool {
    let etcd_client::Error::GRpcStatus(s) = e else {
        return false;
    };
    s.code() == tonic::Code::Cancelled && caused_by(s, "connection closed")
}

/// Whether any of `endpoints` takes a TCP connection within `limit`: a
/// server is there, slow or not.
async fn listening(endpoints: &[String], limit: Duration) -> bool {
    for e in endpoints {
        let Some(authority) = authority(e) else {
            continue;
        };
        if let Ok(Ok(_)) =
            tokio::time::timeout(limit, tokio::net::TcpStream::connect(authority)).await
        {
            return true;
        }
    }
    false
}

/// The `host:port` of an endpoint URL (`http://h:2379`, `https://h:2379/`).
fn authority(endpoint: &str) -> Option<&str> {
    let rest = endpoint
        .strip_prefix("http://")
        .or_else(|| endpoint.strip_prefix("https://"))?;
    let a = rest.split('/').next()?;
    (!a.is_empty()).then_some(a)
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
    use super::*;

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

    #[test]
    fn the_clients_own_deadline_is_no_answer_and_nothing_else_is() {
        let timed_out = status(tonic::Status::cancelled("Timeout expired"));
        assert!(client_timed_out(&timed_out));
        assert!(!client_timed_out(&status(tonic::Status::cancelled(
            "other"
        ))));
        assert!(!client_timed_out(&status(tonic::Status::unavailable(
            "Timeout expired"
        ))));
    }

    /// hyper's error for a read whose connection closed, as tonic wraps it.
    #[derive(Debug)]
    struct Closed;
    impl std::fmt::Display for Closed {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("connection closed")
        }
    }
    impl std::error::Error for Closed {}

    #[test]
    fn only_a_cancelled_read_over_a_closed_connection_is_closed_under_it() {
        let mut closed = tonic::Status::cancelled("operation was canceled");
        closed.set_source(Arc::new(Closed));
        assert!(closed_under_a_read(&status(closed)));
        // The words alone in the message, or the cause under another code,
        // are not it.
        assert!(!closed_under_a_read(&status(tonic::Status::cancelled(
            "connection closed"
        ))));
        let mut refused = tonic::Status::unavailable("tcp connect error");
        refused.set_source(Arc::new(Closed));
        assert!(!closed_under_a_read(&status(refused)));
    }

    #[test]
    fn an_endpoints_host_and_port_are_read_from_its_url() {
        assert_eq!(authority("http://127.0.0.1:2379"), Some("127.0.0.1:2379"));
        assert_eq!(authority("https://etcd-0:2379/"), Some("etcd-0:2379"));
        assert_eq!(authority("etcd-0:2379"), None);
        assert_eq!(authority("http://"), None);
    }

    /// A server that takes each connection and closes it at once (as one
    /// that wants TLS closes a plain one) fails the dial at once with the
    /// close's words, with a patience of a minute: the keep-alive's close
    /// is taken as silence only once etcd was known to be there.
    #[tokio::test]
    async fn a_server_that_closes_every_connection_fails_the_dial_at_once() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let endpoint = format!("http://{}", l.local_addr().expect("addr"));
        let closer = tokio::spawn(async move {
            while let Ok((s, _)) = l.accept().await {
                drop(s);
            }
        });
        let endpoints = [endpoint];
        let access = EtcdAccess::default();
        let started = std::time::Instant::now();
        let got = connect(EtcdDial {
            endpoints: &endpoints,
            access: &access,
            timeout: Duration::from_secs(2),
            keep_alive: Some(Duration::from_secs(1)),
            probe: "/warden/jobs/j",
            patience: Duration::from_secs(60),
        })
        .await;
        closer.abort();
        let e = got.err().expect("the dial fails");
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "failed after {:?}: {e}",
            started.elapsed()
        );
        assert!(matches!(e, CoordError::Connect { .. }), "{e:?}");
    }

    #[tokio::test]
    async fn an_endpoint_that_takes_no_connection_is_not_listening() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let open = format!("http://{}", l.local_addr().expect("addr"));
        let closed = {
            let l2 = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
            format!("http://{}", l2.local_addr().expect("addr"))
        };
        let limit = Duration::from_secs(2);
        assert!(listening(std::slice::from_ref(&open), limit).await);
        assert!(!listening(std::slice::from_ref(&closed), limit).await);
        assert!(listening(&[closed, open], limit).await);
    }
}
