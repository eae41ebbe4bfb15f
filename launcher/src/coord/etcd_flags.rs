//! How the command line says to reach a secured etcd: the same flags for
//! `warden run --rdzv-backend etcd` and `warden goodput --etcd`, named as
//! etcdctl's (`--cacert`, `--cert`, `--key`, `--user`) with an `etcd-`
//! prefix, since `warden run` has TLS of its own to speak of.
//!
//! In: `--etcd-cacert FILE`, `--etcd-cert FILE`, `--etcd-key FILE`,
//! `--etcd-user NAME`, `--etcd-password-file FILE` (each also from a
//! `WARDEN_ETCD_*` variable), and the password in `$WARDEN_ETCD_PASSWORD`.
//! Out: an [`EtcdAccess`] whose files were read and checked, or an
//! [`EtcdFlagsError`] naming the flag, and the file or the value.
//! Never: take a password as a flag's value (`ps` shows every process's
//! arguments to every user of the host); show the password in `--help`,
//! an error or a log line.

use std::path::PathBuf;

use crate::coord::access::{AccessError, FileRole};
use crate::coord::{ClientIdentity, Credentials, EtcdAccess, EtcdTlsFiles, Password};

/// The environment variable that may hold the etcd password. The
/// launcher removes it from its workers' environment.
pub const PASSWORD_ENV: &str = "WARDEN_ETCD_PASSWORD";

/// TLS and authentication to etcd.
#[derive(Debug, Clone, Default, PartialEq, Eq, clap::Args)]
pub struct EtcdFlags {
    /// etcd: the cluster's CA certificate (PEM) that etcd's server
    /// certificate must chain to. Turns TLS on: endpoints are then
    /// `https://HOST:PORT` or `HOST:PORT` (etcdctl's --cacert).
    #[arg(long = "etcd-cacert", value_name = "FILE", env = "WARDEN_ETCD_CACERT")]
    pub etcd_cacert: Option<PathBuf>,
    /// etcd: this host's client certificate (PEM), for an etcd run with
    /// --client-cert-auth; needs --etcd-key and --etcd-cacert (etcdctl's
    /// --cert).
    #[arg(
        long = "etcd-cert",
        value_name = "FILE",
        env = "WARDEN_ETCD_CERT",
        requires_all = ["etcd_key", "etcd_cacert"]
    )]
    pub etcd_cert: Option<PathBuf>,
    /// etcd: the client certificate's private key (PEM) (etcdctl's --key).
    #[arg(
        long = "etcd-key",
        value_name = "FILE",
        env = "WARDEN_ETCD_KEY",
        requires = "etcd_cert"
    )]
    pub etcd_key: Option<PathBuf>,
    /// etcd: the user to log in as, for an etcd with authentication on. A
    /// name only: the password comes from --etcd-password-file or
    /// $WARDEN_ETCD_PASSWORD, never from a flag (etcdctl's --user).
    #[arg(long = "etcd-user", value_name = "NAME", env = "WARDEN_ETCD_USER")]
    pub etcd_user: Option<String>,
    /// etcd: a file holding --etcd-user's password (one trailing newline
    /// is dropped). Keep it mode 0600. Default: $WARDEN_ETCD_PASSWORD.
    #[arg(
        long = "etcd-password-file",
        value_name = "FILE",
        env = "WARDEN_ETCD_PASSWORD_FILE"
    )]
    pub etcd_password_file: Option<PathBuf>,
}

/// Flags that cannot be followed; each names the flag.
#[derive(Debug, thiserror::Error)]
pub enum EtcdFlagsError {
    /// A file that cannot be read, or is not the PEM it should be.
    #[error("{flag}: {source}")]
    File {
        /// The flag that named the file.
        flag: &'static str,
        /// What is wrong with it.
        source: AccessError,
    },
    /// `--etcd-user NAME:PASSWORD`, etcdctl's form, which would put the
    /// password where `ps` shows it.
    #[error(
        "--etcd-user takes a name only, not NAME:PASSWORD: a flag's value is visible to every user of the host (ps); give the password with --etcd-password-file FILE or ${PASSWORD_ENV}"
    )]
    PasswordInUser,
    /// An empty user name.
    #[error("--etcd-user must not be empty")]
    EmptyUser,
    /// A user without a password.
    #[error("--etcd-user {0} needs its password: --etcd-password-file FILE or ${PASSWORD_ENV}")]
    NoPassword(String),
    /// A password without a user.
    #[error("{0} gives an etcd password, but no --etcd-user says whose")]
    NoUser(&'static str),
    /// An empty `$WARDEN_ETCD_PASSWORD`.
    #[error("${PASSWORD_ENV} is empty")]
    EmptyPassword,
    /// An endpoint whose scheme contradicts the TLS flags.
    #[error("{flag} {endpoint}: {problem}")]
    Endpoint {
        /// The flag that gave the endpoints.
        flag: &'static str,
        /// The endpoint.
        endpoint: String,
        /// What is wrong.
        problem: &'static str,
    },
}

impl EtcdFlags {
    /// The access the flags describe, with the password read (file, else
    /// `$WARDEN_ETCD_PASSWORD`) and every TLS file read and checked now.
    pub fn access(&self) -> Result<EtcdAccess, EtcdFlagsError> {
        self.access_with_env(std::env::var(PASSWORD_ENV).ok())
    }

    /// [`EtcdFlags::access`] with the environment's password given.
    pub fn access_with_env(
        &self,
        env_password: Option<String>,
    ) -> Result<EtcdAccess, EtcdFlagsError> {
        let tls = self.etcd_cacert.as_ref().map(|ca| EtcdTlsFiles {
            ca: ca.clone(),
            identity: match (&self.etcd_cert, &self.etcd_key) {
                (Some(cert), Some(key)) => Some(ClientIdentity {
                    cert: cert.clone(),
                    key: key.clone(),
                }),
                _ => None,
            },
        });
        let password = match (&self.etcd_password_file, env_password) {
            (Some(file), _) => {
                Some(
                    Password::from_file(file).map_err(|source| EtcdFlagsError::File {
                        flag: "--etcd-password-file",
                        source,
                    })?,
                )
            }
            (None, Some(p)) if p.is_empty() => return Err(EtcdFlagsError::EmptyPassword),
            (None, Some(p)) => Some(Password::new(p)),
            (None, None) => None,
        };
        let auth = match (&self.etcd_user, password) {
            (Some(u), _) if u.contains(':') => return Err(EtcdFlagsError::PasswordInUser),
            (Some(u), _) if u.is_empty() => return Err(EtcdFlagsError::EmptyUser),
            (Some(u), Some(password)) => Some(Credentials {
                user: u.clone(),
                password,
            }),
            (Some(u), None) => return Err(EtcdFlagsError::NoPassword(u.clone())),
            (None, Some(_)) => {
                return Err(EtcdFlagsError::NoUser(
                    if self.etcd_password_file.is_some() {
                        "--etcd-password-file"
                    } else {
                        "$WARDEN_ETCD_PASSWORD"
                    },
                ));
            }
            (None, None) => None,
        };
        let access = EtcdAccess { tls, auth };
        access.check().map_err(|source| EtcdFlagsError::File {
            flag: match source.role() {
                FileRole::Ca => "--etcd-cacert",
                FileRole::Cert => "--etcd-cert",
                FileRole::Key => "--etcd-key",
                FileRole::Password => "--etcd-password-file",
            },
            source,
        })?;
        Ok(access)
    }

    /// Checks each endpoint's scheme against the TLS flags; `flag` is the
    /// flag that gave them (`--rdzv-endpoint`, `--etcd`).
    pub fn check_endpoints(
        &self,
        flag: &'static str,
        endpoints: &[String],
    ) -> Result<(), EtcdFlagsError> {
        for e in endpoints {
            if let Some(problem) =
                crate::coord::access::endpoint_scheme_problem(e, self.etcd_cacert.is_some())
            {
                return Err(EtcdFlagsError::Endpoint {
                    flag,
                    endpoint: e.clone(),
                    problem,
                });
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flags(user: Option<&str>, file: Option<&str>) -> EtcdFlags {
        EtcdFlags {
            etcd_user: user.map(str::to_owned),
            etcd_password_file: file.map(PathBuf::from),
            ..EtcdFlags::default()
        }
    }

    #[test]
    fn user_and_password_rules() {
        let ok = flags(Some("warden"), None).access_with_env(Some("pw".into()));
        assert!(
            matches!(
                ok,
                Ok(EtcdAccess {
                    auth: Some(_),
                    tls: None
                })
            ),
            "{ok:?}"
        );
        assert!(matches!(
            flags(Some("warden:pw"), None).access_with_env(None),
            Err(EtcdFlagsError::PasswordInUser)
        ));
        assert!(matches!(
            flags(Some("warden"), None).access_with_env(None),
            Err(EtcdFlagsError::NoPassword(_))
        ));
        assert!(matches!(
            flags(None, None).access_with_env(Some("pw".into())),
            Err(EtcdFlagsError::NoUser(_))
        ));
        assert!(matches!(
            flags(Some("warden"), None).access_with_env(Some(String::new())),
            Err(EtcdFlagsError::EmptyPassword)
        ));
        let e = flags(Some("warden"), Some("/nonexistent/pw"))
            .access_with_env(None)
            .err()
            .map(|e| e.to_string());
        assert!(
            e.as_deref().is_some_and(
                |e| e.starts_with("--etcd-password-file: ") && e.contains("/nonexistent/pw")
            ),
            "{e:?}"
        );
        assert_eq!(
            flags(None, None).access_with_env(None).ok(),
            Some(EtcdAccess::default())
        );
    }

    #[test]
    fn tls_files_errors_name_the_flag() {
        let f = EtcdFlags {
            etcd_cacert: Some("/nonexistent/ca.pem".into()),
            ..EtcdFlags::default()
        };
        let e = f.access_with_env(None).err().map(|e| e.to_string());
        assert!(
            e.as_deref().is_some_and(
                |e| e.starts_with("--etcd-cacert: ") && e.contains("/nonexistent/ca.pem")
            ),
            "{e:?}"
        );
        assert!(
            f.check_endpoints("--etcd", &["http://e:2379".into()])
                .is_err()
        );
        assert!(
            f.check_endpoints("--etcd", &["https://e:2379".into(), "e:2379".into()])
                .is_ok()
        );
        assert!(
            EtcdFlags::default()
                .check_endpoints("--etcd", &["https://e:2379".into()])
                .is_err()
        );
    }
}
