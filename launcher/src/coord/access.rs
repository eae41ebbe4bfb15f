//! Who warden is to etcd and how it knows the cluster: the TLS files and
//! the user and password of every etcd client warden makes (the launcher's
//! coordinator, the goodput reports, `warden goodput --etcd`).
//!
//! In: paths (the cluster CA; optionally a client certificate and key, for
//! an etcd run with `--client-cert-auth`) and a user with its password, as
//! `warden run`'s and `warden goodput`'s flags give them
//! (`crate::coord::etcd_flags`).
//! Out: an [`EtcdAccess`] whose files are read and checked as PEM by
//! [`EtcdAccess::check`] (so a launcher fails before it starts anything)
//! and turned into the client's TLS settings by `super::connect`; the rule
//! tying an endpoint's scheme to the TLS settings
//! ([`endpoint_scheme_problem`]).
//! Never: print, log or Debug-format a password ([`Password`] redacts
//! itself); send a password over plain HTTP without saying so (the
//! launcher warns); trust a CA other than the one given (no system roots).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

/// How warden reaches etcd beyond the endpoints: TLS and a user, each
/// optional. The default is plain HTTP with no user, as before TLS.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EtcdAccess {
    /// TLS to etcd's client port: the endpoints are `https://`.
    pub tls: Option<EtcdTlsFiles>,
    /// A user to authenticate as, for an etcd with `auth enable` on.
    pub auth: Option<Credentials>,
}

/// The files of TLS to etcd, read at each connect (so a certificate
/// renewed on disk is taken by the next connection).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdTlsFiles {
    /// The CA (PEM, one certificate or a bundle) that etcd's server
    /// certificate must chain to; the only one trusted.
    pub ca: PathBuf,
    /// A client certificate and key, for an etcd that wants one
    /// (`--client-cert-auth`).
    pub identity: Option<ClientIdentity>,
}

/// This host's certificate for etcd's client-certificate authentication.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientIdentity {
    /// The certificate (PEM; a chain, leaf first).
    pub cert: PathBuf,
    /// Its private key (PEM: PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
}

/// An etcd user and its password.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Credentials {
    /// The etcd user name.
    pub user: String,
    /// Its password.
    pub password: Password,
}

/// A password: shown as `<redacted>` by Debug and never displayed, so it
/// cannot reach a log line or an error message by accident.
#[derive(Clone, PartialEq, Eq)]
pub struct Password(String);

impl std::fmt::Debug for Password {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Password(<redacted>)")
    }
}

impl Password {
    /// A password given as a value (from an environment variable, a test).
    pub fn new(password: impl Into<String>) -> Self {
        Self(password.into())
    }

    /// The password in `path`: the file's contents without one trailing
    /// newline (`echo secret > file` works). An empty one is refused.
    /// A file other users may read is used, with a warning.
    pub fn from_file(path: &Path) -> Result<Self, AccessError> {
        use std::os::unix::fs::PermissionsExt;
        let bytes = warden_core::named_file::read(path, warden_core::named_file::CONFIG_CAP)
            .map_err(|e| AccessError::Read {
                role: FileRole::Password,
                path: path.to_owned(),
                source: Arc::new(e),
            })?;
        let content = |problem: &str| AccessError::Content {
            role: FileRole::Password,
            path: path.to_owned(),
            problem: problem.to_owned(),
        };
        let text = String::from_utf8(bytes).map_err(|_| content("not UTF-8 text"))?;
        let text = text
            .strip_suffix("\r\n")
            .or_else(|| text.strip_suffix('\n'))
            .unwrap_or(&text);
        if text.is_empty() {
            return Err(content("empty"));
        }
        if let Ok(meta) = std::fs::metadata(path)
            && meta.permissions().mode() & 0o004 != 0
        {
            tracing::warn!(
                path = %path.display(),
                "etcd password file is readable by every user of this host; chmod 600 it"
            );
        }
        Ok(Self(text.to_owned()))
    }

    /// The password itself, for the etcd client only.
    pub(crate) fn expose(&self) -> &str {
        &self.0
    }
}

/// Which file of [`EtcdAccess`] a problem is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileRole {
    /// [`EtcdTlsFiles::ca`].
    Ca,
    /// [`ClientIdentity::cert`].
    Cert,
    /// [`ClientIdentity::key`].
    Key,
    /// A password file.
    Password,
}

impl std::fmt::Display for FileRole {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            FileRole::Ca => "CA certificate",
            FileRole::Cert => "client certificate",
            FileRole::Key => "client key",
            FileRole::Password => "password file",
        })
    }
}

/// A file of [`EtcdAccess`] that cannot be used, or a user name etcd
/// would not take; each names the file or the value.
#[derive(Debug, Clone, thiserror::Error)]
pub enum AccessError {
    /// The file cannot be read.
    #[error("etcd {role} {}: cannot read: {source}", path.display())]
    Read {
        /// Which file.
        role: FileRole,
        /// Its path.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: Arc<std::io::Error>,
    },
    /// The file was read but is not what it should be.
    #[error("etcd {role} {}: {problem}", path.display())]
    Content {
        /// Which file.
        role: FileRole,
        /// Its path.
        path: PathBuf,
        /// What is wrong (never the content itself).
        problem: String,
    },
}

impl AccessError {
    /// The file the error is about.
    pub fn role(&self) -> FileRole {
        match self {
            AccessError::Read { role, .. } | AccessError::Content { role, .. } => *role,
        }
    }
}

/// The PEM contents of [`EtcdTlsFiles`], checked.
#[derive(Clone)]
pub(crate) struct TlsMaterial {
    /// The CA certificate(s).
    pub ca: Vec<u8>,
    /// The client certificate and key.
    pub identity: Option<(Vec<u8>, Vec<u8>)>,
}

impl std::fmt::Debug for TlsMaterial {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsMaterial")
            .field("ca_bytes", &self.ca.len())
            .field("identity", &self.identity.is_some())
            .finish()
    }
}

impl EtcdTlsFiles {
    /// Reads the files and checks each is the PEM it should be.
    pub(crate) fn read(&self) -> Result<TlsMaterial, AccessError> {
        let ca = read_certs(FileRole::Ca, &self.ca)?;
        let identity = match &self.identity {
            Some(id) => Some((read_certs(FileRole::Cert, &id.cert)?, read_key(&id.key)?)),
            None => None,
        };
        Ok(TlsMaterial { ca, identity })
    }
}

impl EtcdAccess {
    /// Reads every file now: the launcher calls it before it starts
    /// anything, so a missing or bad file stops it at once, named.
    pub fn check(&self) -> Result<(), AccessError> {
        if let Some(tls) = &self.tls {
            tls.read()?;
        }
        Ok(())
    }

    /// One line for the console: TLS or not, with which files, which user
    /// (never the password).
    pub fn describe(&self) -> String {
        let tls = match &self.tls {
            None => "plain HTTP".to_owned(),
            Some(t) => format!(
                "TLS (CA {}{})",
                t.ca.display(),
                t.identity
                    .as_ref()
                    .map(|i| format!(", client certificate {}", i.cert.display()))
                    .unwrap_or_default()
            ),
        };
        match &self.auth {
            None => format!("{tls}, no user"),
            Some(c) => format!("{tls}, user {}", c.user),
        }
    }
}

/// Why `endpoint` cannot be used with TLS on (`tls`) or off, or `None`.
/// With TLS an endpoint is `https://HOST:PORT` or `HOST:PORT`; without,
/// `http://HOST:PORT` or `HOST:PORT`: a plain endpoint beside TLS files (or
/// https without a CA) is a mistake, not a choice to guess at.
pub fn endpoint_scheme_problem(endpoint: &str, tls: bool) -> Option<&'static str> {
    let (http, https) = (
        endpoint.starts_with("http://"),
        endpoint.starts_with("https://"),
    );
    if !http && !https && endpoint.contains("://") {
        return Some("the scheme must be http:// or https://");
    }
    match (tls, http, https) {
        (true, true, _) => Some(
            "a plain http:// endpoint, while a CA for TLS is given: use https:// (or leave the scheme out)",
        ),
        (false, _, true) => Some(
            "an https:// endpoint needs the cluster's CA certificate (--etcd-cacert; `tls.ca` in a coord config)",
        ),
        _ => None,
    }
}

fn read_file(role: FileRole, path: &Path) -> Result<Vec<u8>, AccessError> {
    warden_core::named_file::read(path, warden_core::named_file::CONFIG_CAP).map_err(|e| {
        AccessError::Read {
            role,
            path: path.to_owned(),
            source: Arc::new(e),
        }
    })
}

/// One or more PEM certificates, each of which parses.
fn read_certs(role: FileRole, path: &Path) -> Result<Vec<u8>, AccessError> {
    let bytes = read_file(role, path)?;
    let bad = |problem: String| AccessError::Content {
        role,
        path: path.to_owned(),
        problem,
    };
    let mut n = 0usize;
    for cert in CertificateDer::pem_slice_iter(&bytes) {
        cert.map_err(|e| bad(format!("not a PEM certificate: {e}")))?;
        n += 1;
    }
    if n == 0 {
        return Err(bad(
            "no PEM certificate in it (no -----BEGIN CERTIFICATE----- block)".to_owned(),
        ));
    }
    Ok(bytes)
}

/// A PEM private key.
fn read_key(path: &Path) -> Result<Vec<u8>, AccessError> {
    let bytes = read_file(FileRole::Key, path)?;
    PrivateKeyDer::from_pem_slice(&bytes).map_err(|e| AccessError::Content {
        role: FileRole::Key,
        path: path.to_owned(),
        problem: format!("no PEM private key in it: {e}"),
    })?;
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn password_never_shows_in_debug() {
        let c = Credentials {
            user: "warden".into(),
            password: Password::new("hunter2"),
        };
        let a = EtcdAccess {
            tls: None,
            auth: Some(c),
        };
        let shown = format!("{a:?} {a:#?} {}", a.describe());
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(shown.contains("warden"), "{shown}");
    }

    #[test]
    fn password_file_drops_one_newline_and_refuses_empty() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let p = dir.path().join("pw");
        std::fs::write(&p, "s3cret\n").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            Password::from_file(&p).map(|p| p.expose().to_owned()).ok(),
            Some("s3cret".to_owned())
        );
        std::fs::write(&p, "\n").unwrap_or_else(|e| panic!("{e}"));
        assert!(matches!(
            Password::from_file(&p),
            Err(AccessError::Content {
                role: FileRole::Password,
                ..
            })
        ));
        let missing = dir.path().join("nope");
        let e = Password::from_file(&missing).err().map(|e| e.to_string());
        assert!(
            e.as_deref()
                .is_some_and(|e| e.contains("nope") && e.contains("cannot read")),
            "{e:?}"
        );
    }

    #[test]
    fn files_that_are_not_pem_are_named() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let junk = dir.path().join("junk.pem");
        std::fs::write(&junk, "hello").unwrap_or_else(|e| panic!("{e}"));
        let tls = EtcdTlsFiles {
            ca: junk.clone(),
            identity: None,
        };
        let e = tls.read().err().map(|e| (e.role(), e.to_string()));
        assert!(
            matches!(&e, Some((FileRole::Ca, m)) if m.contains("junk.pem") && m.contains("no PEM certificate")),
            "{e:?}"
        );
        let tls = EtcdTlsFiles {
            ca: dir.path().join("missing.pem"),
            identity: None,
        };
        assert!(matches!(
            tls.read(),
            Err(AccessError::Read {
                role: FileRole::Ca,
                ..
            })
        ));
    }

    #[test]
    fn schemes_follow_the_tls_setting() {
        let cases = [
            ("127.0.0.1:2379", false, true),
            ("127.0.0.1:2379", true, true),
            ("http://e:2379", false, true),
            ("http://e:2379", true, false),
            ("https://e:2379", true, true),
            ("https://e:2379", false, false),
            ("unix://e", false, false),
        ];
        for (endpoint, tls, fine) in cases {
            assert_eq!(
                endpoint_scheme_problem(endpoint, tls).is_none(),
                fine,
                "{endpoint} tls={tls}"
            );
        }
    }
}
