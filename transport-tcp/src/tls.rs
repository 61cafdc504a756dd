//! TLS over TCP: `tls://host:port`, server TLS and mutual TLS (rustls).
//!
//! ```no_run
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! use transport_tcp::tls::{self, TlsTransport};
//!
//! // A server: its certificate and key; with `require_client_cert`,
//! // clients must present a certificate signed by the CA in `ca_file`.
//! let tls = TlsTransport::builder()
//!     .cert_file("/etc/rpc/server.pem")
//!     .key_file("/etc/rpc/server.key")
//!     .ca_file("/etc/rpc/ca.pem")
//!     .require_client_cert(true)
//!     .build()?; // a missing or invalid file fails here, naming it
//! tls::install(tls);
//! // ... Server::builder().add_service(..).serve("tls://0.0.0.0:7000")
//!
//! // A client: the CA it trusts, and its own certificate for mutual TLS.
//! let tls = TlsTransport::builder()
//!     .ca_file("/etc/rpc/ca.pem")
//!     .cert_file("/etc/rpc/worker-7.pem")
//!     .key_file("/etc/rpc/worker-7.key")
//!     .build()?;
//! tls::install(tls);
//! let channel = rpc_core::Channel::connect("tls://10.0.0.5:7000").await?;
//! # Ok(()) }
//! ```
//!
//! One [`TlsTransport`] serves both ends: what it connects to must present
//! a certificate signed by a CA of [`ca_file`](TlsTransportBuilder::ca_file)
//! and valid for the address's host (a DNS name, or an IP address among the
//! certificate's IP SANs); what it listens on presents
//! [`cert_file`](TlsTransportBuilder::cert_file). Files are PEM, read once
//! by [`build`](TlsTransportBuilder::build).
//!
//! # Features
//! - **Identity.** On a server with
//!   [`require_client_cert`](TlsTransportBuilder::require_client_cert),
//!   handlers see who the client proved to be as
//!   [`Peer::identity`](rpc_core::intercept::Peer::identity)
//!   (`request.peer().identity()`): the client certificate's first DNS
//!   name, else its subject's common name (CN), else its subject's other
//!   attributes (`O=Acme, OU=ML`), else `serial:` and its serial number.
//!   Without client certificates it is `None`.
//! - **Refusals before any call.** A client that presents no certificate,
//!   or one not signed by the trusted CA, is refused during the handshake:
//!   no handler runs. Its `connect` fails, and says why: after the
//!   handshake the server sends one byte that accepts the client, which
//!   the client waits for (with TLS 1.3 a client otherwise learns its
//!   certificate was refused only when it next reads). This costs one
//!   round trip per connection, not per call.
//! - **Errors that say what to fix**, on both ends: "the server's
//!   certificate is not signed by a trusted CA (tls-ca /etc/rpc/ca.pem)",
//!   "the server's certificate expired (valid until 2024-01-01 00:00:00
//!   UTC, now ...); renew it", "the server requires a client certificate",
//!   then rustls's own words. A server logs each refused client at `warn`
//!   (at most one line a second; the count of those left out follows).
//! - **Everything `tcp://` does**: the same writer (inline when idle,
//!   batched when busy), read budget, back-pressure, keepalive and dead-peer
//!   timeout, set with [`TlsTransportBuilder::tcp`].
//!
//! # Listening
//! Each accepted connection's handshake runs in its own task, bounded by
//! [`handshake_timeout`](TlsTransportBuilder::handshake_timeout) (10 s by
//! default): a client that stalls its handshake holds nothing but its own
//! socket, and the listener goes on accepting. At most
//! [`max_handshakes`](TlsTransportBuilder::max_handshakes) run at once
//! (1,024 by default); connections beyond are closed at once.
//!
//! # Resource cleanup
//! Dropping the listener aborts the handshakes in progress. A connection
//! closed in order sends TLS's `close_notify`; a peer whose socket closes
//! without one (it died) ends the connection as a TCP close would.
//!
//! # Thread safety
//! A connection's reader and writer share one rustls session behind a
//! mutex, held only while a read or write runs (never across a wait).

mod explain;
mod identity;
mod stream;

use std::fmt;
use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use rpc_core::transport::{
    self, BoxFuture, Connection, FrameLimits, Listener, RefusalLog, Transport, TransportError,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::task::JoinSet;
use tokio_rustls::{TlsAcceptor, TlsConnector};

use crate::{AcceptLoop, TcpTransport};
use explain::{handshake_error, Side};
use stream::SharedTcp;

/// What a server sends once a client's handshake, its certificate
/// included, has been accepted; the client's `connect` waits for it.
const ACCEPTED: u8 = 0x01;

/// Makes `tls://` addresses work in this process with `transport`
/// (shorthand for [`rpc_core::transport::register`]).
pub fn install(transport: TlsTransport) {
    transport::register(Arc::new(transport));
}

/// The TLS transport: `tls://host:port`. Build one with
/// [`TlsTransport::builder`], then [`install`] it.
#[derive(Clone)]
pub struct TlsTransport {
    scheme: &'static str,
    tcp: TcpTransport,
    /// `None` without a CA file: connecting fails, saying so.
    client: Option<Arc<ClientConfig>>,
    /// `None` without a certificate and key: listening fails, saying so.
    server: Option<Arc<ServerConfig>>,
    ca_file: Option<PathBuf>,
    handshake_timeout: Duration,
    max_handshakes: usize,
}

impl fmt::Debug for TlsTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TlsTransport")
            .field("scheme", &self.scheme)
            .field("ca_file", &self.ca_file)
            .field("connects", &self.client.is_some())
            .field("listens", &self.server.is_some())
            .field("handshake_timeout", &self.handshake_timeout)
            .field("max_handshakes", &self.max_handshakes)
            .finish_non_exhaustive()
    }
}

impl TlsTransport {
    /// A builder with nothing set.
    pub fn builder() -> TlsTransportBuilder {
        TlsTransportBuilder::default()
    }
}

/// Settings of a [`TlsTransport`]; [`build`](Self::build) reads the files.
#[derive(Debug, Clone)]
pub struct TlsTransportBuilder {
    ca_file: Option<PathBuf>,
    cert_file: Option<PathBuf>,
    key_file: Option<PathBuf>,
    require_client_cert: bool,
    scheme: &'static str,
    tcp: TcpTransport,
    handshake_timeout: Duration,
    max_handshakes: usize,
}

impl Default for TlsTransportBuilder {
    fn default() -> TlsTransportBuilder {
        TlsTransportBuilder {
            ca_file: None,
            cert_file: None,
            key_file: None,
            require_client_cert: false,
            scheme: "tls",
            tcp: TcpTransport::default(),
            handshake_timeout: Duration::from_secs(10),
            max_handshakes: 1024,
        }
    }
}

impl TlsTransportBuilder {
    /// PEM file of the CA certificates peers' certificates must be signed
    /// by: servers' when connecting (needed to connect), clients' when
    /// listening with [`require_client_cert`](Self::require_client_cert).
    pub fn ca_file(mut self, path: impl Into<PathBuf>) -> TlsTransportBuilder {
        self.ca_file = Some(path.into());
        self
    }

    /// PEM file of this end's certificate, followed by any intermediate
    /// CA certificates: needed to listen; when connecting, presented to
    /// servers that ask for one (mutual TLS). Goes with
    /// [`key_file`](Self::key_file).
    pub fn cert_file(mut self, path: impl Into<PathBuf>) -> TlsTransportBuilder {
        self.cert_file = Some(path.into());
        self
    }

    /// PEM file of the private key of [`cert_file`](Self::cert_file)'s
    /// certificate (PKCS #8, PKCS #1 or SEC1).
    pub fn key_file(mut self, path: impl Into<PathBuf>) -> TlsTransportBuilder {
        self.key_file = Some(path.into());
        self
    }

    /// When listening, refuse clients that present no certificate signed
    /// by a CA of [`ca_file`](Self::ca_file) (mutual TLS; default false).
    /// Handlers then see each client's name as
    /// [`Peer::identity`](rpc_core::intercept::Peer::identity).
    pub fn require_client_cert(mut self, require: bool) -> TlsTransportBuilder {
        self.require_client_cert = require;
        self
    }

    /// The scheme served (default `"tls"`): another name lets one process
    /// register two TLS configurations, e.g. for clusters with different
    /// CAs (`tls-eu://...`).
    pub fn scheme(mut self, scheme: &'static str) -> TlsTransportBuilder {
        self.scheme = scheme;
        self
    }

    /// The TCP settings connections use (write high water, read budget,
    /// dead-peer timeout); default [`TcpTransport::default`].
    pub fn tcp(mut self, tcp: TcpTransport) -> TlsTransportBuilder {
        self.tcp = tcp;
        self
    }

    /// How long a handshake may take, on either end, before the
    /// connection is dropped (default 10 s). A client's own deadline is
    /// also its endpoint's connect timeout.
    pub fn handshake_timeout(mut self, timeout: Duration) -> TlsTransportBuilder {
        self.handshake_timeout = timeout;
        self
    }

    /// How many handshakes a listener runs at once (default 1,024); a
    /// connection arriving beyond is closed at once.
    pub fn max_handshakes(mut self, handshakes: usize) -> TlsTransportBuilder {
        self.max_handshakes = handshakes.max(1);
        self
    }

    /// Reads the files and builds the transport. Fails naming the file
    /// that is missing, unreadable or holds no usable PEM, or saying which
    /// setting is missing (a certificate without its key, client
    /// certificates required without a CA to check them).
    pub fn build(self) -> Result<TlsTransport, TlsConfigError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let roots = match &self.ca_file {
            Some(path) => Some(Arc::new(read_roots(path)?)),
            None => None,
        };
        let identity = match (&self.cert_file, &self.key_file) {
            (Some(cert), Some(key)) => Some((read_certificates(cert)?, read_key(key)?)),
            (None, None) => None,
            (Some(_), None) => return Err(TlsConfigError::Missing("a key_file for the cert_file")),
            (None, Some(_)) => return Err(TlsConfigError::Missing("a cert_file for the key_file")),
        };
        let rustls_error = |what: &str| {
            let what = what.to_string();
            move |source| TlsConfigError::Rustls { what, source }
        };

        let client = match &roots {
            Some(roots) => {
                let builder = ClientConfig::builder_with_provider(Arc::clone(&provider))
                    .with_safe_default_protocol_versions()
                    .map_err(rustls_error("the client configuration"))?
                    .with_root_certificates(Arc::clone(roots));
                Some(Arc::new(match &identity {
                    Some((chain, key)) => builder
                        .with_client_auth_cert(chain.clone(), key.clone_key())
                        .map_err(rustls_error(&key_context(&self)))?,
                    None => builder.with_no_client_auth(),
                }))
            }
            None => None,
        };

        let server = match identity {
            Some((chain, key)) => {
                let builder = ServerConfig::builder_with_provider(Arc::clone(&provider))
                    .with_safe_default_protocol_versions()
                    .map_err(rustls_error("the server configuration"))?;
                let builder = if self.require_client_cert {
                    let roots = roots.clone().ok_or(TlsConfigError::Missing(
                        "a ca_file to check client certificates against (require_client_cert)",
                    ))?;
                    let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                        roots,
                        Arc::clone(&provider),
                    )
                    .build()
                    .map_err(|e| TlsConfigError::Rustls {
                        what: "the client certificate verifier".into(),
                        source: rustls::Error::General(e.to_string()),
                    })?;
                    builder.with_client_cert_verifier(verifier)
                } else {
                    builder.with_no_client_auth()
                };
                Some(Arc::new(
                    builder
                        .with_single_cert(chain, key)
                        .map_err(rustls_error(&key_context(&self)))?,
                ))
            }
            None if self.require_client_cert => {
                return Err(TlsConfigError::Missing(
                    "a cert_file and key_file to listen with (require_client_cert)",
                ))
            }
            None => None,
        };

        Ok(TlsTransport {
            scheme: self.scheme,
            tcp: self.tcp,
            client,
            server,
            ca_file: self.ca_file,
            handshake_timeout: self.handshake_timeout,
            max_handshakes: self.max_handshakes,
        })
    }
}

fn key_context(builder: &TlsTransportBuilder) -> String {
    let show = |path: &Option<PathBuf>| {
        path.as_deref()
            .map(|p| p.display().to_string())
            .unwrap_or_default()
    };
    format!(
        "the certificate {} with the key {}",
        show(&builder.cert_file),
        show(&builder.key_file)
    )
}

/// Why [`TlsTransportBuilder::build`] failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TlsConfigError {
    /// A file could not be read.
    #[error("cannot read the {what} {}: {source}", path.display())]
    Read {
        /// What the file was to hold (`CA file`, `certificate file`, `key file`).
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// A file holds no usable PEM of the kind expected.
    #[error("the {what} {} {reason}", path.display())]
    Pem {
        /// What the file was to hold.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// A setting another one needs was not given.
    #[error("TLS needs {0}")]
    Missing(&'static str),
    /// rustls refused the configuration (e.g. a key that does not match its certificate).
    #[error("{what}: {source}")]
    Rustls {
        /// What was being set up.
        what: String,
        /// rustls's error.
        #[source]
        source: rustls::Error,
    },
}

fn read(what: &'static str, path: &Path) -> Result<Vec<u8>, TlsConfigError> {
    std::fs::read(path).map_err(|source| TlsConfigError::Read {
        what,
        path: path.into(),
        source,
    })
}

fn pem_error(what: &'static str, path: &Path, reason: impl fmt::Display) -> TlsConfigError {
    TlsConfigError::Pem {
        what,
        path: path.into(),
        reason: reason.to_string(),
    }
}

fn read_certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsConfigError> {
    const WHAT: &str = "certificate file";
    let pem = read(WHAT, path)?;
    let certificates = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| pem_error(WHAT, path, format_args!("is not valid PEM: {e}")))?;
    if certificates.is_empty() {
        return Err(pem_error(
            WHAT,
            path,
            "holds no certificate (no \"BEGIN CERTIFICATE\" section)",
        ));
    }
    Ok(certificates)
}

fn read_roots(path: &Path) -> Result<RootCertStore, TlsConfigError> {
    const WHAT: &str = "CA file";
    let pem = read(WHAT, path)?;
    let mut roots = RootCertStore::empty();
    for certificate in CertificateDer::pem_slice_iter(&pem) {
        let certificate = certificate
            .map_err(|e| pem_error(WHAT, path, format_args!("is not valid PEM: {e}")))?;
        roots.add(certificate).map_err(|e| {
            pem_error(
                WHAT,
                path,
                format_args!("holds an unusable CA certificate: {e}"),
            )
        })?;
    }
    if roots.is_empty() {
        return Err(pem_error(
            WHAT,
            path,
            "holds no certificate (no \"BEGIN CERTIFICATE\" section)",
        ));
    }
    Ok(roots)
}

fn read_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsConfigError> {
    const WHAT: &str = "key file";
    let pem = read(WHAT, path)?;
    PrivateKeyDer::from_pem_slice(&pem).map_err(|e| match e {
        rustls::pki_types::pem::Error::NoItemsFound => pem_error(
            WHAT,
            path,
            "holds no private key (no \"BEGIN PRIVATE KEY\", \"BEGIN RSA PRIVATE KEY\" \
             or \"BEGIN EC PRIVATE KEY\" section)",
        ),
        e => pem_error(WHAT, path, format_args!("is not valid PEM: {e}")),
    })
}

/// The host part of `host:port` or `[v6]:port`, as rustls checks it
/// against the server's certificate.
fn server_name(scheme: &str, authority: &str) -> Result<ServerName<'static>, TransportError> {
    let invalid = |reason: String| TransportError::InvalidAddress {
        address: format!("{scheme}://{authority}"),
        reason,
    };
    let host = match authority.rsplit_once(':') {
        Some((host, _port)) => host,
        None => return Err(invalid("expected host:port".into())),
    };
    let host = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    ServerName::try_from(host.to_string())
        .map_err(|e| invalid(format!("{host:?} is not a host name or IP address: {e}")))
}

fn timed_out(what: String, timeout: Duration, hint: &str) -> TransportError {
    TransportError::io(
        what,
        io::Error::new(
            io::ErrorKind::TimedOut,
            format!("the TLS handshake did not finish within {timeout:?}{hint}"),
        ),
    )
}

impl TlsTransport {
    async fn connect_tls(
        &self,
        authority: &str,
        limits: FrameLimits,
    ) -> Result<Connection, TransportError> {
        let address = format!("{}://{authority}", self.scheme);
        let Some(client) = &self.client else {
            return Err(TransportError::io(
                format!("connect to {address}"),
                io::Error::new(
                    io::ErrorKind::InvalidInput,
                    "no CA to check the server's certificate against: \
                     set TlsTransportBuilder::ca_file",
                ),
            ));
        };
        let name = server_name(self.scheme, authority)?;
        let tcp = TcpStream::connect(authority)
            .await
            .map_err(|e| TransportError::io(format!("connect to {address}"), e))?;
        self.tcp
            .configure(&tcp)
            .map_err(|e| TransportError::io("configure the TCP socket", e))?;
        let peer = tcp
            .peer_addr()
            .map(|a| format!("{}://{a}", self.scheme))
            .map_err(|e| TransportError::io("read peer address", e))?;
        let handshake = async {
            let connector = TlsConnector::from(Arc::clone(client));
            let mut session = connector.connect(name, SharedTcp(Arc::new(tcp))).await?;
            let mut accepted = [0];
            session.read_exact(&mut accepted).await?;
            Ok::<_, io::Error>((session, accepted[0]))
        };
        let context = || format!("TLS handshake with {address}");
        let (session, accepted) = tokio::time::timeout(self.handshake_timeout, handshake)
            .await
            .map_err(|_| {
                timed_out(
                    context(),
                    self.handshake_timeout,
                    " (is the server a tls:// listener? a tcp:// one does not answer)",
                )
            })?
            .map_err(|e| {
                TransportError::io(
                    context(),
                    handshake_error(Side::Client, e, self.ca_file.as_deref()),
                )
            })?;
        if accepted != ACCEPTED {
            return Err(TransportError::Protocol(format!(
                "{address} answered the TLS handshake with {accepted:#04x}, not the \
                 acceptance of an rdma-rpc tls:// server"
            )));
        }
        let (read, write) = stream::split(session.into(), Side::Client);
        Ok(self.tcp.connection(read, write, peer, None, limits))
    }
}

/// The server's end of one handshake, in its own task: TLS, the client's
/// identity, the acceptance byte, then the connection.
async fn accept_tls(
    transport: TlsTransport,
    server: Arc<ServerConfig>,
    tcp: TcpStream,
    from: SocketAddr,
    limits: FrameLimits,
) -> Result<Connection, TransportError> {
    let peer = format!("{}://{from}", transport.scheme);
    transport
        .tcp
        .configure(&tcp)
        .map_err(|e| TransportError::io("configure the TCP socket", e))?;
    let handshake = async {
        let mut session = TlsAcceptor::from(server)
            .accept(SharedTcp(Arc::new(tcp)))
            .await?;
        let identity = session
            .get_ref()
            .1
            .peer_certificates()
            .and_then(|chain| chain.first())
            .map(identity::of);
        session.write_all(&[ACCEPTED]).await?;
        session.flush().await?;
        Ok::<_, io::Error>((session, identity))
    };
    let context = || format!("TLS handshake with {peer}");
    let (session, identity) = tokio::time::timeout(transport.handshake_timeout, handshake)
        .await
        .map_err(|_| timed_out(context(), transport.handshake_timeout, ""))?
        .map_err(|e| {
            TransportError::io(
                context(),
                handshake_error(Side::Server, e, transport.ca_file.as_deref()),
            )
        })?;
    let (read, write) = stream::split(session.into(), Side::Server);
    Ok(transport
        .tcp
        .connection(read, write, peer, identity, limits))
}

impl Transport for TlsTransport {
    fn scheme(&self) -> &'static str {
        self.scheme
    }

    fn connect<'a>(
        &'a self,
        authority: &'a str,
        limits: FrameLimits,
    ) -> BoxFuture<'a, Result<Connection, TransportError>> {
        Box::pin(self.connect_tls(authority, limits))
    }

    fn listen<'a>(
        &'a self,
        authority: &'a str,
        limits: FrameLimits,
    ) -> BoxFuture<'a, Result<Box<dyn Listener>, TransportError>> {
        Box::pin(async move {
            let Some(server) = &self.server else {
                return Err(TransportError::io(
                    format!("listen on {}://{authority}", self.scheme),
                    io::Error::new(
                        io::ErrorKind::InvalidInput,
                        "a TLS server needs a certificate and key: \
                         set TlsTransportBuilder::cert_file and key_file",
                    ),
                ));
            };
            Ok(Box::new(TlsFrameListener {
                accept: AcceptLoop::bind(self.scheme, authority).await?,
                transport: self.clone(),
                server: Arc::clone(server),
                limits,
                handshakes: JoinSet::new(),
                refusals: RefusalLog::default(),
            }) as Box<dyn Listener>)
        })
    }
}

/// A `tls://` listener: accepts TCP connections, runs each one's handshake
/// in a task of its own, and yields the connections whose handshake
/// succeeded.
struct TlsFrameListener {
    accept: AcceptLoop,
    transport: TlsTransport,
    server: Arc<ServerConfig>,
    limits: FrameLimits,
    /// Handshakes in progress; dropping the listener aborts them.
    handshakes: JoinSet<Result<Connection, TransportError>>,
    refusals: RefusalLog,
}

impl Listener for TlsFrameListener {
    /// The next connection whose handshake succeeded. Errors are the
    /// listener's own (see [`AcceptLoop::poll_next`]); failed handshakes
    /// are logged, never returned.
    fn poll_accept(&mut self, cx: &mut Context<'_>) -> Poll<Result<Connection, TransportError>> {
        // Start a handshake for every connection waiting.
        while let Poll::Ready(accepted) = self.accept.poll_next(cx) {
            let (tcp, from) = accepted?;
            if self.handshakes.len() >= self.transport.max_handshakes {
                self.refusals.note(format_args!(
                    "closed {}://{from} at once: {} TLS handshakes are already in progress \
                     (TlsTransportBuilder::max_handshakes)",
                    self.transport.scheme, self.transport.max_handshakes
                ));
                continue;
            }
            self.handshakes.spawn(accept_tls(
                self.transport.clone(),
                Arc::clone(&self.server),
                tcp,
                from,
                self.limits,
            ));
        }
        loop {
            match ready!(self.handshakes.poll_join_next(cx)) {
                Some(Ok(Ok(connection))) => return Poll::Ready(Ok(connection)),
                Some(Ok(Err(error))) => self.refusals.note(format_args!("refused: {error}")),
                Some(Err(panicked)) => self
                    .refusals
                    .note(format_args!("a TLS handshake task failed: {panicked}")),
                // No handshake in progress: the accept loop wakes us.
                None => return Poll::Pending,
            }
        }
    }

    fn local_addr(&self) -> String {
        self.accept.local.clone()
    }
}
