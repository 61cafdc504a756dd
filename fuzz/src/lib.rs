//! The fuzz targets' checks, one module per target, so that the libFuzzer
//! entry points in `fuzz_targets/` stay one line each and the same checks
//! run as plain tests (the committed seeds, any reproducer).
//!
//! Every target drives the code that ships (`rpc_core::frame`,
//! `transport_rdma::proto`), never a copy of its logic; the checks are the
//! properties the peer must not be able to break.

pub mod alloc_meter;
pub mod frame_decode;
pub mod rdma_credit;
pub mod rdma_header;
pub mod rdma_hello;
pub mod rdma_reassembly;
pub mod rdma_region;
pub mod seeds;
