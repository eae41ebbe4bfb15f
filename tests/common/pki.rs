//! A cluster CA made by the test (rcgen): node certificates whose first DNS
//! name is the agent's host name, files to name in `api.tls_*`, and
//! clients with or without a certificate for calling an agent's TCP port.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use hyper_util::rt::TokioIo;
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
use tokio::net::TcpStream;
use tokio_rustls::rustls;
use tonic::transport::{Channel, Endpoint, Uri};
use warden_proto::v1::peer_client::PeerClient;

/// A CA and the directory its files are written to.
pub struct ClusterCa {
    issuer: Issuer<'static, KeyPair>,
    ca_pem: String,
    dir: tempfile::TempDir,
}

impl std::fmt::Debug for ClusterCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ClusterCa({})", self.dir.path().display())
    }
}

/// One node's files.
#[derive(Debug, Clone)]
pub struct NodeFiles {
    /// Its identity (first DNS name).
    pub name: String,
    /// The CA file.
    pub ca: PathBuf,
    /// Its certificate.
    pub cert: PathBuf,
    /// Its key.
    pub key: PathBuf,
}

impl NodeFiles {
    /// The `[api]` keys naming these files (no table header).
    pub fn api_keys(&self) -> String {
        format!(
            "tls_ca = {:?}\ntls_cert = {:?}\ntls_key = {:?}\n",
            self.ca.display().to_string(),
            self.cert.display().to_string(),
            self.key.display().to_string()
        )
    }
}

impl ClusterCa {
    /// A fresh CA named `label`.
    pub fn new(label: &str) -> Self {
        let key = KeyPair::generate().expect("CA key");
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(DnType::CommonName, format!("{label} test CA"));
        let cert = params.self_signed(&key).expect("CA certificate");
        let dir = tempfile::Builder::new()
            .prefix("warden-pki-")
            .tempdir()
            .expect("pki dir");
        let ca_pem = cert.pem();
        std::fs::write(dir.path().join("ca.crt"), &ca_pem).expect("write CA");
        Self {
            issuer: Issuer::new(params, key),
            ca_pem,
            dir,
        }
    }

    /// The CA certificate's file.
    pub fn ca_path(&self) -> PathBuf {
        self.dir.path().join("ca.crt")
    }

    /// Issues a certificate for `name` (its first DNS name) and writes it
    /// and its key as `<name>.crt` and `<name>.key`.
    pub fn node(&self, name: &str) -> NodeFiles {
        // Each node its own directory: tests in parallel reuse host names.
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = self.dir.path().join(format!("{n}-{name}"));
        std::fs::create_dir_all(&dir).expect("node dir");
        let files = NodeFiles {
            name: name.to_owned(),
            ca: self.ca_path(),
            cert: dir.join("node.crt"),
            key: dir.join("node.key"),
        };
        self.issue_to(name, &files.cert, &files.key);
        files
    }

    /// Issues a new certificate for `name` into `cert` and `key` (a
    /// rotation: each file replaced by a rename, as a tool would).
    pub fn issue_to(&self, name: &str, cert: &Path, key: &Path) {
        let k = KeyPair::generate().expect("node key");
        let params = CertificateParams::new(vec![name.to_owned()]).expect("node params");
        let c = params
            .signed_by(&k, &self.issuer)
            .expect("node certificate");
        let write = |path: &Path, text: String| {
            let tmp = path.with_extension("tmp");
            std::fs::write(&tmp, text).expect("write");
            std::fs::rename(&tmp, path).expect("rename");
        };
        write(key, k.serialize_pem());
        write(cert, c.pem());
    }

    /// A rustls client trusting this CA, presenting `node`'s certificate
    /// when given (none: a client without a certificate).
    pub fn client_config(&self, node: Option<&NodeFiles>) -> rustls::ClientConfig {
        use rustls::pki_types::pem::PemObject;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut roots = rustls::RootCertStore::empty();
        for c in rustls::pki_types::CertificateDer::pem_slice_iter(self.ca_pem.as_bytes()) {
            roots.add(c.expect("CA pem")).expect("CA root");
        }
        let b = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .expect("versions")
            .with_root_certificates(roots);
        let mut c = match node {
            None => b.with_no_client_auth(),
            Some(n) => {
                let chain = rustls::pki_types::CertificateDer::pem_file_iter(&n.cert)
                    .expect("cert")
                    .collect::<Result<Vec<_>, _>>()
                    .expect("cert pem");
                let key = rustls::pki_types::PrivateKeyDer::from_pem_file(&n.key).expect("key");
                b.with_client_auth_cert(chain, key).expect("client cert")
            }
        };
        c.alpn_protocols = vec![b"h2".to_vec()];
        c
    }
}

/// The test binary's cluster CA, made once.
pub fn cluster() -> &'static ClusterCa {
    static CA: std::sync::OnceLock<ClusterCa> = std::sync::OnceLock::new();
    CA.get_or_init(|| {
        // A static is never dropped, so its TempDir would stay in /tmp
        // after every test binary that used it: remove it at exit (as
        // users.rs does for the attacker's copy).
        extern "C" fn remove_dir() {
            if let Some(ca) = CA.get() {
                let _ = std::fs::remove_dir_all(ca.dir.path());
            }
        }
        let ca = ClusterCa::new("cluster");
        // SAFETY: registers a plain `extern "C" fn()` with the C library; it
        // runs once at exit and touches only the filesystem.
        unsafe { libc::atexit(remove_dir) };
        ca
    })
}

/// The `[api]` keys of a node of [`cluster`] named `name`.
pub fn api_keys(name: &str) -> String {
    cluster().node(name).api_keys()
}

/// A gRPC channel to `addr` over TLS with `config`, expecting the server to
/// be `server_name`; the first call fails when the handshake does.
pub fn tls_channel(addr: &str, server_name: &str, config: rustls::ClientConfig) -> Channel {
    let config = Arc::new(config);
    let (addr, name) = (addr.to_owned(), server_name.to_owned());
    Endpoint::from_shared(format!("http://{addr}"))
        .expect("endpoint")
        .connect_with_connector_lazy(tower::service_fn(move |_: Uri| {
            let (config, addr, name) = (config.clone(), addr.clone(), name.clone());
            async move {
                let tcp = TcpStream::connect(&addr).await?;
                let name = rustls::pki_types::ServerName::try_from(name)
                    .map_err(|e| std::io::Error::other(e.to_string()))?;
                let s = tokio_rustls::TlsConnector::from(config)
                    .connect(name, tcp)
                    .await?;
                Ok::<_, std::io::Error>(TokioIo::new(s))
            }
        }))
}

/// A Peer client over [`tls_channel`].
pub fn peer_client(
    addr: &str,
    server_name: &str,
    config: rustls::ClientConfig,
) -> PeerClient<Channel> {
    PeerClient::new(tls_channel(addr, server_name, config))
}
