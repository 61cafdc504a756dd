//! RDMA transport for rdma-rpc, on libibverbs and librdmacm (through
//! `rdma-sys`).
//!
//! So far this crate holds the start of its verbs layer, [`verbs`]: safe,
//! owning wrappers over the handful of C objects a reliable-connected (RC)
//! connection needs. The transport proper (rings, credits, the
//! small-vs-large decision) will sit on top of it.
//!
//! # Quick start
//! ```no_run
//! use std::time::Duration;
//! use transport_rdma::verbs::{Access, CmId, CompletionQueue, EventChannel, MemoryRegion,
//!     ProtectionDomain, QpCapabilities, QueuePair};
//!
//! # fn main() -> Result<(), transport_rdma::verbs::Error> {
//! let timeout = Duration::from_secs(5);
//! let channel = EventChannel::new()?;
//! let id = CmId::new(&channel)?;
//! id.resolve("10.77.0.1:7471".parse().unwrap(), timeout)?;
//! let pd = ProtectionDomain::new(&id)?;
//! let cq = CompletionQueue::new(&id, 16)?;
//! let mut qp = QueuePair::new(&id, &pd, &cq, &cq, QpCapabilities::default())?;
//! let mr = MemoryRegion::new(&pd, 4096, Access::LOCAL_WRITE)?;
//! let _server_data = id.connect(&[], timeout)?;
//! mr.write_at(0, b"hello");
//! // SAFETY: `mr` outlives the send, which completes below, and is not
//! // written until then.
//! unsafe { qp.post_send(1, &mr, 0..5)? };
//! cq.wait(timeout)?;
//! # Ok(())
//! # }
//! ```
//!
//! # Testing
//! The device tests (`tests/verbs_smoke.rs`) need an RDMA device: they are
//! `#[ignore]`d on a plain `cargo test` and run in a Soft-RoCE guest by
//! `cargo xtask test` (or by hand: `cargo xtask rxe -- <test binary> --ignored`).

pub mod verbs;
