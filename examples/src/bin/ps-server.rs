//! One shard of a parameter server, for the parameter-server example:
//!
//! ```text
//! ps-server --addr tcp://127.0.0.1:7100 --shard 0 --shards 2
//! ```
//!
//! Holds the f32 tensors of the keys whose index in the key space is
//! `index % shards == shard`, created from zeros on their first push. A
//! `Push` adds a worker's gradient into its key's tensor (element by
//! element, f32); a `Pull` returns the tensor. A key of another shard is
//! refused with `FAILED_PRECONDITION` naming the shard that owns it. Prints
//! `listening on ADDR`; shuts down on Ctrl-C, letting calls in flight finish.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use examples::ps::parameter_server_server::{ParameterServer, ParameterServerServer};
use examples::ps::{Key, PullRequest, PushReply, PushRequest, Tensor};
use prost::bytes::{Bytes, BytesMut};
use rpc_core::{Request, Response, Status};

const USAGE: &str = "usage: ps-server --addr scheme://host:port --shard I --shards N";

/// A tensor of this shard: its values and how many pushes were summed into it.
struct Stored {
    name: String,
    /// Little-endian f32s, as they go on the wire. A pull hands out a
    /// reference (no copy: over tcp:// it is written from here); a push
    /// sums in place when no pull still holds the bytes, else into a copy.
    data: Bytes,
    pushes: u64,
}

struct Shard {
    shard: u64,
    shards: u64,
    tensors: Mutex<HashMap<u64, Arc<Mutex<Stored>>>>,
}

impl Shard {
    /// The key, if this shard owns it.
    fn owned(&self, key: Option<Key>) -> Result<Key, Status> {
        let key = key.ok_or_else(|| Status::invalid_argument("no key"))?;
        let owner = key.index % self.shards;
        if owner != self.shard {
            return Err(Status::failed_precondition(format!(
                "key {} ({:?}) belongs to shard {owner} of {}, this is shard {}",
                key.index, key.name, self.shards, self.shard
            )));
        }
        Ok(key)
    }
}

impl ParameterServer for Shard {
    async fn push(&self, request: Request<PushRequest>) -> Result<Response<PushReply>, Status> {
        let request = request.into_inner();
        let key = self.owned(request.key)?;
        let gradient = request.gradient;
        if !gradient.len().is_multiple_of(4) {
            return Err(Status::invalid_argument(format!(
                "a gradient of {} bytes is not a whole number of f32s",
                gradient.len()
            )));
        }
        let stored = Arc::clone(
            self.tensors
                .lock()
                .expect("tensors")
                .entry(key.index)
                .or_insert_with(|| {
                    Arc::new(Mutex::new(Stored {
                        name: key.name.clone(),
                        data: Bytes::from(vec![0; gradient.len()]),
                        pushes: 0,
                    }))
                }),
        );
        // Summed outside the map's lock: pushes to other keys go on meanwhile.
        let mut stored = stored.lock().expect("tensor");
        if stored.data.len() != gradient.len() {
            return Err(Status::invalid_argument(format!(
                "key {} holds {} f32s, the gradient has {}",
                key.index,
                stored.data.len() / 4,
                gradient.len() / 4
            )));
        }
        let mut data = std::mem::take(&mut stored.data)
            .try_into_mut()
            .unwrap_or_else(|held| BytesMut::from(&held[..]));
        for (value, add) in data.chunks_exact_mut(4).zip(gradient.chunks_exact(4)) {
            let sum = f32::from_le_bytes(value.try_into().expect("4 bytes"))
                + f32::from_le_bytes(add.try_into().expect("4 bytes"));
            value.copy_from_slice(&sum.to_le_bytes());
        }
        stored.data = data.freeze();
        stored.pushes += 1;
        Ok(Response::new(PushReply {
            pushes: stored.pushes,
        }))
    }

    async fn pull(&self, request: Request<PullRequest>) -> Result<Response<Tensor>, Status> {
        let key = self.owned(request.into_inner().key)?;
        let stored = self
            .tensors
            .lock()
            .expect("tensors")
            .get(&key.index)
            .cloned();
        let Some(stored) = stored else {
            return Err(Status::not_found(format!(
                "key {} ({:?}) was never pushed",
                key.index, key.name
            )));
        };
        let stored = stored.lock().expect("tensor");
        Ok(Response::new(Tensor {
            key: Some(Key {
                index: key.index,
                name: stored.name.clone(),
            }),
            data: stored.data.clone(),
            pushes: stored.pushes,
        }))
    }
}

fn usage() -> ! {
    eprintln!("{USAGE}");
    std::process::exit(2)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    examples::init_logging();
    examples::install_transports();
    let (mut addr, mut shard, mut shards) = (None, None, None);
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let Some(value) = args.next() else { usage() };
        match flag.as_str() {
            "--addr" => addr = Some(value),
            "--shard" => shard = Some(value.parse::<u64>().unwrap_or_else(|_| usage())),
            "--shards" => shards = Some(value.parse::<u64>().unwrap_or_else(|_| usage())),
            _ => usage(),
        }
    }
    let (Some(addr), Some(shard), Some(shards)) = (addr, shard, shards) else {
        usage()
    };
    if shard >= shards {
        eprintln!("ps-server: --shard {shard} is not below --shards {shards}");
        usage();
    }
    let server = rpc_core::Server::builder()
        .add_service(ParameterServerServer::new(Shard {
            shard,
            shards,
            tensors: Mutex::new(HashMap::new()),
        }))
        .bind(&addr)
        .await?;
    println!("listening on {}", server.local_addr());
    server
        .serve_with_shutdown(async {
            tokio::signal::ctrl_c().await.ok();
        })
        .await?;
    Ok(())
}
