//! `cargo xtask`: the project's developer and CI tasks.
//!
//! - `cargo xtask demo`: the main job, a real RPC server and client.
//! - `cargo xtask test`: every test in the workspace, the codegen consumer
//!   crate's and the fuzz harnesses'.
//! - `cargo xtask rxe -- COMMAND`: run COMMAND against Soft-RoCE in a VM.
//! - `cargo xtask rxe-baseline`: perftest numbers on that device.
//! - `cargo xtask bench [--quick] [--tcp|--rdma]`: end-to-end benchmark against tonic and raw TCP, and over RDMA against perftest.
//! - `cargo xtask fuzz [--minutes N] [TARGET...]`: the fuzz targets in `fuzz/` under
//!   libFuzzer (not run in CI).

mod bench;
mod fuzz;
mod rxe;
mod setup;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode};
use std::time::{Duration, Instant};

const USAGE: &str = "usage: cargo xtask <demo | test | rxe | rxe-baseline | bench | fuzz>

  demo          run the greeter server and client, the inference fan-out
                (shard-server, fanout-client) and the parameter server
                (ps-server, ps-worker) (the main job)
  test          run every test (installs what it needs first; RDMA tests
                run in a Soft-RoCE VM)
  rxe           run a command next to a Soft-RoCE device in a VM
  rxe-baseline  perftest numbers on that device
  bench         end-to-end benchmark: rdma-rpc vs tonic vs raw TCP; over rdma:// vs perftest (Soft-RoCE)
                (--quick for a short run; see below)
  fuzz          run the fuzz targets (cargo-fuzz, stable toolchain) for
                --minutes N each (default 1); not part of CI or `test`

details of rxe and rxe-baseline:";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("demo") => demo(),
        Some("test") => test(),
        Some("demo-in-guest") => demo_in_guest(),
        Some("rxe") => return rxe::rxe_main(&args[1..]),
        Some("rxe-baseline") => return rxe::baseline_main(&args[1..]),
        Some("bench") => bench::bench_main(&args[1..]),
        Some("fuzz") => fuzz::fuzz_main(&args[1..]),
        Some("-h" | "--help") => {
            println!(
                "{USAGE}\n{}\n{}\n{}",
                rxe::RXE_USAGE,
                bench::BENCH_USAGE,
                fuzz::FUZZ_USAGE
            );
            Ok(())
        }
        _ => Err(USAGE.to_string()),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("xtask: {message}");
            ExitCode::FAILURE
        }
    }
}

/// Debian packages every build of the workspace needs.
const BUILD_PACKAGES: &[&str] = &["build-essential", "pkg-config"];

fn demo() -> Result<(), String> {
    setup::ensure_debian_packages(BUILD_PACKAGES)?;
    setup::ensure_debian_packages(rxe::RDMA_BUILD_PACKAGES)?;
    cargo(&["build", "-p", "examples", "--bins"])?;
    let bin = workspace_root().join("target/debug");
    println!("== greeter over TCP");
    greeter_demo(&bin, "tcp://127.0.0.1:0")?;
    println!("== inference fan-out over TCP: 4 shards x 2 replicas, one replica 10x slower");
    fanout_demo(&bin, "tcp://127.0.0.1:0", 4, 1000, 50)?;
    println!("== parameter server over TCP: 2 shards, 4 workers, 8 keys of 1 MiB");
    ps_demo(&bin, "tcp://127.0.0.1:0", None)?;
    println!("== greeter over RDMA (Soft-RoCE device rxe0 in a VM; on a host with an RDMA NIC run");
    println!(
        "   greeter-server --addr rdma://NIC_IP:PORT and greeter-client --addr rdma://NIC_IP:PORT)"
    );
    let xtask = std::env::current_exe().map_err(|e| format!("where is xtask itself? {e}"))?;
    run(Command::new(&xtask)
        .args(["rxe", "--"])
        .arg(&xtask)
        .arg("demo-in-guest"))
}

/// The RDMA half of the demo, inside the Soft-RoCE guest (`cargo xtask rxe` sets `RDMA_TEST_IP`).
fn demo_in_guest() -> Result<(), String> {
    let ip = std::env::var("RDMA_TEST_IP").map_err(|_| {
        "RDMA_TEST_IP is not set: demo-in-guest runs inside `cargo xtask rxe`".to_string()
    })?;
    let bin = workspace_root().join("target/debug");
    greeter_demo(&bin, &format!("rdma://{ip}:0"))?;
    println!("== greeter over RDMA with a shared secret (RDMA_RPC_SECRET_FILE on both sides)");
    authenticated_greeter_demo(&bin, &format!("rdma://{ip}:0"))?;
    // The emulated device and guest take ~20 ms a call: a deadline to match.
    println!("== inference fan-out over RDMA: 2 shards x 2 replicas, one replica 10x slower, deadline 500 ms (emulated device)");
    fanout_demo(&bin, &format!("rdma://{ip}:0"), 2, 300, 500)?;
    println!("== parameter server over RDMA: 2 shards, 4 workers, 8 keys of 1 MiB");
    ps_demo(&bin, &format!("rdma://{ip}:0"), None)?;
    println!("== parameter server over RDMA, tensors by rendezvous (RDMA_RPC_RENDEZVOUS=131072 on both sides),");
    println!("   gradients written into payload buffers (registered memory the shard reads with no copy)");
    ps_demo(&bin, &format!("rdma://{ip}:0"), Some("131072"))
}

/// How long the parameter-server demo may take, start to end: ~2 s on the
/// host, ~20 s in the emulated guest.
const PS_DEMO_TIMEOUT: Duration = Duration::from_secs(180);

/// Starts two `ps-server` shards on `listen` (port 0: each picks one), runs
/// `ps-worker` against them (4 workers, 8 keys of 1 MiB, one round: it
/// checks every pulled tensor and prints push and pull GB/s), then stops the
/// shards with SIGINT. Every wait is bounded by [`PS_DEMO_TIMEOUT`]. With a
/// `rendezvous` threshold, both sides send tensors that large by
/// rendezvous and the workers write gradients into payload buffers.
fn ps_demo(bin: &Path, listen: &str, rendezvous: Option<&str>) -> Result<(), String> {
    let rendezvous_env = rendezvous.map(|bytes| ("RDMA_RPC_RENDEZVOUS", bytes));
    let deadline = Instant::now() + PS_DEMO_TIMEOUT;
    let shards = 2;
    let mut servers = Vec::new();
    let mut addresses = Vec::new();
    let mut outcome = Ok(());
    for shard in 0..shards {
        let started = Command::new(bin.join("ps-server"))
            .envs(rendezvous_env)
            .args(["--addr", listen])
            .args([
                "--shard",
                &shard.to_string(),
                "--shards",
                &shards.to_string(),
            ])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .map_err(|e| format!("could not start ps-server: {e}"));
        let mut server = match started {
            Ok(server) => server,
            Err(e) => {
                outcome = Err(e);
                break;
            }
        };
        let line = first_line_within(&mut server, deadline);
        servers.push(server);
        match line {
            Ok(line) => match line.trim().strip_prefix("listening on ") {
                Some(address) => {
                    println!("ps-server shard {shard} listening on {address}");
                    addresses.push(address.to_string());
                }
                None => {
                    outcome = Err(format!(
                        "ps-server shard {shard} did not start (said {line:?})"
                    ));
                    break;
                }
            },
            Err(e) => {
                outcome = Err(format!("ps-server shard {shard}: {e}"));
                break;
            }
        }
    }
    if outcome.is_ok() {
        let mut worker = Command::new(bin.join("ps-worker"));
        worker
            .args(["--addr", &addresses.join(",")])
            .args(["--workers", "4", "--keys", "8", "--size", "1048576"])
            .args(["--rounds", "1", "--timeout-s", "60"])
            .envs(rendezvous_env);
        let payload_buffers = if rendezvous.is_some() {
            worker.arg("--payload-buffers");
            " --payload-buffers"
        } else {
            ""
        };
        println!("-- ps-worker --workers 4 --keys 8 --size 1048576 --rounds 1{payload_buffers}");
        outcome = run_until(&mut worker, deadline);
    }
    for server in &servers {
        let _ = Command::new("kill")
            .args(["-INT", &server.id().to_string()])
            .status();
    }
    // Shutting down waits at most 10 s past the deadline, then kills.
    let stop_by = deadline.max(Instant::now()) + Duration::from_secs(10);
    for (shard, mut server) in servers.into_iter().enumerate() {
        let status =
            wait_until(&mut server, stop_by).map_err(|e| format!("ps-server shard {shard}: {e}"));
        match status {
            Ok(status) if status.success() => {}
            Ok(status) => {
                outcome = outcome.and(Err(format!("ps-server shard {shard} exited with {status}")))
            }
            Err(e) => outcome = outcome.and(Err(e)),
        }
    }
    outcome?;
    println!("ps-server shards shut down cleanly");
    Ok(())
}

/// The first line `child` prints on its piped stdout, if it prints one before
/// `deadline` (else the child is killed). The rest of its output is passed on.
fn first_line_within(child: &mut Child, deadline: Instant) -> Result<String, String> {
    use std::io::BufRead;

    let stdout = child.stdout.take().expect("piped stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut reader = std::io::BufReader::new(stdout);
        let mut line = String::new();
        let first = reader.read_line(&mut line).map(|_| line);
        let _ = tx.send(first);
        // Pass the rest on, so the child never blocks on a full pipe.
        for line in reader.lines().map_while(Result::ok) {
            println!("{line}");
        }
    });
    match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
        Ok(Ok(line)) if !line.is_empty() => Ok(line),
        Ok(Ok(_)) => Err("exited without printing a line".into()),
        Ok(Err(e)) => Err(format!("reading its output: {e}")),
        Err(_) => {
            let _ = child.kill();
            Err("printed nothing in time: killed".into())
        }
    }
}

/// Runs `command` to its end, killing it if it runs past `deadline`.
fn run_until(command: &mut Command, deadline: Instant) -> Result<(), String> {
    let mut child = command
        .spawn()
        .map_err(|e| format!("could not start {command:?}: {e}"))?;
    let status = wait_until(&mut child, deadline).map_err(|e| format!("{command:?}: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("{command:?} failed with {status}"))
    }
}

/// Waits for `child` to exit; kills it if it is still running at `deadline`.
fn wait_until(child: &mut Child, deadline: Instant) -> Result<std::process::ExitStatus, String> {
    loop {
        match child.try_wait() {
            Ok(Some(status)) => return Ok(status),
            Ok(None) if Instant::now() >= deadline => {
                let _ = child.kill();
                let _ = child.wait();
                return Err("still running at the demo's deadline: killed".into());
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(50)),
            Err(e) => return Err(format!("waiting for it: {e}")),
        }
    }
}

/// Starts `shard-server` (`shards` x 2 replicas on `listen`, replica 0 of
/// shard 0 ten times slower), runs `fanout-client` against them without and
/// with hedging, under a deadline of `deadline_ms`, then stops the server with SIGINT.
fn fanout_demo(
    bin: &Path,
    listen: &str,
    shards: u32,
    queries: u32,
    deadline_ms: u32,
) -> Result<(), String> {
    use std::io::BufRead;

    let mut server = Command::new(bin.join("shard-server"))
        .args([
            "--addr",
            listen,
            "--shards",
            &shards.to_string(),
            "--replicas",
            "2",
        ])
        .args(["--slow", "0:0", "--slow-factor", "10"])
        .args(["--metrics-addr", "127.0.0.1:0"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .map_err(|e| format!("could not start shard-server: {e}"))?;
    let stdout = server.stdout.take().expect("piped stdout");
    let mut client_args = Vec::new();
    let mut metrics_at = None;
    for line in std::io::BufReader::new(stdout).lines() {
        let line = line.map_err(|e| format!("reading shard-server's output: {e}"))?;
        println!("shard-server: {line}");
        if line == "ready" {
            break;
        }
        match line.split_once(": ") {
            Some((_, replicas)) if line.starts_with("shard ") => {
                client_args.extend(["--shard".to_string(), replicas.to_string()]);
            }
            Some(("metrics", url)) => {
                metrics_at = url
                    .strip_prefix("http://")
                    .and_then(|u| u.strip_suffix("/metrics"))
                    .map(str::to_string);
            }
            _ => {
                let _ = server.kill();
                return Err(format!("shard-server did not start (said {line:?})"));
            }
        }
    }
    let mut outcome = Ok(());
    for hedge in ["off", "p95"] {
        println!("-- fanout-client --hedge {hedge}");
        outcome = run(Command::new(bin.join("fanout-client"))
            .args(&client_args)
            .args(["--queries", &queries.to_string(), "--hedge", hedge])
            .args(["--deadline-ms", &deadline_ms.to_string()]));
        if outcome.is_err() {
            break;
        }
    }
    if outcome.is_ok() {
        outcome = match &metrics_at {
            Some(address) => show_metrics(address),
            None => Err("shard-server did not print its metrics address".into()),
        };
    }
    let _ = Command::new("kill")
        .args(["-INT", &server.id().to_string()])
        .status();
    let server_status = server
        .wait()
        .map_err(|e| format!("waiting for shard-server: {e}"))?;
    outcome?;
    if !server_status.success() {
        return Err(format!("shard-server exited with {server_status}"));
    }
    Ok(())
}

/// Scrapes `http://ADDRESS/metrics` and prints the servers' handled-call
/// counters and the transport's series; fails unless some calls were
/// counted as `OK` and some connections as opened by the servers.
fn show_metrics(address: &str) -> Result<(), String> {
    use std::io::{Read, Write};

    let mut stream = std::net::TcpStream::connect(address)
        .map_err(|e| format!("connecting to the metrics endpoint {address}: {e}"))?;
    let request = format!("GET /metrics HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n\r\n");
    let mut response = String::new();
    stream
        .write_all(request.as_bytes())
        .and_then(|()| stream.read_to_string(&mut response))
        .map_err(|e| format!("scraping {address}: {e}"))?;
    println!("-- GET http://{address}/metrics (rpc_server_handled_total)");
    let mut ok_calls = 0.0;
    for line in response
        .lines()
        .filter(|l| l.starts_with("rpc_server_handled_total{"))
    {
        println!("{line}");
        if line.contains("code=\"OK\"") {
            ok_calls += line
                .rsplit(' ')
                .next()
                .and_then(|v| v.parse::<f64>().ok())
                .unwrap_or(0.0);
        }
    }
    println!("-- (rpc_transport_*)");
    let mut server_connections = 0.0;
    for line in response.lines().filter(|l| l.starts_with("rpc_transport_")) {
        println!("{line}");
        if line.starts_with("rpc_transport_connections_opened_total{")
            && line.contains("side=\"server\"")
        {
            server_connections += line
                .rsplit(' ')
                .next()
                .and_then(|v| v.parse::<f64>().ok())
                .unwrap_or(0.0);
        }
    }
    if ok_calls == 0.0 {
        Err(format!(
            "the metrics endpoint counted no successful calls:\n{response}"
        ))
    } else if server_connections == 0.0 {
        Err(format!(
            "the metrics endpoint counted no connections opened by the servers:\n{response}"
        ))
    } else {
        Ok(())
    }
}

/// [`greeter_demo`] with a shared secret in `RDMA_RPC_SECRET_FILE` for
/// the server and its client, after checking that a client without it is
/// refused.
fn authenticated_greeter_demo(bin: &Path, listen: &str) -> Result<(), String> {
    let secret = std::env::temp_dir().join(format!("rdma-rpc-demo-{}.secret", std::process::id()));
    std::fs::write(&secret, "demo secret: at least 16 bytes\n")
        .map_err(|e| format!("writing {}: {e}", secret.display()))?;
    let outcome = greeter_demo_with(
        bin,
        listen,
        &[("RDMA_RPC_SECRET_FILE", secret.as_os_str())],
        |addr| {
            let refused = Command::new(bin.join("greeter-client"))
                .args(["--addr", addr])
                .env_remove("RDMA_RPC_SECRET_FILE")
                .output()
                .map_err(|e| format!("could not start greeter-client: {e}"))?;
            let said = String::from_utf8_lossy(&refused.stderr);
            if refused.status.success() || !said.contains("shared secret") {
                return Err(format!(
                    "a client without the secret was not refused as it should be ({}):\n{said}",
                    refused.status
                ));
            }
            println!(
                "a client without the secret was refused: {}",
                said.lines().last().unwrap_or("")
            );
            Ok(())
        },
    );
    let _ = std::fs::remove_file(&secret);
    outcome
}

/// Starts `greeter-server` on `listen`, runs `greeter-client` against the
/// address it reports, then stops the server with SIGINT (graceful shutdown).
fn greeter_demo(bin: &Path, listen: &str) -> Result<(), String> {
    greeter_demo_with(bin, listen, &[], |_| Ok(()))
}

/// [`greeter_demo`] with `env` set for both programs, and `before` run
/// with the server's address before the client.
fn greeter_demo_with(
    bin: &Path,
    listen: &str,
    env: &[(&str, &std::ffi::OsStr)],
    before: impl FnOnce(&str) -> Result<(), String>,
) -> Result<(), String> {
    use std::io::BufRead;

    let mut server = Command::new(bin.join("greeter-server"))
        .args(["--addr", listen])
        .envs(env.iter().copied())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .map_err(|e| format!("could not start greeter-server: {e}"))?;
    let stdout = server.stdout.take().expect("piped stdout");
    let mut first_line = String::new();
    std::io::BufReader::new(stdout)
        .read_line(&mut first_line)
        .map_err(|e| format!("reading greeter-server's output: {e}"))?;
    let Some(addr) = first_line.trim().strip_prefix("listening on ") else {
        let _ = server.kill();
        return Err(format!(
            "greeter-server did not start (said {first_line:?})"
        ));
    };
    println!("greeter-server listening on {addr}");
    let client = before(addr).and_then(|()| {
        run(Command::new(bin.join("greeter-client"))
            .args(["--addr", addr])
            .envs(env.iter().copied()))
    });
    let _ = Command::new("kill")
        .args(["-INT", &server.id().to_string()])
        .status();
    let server_status = server
        .wait()
        .map_err(|e| format!("waiting for greeter-server: {e}"))?;
    client?;
    if !server_status.success() {
        return Err(format!("greeter-server exited with {server_status}"));
    }
    println!("greeter-server shut down cleanly");
    Ok(())
}

fn test() -> Result<(), String> {
    setup::ensure_debian_packages(BUILD_PACKAGES)?;
    setup::ensure_debian_packages(rxe::RDMA_BUILD_PACKAGES)?;
    cargo(&["test", "--workspace", "--all-targets"])?;
    cargo(&["test", "--workspace", "--doc"])?;
    codegen_consumer_tests()?;
    fuzz_harness_tests()?;
    rxe::run_rdma_tests()?;
    Ok(())
}

/// Builds and tests `rpc-codegen/tests/consumer`, a crate outside the workspace
/// (like a user's) whose `build.rs` runs `rpc_codegen::compile_protos` on
/// awkward real-world protos, with deny-level lints on the generated code.
fn codegen_consumer_tests() -> Result<(), String> {
    let root = workspace_root();
    let manifest = root.join("rpc-codegen/tests/consumer/Cargo.toml");
    let manifest = manifest.to_str().expect("UTF-8 path");
    // Its own target directory: a nested cargo must not wait on the workspace's build lock.
    let target = root.join("target/consumer");
    for args in [
        &["test", "--manifest-path", manifest][..],
        &[
            "clippy",
            "--all-targets",
            "--manifest-path",
            manifest,
            "--",
            "-D",
            "warnings",
        ][..],
    ] {
        run(Command::new(env_cargo())
            .args(args)
            .env("CARGO_TARGET_DIR", &target)
            .current_dir(&root))?;
    }
    Ok(())
}

/// Tests the fuzz targets' harnesses (`fuzz/`, a crate outside the
/// workspace: `cargo xtask fuzz` runs them under libFuzzer): each target's
/// checks on its committed seeds, which must match what today's encoders
/// produce. So a change to a protocol the harnesses model fails here, not
/// at the next fuzzing run.
fn fuzz_harness_tests() -> Result<(), String> {
    let root = workspace_root();
    run(Command::new(env_cargo())
        .args(["test", "--manifest-path", "fuzz/Cargo.toml"])
        // Its own target directory, as the consumer crate's.
        .env("CARGO_TARGET_DIR", root.join("target/fuzz-harness"))
        .current_dir(&root))
}

/// Runs `cargo ARGS` in the workspace root and fails if it fails.
fn cargo(args: &[&str]) -> Result<(), String> {
    run(Command::new(env_cargo())
        .args(args)
        .current_dir(workspace_root()))
}

fn run(command: &mut Command) -> Result<(), String> {
    let status = command
        .status()
        .map_err(|e| format!("could not start {command:?}: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("{command:?} failed with {status}"))
    }
}

fn env_cargo() -> String {
    std::env::var("CARGO").unwrap_or_else(|_| "cargo".into())
}

/// The workspace root (the parent of this crate's manifest directory).
fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives one level below the workspace root")
        .to_path_buf()
}
