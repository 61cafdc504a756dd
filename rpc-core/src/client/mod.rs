//! The client side: an [`Endpoint`] configures, a [`Channel`] multiplexes calls
//! over one connection (reconnecting as needed), a [`Client`] makes typed calls.
//!
//! Layers, each using only those above it: `endpoint` (address and
//! configuration), `call_table` (one connection's open calls and its reader:
//! `ClientConn`), `channel` (connecting, reconnecting, balancing over replicas), `calls` (typed
//! calls and the handle that cancels a dropped call).

mod call_table;
mod calls;
mod channel;
mod deadlines;
mod endpoint;

pub use calls::Client;
pub use channel::{Balance, Channel};
pub(crate) use endpoint::{frame_limits, resolve};
pub use endpoint::{
    AddressError, ConnectError, Endpoint, DEFAULT_MAX_MESSAGE_SIZE, MAX_MESSAGE_SIZE_LIMIT,
};
