//! The parameter-server binaries end to end over TCP: two shards, workers
//! whose pulled tensors are checked by `ps-worker` itself, and a key sent to
//! the wrong shard.

use std::io::BufRead;
use std::process::{Child, Command, Stdio};

use examples::ps::parameter_server_client::ParameterServerClient;
use examples::ps::{Key, PullRequest, PushRequest};
use prost::bytes::Bytes;
use rpc_core::Code;

/// A `ps-server` shard on a free port; stopped with SIGKILL when dropped.
struct Shard {
    process: Child,
    address: String,
}

impl Drop for Shard {
    fn drop(&mut self) {
        let _ = self.process.kill();
        let _ = self.process.wait();
    }
}

fn spawn_shard(shard: u32, shards: u32) -> Shard {
    let mut process = Command::new(env!("CARGO_BIN_EXE_ps-server"))
        .args(["--addr", "tcp://127.0.0.1:0"])
        .args([
            "--shard",
            &shard.to_string(),
            "--shards",
            &shards.to_string(),
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("ps-server starts");
    let mut line = String::new();
    std::io::BufReader::new(process.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let address = line
        .trim()
        .strip_prefix("listening on ")
        .expect("ps-server reports its address")
        .to_string();
    Shard { process, address }
}

fn worker(shards: &[&Shard], args: &[&str]) -> std::process::Output {
    let addresses: Vec<&str> = shards.iter().map(|s| s.address.as_str()).collect();
    Command::new(env!("CARGO_BIN_EXE_ps-worker"))
        .args(["--addr", &addresses.join(",")])
        .args(args)
        .args(["--timeout-s", "30"])
        .output()
        .expect("ps-worker runs")
}

#[test]
fn workers_pull_the_exact_sum_of_their_pushes_twice_over() {
    let (a, b) = (spawn_shard(0, 2), spawn_shard(1, 2));
    let args = [
        "--workers",
        "3",
        "--keys",
        "5",
        "--size",
        "65536",
        "--rounds",
        "2",
    ];
    // A second run counts in what the first left on the shards.
    for run in 0..2 {
        let out = worker(&[&a, &b], &args);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "run {run}: {}\n{stdout}{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            stdout.contains("push: ") && stdout.contains("pull: "),
            "{stdout}"
        );
    }
}

#[test]
fn lines_report_each_measured_round_after_the_warm_up() {
    let (a, b) = (spawn_shard(0, 2), spawn_shard(1, 2));
    let args = [
        "--workers",
        "2",
        "--keys",
        "4",
        "--size",
        "4096",
        "--rounds",
        "2",
        "--warmup-rounds",
        "1",
        "--lines",
    ];
    let out = worker(&[&a, &b], &args);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    let lines: Vec<&str> = stdout.lines().filter(|l| l.starts_with("ps ")).collect();
    assert_eq!(lines.len(), 4, "{stdout}");
    for phase in ["push", "pull"] {
        for round in 0..2 {
            let start = format!(
                "ps phase={phase} round={round} workers=2 shards=2 keys=4 size=4096 bytes=32768 "
            );
            assert!(lines.iter().any(|l| l.starts_with(&start)), "{stdout}");
        }
    }
    assert!(lines.iter().all(|l| l.contains(" gb_per_s=")), "{stdout}");
}

#[test]
fn shards_listed_in_the_wrong_order_fail_the_worker() {
    let (a, b) = (spawn_shard(0, 2), spawn_shard(1, 2));
    let out = worker(
        &[&b, &a],
        &["--workers", "1", "--keys", "2", "--size", "64"],
    );
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("FAILED_PRECONDITION"), "{stderr}");
}

#[tokio::test]
async fn a_key_of_another_shard_is_refused_naming_its_owner() {
    examples::install_transports();
    let shard = spawn_shard(1, 3);
    let client = ParameterServerClient::connect(&shard.address)
        .await
        .unwrap();
    let key = |index: u64| {
        Some(Key {
            index,
            name: format!("tensor.{index}"),
        })
    };
    let status = client
        .push(PushRequest {
            key: key(5),
            gradient: Bytes::from(vec![0u8; 8]),
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::FailedPrecondition);
    assert!(status.message().contains("shard 2 of 3"), "{status}");
    // Its own keys: a pull before any push is NOT_FOUND, then pushes add up.
    let status = client.pull(PullRequest { key: key(4) }).await.unwrap_err();
    assert_eq!(status.code(), Code::NotFound);
    let half = Bytes::from(
        [0.5f32, -2.0]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect::<Vec<_>>(),
    );
    for pushes in 1..=2 {
        let reply = client
            .push(PushRequest {
                key: key(4),
                gradient: half.clone(),
            })
            .await
            .unwrap();
        assert_eq!(reply.into_inner().pushes, pushes);
    }
    let tensor = client
        .pull(PullRequest { key: key(4) })
        .await
        .unwrap()
        .into_inner();
    let expected: Vec<u8> = [1.0f32, -4.0]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    assert_eq!(tensor.data, expected);
    assert_eq!(tensor.pushes, 2);
    // A gradient of another length is refused.
    let status = client
        .push(PushRequest {
            key: key(4),
            gradient: Bytes::from(vec![0u8; 12]),
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument, "{status}");
}
