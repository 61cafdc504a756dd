//! What generated code uses, and nothing else: generated code imports only
//! from here, so the runtime can change underneath it.
//!
//! The contract is written down in `docs/codegen-contract.md`.

pub use std::future::Future;
pub use std::sync::Arc;
pub use std::time::Duration;

pub use futures::Stream;
pub use prost_types;

pub use crate::client::{Channel, Client, ConnectError};
pub use crate::codec::ProstCodec;
pub use crate::message::{IntoRequest, IntoStreamingRequest, Request, Response, Streaming};
pub use crate::server::{
    client_streaming, server_streaming, streaming, unary, unimplemented, ServerCall, Service,
};
pub use crate::status::Status;
pub use crate::transport::BoxFuture;
