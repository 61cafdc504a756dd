//! W3C trace context: a `traceparent` carried in each call's metadata, so
//! the calls one request causes (a fan-out's shard calls, a handler's calls
//! onward) share one trace id.
//!
//! ```
//! use rpc_core::trace::{TraceContext, TracePropagation};
//! use rpc_core::{Endpoint, Server};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // Servers take the caller's context (or start a trace) and run the
//! // handler inside it; clients send the current context onward.
//! let server = Server::builder().intercept(TracePropagation);
//! let shards = Endpoint::new("mem://shard-0")?.intercept(TracePropagation);
//!
//! // A front end that is not itself a handler starts one trace per query:
//! let query = TraceContext::new_root().scope(async {
//!     // every call made here carries the same trace id
//! });
//! # drop((server, shards, query)); Ok(()) }
//! ```
//!
//! A handler reads its context with [`TraceContext::current`] (or
//! `request.extensions().get::<TraceContext>()`); the server's `rpc.server`
//! span records its `trace_id`. Calls made from tasks the handler spawns
//! carry the context only if the task runs inside
//! [`TraceContext::scope`]. Without the interceptor nothing is parsed or
//! sent: a call pays nothing for the feature.
//!
//! A malformed `traceparent` is ignored, as the W3C specification says: the
//! server starts a new trace rather than failing the call.

use std::collections::hash_map::RandomState;
use std::fmt;
use std::future::Future;
use std::hash::{BuildHasher, Hasher};

use crate::intercept::{CallHead, Interceptor};
use crate::status::Status;

/// The metadata key, as W3C Trace Context names the header.
pub const TRACEPARENT: &str = "traceparent";

tokio::task_local! {
    static CURRENT: TraceContext;
}

/// Where a call is in a trace: the trace's id, the id of the span that
/// stands for the current hop (sent as the next hop's `parent-id`), and the
/// sampling flags.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct TraceContext {
    trace_id: u128,
    span_id: u64,
    flags: u8,
}

impl TraceContext {
    /// A new trace, sampled, with random ids.
    pub fn new_root() -> TraceContext {
        TraceContext {
            trace_id: (u128::from(random_nonzero()) << 64) | u128::from(random_nonzero()),
            span_id: random_nonzero(),
            flags: 0x01,
        }
    }

    /// The next hop of the same trace: a new span id, the same trace id and flags.
    pub fn child(&self) -> TraceContext {
        TraceContext {
            span_id: random_nonzero(),
            ..*self
        }
    }

    /// The context the current task runs in, if any (inside a handler of a
    /// server with [`TracePropagation`], or inside [`scope`](Self::scope)).
    pub fn current() -> Option<TraceContext> {
        CURRENT.try_with(|context| *context).ok()
    }

    /// Runs `future` with this as the [`current`](Self::current) context.
    pub fn scope<F: Future>(self, future: F) -> impl Future<Output = F::Output> {
        CURRENT.scope(self, future)
    }

    /// Runs `f` with this as the [`current`](Self::current) context (a
    /// handler's first poll on the connection's reader).
    pub(crate) fn sync_scope<R>(self, f: impl FnOnce() -> R) -> R {
        CURRENT.sync_scope(self, f)
    }

    /// The trace id, as 32 lowercase hex digits in the header.
    pub fn trace_id(&self) -> u128 {
        self.trace_id
    }

    /// The id of this hop's span, as 16 lowercase hex digits in the header.
    pub fn span_id(&self) -> u64 {
        self.span_id
    }

    /// Whether the trace is sampled (flag bit 0).
    pub fn is_sampled(&self) -> bool {
        self.flags & 0x01 != 0
    }

    /// Reads a `traceparent` header value: `None` for anything the W3C
    /// specification says to ignore (wrong lengths, uppercase or non-hex
    /// digits, version `ff`, an all-zero id, a version-00 value with more
    /// after it).
    pub fn parse(header: &str) -> Option<TraceContext> {
        let bytes = header.as_bytes();
        if bytes.len() < 55 || bytes[2] != b'-' || bytes[35] != b'-' || bytes[52] != b'-' {
            return None;
        }
        let version = hex(&bytes[0..2])?;
        // A later version may append fields after a '-'; version 00 may not.
        let tail_ok = match (version, bytes.len()) {
            (0xff, _) => false,
            (_, 55) => true,
            (0, _) => false,
            (_, _) => bytes[55] == b'-',
        };
        let trace_id = hex(&bytes[3..35])?;
        let span_id = u64::try_from(hex(&bytes[36..52])?).ok()?;
        // Only the sampled bit is defined; the others are passed on as zero.
        let flags = u8::try_from(hex(&bytes[53..55])?).ok()? & 0x01;
        (tail_ok && trace_id != 0 && span_id != 0).then_some(TraceContext {
            trace_id,
            span_id,
            flags,
        })
    }
}

/// The `traceparent` header value (version 00).
impl fmt::Display for TraceContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "00-{:032x}-{:016x}-{:02x}",
            self.trace_id, self.span_id, self.flags
        )
    }
}

impl fmt::Debug for TraceContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "TraceContext({self})")
    }
}

/// The interceptor that carries trace context across calls, on servers and
/// clients alike (see the [module docs](self)):
/// - a call whose metadata holds a valid `traceparent` (a server's incoming
///   call, or a client call the caller tagged by hand) keeps it, and the
///   handler runs in that context;
/// - otherwise the call gets one: a child of the current context, or a new
///   trace when there is none.
#[derive(Debug, Clone, Copy, Default)]
pub struct TracePropagation;

impl Interceptor for TracePropagation {
    fn on_call(&self, call: &mut CallHead<'_>) -> Result<(), Status> {
        let received = call
            .metadata()
            .get_str(TRACEPARENT)
            .and_then(TraceContext::parse);
        let context = match received {
            Some(context) => context,
            None => {
                let context = TraceContext::current()
                    .map_or_else(TraceContext::new_root, |current| current.child());
                call.metadata_mut().remove(TRACEPARENT);
                call.metadata_mut().insert(TRACEPARENT, context.to_string());
                context
            }
        };
        call.extensions_mut().insert(context);
        Ok(())
    }
}

/// Parses lowercase hex digits (at most 32).
fn hex(digits: &[u8]) -> Option<u128> {
    digits.iter().try_fold(0u128, |value, &digit| {
        let nibble = match digit {
            b'0'..=b'9' => digit - b'0',
            b'a'..=b'f' => digit - b'a' + 10,
            _ => return None,
        };
        Some(value << 4 | u128::from(nibble))
    })
}

/// A random non-zero `u64` from the standard library's per-process random
/// hash keys (trace ids need to be unlikely to collide, not secret).
fn random_nonzero() -> u64 {
    loop {
        let value = RandomState::new().build_hasher().finish();
        if value != 0 {
            return value;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const EXAMPLE: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn parses_and_prints_the_specification_example() {
        let context = TraceContext::parse(EXAMPLE).unwrap();
        assert_eq!(context.trace_id(), 0x4bf92f3577b34da6a3ce929d0e0e4736);
        assert_eq!(context.span_id(), 0x00f067aa0ba902b7);
        assert!(context.is_sampled());
        assert_eq!(context.to_string(), EXAMPLE);
    }

    #[test]
    fn ignores_what_the_specification_says_to_ignore() {
        let bad = [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473g-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00_4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736_00f067aa0ba902b7-01",
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01x",
        ];
        for header in bad {
            assert_eq!(TraceContext::parse(header), None, "{header:?}");
        }
        // Flags other than "sampled" are not passed on.
        let unknown_flags = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-ff";
        let parsed = TraceContext::parse(unknown_flags).unwrap();
        assert!(parsed.is_sampled());
        assert!(parsed.child().to_string().ends_with("-01"), "{parsed}");
        // A later version's extra fields are skipped.
        let later = "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-what-comes-next";
        assert_eq!(
            TraceContext::parse(later).map(|c| c.span_id()),
            Some(0x00f067aa0ba902b7)
        );
    }

    #[test]
    fn a_child_keeps_the_trace_and_takes_a_new_span() {
        let root = TraceContext::new_root();
        let child = root.child();
        assert_eq!(child.trace_id(), root.trace_id());
        assert_ne!(child.span_id(), root.span_id());
        assert_ne!(TraceContext::new_root().trace_id(), root.trace_id());
        assert_eq!(TraceContext::parse(&child.to_string()), Some(child));
    }

    #[tokio::test]
    async fn scope_sets_the_current_context() {
        assert_eq!(TraceContext::current(), None);
        let root = TraceContext::new_root();
        let seen = root.scope(async { TraceContext::current() }).await;
        assert_eq!(seen, Some(root));
        assert_eq!(TraceContext::current(), None);
    }
}
