//! The committed seed corpus of the byte-input targets, produced by the
//! real encoders (`fuzz/corpus/TARGET/seed-*`). The structured targets'
//! seeds are inputs a fuzzing run found and `cargo fuzz cmin` kept.
//!
//! `UPDATE_SEEDS=1 cargo test --manifest-path fuzz/Cargo.toml --lib seeds`
//! rewrites them; without it the test checks the committed files match.

use std::time::Duration;

use bytes::Bytes;
use rpc_core::frame::{EncodePayload, OutBody, OutFrame};
use rpc_core::{Code, MetadataMap, Status};
use transport_rdma::proto::{Header, Hello, Kind, FIRST, LAST};

/// `(target, file name, bytes)` of every generated seed.
pub fn seeds() -> Vec<(&'static str, String, Vec<u8>)> {
    let mut out = Vec::new();
    for (name, frame) in frames() {
        out.push(("frame_decode", format!("seed-{name}"), frame.to_vec()));
    }
    for (name, hello) in hellos() {
        out.push((
            "rdma_hello",
            format!("seed-{name}"),
            hello.to_bytes().to_vec(),
        ));
    }
    for (name, header, body) in headers() {
        // rdma_header's input: a slack byte (slot bytes the message did not fill), then the slot.
        let mut input = vec![8];
        input.extend_from_slice(&header.to_bytes());
        input.extend(std::iter::repeat_n(b'x', body));
        input.extend_from_slice(&[0; 8]);
        out.push(("rdma_header", format!("seed-{name}"), input));
    }
    out
}

fn frames() -> Vec<(&'static str, Bytes)> {
    let mut metadata = MetadataMap::new();
    metadata.insert("authorization", "Bearer x");
    metadata.insert("trace-id", "0af7651916cd43dd");
    let payload = Bytes::from_static(b"\x0a\x05world");
    let empty = MetadataMap::new();
    let mut status = Status::new(Code::NotFound, "no such key");
    *status.metadata_mut() = metadata.clone();
    let go_away = Status::new(Code::Unavailable, "shutting down");
    let frame = |call_id, body, payload: Option<&Bytes>, end_stream| {
        OutFrame::new(
            call_id,
            body,
            payload.map(|p| p as &dyn EncodePayload),
            end_stream,
        )
        .expect("seed frame")
        .to_bytes()
    };
    vec![
        (
            "request",
            frame(
                1,
                OutBody::Request {
                    method: "/helloworld.Greeter/SayHello",
                    timeout: Some(Duration::from_millis(1500)),
                    metadata: &metadata,
                },
                Some(&payload),
                true,
            ),
        ),
        (
            "request-no-timeout",
            frame(
                3,
                OutBody::Request {
                    method: "/ps.ParameterServer/Pull",
                    timeout: None,
                    metadata: &empty,
                },
                None,
                false,
            ),
        ),
        ("message", frame(1, OutBody::Message, Some(&payload), false)),
        ("end-stream", frame(1, OutBody::Message, None, true)),
        ("status", frame(1, OutBody::Status(&status), None, false)),
        ("cancel", frame(5, OutBody::Cancel, None, false)),
        (
            "window-update",
            frame(0, OutBody::WindowUpdate(65536), None, false),
        ),
        ("go-away", frame(0, OutBody::GoAway(&go_away), None, false)),
        ("ping", frame(0, OutBody::Ping, None, false)),
        ("pong", frame(0, OutBody::Pong, None, false)),
    ]
}

fn hellos() -> Vec<(&'static str, Hello)> {
    vec![
        (
            "default",
            Hello {
                ring_slots: 64,
                initial_slots: 8,
                slot_size: 8192,
                region_len: 1 << 20,
                reads_rendezvous: false,
            },
        ),
        (
            "smallest",
            Hello {
                ring_slots: 8,
                initial_slots: 8,
                slot_size: 96,
                region_len: 4096,
                reads_rendezvous: false,
            },
        ),
        (
            "largest",
            Hello {
                ring_slots: 256,
                initial_slots: 8,
                slot_size: 64 * 1024,
                region_len: 16 << 20,
                reads_rendezvous: false,
            },
        ),
    ]
}

fn headers() -> Vec<(&'static str, Header, usize)> {
    let inline = Header {
        credits: 3,
        len: 16,
        freed_to: 4096,
        ..Header::new(Kind::Inline)
    };
    let chunk = |flags, len, total, pos| Header {
        flags,
        len,
        total,
        pos,
        credits: 1,
        ..Header::new(Kind::Chunk)
    };
    vec![
        ("inline", inline, 16),
        ("chunk-whole", chunk(FIRST | LAST, 5000, 5000, 8192), 0),
        ("chunk-first", chunk(FIRST, 4096, 10000, 0), 0),
        ("chunk-middle", chunk(0, 4096, 0, 4096), 0),
        ("chunk-last", chunk(LAST, 1808, 0, 8192), 0),
        (
            "credit",
            Header {
                credits: 32,
                freed_to: 1 << 20,
                ..Header::new(Kind::Credit)
            },
            0,
        ),
        ("close", Header::new(Kind::Close), 0),
        (
            "announce-one-segment",
            Header {
                len: 1 << 20,
                pos: 7,
                credits: 1,
                ..Header::new(Kind::Announce)
            },
            transport_rdma::proto::announce_body_len(1, 32),
        ),
        (
            "announce-three-segments",
            Header {
                len: 64 << 20,
                pos: 8,
                ..Header::new(Kind::Announce)
            },
            transport_rdma::proto::announce_body_len(3, 200),
        ),
        (
            "done",
            Header {
                pos: 7,
                ..Header::new(Kind::Done)
            },
            0,
        ),
        ("region-wanted", Header::new(Kind::RegionWanted), 0),
        (
            "region-granted",
            Header {
                pos: 0,
                total: 0x1234,
                ..Header::new(Kind::RegionGranted)
            },
            0,
        ),
        ("region-returned", Header::new(Kind::RegionReturned), 0),
        (
            "ring-shrinks",
            Header {
                pos: 56,
                credits: 2,
                ..Header::new(Kind::RingShrinks)
            },
            0,
        ),
    ]
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    #[test]
    fn seeds_pass_their_targets_and_match_the_committed_corpus() {
        let corpus = Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus");
        let update = std::env::var_os("UPDATE_SEEDS").is_some();
        for (target, name, bytes) in super::seeds() {
            assert!(crate::run_input(target, &bytes), "{target}/{name}");
            let path = corpus.join(target).join(&name);
            if update {
                std::fs::create_dir_all(path.parent().unwrap()).unwrap();
                std::fs::write(&path, &bytes).unwrap();
            } else {
                let committed = std::fs::read(&path).unwrap_or_else(|e| {
                    panic!("{}: {e} (UPDATE_SEEDS=1 writes it)", path.display())
                });
                assert_eq!(
                    committed,
                    bytes,
                    "{} is stale (UPDATE_SEEDS=1 rewrites it)",
                    path.display()
                );
            }
        }
    }
}
