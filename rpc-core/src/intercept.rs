//! Interceptors: code that runs around every call, on the server
//! ([`ServerBuilder::intercept`](crate::ServerBuilder::intercept)) or the
//! client ([`Endpoint::intercept`](crate::Endpoint::intercept)): read and add
//! metadata, reject a call with a [`Status`], hand a handler request
//! [`Extensions`], time calls.
//!
//! ```
//! use rpc_core::intercept::{CallHead, Interceptor};
//! use rpc_core::Status;
//!
//! /// Admits calls that carry the right token, and tells handlers who called.
//! struct RequireToken(&'static str);
//!
//! #[derive(Clone, Debug, PartialEq)]
//! struct Caller(String);
//!
//! impl Interceptor for RequireToken {
//!     fn on_call(&self, call: &mut CallHead<'_>) -> Result<(), Status> {
//!         match call.metadata().get_str("authorization") {
//!             Some(token) if token == self.0 => {
//!                 let caller = Caller(call.peer().address().to_string());
//!                 call.extensions_mut().insert(caller);
//!                 Ok(())
//!             }
//!             _ => Err(Status::unauthenticated("a valid authorization token is required")),
//!         }
//!     }
//! }
//!
//! let server = rpc_core::Server::builder().intercept(RequireToken("s3cret"));
//! // A handler reads it back: `request.extensions().get::<Caller>()`.
//! ```
//!
//! A closure `Fn(&mut CallHead) -> Result<(), Status>` is an interceptor too.
//! Interceptors run in the order added, on the connection's reading task
//! before the handler's task is spawned: they must not block. A server
//! without interceptors pays one branch per call for the feature.
//!
//! Why not tower `Layer`s: a tower service per call boxes a future and
//! polls through every layer for each call and each message; what these
//! hooks do (look at the head, decide, observe the end) needs none of that,
//! and costs nothing when absent.

use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use crate::metadata::MetadataMap;
use crate::status::Status;

/// Who is on the other side of a call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Peer {
    address: String,
    identity: Option<String>,
}

impl Peer {
    /// A peer at `address` (as the transport reports it, e.g. `tcp://10.0.0.5:41234`).
    pub fn new(address: impl Into<String>) -> Peer {
        Peer {
            address: address.into(),
            identity: None,
        }
    }

    /// A peer at `address` that proved to be `identity` (see [`Peer::identity`]).
    pub fn with_identity(address: impl Into<String>, identity: Option<String>) -> Peer {
        Peer {
            address: address.into(),
            identity,
        }
    }

    /// The peer's transport address.
    pub fn address(&self) -> &str {
        &self.address
    }

    /// Who the peer proved to be, when the transport authenticates peers:
    /// for `tls://` with client certificates required, the client
    /// certificate's first DNS name, else its subject's common name (CN),
    /// else its subject's other attributes (`O=Acme, OU=ML`), else
    /// `serial:` and its serial number in hex; for `rdma://` with a shared
    /// secret, `"rdma-secret"`; `None` where the peer was not
    /// authenticated.
    pub fn identity(&self) -> Option<&str> {
        self.identity.as_deref()
    }
}

/// Values of any type, one per type: what interceptors hand handlers
/// ([`Request::extensions`](crate::Request::extensions)). Cloning is cheap
/// (values are shared).
#[derive(Clone, Default)]
pub struct Extensions {
    /// `None` unless something is stored: every request carries one, so it
    /// is a pointer wide and costs no hasher set-up when unused.
    #[allow(clippy::box_collection)]
    map: Option<Box<HashMap<TypeId, Arc<dyn Any + Send + Sync>>>>,
}

impl Extensions {
    /// No values.
    pub fn new() -> Extensions {
        Extensions::default()
    }

    /// Stores `value`, replacing any earlier value of its type.
    pub fn insert<T: Send + Sync + 'static>(&mut self, value: T) {
        self.map
            .get_or_insert_with(Box::default)
            .insert(TypeId::of::<T>(), Arc::new(value));
    }

    /// The value of type `T`, if one was stored.
    pub fn get<T: Send + Sync + 'static>(&self) -> Option<&T> {
        self.map
            .as_ref()?
            .get(&TypeId::of::<T>())?
            .downcast_ref::<T>()
    }

    /// Removes the value of type `T`; whether there was one.
    pub fn remove<T: Send + Sync + 'static>(&mut self) -> bool {
        self.map
            .as_mut()
            .is_some_and(|map| map.remove(&TypeId::of::<T>()).is_some())
    }

    /// Whether nothing is stored.
    pub fn is_empty(&self) -> bool {
        self.map.as_ref().is_none_or(|map| map.is_empty())
    }
}

impl fmt::Debug for Extensions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Extensions")
            .field("values", &self.map.as_ref().map_or(0, |map| map.len()))
            .finish()
    }
}

/// A call as an interceptor sees it before it runs.
pub struct CallHead<'a> {
    pub(crate) path: &'a str,
    pub(crate) metadata: &'a mut MetadataMap,
    pub(crate) peer: &'a Peer,
    pub(crate) extensions: &'a mut Extensions,
    pub(crate) timeout: Option<Duration>,
}

impl CallHead<'_> {
    /// The method's path, `/package.Service/Method`.
    pub fn path(&self) -> &str {
        self.path
    }

    /// The service part of the path, `package.Service`.
    pub fn service(&self) -> &str {
        service_of(self.path)
    }

    /// The method part of the path, `Method`.
    pub fn method(&self) -> &str {
        self.path.rsplit_once('/').map_or("", |(_, method)| method)
    }

    /// The call's metadata.
    pub fn metadata(&self) -> &MetadataMap {
        self.metadata
    }

    /// The call's metadata, to add to (on a client, before it is sent; on a
    /// server, what the handler will see).
    pub fn metadata_mut(&mut self) -> &mut MetadataMap {
        self.metadata
    }

    /// The other side: on a server the client, on a client the server's address.
    pub fn peer(&self) -> &Peer {
        self.peer
    }

    /// Values for the handler (server side; on a client they go nowhere).
    pub fn extensions_mut(&mut self) -> &mut Extensions {
        self.extensions
    }

    /// The time the call has (on a server, what was left when it arrived).
    pub fn timeout(&self) -> Option<Duration> {
        self.timeout
    }
}

/// A call as an interceptor sees it once it ended.
#[derive(Debug)]
pub struct CallEnd<'a> {
    pub(crate) path: &'a str,
    pub(crate) peer: &'a Peer,
    pub(crate) status: &'a Status,
    pub(crate) elapsed: Duration,
}

impl CallEnd<'_> {
    /// The method's path, `/package.Service/Method`.
    pub fn path(&self) -> &str {
        self.path
    }

    /// The other side.
    pub fn peer(&self) -> &Peer {
        self.peer
    }

    /// How the call ended (`Cancelled` if the client cancelled it or its
    /// connection closed first).
    pub fn status(&self) -> &Status {
        self.status
    }

    /// From [`Interceptor::on_call`] to the end.
    pub fn elapsed(&self) -> Duration {
        self.elapsed
    }
}

/// Code that runs around every call; see the [module docs](self).
pub trait Interceptor: Send + Sync + 'static {
    /// Before the call runs (server) or is sent (client): read or add
    /// metadata, add extensions, or reject it with a status (the handler
    /// never runs; a client's call is not sent).
    fn on_call(&self, call: &mut CallHead<'_>) -> Result<(), Status>;

    /// Once the call ended, for every call `on_call` admitted or rejected
    /// (on a client: calls with a single response, when it arrives).
    fn on_end(&self, _call: &CallEnd<'_>) {}
}

impl fmt::Debug for dyn Interceptor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Interceptor")
    }
}

impl<F> Interceptor for F
where
    F: Fn(&mut CallHead<'_>) -> Result<(), Status> + Send + Sync + 'static,
{
    fn on_call(&self, call: &mut CallHead<'_>) -> Result<(), Status> {
        self(call)
    }
}

/// An interceptor and the service it is limited to (`None`: every service).
pub(crate) type Scoped = (Option<String>, Arc<dyn Interceptor>);

/// Runs `on_call` of each interceptor in scope, in order; on a rejection,
/// `on_end` of those that ran, and the rejection.
pub(crate) fn run_on_call(interceptors: &[Scoped], head: &mut CallHead<'_>) -> Result<(), Status> {
    for (i, (scope, interceptor)) in interceptors.iter().enumerate() {
        if !in_scope(scope, head.path) {
            continue;
        }
        if let Err(status) = interceptor.on_call(head) {
            let end = CallEnd {
                path: head.path,
                peer: head.peer,
                status: &status,
                elapsed: Duration::ZERO,
            };
            run_on_end(&interceptors[..=i], &end);
            return Err(status);
        }
    }
    Ok(())
}

/// Runs `on_end` of each interceptor in scope.
pub(crate) fn run_on_end(interceptors: &[Scoped], end: &CallEnd<'_>) {
    for (scope, interceptor) in interceptors {
        if in_scope(scope, end.path) {
            interceptor.on_end(end);
        }
    }
}

fn service_of(path: &str) -> &str {
    path.strip_prefix('/')
        .and_then(|p| p.split_once('/'))
        .map_or("", |(service, _)| service)
}

/// Whether a call to `path` is in `scope` (the path is parsed only for a
/// scoped interceptor).
fn in_scope(scope: &Option<String>, path: &str) -> bool {
    scope.as_deref().is_none_or(|s| s == service_of(path))
}
