//! [`Channel`]: calls multiplexed over one connection, reconnecting as needed.

use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use crate::status::Status;

use super::call_table::ClientConn;
use super::endpoint::{frame_limits, ChannelConfig, ConnectError, Endpoint};

/// A connection to one server, shared by every call and every clone.
///
/// Cloning is cheap; all clones multiplex their calls over one connection.
/// When the connection fails, its pending calls end with `Unavailable` and the
/// next call reconnects (with backoff after failed attempts).
///
/// Each connection's frames are read by a task on the tokio runtime, which
/// hands every response to the task awaiting its call. Make latency-critical
/// calls from a spawned task rather than from `Runtime::block_on`: a caller
/// on the `block_on` thread costs a cross-thread wake-up per call.
#[derive(Clone)]
pub struct Channel {
    pub(super) shared: Arc<ChannelShared>,
}

pub(super) struct ChannelShared {
    pub(super) endpoint: Endpoint,
    pub(super) state: Mutex<ConnState>,
    pub(super) connecting: tokio::sync::Mutex<()>,
}

pub(super) enum ConnState {
    Idle,
    Ready(Arc<ClientConn>),
    Backoff {
        retry_at: Instant,
        delay: Duration,
        error: String,
    },
}

impl Drop for ChannelShared {
    fn drop(&mut self) {
        if let ConnState::Ready(conn) = &*self.state.lock().unwrap_or_else(|e| e.into_inner()) {
            conn.sink.close();
        }
    }
}

impl fmt::Debug for Channel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Channel")
            .field("address", &self.shared.endpoint.address)
            .finish()
    }
}

impl Channel {
    /// Connects to `address` with default settings; see [`Endpoint`] for more.
    pub async fn connect(address: &str) -> Result<Channel, ConnectError> {
        Endpoint::new(address)?.connect().await
    }

    /// The address this channel connects to.
    pub fn address(&self) -> &str {
        &self.shared.endpoint.address
    }

    pub(super) fn config(&self) -> &ChannelConfig {
        &self.shared.endpoint.config
    }

    pub(super) async fn dial(&self) -> Result<Arc<ClientConn>, ConnectError> {
        let endpoint = &self.shared.endpoint;
        let limits = frame_limits(endpoint.config.max_message_size);
        let connecting = endpoint.transport.connect(&endpoint.authority, limits);
        match tokio::time::timeout(endpoint.config.connect_timeout, connecting).await {
            Ok(Ok(connection)) => Ok(ClientConn::start(connection, &endpoint.config)),
            Ok(Err(source)) => Err(ConnectError::Transport {
                address: endpoint.address.clone(),
                source,
            }),
            Err(_) => Err(ConnectError::Timeout {
                address: endpoint.address.clone(),
                timeout: endpoint.config.connect_timeout,
            }),
        }
    }

    pub(super) fn ready_connection(&self) -> Option<Arc<ClientConn>> {
        match &*self.shared.state.lock().unwrap_or_else(|e| e.into_inner()) {
            ConnState::Ready(conn) if conn.accepts_calls() => Some(Arc::clone(conn)),
            _ => None,
        }
    }

    /// The live connection, connecting (once, for all waiting callers) if needed.
    pub(super) async fn connection(&self) -> Result<Arc<ClientConn>, Status> {
        if let Some(conn) = self.ready_connection() {
            return Ok(conn);
        }
        let _one_dialer = self.shared.connecting.lock().await;
        if let Some(conn) = self.ready_connection() {
            return Ok(conn);
        }
        let previous_delay = {
            let state = self.shared.state.lock().unwrap_or_else(|e| e.into_inner());
            match &*state {
                ConnState::Backoff {
                    retry_at,
                    delay,
                    error,
                } => {
                    let now = Instant::now();
                    if now < *retry_at {
                        return Err(Status::unavailable(format!(
                            "{} is unreachable: {error}; next reconnect attempt in {:?}",
                            self.address(),
                            *retry_at - now
                        )));
                    }
                    Some(*delay)
                }
                _ => None,
            }
        };
        match self.dial().await {
            Ok(conn) => {
                *self.shared.state.lock().unwrap_or_else(|e| e.into_inner()) =
                    ConnState::Ready(Arc::clone(&conn));
                Ok(conn)
            }
            Err(error) => {
                let config = self.config();
                let delay = previous_delay
                    .map_or(config.backoff_initial, |d| (d * 2).min(config.backoff_max));
                let message = error.to_string();
                *self.shared.state.lock().unwrap_or_else(|e| e.into_inner()) = ConnState::Backoff {
                    retry_at: Instant::now() + delay,
                    delay,
                    error: message.clone(),
                };
                Err(Status::unavailable(message))
            }
        }
    }
}

/// Connecting: how an [`Endpoint`] becomes a [`Channel`].
impl Endpoint {
    /// Connects now; fails if the first connection cannot be made.
    pub async fn connect(self) -> Result<Channel, ConnectError> {
        let channel = self.connect_lazy();
        let conn = channel.dial().await?;
        *channel
            .shared
            .state
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = ConnState::Ready(conn);
        Ok(channel)
    }

    /// A channel that connects on its first call.
    pub fn connect_lazy(self) -> Channel {
        Channel {
            shared: Arc::new(ChannelShared {
                endpoint: self,
                state: Mutex::new(ConnState::Idle),
                connecting: tokio::sync::Mutex::new(()),
            }),
        }
    }
}
