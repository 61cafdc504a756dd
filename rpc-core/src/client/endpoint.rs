//! Where to connect and how: [`Endpoint`], its configuration, and the address resolution the server shares.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use crate::flow::{DEFAULT_STREAM_WINDOW, INITIAL_STREAM_WINDOW};
use crate::frame::{HEAD_LEN, MAX_HEADER_LEN};
use crate::intercept::{Interceptor, Scoped};
use crate::keepalive::{Keepalive, DEFAULT_KEEPALIVE};
use crate::transport::{self, FrameLimits, Transport, TransportError};

/// Default largest message, either way: 64 MiB + 64 KiB.
///
/// Parameter-server tensors are large: the limit counts the encoded message,
/// so a message whose `bytes` field holds a whole 64 MiB tensor (plus the
/// field's tag and length) fits, with 64 KiB to spare for its name, shape and
/// other small fields.
pub const DEFAULT_MAX_MESSAGE_SIZE: usize = (64 << 20) + (64 << 10);

/// The largest message size the wire format can carry.
pub const MAX_MESSAGE_SIZE_LIMIT: usize = u32::MAX as usize;

pub(crate) fn frame_limits(max_message_size: usize) -> FrameLimits {
    FrameLimits {
        max_frame_len: max_message_size.saturating_add(HEAD_LEN + MAX_HEADER_LEN),
    }
}

/// An address that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AddressError {
    /// Not of the form `scheme://authority`.
    #[error("invalid address {0:?}: expected scheme://host:port, e.g. tcp://127.0.0.1:50051")]
    Invalid(String),
    /// No transport serves the scheme in this process.
    #[error("no transport is installed for {scheme}:// (installed: {installed}); call transport_{scheme}::install() at start-up")]
    UnknownScheme {
        /// The scheme asked for.
        scheme: String,
        /// The schemes that are installed.
        installed: String,
    },
    /// A balanced channel was given no endpoints.
    #[error("a channel needs at least one endpoint to balance over")]
    NoEndpoints,
}

/// Finds the transport for `address` and splits off its authority.
pub(crate) fn resolve(address: &str) -> Result<(Arc<dyn Transport>, String), AddressError> {
    let (scheme, authority) =
        transport::split_address(address).ok_or_else(|| AddressError::Invalid(address.into()))?;
    let transport = transport::lookup(scheme).ok_or_else(|| AddressError::UnknownScheme {
        scheme: scheme.into(),
        installed: transport::registered_schemes().join(", "),
    })?;
    Ok((transport, authority.to_string()))
}

/// Connecting a channel failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConnectError {
    /// The address is unusable.
    #[error(transparent)]
    Address(#[from] AddressError),
    /// The transport could not connect.
    #[error("connecting to {address} failed: {source}")]
    Transport {
        /// The address.
        address: String,
        /// Why.
        #[source]
        source: TransportError,
    },
    /// No connection within the connect timeout.
    #[error("connecting to {address} timed out after {timeout:?}")]
    Timeout {
        /// The address.
        address: String,
        /// The connect timeout.
        timeout: Duration,
    },
}

#[derive(Debug, Clone)]
pub(super) struct ChannelConfig {
    pub(super) connect_timeout: Duration,
    pub(super) timeout: Option<Duration>,
    pub(super) max_message_size: usize,
    pub(super) stream_window: u32,
    pub(super) backoff_initial: Duration,
    pub(super) backoff_max: Duration,
    pub(super) keepalive: Option<Keepalive>,
    pub(super) wait_for_ready: bool,
    pub(super) interceptors: Vec<Scoped>,
}

/// Where and how to connect; builds a [`Channel`](super::Channel).
///
/// ```no_run
/// # async fn run() -> Result<(), rpc_core::ConnectError> {
/// use std::time::Duration;
/// let channel = rpc_core::Endpoint::new("tcp://127.0.0.1:50051")?
///     .timeout(Duration::from_secs(2))
///     .max_message_size(256 << 20)
///     .connect()
///     .await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Endpoint {
    pub(super) address: String,
    pub(super) authority: String,
    pub(super) transport: Arc<dyn Transport>,
    pub(super) config: ChannelConfig,
}

impl fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Endpoint")
            .field("address", &self.address)
            .field("config", &self.config)
            .finish()
    }
}

impl Endpoint {
    /// An endpoint for `address` (`tcp://host:port`, `rdma://host:port`, `mem://name`),
    /// using the transport installed for its scheme.
    pub fn new(address: impl Into<String>) -> Result<Endpoint, AddressError> {
        let address = address.into();
        let (transport, authority) = resolve(&address)?;
        Ok(Endpoint {
            address,
            authority,
            transport,
            config: ChannelConfig {
                connect_timeout: Duration::from_secs(20),
                timeout: None,
                max_message_size: DEFAULT_MAX_MESSAGE_SIZE,
                stream_window: DEFAULT_STREAM_WINDOW,
                backoff_initial: Duration::from_millis(100),
                backoff_max: Duration::from_secs(10),
                keepalive: Some(DEFAULT_KEEPALIVE),
                wait_for_ready: false,
                interceptors: Vec::new(),
            },
        })
    }

    /// How long one connection attempt may take (default 20 s).
    pub fn connect_timeout(mut self, timeout: Duration) -> Endpoint {
        self.config.connect_timeout = timeout;
        self
    }

    /// Timeout for calls whose request sets none (default: none).
    pub fn timeout(mut self, timeout: Duration) -> Endpoint {
        self.config.timeout = Some(timeout);
        self
    }

    /// Largest message sent or received (default [`DEFAULT_MAX_MESSAGE_SIZE`]).
    /// Larger ones fail with `ResourceExhausted`; the connection stays up.
    /// At most 4 GiB - 1 (the frame's length field).
    pub fn max_message_size(mut self, bytes: usize) -> Endpoint {
        self.config.max_message_size = bytes.min(MAX_MESSAGE_SIZE_LIMIT);
        self
    }

    /// Bytes a server may send on one response stream ahead of the reader
    /// (default [`DEFAULT_STREAM_WINDOW`]); at least 64 KiB.
    pub fn stream_window(mut self, bytes: u32) -> Endpoint {
        self.config.stream_window = bytes.max(INITIAL_STREAM_WINDOW);
        self
    }

    /// Delay before reconnecting after a failed attempt: starts at `initial`,
    /// doubles per failure up to `max` (defaults 100 ms and 10 s). Calls made
    /// while waiting fail at once with `Unavailable`, naming the last error.
    pub fn reconnect_backoff(mut self, initial: Duration, max: Duration) -> Endpoint {
        self.config.backoff_initial = initial;
        self.config.backoff_max = max.max(initial);
        self
    }

    /// While the server is unreachable (between reconnect attempts), make
    /// calls wait for the next attempt instead of failing at once with
    /// `Unavailable`; a call's deadline still bounds its wait. On a channel
    /// over several replicas, calls wait only when every replica is
    /// unreachable. (Default: off, calls fail fast, as in gRPC.)
    pub fn wait_for_ready(mut self, wait: bool) -> Endpoint {
        self.config.wait_for_ready = wait;
        self
    }

    /// Runs `interceptor` on every call made on this channel, before it is
    /// sent (after those added before it): to add metadata (credentials, a
    /// trace context) or refuse the call locally; its `on_end` hears how
    /// calls with a single response ended. See [`intercept`](crate::intercept).
    pub fn intercept(mut self, interceptor: impl Interceptor) -> Endpoint {
        self.config.interceptors.push((None, Arc::new(interceptor)));
        self
    }

    /// After `interval` without a frame from the server, ping it; if nothing
    /// arrives within `timeout` more, fail the connection and its calls with
    /// `Unavailable` (defaults 20 s and 20 s). Catches a server host that
    /// died while calls waited for answers, on any transport.
    pub fn keepalive(mut self, interval: Duration, timeout: Duration) -> Endpoint {
        self.config.keepalive = Some(Keepalive { interval, timeout });
        self
    }

    /// No keepalive pings: calls without a deadline may then wait forever on a dead server.
    pub fn no_keepalive(mut self) -> Endpoint {
        self.config.keepalive = None;
        self
    }
}
