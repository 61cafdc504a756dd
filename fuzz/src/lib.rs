//! The fuzz targets' checks, one module per target, so that the libFuzzer
//! entry points in `fuzz_targets/` stay one line each and the same checks
//! run as plain tests (the committed seeds, any reproducer).
//!
//! Every target drives the code that ships (`rpc_core::frame`,
//! `transport_rdma::proto`, `transport_tcp::reader`), never a copy of its logic; the checks are the
//! properties the peer must not be able to break.

pub mod alloc_meter;
pub mod frame_decode;
pub mod rdma_connection;
pub mod rdma_credit;
pub mod rdma_header;
pub mod rdma_hello;
pub mod rdma_reassembly;
pub mod rdma_region;
pub mod seeds;
pub mod tcp_reader;

/// Runs `target`'s checks on one input as libFuzzer would: bytes as they
/// are, or decoded into the structured input the way `fuzz_target!` does
/// (`Arbitrary::arbitrary_take_rest`; inputs it cannot decode are skipped,
/// and then this returns false).
pub fn run_input(target: &str, data: &[u8]) -> bool {
    use arbitrary::{Arbitrary, Unstructured};
    fn structured<'a, T: Arbitrary<'a>>(data: &'a [u8], check: impl FnOnce(&T)) -> bool {
        let Ok(input) = T::arbitrary_take_rest(Unstructured::new(data)) else {
            return false;
        };
        check(&input);
        true
    }
    let bytes = |check: fn(&[u8])| {
        check(data);
        true
    };
    match target {
        "frame_decode" => bytes(frame_decode::check),
        "rdma_hello" => bytes(rdma_hello::check),
        "rdma_header" => bytes(rdma_header::check),
        "rdma_region" => structured(data, rdma_region::check),
        "rdma_reassembly" => structured(data, rdma_reassembly::check),
        "rdma_credit" => structured(data, rdma_credit::check),
        "rdma_connection" => structured(data, rdma_connection::check),
        "tcp_reader" => structured(data, tcp_reader::check),
        other => panic!("no fuzz target {other}"),
    }
}

#[cfg(test)]
mod tests {
    /// Every committed corpus file passes its target's checks.
    #[test]
    fn committed_corpus_passes() {
        let corpus = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus");
        let mut files = 0;
        for dir in std::fs::read_dir(&corpus).unwrap() {
            let dir = dir.unwrap();
            let target = dir.file_name().into_string().unwrap();
            for file in std::fs::read_dir(dir.path()).unwrap() {
                let path = file.unwrap().path();
                assert!(
                    super::run_input(&target, &std::fs::read(&path).unwrap()),
                    "{} does not decode as {target}'s input",
                    path.display()
                );
                files += 1;
            }
        }
        assert!(
            files >= 20,
            "only {files} corpus files under {}",
            corpus.display()
        );
    }
}
