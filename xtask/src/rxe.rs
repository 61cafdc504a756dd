//! `cargo xtask rxe`: run a command against real RDMA verbs (the kernel's
//! Soft-RoCE, `rdma_rxe`) in a qemu guest, on machines without an RDMA NIC.
//!
//! The guest boots a Debian kernel (downloaded, never installed) with a
//! busybox initramfs, shares the host's `/` read-only (under a writable
//! tmpfs overlay), creates the RDMA device, and runs the command in the
//! current directory with the host's binaries and libraries. See
//! `docs/soft-roce.md` and `shared/design/soft-roce-vm.md`.
//!
//! Exit statuses: the command's own when it ran; [`EXIT_TIMED_OUT`] when
//! the time limit passed; [`EXIT_VM_FAILED`] when the VM or its set-up
//! failed.

pub(crate) mod baseline;
mod image;
mod vm;

use std::fmt::Write as _;
use std::fs;
use std::path::PathBuf;
use std::process::{Command, ExitCode};
use std::time::{Duration, Instant};

use vm::{GuestEnd, GuestRun, GuestSpec, Nic};

pub(crate) use baseline::baseline_main;

/// Exit status when the time limit passed (as `timeout(1)`).
pub(crate) const EXIT_TIMED_OUT: u8 = 124;
/// Exit status when the VM or the guest's set-up failed.
pub(crate) const EXIT_VM_FAILED: u8 = 125;

/// Debian packages the runner needs on the host (the rdma-core user space
/// runs in the guest from the host's disk).
pub(crate) const RXE_PACKAGES: &[&str] = &[
    "qemu-system-x86",
    "busybox-static",
    "kmod",
    "cpio",
    "xz-utils",
    "iproute2",
    "rdma-core",
    "ibverbs-providers",
    "ibverbs-utils",
    "perftest",
    "rdmacm-utils",
    // The stacks of a device test that hangs (`rxe/device_suite.sh`).
    "gdb",
];

/// Debian packages needed to build `transport-rdma` (rdma-sys runs bindgen).
pub(crate) const RDMA_BUILD_PACKAGES: &[&str] = &[
    "libclang-dev",
    "clang",
    "pkg-config",
    "libibverbs-dev",
    "librdmacm-dev",
];

/// Usage of `cargo xtask rxe`, also shown by `cargo xtask --help`.
pub(crate) const RXE_USAGE: &str = "  rxe [OPTIONS] -- COMMAND [ARGS...]
         run COMMAND in a qemu guest with a Soft-RoCE device, in the current
         directory, with the host's files (read-only + a throw-away writable
         layer); streams its output and exits with its status.
         --hosts 1|2      1 (default): one guest, one device on a dummy netdev;
                          server and client share it.
                          2: two guests joined by a virtual wire (virtio-net
                          over UDP on the host's loopback); COMMAND runs in
                          both, as server and as client.
         --timeout SECS   kill the guest(s) after SECS (default 600, or $RXE_TIMEOUT)
         --mtu BYTES      netdev MTU (default 1500: RDMA path MTU 1024)
         --env NAME=VALUE set a variable for COMMAND (repeatable)
         In the guest: RDMA_TEST_DEVICE (rxe0), RDMA_TEST_IP (this side's
         address: listen on it / connect to it), RDMA_TEST_NETDEV (the netdev
         under the device, to cut or degrade with ip/tc), RDMA_TEST_ROLE
         (both | server | client) and, with --hosts 2, RDMA_TEST_PEER_IP.
         Exit status: COMMAND's own; 124 timed out; 125 the VM or set-up
         failed (or bad options).
  rxe-baseline [--repeat N] [--timeout SECS]
         run perftest (ib_send_lat, ib_write_lat, ib_send_bw, ib_write_bw; a
         few sizes each) on the Soft-RoCE device, N times each (default 1);
         writes the medians to target/rxe/baseline.json and .md";

/// The device's name in the guest.
const DEVICE: &str = "rxe0";
/// Addresses: one guest (dummy netdev), and the two ends of the wire.
const SINGLE_IP: &str = "10.77.0.1";
const SERVER_IP: &str = "10.79.0.1";
const CLIENT_IP: &str = "10.79.0.2";
const DEFAULT_TIMEOUT_SECS: u64 = 600;
/// Limit of one run of the whole device suite (`cargo xtask test`), unless
/// `RXE_TIMEOUT` says otherwise: with a process per test, one host takes
/// 11–18 minutes on a 2-core machine (1,008 s in the CI run of `39fb152`),
/// two hosts, which run only the tests across the wire, ~3 (163 s at
/// `4792903`). A hung test costs its own limit (`DEVICE_TEST_LIMIT_SECS`),
/// not this one.
const DEVICE_SUITE_TIMEOUT_SECS: u64 = 2400;
/// Peer pings (1 s each at most) before a two-hosts guest gives up.
const PEER_WAIT_TRIES: u32 = 90;

/// Host variables passed through to the command (the chroot starts with an
/// empty environment otherwise).
const PASSED_ENV: &[&str] = &[
    "PATH",
    "HOME",
    "USER",
    "LANG",
    "LC_ALL",
    "TZ",
    "NO_COLOR",
    "CI",
    "RUST_BACKTRACE",
    "RUST_LIB_BACKTRACE",
    "RUST_LOG",
    "RUST_MIN_STACK",
    "RUST_TEST_THREADS",
    "RUST_TEST_NOCAPTURE",
];

/// What to run and how.
struct RunRequest {
    /// 1 or 2 guests.
    hosts: u8,
    /// The whole run's time limit.
    timeout: Duration,
    /// Netdev MTU.
    mtu: u32,
    /// Extra variables for the command.
    env: Vec<(String, String)>,
    /// The command and its arguments.
    command: Vec<String>,
    /// The directory the command runs in.
    cwd: PathBuf,
    /// Keep the command's output (it is streamed either way).
    capture: bool,
}

/// How a run ended, over all guests.
struct RunOutcome {
    /// Per guest.
    guests: Vec<GuestRun>,
    /// Wall time, boot included.
    elapsed: Duration,
}

/// `cargo xtask rxe ...`
pub(crate) fn rxe_main(args: &[String]) -> ExitCode {
    let request = match parse_args(args) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("xtask rxe: {e}\nusage: cargo xtask\n{RXE_USAGE}");
            return ExitCode::from(EXIT_VM_FAILED);
        }
    };
    match run(&request) {
        Ok(outcome) => ExitCode::from(report(&request, &outcome)),
        Err(e) => {
            eprintln!("xtask rxe: set-up failed: {e}");
            ExitCode::from(EXIT_VM_FAILED)
        }
    }
}

fn parse_args(args: &[String]) -> Result<RunRequest, String> {
    let mut request = RunRequest {
        hosts: 1,
        timeout: default_timeout()?,
        mtu: 1500,
        env: Vec::new(),
        command: Vec::new(),
        cwd: std::env::current_dir().map_err(|e| format!("no current directory: {e}"))?,
        capture: false,
    };
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        let mut value = |name: &str| {
            it.next()
                .cloned()
                .ok_or_else(|| format!("{name} needs a value"))
        };
        match arg.as_str() {
            "--" => {
                request.command = it.cloned().collect();
                break;
            }
            "--hosts" => {
                request.hosts = match value("--hosts")?.as_str() {
                    "1" => 1,
                    "2" => 2,
                    other => return Err(format!("--hosts must be 1 or 2, not {other}")),
                }
            }
            "--timeout" => request.timeout = parse_timeout(&value("--timeout")?)?,
            "--mtu" => {
                let v = value("--mtu")?;
                request.mtu = v.parse().map_err(|_| format!("--mtu: not a number: {v}"))?;
            }
            "--env" => {
                let v = value("--env")?;
                let (name, val) = v
                    .split_once('=')
                    .ok_or_else(|| format!("--env wants NAME=VALUE, got {v}"))?;
                request.env.push((name.to_string(), val.to_string()));
            }
            other if other.starts_with('-') => return Err(format!("unknown option {other}")),
            _ => {
                // No `--`: the command starts here.
                request.command = std::iter::once(arg).chain(it).cloned().collect();
                break;
            }
        }
    }
    if request.command.is_empty() {
        return Err("no command given".into());
    }
    Ok(request)
}

fn default_timeout() -> Result<Duration, String> {
    match std::env::var("RXE_TIMEOUT") {
        Ok(v) => parse_timeout(&v),
        Err(_) => Ok(Duration::from_secs(DEFAULT_TIMEOUT_SECS)),
    }
}

fn parse_timeout(v: &str) -> Result<Duration, String> {
    match v.parse::<u64>() {
        Ok(s) if s > 0 => Ok(Duration::from_secs(s)),
        _ => Err(format!(
            "timeout must be a positive number of seconds, not {v:?}"
        )),
    }
}

/// Installs what is missing, builds (or reuses) the boot image, and runs the
/// request. `Err` is a set-up failure on the host.
fn run(request: &RunRequest) -> Result<RunOutcome, String> {
    let started = Instant::now();
    crate::setup::ensure_debian_packages(RXE_PACKAGES)?;
    let cache = rxe_dir();
    let image = image::ensure(&cache)?;

    let runs = cache.join("runs");
    let mut specs = Vec::new();
    let roles: &[(&str, &str, Option<&str>)] = if request.hosts == 1 {
        &[("both", SINGLE_IP, None)]
    } else {
        &[
            ("server", SERVER_IP, Some(CLIENT_IP)),
            ("client", CLIENT_IP, Some(SERVER_IP)),
        ]
    };
    let ports = if request.hosts == 2 {
        free_udp_ports()?
    } else {
        [0, 0]
    };
    for (i, (role, ip, peer)) in roles.iter().enumerate() {
        let run_dir = runs.join(format!("{}-{role}", std::process::id()));
        if run_dir.exists() {
            fs::remove_dir_all(&run_dir)
                .map_err(|e| format!("cannot clear {}: {e}", run_dir.display()))?;
        }
        fs::create_dir_all(&run_dir)
            .map_err(|e| format!("cannot create {}: {e}", run_dir.display()))?;
        let job = job_script(request, role, ip, *peer);
        fs::write(run_dir.join("job.sh"), job).map_err(|e| format!("cannot write job.sh: {e}"))?;
        specs.push(GuestSpec {
            label: if request.hosts == 1 {
                String::new()
            } else {
                format!("[{role}] ")
            },
            run_dir,
            nic: (request.hosts == 2).then(|| Nic {
                local_port: ports[i],
                peer_port: ports[1 - i],
                mac: format!("52:54:00:79:00:0{}", i + 1),
            }),
        });
    }
    let guests = vm::run(&image, &specs, request.timeout, request.capture);
    for spec in &specs {
        let _ = fs::remove_dir_all(&spec.run_dir);
    }
    Ok(RunOutcome {
        guests,
        elapsed: started.elapsed(),
    })
}

/// Prints what happened and returns the exit status for it: 125 if any
/// guest's VM or set-up failed, else 124 if any timed out, else the first
/// non-zero command status (server's before client's), else 0.
fn report(request: &RunRequest, outcome: &RunOutcome) -> u8 {
    let (mut vm_failed, mut timed_out, mut command_status) = (false, false, None);
    for g in &outcome.guests {
        let who = if g.label.is_empty() {
            String::new()
        } else {
            format!("{}: ", g.label.trim_end())
        };
        match &g.end {
            GuestEnd::Exited(0) => {}
            GuestEnd::Exited(n) => {
                eprintln!(
                    "xtask rxe: {who}command failed: `{}` exited with status {n}",
                    request.command.join(" ")
                );
                command_status
                    .get_or_insert(u8::try_from(*n).ok().filter(|c| *c != 0).unwrap_or(1));
            }
            GuestEnd::TimedOut => {
                eprintln!(
                    "xtask rxe: {who}timed out after {} s (qemu killed); raise it with --timeout or RXE_TIMEOUT",
                    request.timeout.as_secs()
                );
                if g.output.is_empty() {
                    show_boot_log(g);
                }
                timed_out = true;
            }
            GuestEnd::SetupFailed(what) => {
                eprintln!("xtask rxe: {who}guest set-up failed: {what}");
                show_boot_log(g);
                vm_failed = true;
            }
            GuestEnd::VmFailed(what) => {
                eprintln!("xtask rxe: {who}VM failed: {what}");
                show_boot_log(g);
                vm_failed = true;
            }
            GuestEnd::StoppedAfterPeerFailure => {
                eprintln!("xtask rxe: {who}stopped because the other guest had failed");
            }
        }
    }
    let code = if vm_failed {
        EXIT_VM_FAILED
    } else if timed_out {
        EXIT_TIMED_OUT
    } else {
        command_status.unwrap_or(0)
    };
    eprintln!(
        "xtask rxe: done in {:.1} s (exit status {code})",
        outcome.elapsed.as_secs_f64()
    );
    code
}

fn show_boot_log(g: &GuestRun) {
    let lines: Vec<&str> = g.boot_log.lines().collect();
    let tail = &lines[lines.len().saturating_sub(60)..];
    if !tail.is_empty() {
        eprintln!(
            "xtask rxe: {}guest console before the command (last {} lines):",
            g.label,
            tail.len()
        );
        for line in tail {
            eprintln!("  | {line}");
        }
    }
}

/// Writes `job.sh`: the variables and command above the fixed body.
fn job_script(request: &RunRequest, role: &str, ip: &str, peer: Option<&str>) -> String {
    const BODY: &str = include_str!("rxe/job.sh");
    let mut s = String::from("# Written by `cargo xtask rxe`.\n");
    let netdev = if request.hosts == 1 {
        "rxe-dummy0"
    } else {
        "eth0"
    };
    // The guest's stdout is a serial console (a tty): keep programs from
    // sending colour codes into logs.
    let mut vars: Vec<(String, String)> = vec![("TERM".into(), "dumb".into())];
    for name in PASSED_ENV {
        if let Ok(v) = std::env::var(name) {
            vars.push(((*name).to_string(), v));
        }
    }
    vars.extend(request.env.iter().cloned());
    vars.push(("RDMA_TEST_DEVICE".into(), DEVICE.into()));
    vars.push(("RDMA_TEST_IP".into(), ip.into()));
    vars.push(("RDMA_TEST_NETDEV".into(), netdev.into()));
    vars.push(("RDMA_TEST_ROLE".into(), role.into()));
    if let Some(peer) = peer {
        vars.push(("RDMA_TEST_PEER_IP".into(), peer.into()));
    }
    for (name, value) in &vars {
        let _ = writeln!(s, "export {name}={}", shell_quote(value));
    }
    let _ = writeln!(s, "RXE_HOSTS={}", request.hosts);
    let _ = writeln!(s, "RXE_MTU={}", request.mtu);
    let _ = writeln!(s, "RXE_PEER_WAIT={PEER_WAIT_TRIES}");
    let _ = writeln!(s, "RXE_CWD={}", shell_quote(&request.cwd.to_string_lossy()));
    let words: Vec<String> = request.command.iter().map(|w| shell_quote(w)).collect();
    let _ = writeln!(s, "set -- {}", words.join(" "));
    s.push_str(BODY);
    s
}

fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// Two UDP ports on the loopback that are free right now.
fn free_udp_ports() -> Result<[u16; 2], String> {
    let a =
        std::net::UdpSocket::bind("127.0.0.1:0").map_err(|e| format!("no free UDP port: {e}"))?;
    let b =
        std::net::UdpSocket::bind("127.0.0.1:0").map_err(|e| format!("no free UDP port: {e}"))?;
    let port =
        |s: &std::net::UdpSocket| s.local_addr().map(|a| a.port()).map_err(|e| e.to_string());
    Ok([port(&a)?, port(&b)?])
}

/// `target/rxe` (or `$CARGO_TARGET_DIR/rxe`).
fn rxe_dir() -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| crate::workspace_root().join("target"));
    target.join("rxe")
}

/// Runs `command` in one Soft-RoCE guest (in `cwd`, with `env` set),
/// streaming its output as `cargo xtask rxe` does, and returns that output
/// and the exit status `cargo xtask rxe` would give (0: the command ran and
/// succeeded; see [`EXIT_TIMED_OUT`], [`EXIT_VM_FAILED`]). `Err` is a set-up
/// failure on the host.
pub(crate) fn run_captured(
    command: Vec<String>,
    cwd: PathBuf,
    env: Vec<(String, String)>,
    timeout: Duration,
) -> Result<(String, u8), String> {
    let request = RunRequest {
        hosts: 1,
        timeout,
        mtu: 1500,
        env,
        command,
        cwd,
        capture: true,
    };
    let outcome = run(&request)?;
    let code = report(&request, &outcome);
    let output = outcome
        .guests
        .into_iter()
        .next()
        .map(|g| g.output)
        .unwrap_or_default();
    Ok((output, code))
}

/// The packages whose test executables hold device tests: the transport's
/// own, and the examples' (tonic over `RdmaStream`).
const DEVICE_TEST_PACKAGES: &[&str] = &["transport-rdma", "examples"];

/// Runs the device suite in the guest: `sh -c DEVICE_SUITE sh LIMIT SUFFIX
/// EXECUTABLE...` (each test named `…SUFFIX` in its own process, under a
/// time limit).
const DEVICE_SUITE: &str = include_str!("rxe/device_suite.sh");

/// Limit of one device test in [`DEVICE_SUITE`]: the longest took 110 s in
/// one guest on a 2-core machine in the CI run of `39fb152`, and up to 203 s
/// (`two_thousand_connections_…`, each guest running it on its own) when
/// two guests ran every test. One that hangs fails with its threads' stacks
/// instead of taking the whole suite's time.
const DEVICE_TEST_LIMIT_SECS: u64 = 600;

/// How the device tests that cross the wire in a two-host run end their
/// names: their server runs in one guest, their client in the other
/// (`RDMA_TEST_ROLE`); with one host, both in one process.
const ACROSS_THE_WIRE: &str = "_across_the_wire";

/// Builds the test executables of [`DEVICE_TEST_PACKAGES`] on the host and
/// runs their device tests (the `#[ignore]`d ones) in the guest: all of them
/// with one device, then those named [`ACROSS_THE_WIRE`] on two hosts joined
/// by a wire. Fails if any fails.
pub(crate) fn run_rdma_tests() -> Result<(), String> {
    crate::setup::ensure_debian_packages(RDMA_BUILD_PACKAGES)?;
    crate::setup::ensure_debian_packages(RXE_PACKAGES)?;
    let root = crate::workspace_root();
    let mut args = vec!["test"];
    for package in DEVICE_TEST_PACKAGES {
        args.extend(["-p", package]);
    }
    args.extend(["--no-run", "--message-format=json"]);
    let out = command_output(
        Command::new(crate::env_cargo())
            .args(&args)
            .current_dir(&root),
    )?;
    let executables = test_executables(&out);
    // Only binaries that hold device tests need a guest.
    let mut with_device_tests = Vec::new();
    for exe in executables {
        let list = command_output(Command::new(&exe).args(["--list", "--ignored"]))?;
        if list.lines().any(|l| l.ends_with(": test")) {
            with_device_tests.push(exe);
        }
    }
    if with_device_tests.is_empty() {
        return Err(format!(
            "{} have no device tests (#[ignore]d tests): nothing ran in the guest",
            DEVICE_TEST_PACKAGES.join(", ")
        ));
    }
    // The same order in every run (cargo lists executables as their builds
    // finish), by test file name; `link_down` last: it takes the device's
    // link down and re-creates the device, which the others need not share.
    let test_name = |exe: &PathBuf| {
        let stem = exe.file_name().unwrap_or_default().to_string_lossy();
        stem.rsplit_once('-')
            .map_or(stem.to_string(), |(name, _hash)| name.to_string())
    };
    with_device_tests.sort_by_key(|exe| {
        let name = test_name(exe);
        (name == "link_down", name)
    });
    let mut failures = Vec::new();
    // One host runs every test; two hosts only those that cross the wire
    // between them (the others would run over each guest's own device,
    // as they just did on one host).
    for (hosts, suffix) in [(1, ""), (2, ACROSS_THE_WIRE)] {
        eprintln!("xtask: RDMA device tests in the Soft-RoCE guest, --hosts {hosts}");
        let mut command = vec![
            "sh".to_string(),
            "-c".into(),
            DEVICE_SUITE.into(),
            "sh".into(),
            DEVICE_TEST_LIMIT_SECS.to_string(),
            suffix.into(),
        ];
        command.extend(
            with_device_tests
                .iter()
                .map(|p| p.to_string_lossy().into_owned()),
        );
        let request = RunRequest {
            hosts,
            timeout: match std::env::var("RXE_TIMEOUT") {
                Ok(v) => parse_timeout(&v)?,
                Err(_) => Duration::from_secs(DEVICE_SUITE_TIMEOUT_SECS),
            },
            mtu: 1500,
            env: Vec::new(),
            command,
            cwd: root.clone(),
            capture: false,
        };
        let outcome = run(&request)?;
        let code = report(&request, &outcome);
        if code != 0 {
            failures.push(format!("--hosts {hosts}: exit status {code}"));
        }
    }
    if failures.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "RDMA device tests failed in the guest ({})",
            failures.join("; ")
        ))
    }
}

/// The test executables in `cargo test --no-run --message-format=json`:
/// artifacts built with the test profile (`"profile":{..,"test":true}`).
/// The target's own `"test":true` only says it has tests: a package's
/// programs, built for its integration tests, carry it too.
fn test_executables(json_lines: &str) -> Vec<PathBuf> {
    const KEY: &str = "\"executable\":\"";
    const PROFILE: &str = "\"profile\":{";
    let test_profile = |l: &str| {
        let Some(start) = l.find(PROFILE) else {
            return false;
        };
        let profile = &l[start..];
        // The profile object holds no nested object: it ends at its first `}`.
        profile[..profile.find('}').unwrap_or(profile.len())].contains("\"test\":true")
    };
    json_lines
        .lines()
        .filter(|l| l.contains("\"reason\":\"compiler-artifact\"") && test_profile(l))
        .filter_map(|l| {
            let start = l.find(KEY)? + KEY.len();
            let end = l[start..].find('"')? + start;
            Some(PathBuf::from(&l[start..end]))
        })
        .collect()
}

/// Runs a command quietly; on failure, the error carries its output.
fn run_quiet(command: &mut Command) -> Result<(), String> {
    command_output(command).map(drop)
}

/// Runs a command and returns its stdout; on failure, the error carries
/// both streams.
fn command_output(command: &mut Command) -> Result<String, String> {
    let out = command
        .output()
        .map_err(|e| format!("could not start {command:?}: {e}"))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(format!(
            "{command:?} failed with {}:\n{}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quoting_survives_single_quotes() {
        assert_eq!(shell_quote("it's"), r"'it'\''s'");
    }

    #[test]
    fn parses_hosts_timeout_and_command() {
        let args: Vec<String> = ["--hosts", "2", "--timeout", "30", "--", "ibv_devinfo", "-v"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let r = parse_args(&args).unwrap();
        assert_eq!(r.hosts, 2);
        assert_eq!(r.timeout, Duration::from_secs(30));
        assert_eq!(r.command, ["ibv_devinfo", "-v"]);
        assert!(parse_args(&["--hosts".into(), "3".into(), "true".into()]).is_err());
        assert!(parse_args(&["--".into()]).is_err());
    }

    #[test]
    fn finds_test_executables() {
        let json = r#"{"reason":"compiler-artifact","profile":{"test":true},"executable":"/t/deps/verbs_smoke-1"}
{"reason":"compiler-artifact","profile":{"test":false},"executable":null}
{"reason":"compiler-artifact","target":{"kind":["bin"],"test":true},"profile":{"debug_assertions":true,"test":false},"executable":"/t/greeter-server"}
{"reason":"compiler-artifact","target":{"kind":["bin"],"test":true},"profile":{"debug_assertions":true,"test":true},"executable":"/t/deps/greeter_server-2"}
{"reason":"build-finished","success":true}"#;
        assert_eq!(
            test_executables(json),
            [
                PathBuf::from("/t/deps/verbs_smoke-1"),
                PathBuf::from("/t/deps/greeter_server-2")
            ]
        );
        assert!(rxe_dir().ends_with("rxe"));
    }
}
