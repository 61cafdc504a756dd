//! Example programs for rdma-rpc, one `[[bin]]` each (`src/bin/`), and what they share.
//!
//! Every program takes `--addr scheme://host:port`; the scheme picks the
//! transport (`tcp://`, `rdma://`), nothing else changes.

/// The greeter service, generated from `proto/helloworld.proto`.
pub mod helloworld {
    rpc_core::include_proto!("helloworld");
}

/// The model-shard service of the fan-out example, generated from `proto/shard.proto`.
pub mod shard {
    rpc_core::include_proto!("shard");
}

/// The parameter-server service of the parameter-server example (`ps-server`,
/// `ps-worker`), generated from `proto/ps.proto`; its `bytes` fields are
/// `Bytes` (rpc-codegen's default), so a tensor decodes without a copy.
pub mod ps {
    rpc_core::include_proto!("ps");
}

pub mod tonic_rdma;

/// Installs every transport this build has, so any address scheme works.
///
/// With `RDMA_RPC_SECRET_FILE` set, `rdma://` servers admit only clients
/// that prove the secret in that file, and clients connect only to servers
/// that prove it (see `transport_rdma`'s Authentication); exits with a
/// message when the file is not a usable secret. `RDMA_RPC_RENDEZVOUS`
/// sets `RdmaTransport::rendezvous_threshold`: a size in bytes, or `off`
/// (what `cargo xtask bench --ps` compares the default with).
pub fn install_transports() {
    transport_tcp::install();
    let secret = std::env::var_os("RDMA_RPC_SECRET_FILE");
    let rendezvous = std::env::var("RDMA_RPC_RENDEZVOUS").ok();
    if secret.is_none() && rendezvous.is_none() {
        return transport_rdma::install();
    }
    let mut rdma = transport_rdma::RdmaTransport::default();
    if let Some(path) = secret {
        match transport_rdma::SharedSecret::from_file(&path) {
            Ok(secret) => rdma = rdma.auth_secret(Some(secret)),
            Err(e) => {
                eprintln!("RDMA_RPC_SECRET_FILE: {e}");
                std::process::exit(2);
            }
        }
    }
    match rendezvous.as_deref() {
        None => {}
        Some("off") => rdma = rdma.rendezvous_threshold(None),
        Some(bytes) => match bytes.parse() {
            Ok(bytes) => rdma = rdma.rendezvous_threshold(Some(bytes)),
            Err(_) => {
                eprintln!("RDMA_RPC_RENDEZVOUS: {bytes:?} is neither a size in bytes nor off");
                std::process::exit(2);
            }
        },
    }
    rpc_core::transport::register(std::sync::Arc::new(rdma));
}

/// The value of `--addr`, or `default`; exits with a usage message on bad arguments.
pub fn addr_arg(program: &str, default: &str) -> String {
    let mut args = std::env::args().skip(1);
    let mut addr = default.to_string();
    while let Some(arg) = args.next() {
        match (arg.as_str(), args.next()) {
            ("--addr", Some(value)) => addr = value,
            _ => {
                eprintln!("usage: {program} [--addr scheme://host:port]   (default {default})");
                std::process::exit(2);
            }
        }
    }
    addr
}

/// Logs to stderr, filtered by `RUST_LOG` (default `info`).
pub fn init_logging() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
}
