//! Mutual TLS between agents: the cluster CA, this node's certificate and
//! key, and the rustls configurations built from them for the `api.tcp`
//! listener ([`accept`]) and for every dialer of a peer agent ([`connect`]).
//!
//! In: the three PEM files named by `api.tls_ca`, `api.tls_cert` and
//! `api.tls_key`, read again whenever they change ([`reload`]). Out: a
//! server configuration that demands a client certificate of the cluster
//! CA, client configurations that present this node's certificate and
//! verify the peer's against the same CA, and each peer's identity (the
//! first DNS name of its certificate). Never: serve or dial with a
//! half-loaded set of files (a bad new file keeps the last good set), nor
//! accept a certificate that does not chain to the configured CA.
//!
//! The identity of an agent is its `agent.host_name`: a node certificate
//! must carry it as its first DNS subject alternative name, so that the
//! origin a pushed shard's manifest names can be bound to the certificate
//! that pushed it.

pub mod accept;
pub mod connect;
pub mod reload;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::{ClientConfig, WebPkiServerVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::server::{ServerConfig, WebPkiClientVerifier};
use rustls::{CertificateError, DigitallySignedStruct, RootCertStore, SignatureScheme};
use rustls_pki_types::pem::PemObject;

/// Why the TLS files could not be used. Each names the config key and file.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file could not be read or holds no usable PEM section.
    #[error("{key} = {path:?}: {why}")]
    File {
        /// The config key that names the file.
        key: &'static str,
        /// The file.
        path: PathBuf,
        /// What was wrong with it.
        why: String,
    },
    /// rustls refused the combination (a key that does not match the
    /// certificate, a CA it cannot use).
    #[error("{key}: {why}")]
    Config {
        /// The config key most likely at fault.
        key: &'static str,
        /// rustls' words.
        why: String,
    },
}

/// The three files of a node's TLS set, as configured.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    /// `api.tls_ca`: the cluster CA certificate(s), PEM.
    pub ca: PathBuf,
    /// `api.tls_cert`: this node's certificate chain, PEM.
    pub cert: PathBuf,
    /// `api.tls_key`: this node's private key, PEM.
    pub key: PathBuf,
}

/// One loaded, consistent TLS set: everything a handshake needs.
#[derive(Debug)]
pub struct Material {
    /// For the `api.tcp` listener: client certificates of the CA required.
    pub server: Arc<ServerConfig>,
    /// For dialing a peer whose name is known: its certificate must chain
    /// to the CA and carry that name.
    pub client_named: Arc<ClientConfig>,
    /// For dialing a peer known only by address (`straggler.peers`): its
    /// certificate must chain to the CA; its name is learned, not checked.
    pub client_any: Arc<ClientConfig>,
    /// This node's identity: the first DNS name of its certificate.
    pub identity: String,
}

/// The crypto provider every configuration uses (ring, as the rest of the
/// dependency tree already links it).
fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn file_err(key: &'static str, path: &Path, why: impl ToString) -> TlsError {
    TlsError::File {
        key,
        path: path.to_owned(),
        why: why.to_string(),
    }
}

fn certs(key: &'static str, path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let pem = warden_core::named_file::read(path, warden_core::named_file::CONFIG_CAP)
        .map_err(|e| file_err(key, path, e))?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| file_err(key, path, e))?;
    if certs.is_empty() {
        return Err(file_err(key, path, "no CERTIFICATE section in the file"));
    }
    Ok(certs)
}

/// The identity a certificate carries: its first DNS subject alternative
/// name, or None when it has none (such a certificate identifies nobody).
pub fn identity_of(cert: &CertificateDer<'_>) -> Option<String> {
    let ee = webpki::EndEntityCert::try_from(cert).ok()?;
    ee.valid_dns_names().next().map(str::to_owned)
}

impl Material {
    /// Loads and checks the three files; `host` is this agent's
    /// `agent.host_name`, which the certificate must carry first.
    pub fn load(files: &TlsFiles, host: &str) -> Result<Self, TlsError> {
        let ca = certs("api.tls_ca", &files.ca)?;
        let chain = certs("api.tls_cert", &files.cert)?;
        let key = warden_core::named_file::read(&files.key, warden_core::named_file::CONFIG_CAP)
            .map_err(|e| file_err("api.tls_key", &files.key, e))
            .and_then(|pem| {
                PrivateKeyDer::from_pem_slice(&pem)
                    .map_err(|e| file_err("api.tls_key", &files.key, e))
            })?;
        let mut roots = RootCertStore::empty();
        for c in ca {
            roots
                .add(c)
                .map_err(|e| file_err("api.tls_ca", &files.ca, e))?;
        }
        let roots = Arc::new(roots);
        let identity = chain.first().and_then(identity_of).ok_or_else(|| {
            file_err(
                "api.tls_cert",
                &files.cert,
                "the certificate has no DNS subject alternative name (it must carry the \
                 agent's host name)",
            )
        })?;
        if identity != host {
            return Err(file_err(
                "api.tls_cert",
                &files.cert,
                format!(
                    "the certificate's first DNS name is {identity:?}, not this agent's host \
                     name {host:?} (agent.host_name): peers bind a shard's origin to it"
                ),
            ));
        }
        let cfg = |key: &'static str| {
            move |e: rustls::Error| TlsError::Config {
                key,
                why: e.to_string(),
            }
        };
        let client_verifier =
            WebPkiClientVerifier::builder_with_provider(roots.clone(), provider())
                .build()
                .map_err(|e| TlsError::Config {
                    key: "api.tls_ca",
                    why: e.to_string(),
                })?;
        let mut server = ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(cfg("api.tls_cert"))?
            .with_client_cert_verifier(client_verifier)
            .with_single_cert(chain.clone(), key.clone_key())
            .map_err(cfg("api.tls_key"))?;
        server.alpn_protocols = vec![b"h2".to_vec()];
        let server_verifier = WebPkiServerVerifier::builder_with_provider(roots, provider())
            .build()
            .map_err(|e| TlsError::Config {
                key: "api.tls_ca",
                why: e.to_string(),
            })?;
        let client = |verifier: Arc<dyn ServerCertVerifier>| -> Result<_, TlsError> {
            let mut c = ClientConfig::builder_with_provider(provider())
                .with_safe_default_protocol_versions()
                .map_err(cfg("api.tls_cert"))?
                .dangerous()
                .with_custom_certificate_verifier(verifier)
                .with_client_auth_cert(chain.clone(), key.clone_key())
                .map_err(cfg("api.tls_key"))?;
            c.alpn_protocols = vec![b"h2".to_vec()];
            Ok(Arc::new(c))
        };
        Ok(Self {
            server: Arc::new(server),
            client_named: client(server_verifier.clone())?,
            client_any: client(Arc::new(AnyClusterName(server_verifier)))?,
            identity,
        })
    }
}

/// Verifies a server's certificate against the cluster CA without
/// checking its name: for peers configured by address only, whose name is
/// not known in advance. The chain, validity period and signatures are
/// still checked by webpki; only a name mismatch is forgiven.
#[derive(Debug)]
struct AnyClusterName(Arc<WebPkiServerVerifier>);

impl ServerCertVerifier for AnyClusterName {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match self
            .0
            .verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)
        {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

/// How this agent talks to its peers over TCP.
#[derive(Debug, Clone)]
pub enum PeerTls {
    /// Mutual TLS with the cluster CA; the files are watched for changes.
    Mutual(Arc<reload::Reloader>),
    /// Plain TCP with no authentication (`api.insecure = true`, or an
    /// agent with neither TLS files nor a TCP listener: unit tests, tools).
    Insecure,
}

impl PeerTls {
    /// This node's TLS identity, when it has one.
    pub fn identity(&self) -> Option<String> {
        match self {
            PeerTls::Mutual(r) => Some(r.current().identity.clone()),
            PeerTls::Insecure => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};

    /// A CA and a node certificate for `name`, written into `dir`; the
    /// second key is another key, for the mismatch case.
    fn files(dir: &Path, name: &str) -> (TlsFiles, String) {
        let ca_key = KeyPair::generate().unwrap();
        let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let ca_cert = ca.self_signed(&ca_key).unwrap();
        let issuer = Issuer::new(ca, ca_key);
        let key = KeyPair::generate().unwrap();
        let cert = CertificateParams::new(vec![name.to_owned()])
            .unwrap()
            .signed_by(&key, &issuer)
            .unwrap();
        let f = TlsFiles {
            ca: dir.join("ca.crt"),
            cert: dir.join("node.crt"),
            key: dir.join("node.key"),
        };
        std::fs::write(&f.ca, ca_cert.pem()).unwrap();
        std::fs::write(&f.cert, cert.pem()).unwrap();
        std::fs::write(&f.key, key.serialize_pem()).unwrap();
        (f, KeyPair::generate().unwrap().serialize_pem())
    }

    #[test]
    fn a_good_set_loads_and_each_bad_one_names_its_key() {
        let dir = tempfile::tempdir().unwrap();
        let (f, other_key) = files(dir.path(), "h1");
        assert_eq!(Material::load(&f, "h1").unwrap().identity, "h1");
        let e = Material::load(&f, "h2").unwrap_err().to_string();
        assert!(e.contains("api.tls_cert") && e.contains("\"h2\""), "{e}");

        let r = reload::Reloader::open(f.clone(), "h1").unwrap();
        assert!(matches!(r.check(), reload::Reload::Unchanged));
        // A key that does not match: refused, the old set stays.
        std::fs::write(&f.key, other_key).unwrap();
        match r.check() {
            reload::Reload::Refused(e) => assert!(e.to_string().contains("api.tls_key"), "{e}"),
            other => panic!("{other:?}"),
        }
        assert_eq!(r.current().identity, "h1");
        // Reported once, not on every poll.
        assert!(matches!(r.check(), reload::Reload::Unchanged));

        std::fs::write(&f.cert, "garbage").unwrap();
        let e = Material::load(&f, "h1").unwrap_err().to_string();
        assert!(e.contains("api.tls_cert"), "{e}");
    }
}
