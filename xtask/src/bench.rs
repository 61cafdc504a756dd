//! `cargo xtask bench`: the end-to-end benchmark, in two parts.
//!
//! Builds `bench-node` (crate `benches`) in release mode. The TCP part: for
//! each system (rdma-rpc, rdma-rpc's server with `thread_per_core(1)`,
//! tonic, raw TCP) starts a server process on a free
//! port, runs a client process against it, and reads the client's result
//! lines. The RDMA part ([`rdma`]): rdma-rpc over `rdma://` and perftest on
//! the Soft-RoCE device, in one `cargo xtask rxe` guest. Each part prints
//! its side-by-side tables, checks the targets, and writes its own section
//! of the markdown report and its own SVG plot. The fan-out part
//! ([`fanout`], `fanout-bench`): whole fan-outs to 4, 16 and 64 shards,
//! rdma-rpc against tonic with `join_all`, with one slow replica with and
//! without hedging, over TCP and (in the guest) RDMA. The byte-stream part
//! ([`stream`]): tonic over `RdmaStream` against tonic over TCP and
//! rdma-rpc, and a bulk `RdmaStream` copy against `ib_write_bw`, in one
//! guest. The parameter-server part ([`ps`]): `ps-server` / `ps-worker`
//! pushing and pulling tensors over TCP against a raw TCP floor (`ps-raw`),
//! and over RDMA against `ib_write_bw` / `ib_read_bw`, in one guest. The
//! head-of-line part ([`hol`], `hol-bench`): small calls beside large ones
//! on the same channel, over TCP and (in the guest) RDMA.

mod fanout;
mod hol;
mod instructions;
mod ps;
mod rdma;
mod stream;

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Instant;

use crate::{cargo, rxe, setup, workspace_root, BUILD_PACKAGES};

pub(crate) const BENCH_USAGE: &str = "details of bench:
  cargo xtask bench [--quick] [--tcp] [--rdma] [--fanout | --fanout-tcp] [--stream]
                    [--instructions] [--ps] [--hol] [--rpc-addr URL] [--out DIR]
    --quick         short measurements (about three minutes for the TCP part);
                    the report goes to target/bench/ unless --out is given
    --tcp           run the TCP part: rdma-rpc (its server as built by default,
                    and with thread_per_core(1)) vs tonic vs raw TCP, on loopback
    --rdma          run the RDMA part: rdma-rpc over rdma:// vs perftest on
                    Soft-RoCE, in one qemu guest (`cargo xtask rxe`; about
                    2 minutes with --quick, 5 to 6 without)
    --fanout        run the fan-out part: 4, 16, 64 shards x 2 replicas,
                    rdma-rpc (FanOut, hedging) vs tonic + join_all over TCP,
                    and rdma-rpc over rdma:// in a Soft-RoCE guest (about
                    8 minutes; 4 with --quick)
    --fanout-tcp    the fan-out part over TCP only (no guest)
    --stream        run the byte-stream part: tonic over RdmaStream vs tonic
                    over the guest's TCP vs rdma-rpc over rdma:// (latency,
                    64 in flight), and an RdmaStream bulk copy vs
                    ib_write_bw, in one Soft-RoCE guest (about 3 minutes
                    with --quick, 4 to 5 without)
    --instructions  count instructions per unary call with callgrind:
                    rdma-rpc (tcp, mem, with rpc-metrics) vs the raw echo and
                    tonic (about 3 minutes; installs valgrind)
    --ps            run the parameter-server part: ps-server/ps-worker
                    push and pull of 64 KiB to 64 MiB tensors, 1 and 4
                    workers, 2 shards, over TCP against a raw TCP floor
                    (ps-raw) and over RDMA against ib_write_bw/ib_read_bw
                    in one Soft-RoCE guest (about 6 minutes with --quick,
                    30 without)
    --hol           run the head-of-line part: 32 B calls one at a time
                    beside 64 MiB (TCP) or 16 MiB (RDMA, in a Soft-RoCE
                    guest) calls on the same channel and on a channel of
                    their own (about 2 minutes)
                    [without --tcp, --rdma, --fanout, --stream,
                    --instructions, --ps or --hol: the first four for a full run,
                    the TCP part alone for --quick]
    --rpc-addr URL  where the TCP part's rdma-rpc server listens
                    [tcp://127.0.0.1:0] (the comparators stay on TCP)
    --out DIR       write benchmarks.md, benchmarks.svg (TCP),
                    benchmarks-rdma.svg (RDMA), benchmarks-fanout.svg
                    (fan-out) and benchmarks-ps.svg (parameter server)
                    into DIR, replacing only the
                    generated sections of the parts that ran
                    [docs/ for a full run, target/bench/ for --quick]";

/// Payload sizes measured, in bytes.
const SIZES: [usize; 5] = [32, 1024, 64 << 10, 1 << 20, 16 << 20];
/// Calls in flight for the throughput measurements.
const CONCURRENCY: [usize; 4] = [1, 16, 64, 256];
/// Throughput runs with more payload bytes in flight than this are skipped.
const MAX_INFLIGHT_BYTES: usize = 512 << 20;
/// Marks the TCP part's generated section of the report; text outside it is kept.
const BEGIN: &str = "<!-- cargo xtask bench: generated from here -->";
const END: &str = "<!-- cargo xtask bench: generated up to here -->";

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
enum System {
    Rpc,
    /// rdma-rpc with the server's `thread_per_core(1)`.
    RpcThreadPerCore,
    Raw,
    Tonic,
}

impl System {
    const ALL: [System; 4] = [
        System::Rpc,
        System::RpcThreadPerCore,
        System::Tonic,
        System::Raw,
    ];

    fn arg(self) -> &'static str {
        match self {
            System::Rpc | System::RpcThreadPerCore => "rpc",
            System::Tonic => "tonic",
            System::Raw => "raw",
        }
    }

    fn title(self) -> &'static str {
        match self {
            System::Rpc => "rdma-rpc",
            System::RpcThreadPerCore => "rdma-rpc, thread per core",
            System::Tonic => "tonic",
            System::Raw => "raw TCP",
        }
    }

    /// What the server is started with beyond its system and address.
    fn server_args(self) -> &'static [&'static str] {
        match self {
            System::RpcThreadPerCore => &["--thread-per-core", "1"],
            System::Rpc | System::Tonic | System::Raw => &[],
        }
    }

    fn colour(self) -> &'static str {
        match self {
            System::Rpc => "#d62728",
            System::RpcThreadPerCore => "#ff7f0e",
            System::Tonic => "#1f77b4",
            System::Raw => "#555555",
        }
    }
}

struct Settings {
    quick: bool,
    /// Run the TCP part.
    tcp: bool,
    /// Run the RDMA part.
    rdma: bool,
    /// Run the fan-out part.
    fanout: bool,
    /// The fan-out part also runs over RDMA (in the guest).
    fanout_rdma: bool,
    /// Run the byte-stream part.
    stream: bool,
    /// Count instructions per call.
    instructions: bool,
    /// Run the parameter-server part.
    ps: bool,
    /// Run the head-of-line part.
    hol: bool,
    rpc_addr: String,
    out: PathBuf,
    client_args: Vec<String>,
    /// `cargo xtask bench` and the arguments given, for the report.
    command: String,
}

#[derive(Clone, Copy, Debug)]
struct Latency {
    calls: u64,
    p50: f64,
    p99: f64,
    p999: f64,
}

#[derive(Default)]
struct Results {
    /// Microseconds, by (system, size).
    latency: BTreeMap<(System, usize), Latency>,
    /// Calls per second, by (system, size, concurrency).
    throughput: BTreeMap<(System, usize, usize), f64>,
}

pub(crate) fn bench_main(args: &[String]) -> Result<(), String> {
    let settings = parse(args)?;
    setup::ensure_debian_packages(BUILD_PACKAGES)?;
    // bench-node links transport-rdma (rdma-sys runs bindgen).
    setup::ensure_debian_packages(rxe::RDMA_BUILD_PACKAGES)?;
    let started = Instant::now();
    let others = settings.tcp
        || settings.rdma
        || settings.fanout
        || settings.stream
        || settings.instructions;
    if others {
        eprintln!("xtask bench: building bench-node and fanout-bench (release)");
        cargo(&[
            "build",
            "--release",
            "-p",
            "benches",
            "--bin",
            "bench-node",
            "--bin",
            "fanout-bench",
            "--bin",
            "call-instructions",
        ])?;
    }
    if settings.ps {
        eprintln!("xtask bench: building ps-server, ps-worker and ps-raw (release)");
        cargo(&[
            "build",
            "--release",
            "-p",
            "examples",
            "--bin",
            "ps-server",
            "--bin",
            "ps-worker",
            "-p",
            "benches",
            "--bin",
            "ps-raw",
        ])?;
    }
    let node = target_dir().join("release/bench-node");
    std::fs::create_dir_all(&settings.out)
        .map_err(|e| format!("creating {}: {e}", settings.out.display()))?;
    if settings.tcp {
        tcp_part(&node, &settings)?;
    }
    if settings.rdma {
        let part = rdma::run(&node, &settings)?;
        write_part(
            &settings,
            rdma::SVG_NAME,
            &part.svg,
            &part.generated,
            rdma::MARKERS,
        )?;
        println!("\n{}", part.tables);
        if let Some(failed) = part.failed {
            return Err(failed);
        }
    }
    if settings.fanout {
        let fanout_node = target_dir().join("release/fanout-bench");
        let part = fanout::run(&fanout_node, &settings, settings.fanout_rdma)?;
        write_part(
            &settings,
            fanout::SVG_NAME,
            &part.svg,
            &part.generated,
            fanout::MARKERS,
        )?;
        println!("\n{}", part.tables);
        if let Some(failed) = part.failed {
            return Err(format!("the fan-out part is incomplete: {failed}"));
        }
    }
    if settings.stream {
        let part = stream::run(&node, &settings)?;
        write_section(&settings, &part.generated, stream::MARKERS)?;
        println!("\n{}", part.tables);
        if let Some(failed) = part.failed {
            return Err(failed);
        }
    }
    if settings.ps {
        let release = target_dir().join("release");
        let part = ps::run(&release, &release.join("ps-raw"), &settings)?;
        write_part(
            &settings,
            ps::SVG_NAME,
            &part.svg,
            &part.generated,
            ps::MARKERS,
        )?;
        println!("\n{}", part.tables);
        if let Some(failed) = part.failed {
            return Err(failed);
        }
    }
    if settings.hol {
        eprintln!("xtask bench: building hol-bench (release)");
        cargo(&["build", "--release", "-p", "benches", "--bin", "hol-bench"])?;
        let bin = target_dir().join("release/hol-bench");
        let part = hol::run(&bin, settings.quick, &settings.command)?;
        write_section(&settings, &part.generated, hol::MARKERS)?;
        println!("\n{}", part.tables);
        if let Some(failed) = part.failed {
            return Err(failed);
        }
    }
    if settings.instructions {
        setup::ensure_debian_packages(&["valgrind"])?;
        let program = target_dir().join("release/call-instructions");
        let generated = instructions::run(&program, &settings.command)?;
        write_section(&settings, &generated, instructions::MARKERS)?;
        println!("\n{generated}");
    }
    eprintln!(
        "xtask bench: done in {:.0} s",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// The TCP part: every system on loopback, the systems taking turns size by size.
fn tcp_part(node: &Path, settings: &Settings) -> Result<(), String> {
    let started = Instant::now();
    // One result line per size for latency, and one per concurrency.
    let per_system = SIZES.len() * (1 + CONCURRENCY.len());
    let total = per_system * System::ALL.len();
    let mut done = 0;
    let mut results = Results::default();
    // All three servers stay up; the sizes are the outer loop, so the systems
    // take turns and a neighbour's load lands on all of them alike.
    let mut servers = Vec::new();
    for system in System::ALL {
        let listen = match system {
            System::Rpc | System::RpcThreadPerCore => settings.rpc_addr.as_str(),
            System::Tonic | System::Raw => "tcp://127.0.0.1:0",
        };
        servers.push((system, start_server(node, system, listen)?));
    }
    for size in SIZES {
        for (system, (_, addr)) in &servers {
            let run = ClientRun {
                node,
                system: *system,
                addr,
                size,
                settings,
            };
            run.measure(&mut results, &mut done, total)?;
        }
    }
    drop(servers);
    eprintln!(
        "xtask bench: TCP part measured in {:.0} s",
        started.elapsed().as_secs_f64()
    );

    let tables = tables(&results);
    let targets = targets(&results);
    println!("\n{tables}\n{targets}");
    let generated = report(settings, &tables, &targets);
    write_part(
        settings,
        "benchmarks.svg",
        &svg(&results),
        &generated,
        (BEGIN, END),
    )
}

/// Writes a part's plot, and its section of `benchmarks.md` (between
/// `markers`; the rest of the file is kept).
fn write_part(
    settings: &Settings,
    svg_name: &str,
    svg: &str,
    generated: &str,
    markers: (&str, &str),
) -> Result<(), String> {
    let svg_path = settings.out.join(svg_name);
    std::fs::write(&svg_path, svg).map_err(|e| format!("writing {}: {e}", svg_path.display()))?;
    eprintln!("xtask bench: wrote {}", svg_path.display());
    write_section(settings, generated, markers)
}

/// Replaces the section between `markers` of `benchmarks.md` in the output
/// directory with `generated` (the rest of the file is kept).
fn write_section(
    settings: &Settings,
    generated: &str,
    markers: (&str, &str),
) -> Result<(), String> {
    let md_path = settings.out.join("benchmarks.md");
    let existing = std::fs::read_to_string(&md_path).unwrap_or_default();
    std::fs::write(&md_path, splice(&existing, generated, markers))
        .map_err(|e| format!("writing {}: {e}", md_path.display()))?;
    eprintln!("xtask bench: wrote {}", md_path.display());
    Ok(())
}

/// Cargo's target directory: `$CARGO_TARGET_DIR` (relative to the workspace
/// root, where `cargo` runs) or `target/`.
fn target_dir() -> PathBuf {
    let root = workspace_root();
    std::env::var_os("CARGO_TARGET_DIR")
        .map(|dir| root.join(dir))
        .unwrap_or_else(|| root.join("target"))
}

fn parse(given: &[String]) -> Result<Settings, String> {
    let mut quick = false;
    let (mut tcp, mut rdma) = (false, false);
    let (mut fanout, mut fanout_rdma) = (false, false);
    let mut stream = false;
    let mut instructions = false;
    let mut ps = false;
    let mut hol = false;
    let mut rpc_addr = "tcp://127.0.0.1:0".to_string();
    let mut out = None;
    let mut args = given.iter();
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--quick" => quick = true,
            "--tcp" => tcp = true,
            "--rdma" => rdma = true,
            "--fanout" => (fanout, fanout_rdma) = (true, true),
            "--fanout-tcp" => fanout = true,
            "--stream" => stream = true,
            "--instructions" => instructions = true,
            "--ps" => ps = true,
            "--hol" => hol = true,
            "--rpc-addr" => rpc_addr = args.next().ok_or("--rpc-addr needs a URL")?.clone(),
            "--out" => out = Some(PathBuf::from(args.next().ok_or("--out needs a directory")?)),
            "-h" | "--help" => return Err(BENCH_USAGE.to_string()),
            other => return Err(format!("unknown option {other:?}\n{BENCH_USAGE}")),
        }
    }
    if !tcp && !rdma && !fanout && !stream && !instructions && !ps && !hol {
        tcp = true;
        rdma = !quick;
        fanout = !quick;
        fanout_rdma = !quick;
        stream = !quick;
    }
    let root = workspace_root();
    let out = out.unwrap_or_else(|| {
        if quick {
            root.join("target/bench")
        } else {
            root.join("docs")
        }
    });
    // (warm-up, latency run, latency call cap, throughput run), in ms.
    let (warmup, latency, calls, throughput) = if quick {
        (200, 700, 20_000, 500)
    } else {
        (1000, 5000, 100_000, 3000)
    };
    let list = |xs: &[usize]| {
        xs.iter()
            .map(usize::to_string)
            .collect::<Vec<_>>()
            .join(",")
    };
    let client_args = [
        ("--concurrency", list(&CONCURRENCY)),
        ("--warmup-ms", warmup.to_string()),
        ("--latency-ms", latency.to_string()),
        ("--latency-calls", calls.to_string()),
        ("--throughput-ms", throughput.to_string()),
        ("--max-inflight-bytes", MAX_INFLIGHT_BYTES.to_string()),
    ]
    .into_iter()
    .flat_map(|(flag, value)| [flag.to_string(), value])
    .collect();
    let command = std::iter::once("cargo xtask bench")
        .chain(given.iter().map(String::as_str))
        .collect::<Vec<_>>()
        .join(" ");
    Ok(Settings {
        quick,
        tcp,
        rdma,
        fanout,
        fanout_rdma,
        stream,
        instructions,
        ps,
        hol,
        rpc_addr,
        out,
        client_args,
        command,
    })
}

/// Kills the server process when dropped, whatever happened to the client.
struct ServerProcess(Child);

impl Drop for ServerProcess {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `system`'s server on `listen`; returns it and the address it reports.
fn start_server(
    node: &Path,
    system: System,
    listen: &str,
) -> Result<(ServerProcess, String), String> {
    let mut server = ServerProcess(
        Command::new(node)
            .args(["server", "--system", system.arg(), "--addr", listen])
            .args(system.server_args())
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| format!("could not start bench-node server: {e}"))?,
    );
    let mut line = String::new();
    BufReader::new(server.0.stdout.take().expect("piped stdout"))
        .read_line(&mut line)
        .map_err(|e| format!("reading bench-node server's output: {e}"))?;
    let Some(addr) = line.trim().strip_prefix("listening on ") else {
        return Err(format!(
            "{} server did not start (said {line:?})",
            system.title()
        ));
    };
    eprintln!("xtask bench: {} server on {addr}", system.title());
    Ok((server, addr.to_string()))
}

/// One client process: every measurement of one system at one size.
struct ClientRun<'a> {
    node: &'a Path,
    system: System,
    addr: &'a str,
    size: usize,
    settings: &'a Settings,
}

impl ClientRun<'_> {
    fn measure(&self, results: &mut Results, done: &mut usize, total: usize) -> Result<(), String> {
        let ClientRun {
            node,
            system,
            addr,
            size: _,
            settings,
        } = *self;
        let mut client = Command::new(node)
            .args(["client", "--system", system.arg(), "--addr", addr])
            .args(&settings.client_args)
            .args(["--sizes", &self.size.to_string()])
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| format!("could not start bench-node client: {e}"))?;
        let stdout = client.stdout.take().expect("piped stdout");
        for line in BufReader::new(stdout).lines() {
            let line = line.map_err(|e| format!("reading bench-node client's output: {e}"))?;
            *done += 1;
            let progress = format!("[{:>2}/{total}] {:<8}", *done, system.title());
            let fields = fields(&line);
            let size = field(&fields, "size")?;
            match line.split(' ').next() {
                Some("latency") => {
                    let us = |key| field(&fields, key).map(|ns| ns as f64 / 1000.0);
                    let latency = Latency {
                        calls: field(&fields, "calls")? as u64,
                        p50: us("p50_ns")?,
                        p99: us("p99_ns")?,
                        p999: us("p999_ns")?,
                    };
                    eprintln!(
                        "{progress} {:>7} latency: p50 {} p99 {} p99.9 {} ({} calls)",
                        size_name(size),
                        micros(latency.p50),
                        micros(latency.p99),
                        micros(latency.p999),
                        latency.calls
                    );
                    results.latency.insert((system, size), latency);
                }
                Some("throughput") => {
                    let concurrency = field(&fields, "concurrency")?;
                    let rate: f64 = fields
                        .get("calls_per_s")
                        .and_then(|v| v.parse().ok())
                        .ok_or_else(|| format!("no calls_per_s in {line:?}"))?;
                    eprintln!(
                    "{progress} {:>7} throughput, {concurrency:>3} in flight: {} calls/s, {:.3} GB/s",
                    size_name(size),
                    rate_name(rate),
                    rate * size as f64 / 1e9
                );
                    results.throughput.insert((system, size, concurrency), rate);
                }
                Some("skipped") => {
                    eprintln!(
                    "{progress} {:>7} throughput, {:>3} in flight: skipped (over {} MiB in flight)",
                    size_name(size),
                    field(&fields, "concurrency")?,
                    MAX_INFLIGHT_BYTES >> 20
                );
                }
                _ => return Err(format!("unexpected line from bench-node: {line:?}")),
            }
        }
        let status = client
            .wait()
            .map_err(|e| format!("waiting for bench-node client: {e}"))?;
        if !status.success() {
            return Err(format!("{} client failed with {status}", system.title()));
        }
        Ok(())
    }
}

fn fields(line: &str) -> BTreeMap<&str, &str> {
    line.split(' ')
        .filter_map(|kv| kv.split_once('='))
        .collect()
}

fn field(fields: &BTreeMap<&str, &str>, key: &str) -> Result<usize, String> {
    fields
        .get(key)
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| format!("bench-node result without {key}: {fields:?}"))
}

pub(crate) fn size_name(size: usize) -> String {
    match size {
        s if s >= 1 << 20 && s % (1 << 20) == 0 => format!("{} MiB", s >> 20),
        s if s >= 1 << 10 && s % (1 << 10) == 0 => format!("{} KiB", s >> 10),
        s => format!("{s} B"),
    }
}

/// `s` quoted for a POSIX shell (the guest scripts).
fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// The median of `values` (the mean of the middle two for an even count).
fn median(values: Option<&Vec<f64>>) -> Option<f64> {
    let mut v = values?.clone();
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let mid = v.len() / 2;
    Some(if v.len() % 2 == 1 {
        v[mid]
    } else {
        (v[mid - 1] + v[mid]) / 2.0
    })
}

fn micros(us: f64) -> String {
    if us >= 10_000.0 {
        format!("{:.1} ms", us / 1000.0)
    } else if us >= 100.0 {
        format!("{us:.0} µs")
    } else {
        format!("{us:.1} µs")
    }
}

fn rate_name(rate: f64) -> String {
    if rate >= 1e6 {
        format!("{:.2} M", rate / 1e6)
    } else if rate >= 1e3 {
        format!("{:.1} k", rate / 1e3)
    } else {
        format!("{rate:.1}")
    }
}

fn ratio(ours: Option<f64>, theirs: Option<f64>) -> String {
    match (ours, theirs) {
        (Some(a), Some(b)) if b > 0.0 => format!("{:.2}×", a / b),
        _ => "–".into(),
    }
}

/// Picks one percentile out of a [`Latency`].
type Pick = fn(&Latency) -> f64;

/// The side-by-side tables, in markdown.
fn tables(results: &Results) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "### Unary round-trip latency, one call at a time\n\n\
         Ratios are rdma-rpc's latency over the comparator's: below 1× is faster.\n\n\
         | size | percentile | rdma-rpc | raw TCP | rdma-rpc / raw | tonic | rdma-rpc / tonic | thread per core | thread per core / raw |\n\
         |---:|---|---:|---:|---:|---:|---:|---:|---:|"
    );
    for size in SIZES {
        let get = |system| results.latency.get(&(system, size)).copied();
        let percentiles: [(&str, Pick); 3] = [
            ("p50", |l| l.p50),
            ("p99", |l| l.p99),
            ("p99.9", |l| l.p999),
        ];
        for (name, pick) in percentiles {
            let value = |system| get(system).map(|l| pick(&l));
            let show = |system| value(system).map_or("–".into(), micros);
            let _ = writeln!(
                out,
                "| {} | {name} | {} | {} | {} | {} | {} | {} | {} |",
                size_name(size),
                show(System::Rpc),
                show(System::Raw),
                ratio(value(System::Rpc), value(System::Raw)),
                show(System::Tonic),
                ratio(value(System::Rpc), value(System::Tonic)),
                show(System::RpcThreadPerCore),
                ratio(value(System::RpcThreadPerCore), value(System::Raw)),
            );
        }
    }
    let calls = |system| {
        results
            .latency
            .get(&(system, SIZES[0]))
            .map_or(0, |l| l.calls)
    };
    let _ = writeln!(
        out,
        "\nCalls measured per size (at 32 B): rdma-rpc {}, raw {}, tonic {}; \
         fewer at large sizes, where each call is slower.\n",
        calls(System::Rpc),
        calls(System::Raw),
        calls(System::Tonic)
    );
    let _ = writeln!(
        out,
        "### Throughput, unary calls in flight on one connection\n\n\
         rdma-rpc and tonic: one task per call in flight, all on one channel. Raw TCP: one \
         connection pipelining that many frames, its writes batched. \"Thread per core\": \
         rdma-rpc's server with `ServerBuilder::thread_per_core(1)` (the connection served \
         wholly on one current-thread runtime), the same client. GB/s counts payload one way \
         (10⁹ bytes/s); the echo carries as much back. Ratios above 1× mean rdma-rpc is faster.\n\n\
         | size | in flight | rdma-rpc calls/s | rdma-rpc GB/s | raw TCP calls/s | rdma-rpc / raw | tonic calls/s | rdma-rpc / tonic | thread per core calls/s | thread per core / raw |\n\
         |---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    for size in SIZES {
        for concurrency in CONCURRENCY {
            let get = |system| {
                results
                    .throughput
                    .get(&(system, size, concurrency))
                    .copied()
            };
            if System::ALL.iter().all(|&s| get(s).is_none()) {
                continue;
            }
            let show = |system| get(system).map_or("–".into(), rate_name);
            let _ = writeln!(
                out,
                "| {} | {concurrency} | {} | {} | {} | {} | {} | {} | {} | {} |",
                size_name(size),
                show(System::Rpc),
                get(System::Rpc).map_or("–".into(), |r| format!("{:.3}", r * size as f64 / 1e9)),
                show(System::Raw),
                ratio(get(System::Rpc), get(System::Raw)),
                show(System::Tonic),
                ratio(get(System::Rpc), get(System::Tonic)),
                show(System::RpcThreadPerCore),
                ratio(get(System::RpcThreadPerCore), get(System::Raw)),
            );
        }
    }
    let _ = writeln!(
        out,
        "\nRuns with more than {} MiB of payload in flight (16 MiB × 64 and × 256) are skipped.",
        MAX_INFLIGHT_BYTES >> 20
    );
    out
}

/// The issue's targets, checked against this run.
fn targets(results: &Results) -> String {
    let mut out = String::from("### Targets\n\n| target | measured | verdict |\n|---|---:|---|\n");
    let p50 = |system, size| results.latency.get(&(system, size)).map(|l| l.p50);
    let rate = |system, size| results.throughput.get(&(system, size, 64)).copied();
    let mut row = |target: String, measured: Option<f64>, limit: f64, at_most: bool| {
        target_row(&mut out, &target, measured, limit, at_most);
    };
    for size in [32, 1024, 64 << 10, 1 << 20] {
        let r = match (p50(System::Rpc, size), p50(System::Raw, size)) {
            (Some(a), Some(b)) => Some(a / b),
            _ => None,
        };
        row(
            format!("p50 at {} ≤ 1.3× raw TCP", size_name(size)),
            r,
            1.3,
            true,
        );
    }
    for size in SIZES {
        let over = |other| match (rate(System::Rpc, size), rate(other, size)) {
            (Some(a), Some(b)) => Some(a / b),
            _ => None,
        };
        if rate(System::Rpc, size).is_none() {
            continue;
        }
        row(
            format!("{} × 64 in flight: ≥ 5× tonic", size_name(size)),
            over(System::Tonic),
            5.0,
            false,
        );
        row(
            format!("{} × 64 in flight: ≥ 0.5× pipelined raw", size_name(size)),
            over(System::Raw),
            0.5,
            false,
        );
        if let (Some(a), Some(b)) = (
            rate(System::RpcThreadPerCore, size),
            rate(System::Raw, size),
        ) {
            row(
                format!(
                    "{} × 64 in flight, thread per core: ≥ 0.5× pipelined raw",
                    size_name(size)
                ),
                Some(a / b),
                0.5,
                false,
            );
        }
    }
    out
}

/// One row of a targets table: `measured` (a ratio) against `limit`, which
/// it must stay under (`at_most`) or reach.
fn target_row(out: &mut String, target: &str, measured: Option<f64>, limit: f64, at_most: bool) {
    let (shown, verdict) = match measured {
        None => ("–".to_string(), "not measured".to_string()),
        Some(m) => {
            let met = if at_most { m <= limit } else { m >= limit };
            let verdict = if met {
                "met".to_string()
            } else if at_most {
                format!("missed by {:.0} %", (m / limit - 1.0) * 100.0)
            } else {
                format!("missed: {:.0} % of the goal", m / limit * 100.0)
            };
            (format!("{m:.2}×"), verdict)
        }
    };
    let _ = writeln!(out, "| {target} | {shown} | {verdict} |");
}

fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|info| {
            info.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let memory = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|info| {
            info.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
        })
        .map_or("?".into(), |kb| {
            format!("{:.0} GiB", kb as f64 / (1 << 20) as f64)
        });
    let output = |program: &str, args: &[&str]| {
        Command::new(program)
            .args(args)
            .output()
            .ok()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
            .unwrap_or_default()
    };
    format!(
        "{cpu}, {cores} cores, {memory} memory; Linux {}; {}",
        output("uname", &["-r"]),
        output("rustc", &["-V"])
    )
}

/// Now, as `2026-11-22 04:45 UTC`.
fn date() -> String {
    Command::new("date")
        .args(["-u", "+%Y-%m-%d %H:%M UTC"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default()
}

/// The TCP part's generated section of the report.
fn report(settings: &Settings, tables: &str, targets: &str) -> String {
    format!(
        "{BEGIN}\n\
         ## Results\n\n\
         - Command: `{command}`{quick}\n\
         - Machine: {machine}\n\
         - Date: {date}\n\
         - rdma-rpc address: `{addr}`; tonic and raw TCP on `tcp://127.0.0.1:0`; client and \
         server in separate processes, each a default multi-threaded tokio runtime.\n\
         - One client process per system and size, the systems taking turns size by size: \
         `bench-node client --system SYSTEM --addr ADDR --sizes SIZE {args}`\n\n\
         ![p50 latency by size; throughput by calls in flight](benchmarks.svg)\n\n\
         {tables}\n{targets}\n{END}\n",
        quick = if settings.quick {
            " (short measurements: indicative only)"
        } else {
            ""
        },
        command = settings.command,
        machine = machine(),
        date = date(),
        addr = settings.rpc_addr,
        args = settings.client_args.join(" "),
    )
}

/// `existing` with its section between `markers` replaced by `generated`
/// (which carries the markers; appended if `existing` has none).
fn splice(existing: &str, generated: &str, (begin_marker, end_marker): (&str, &str)) -> String {
    match (existing.find(begin_marker), existing.find(end_marker)) {
        (Some(begin), Some(end)) if begin < end => {
            let after = existing[end + end_marker.len()..].trim_start_matches('\n');
            format!("{}{generated}{after}", &existing[..begin])
        }
        _ if existing.trim().is_empty() => {
            format!(
                "# Benchmarks\n\nRegenerate the results with `cargo xtask bench`.\n\n{generated}"
            )
        }
        _ => format!("{}\n\n{generated}", existing.trim_end()),
    }
}

/// One panel of a plot: log-scaled axes, one polyline per series.
struct Panel<'a> {
    title: &'a str,
    x_label: &'a str,
    y_label: &'a str,
    xs: &'a [usize],
    x_name: fn(usize) -> String,
    series: Vec<Series>,
}

/// One line of a plot: a value (or none) per x.
struct Series {
    name: String,
    colour: &'static str,
    /// Drawn dashed (the comparators of the RDMA plot).
    dashed: bool,
    ys: Vec<Option<f64>>,
}

impl Series {
    fn of(system: System, ys: Vec<Option<f64>>) -> Series {
        Series {
            name: system.title().to_string(),
            colour: system.colour(),
            dashed: false,
            ys,
        }
    }
}

/// An SVG of `panels` side by side (400 × 380 each), with the names and
/// colours of `legend` under them (in as many rows as they need).
fn plot(panels: &[Panel<'_>], legend: &[Series]) -> String {
    let step = 200.0;
    let width = 400.0 * panels.len() as f64;
    let per_row = (((width - 40.0) / step) as usize).max(1);
    let rows = legend.len().div_ceil(per_row).max(1);
    let height = 400.0 + 22.0 * rows as f64;
    let mut out = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{width}\" height=\"{height}\" \
         viewBox=\"0 0 {width} {height}\" font-family=\"sans-serif\" font-size=\"12\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
    );
    for (i, panel) in panels.iter().enumerate() {
        draw_panel(&mut out, panel, 400.0 * i as f64, 0.0, 400.0, 380.0);
    }
    for (row, items) in legend.chunks(per_row).enumerate() {
        let y = 402.0 + 22.0 * row as f64;
        let mut x = (width - step * items.len() as f64) / 2.0 + 20.0;
        for series in items {
            let _ = writeln!(
                out,
                "<line x1=\"{x}\" y1=\"{y}\" x2=\"{}\" y2=\"{y}\" stroke=\"{}\" stroke-width=\"3\"{}/>\
                 <text x=\"{}\" y=\"{}\">{}</text>",
                x + 24.0,
                series.colour,
                dash(series.dashed),
                x + 30.0,
                y + 4.0,
                series.name
            );
            x += step;
        }
    }
    out.push_str("</svg>\n");
    out
}

fn dash(dashed: bool) -> &'static str {
    if dashed {
        " stroke-dasharray=\"6 4\""
    } else {
        ""
    }
}

/// The plot: p50 latency against size, and throughput against calls in flight.
fn svg(results: &Results) -> String {
    let latency = Panel {
        title: "Unary p50 latency (lower is better)",
        x_label: "payload size",
        y_label: "µs",
        xs: &SIZES,
        x_name: size_name,
        series: System::ALL
            .iter()
            .map(|&s| {
                let ys = SIZES
                    .iter()
                    .map(|&size| results.latency.get(&(s, size)).map(|l| l.p50))
                    .collect();
                Series::of(s, ys)
            })
            .collect(),
    };
    let rates = |size: usize, scale: f64| -> Vec<Series> {
        System::ALL
            .iter()
            .map(|&s| {
                let ys = CONCURRENCY
                    .iter()
                    .map(|&c| results.throughput.get(&(s, size, c)).map(|r| r * scale))
                    .collect();
                Series::of(s, ys)
            })
            .collect()
    };
    let small = Panel {
        title: "Throughput at 1 KiB (higher is better)",
        x_label: "calls in flight",
        y_label: "calls/s",
        xs: &CONCURRENCY,
        x_name: |c| c.to_string(),
        series: rates(1024, 1.0),
    };
    let large = Panel {
        title: "Throughput at 1 MiB (higher is better)",
        x_label: "calls in flight",
        y_label: "GB/s",
        xs: &CONCURRENCY,
        x_name: |c| c.to_string(),
        series: rates(1 << 20, (1 << 20) as f64 / 1e9),
    };
    let legend: Vec<Series> = System::ALL
        .iter()
        .map(|&s| Series::of(s, Vec::new()))
        .collect();
    plot(&[latency, small, large], &legend)
}

fn draw_panel(out: &mut String, panel: &Panel<'_>, x0: f64, y0: f64, w: f64, h: f64) {
    let (left, right, top, bottom) = (x0 + 70.0, x0 + w - 20.0, y0 + 40.0, y0 + h - 50.0);
    let values: Vec<f64> = panel
        .series
        .iter()
        .flat_map(|series| series.ys.iter().flatten().copied())
        .filter(|v| *v > 0.0)
        .collect();
    let _ = writeln!(
        out,
        "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\" font-size=\"14\" font-weight=\"bold\">{}</text>",
        (left + right) / 2.0,
        y0 + 22.0,
        panel.title
    );
    let _ = writeln!(
        out,
        "<rect x=\"{left}\" y=\"{top}\" width=\"{}\" height=\"{}\" fill=\"none\" stroke=\"#999\"/>",
        right - left,
        bottom - top
    );
    if values.is_empty() {
        return;
    }
    // Decades that cover every value: a log axis with a grid line per power of ten.
    let lo = values
        .iter()
        .copied()
        .fold(f64::INFINITY, f64::min)
        .log10()
        .floor();
    let hi = values
        .iter()
        .copied()
        .fold(0.0, f64::max)
        .log10()
        .ceil()
        .max(lo + 1.0);
    let y_of = |v: f64| bottom - (v.log10() - lo) / (hi - lo) * (bottom - top);
    let n = panel.xs.len();
    let x_of = |i: usize| left + (i as f64 + 0.5) * (right - left) / n as f64;
    let mut decade = lo;
    while decade <= hi {
        let y = y_of(10f64.powf(decade));
        let _ = writeln!(
            out,
            "<line x1=\"{left}\" y1=\"{y:.1}\" x2=\"{right}\" y2=\"{y:.1}\" stroke=\"#e5e5e5\"/>\
             <text x=\"{}\" y=\"{:.1}\" text-anchor=\"end\">{}</text>",
            left - 6.0,
            y + 4.0,
            axis_number(10f64.powf(decade))
        );
        decade += 1.0;
    }
    for (i, &x) in panel.xs.iter().enumerate() {
        let _ = writeln!(
            out,
            "<text x=\"{:.1}\" y=\"{}\" text-anchor=\"middle\">{}</text>",
            x_of(i),
            bottom + 18.0,
            (panel.x_name)(x)
        );
    }
    let _ = writeln!(
        out,
        "<text x=\"{:.1}\" y=\"{}\" text-anchor=\"middle\">{}</text>\
         <text x=\"{}\" y=\"{:.1}\" text-anchor=\"middle\" transform=\"rotate(-90 {} {:.1})\">{} (log scale)</text>",
        (left + right) / 2.0,
        bottom + 38.0,
        panel.x_label,
        x0 + 16.0,
        (top + bottom) / 2.0,
        x0 + 16.0,
        (top + bottom) / 2.0,
        panel.y_label
    );
    for series in &panel.series {
        let points: Vec<String> = series
            .ys
            .iter()
            .enumerate()
            .filter_map(|(i, y)| {
                y.filter(|v| *v > 0.0)
                    .map(|v| format!("{:.1},{:.1}", x_of(i), y_of(v)))
            })
            .collect();
        let _ = writeln!(
            out,
            "<polyline points=\"{}\" fill=\"none\" stroke=\"{}\" stroke-width=\"2\"{}/>",
            points.join(" "),
            series.colour,
            dash(series.dashed)
        );
        for point in &points {
            let (x, y) = point.split_once(',').expect("x,y");
            let _ = writeln!(
                out,
                "<circle cx=\"{x}\" cy=\"{y}\" r=\"3\" fill=\"{}\"/>",
                series.colour
            );
        }
    }
}

fn axis_number(v: f64) -> String {
    if v >= 1e9 {
        format!("{:.0}G", v / 1e9)
    } else if v >= 1e6 {
        format!("{:.0}M", v / 1e6)
    } else if v >= 1e3 {
        format!("{:.0}k", v / 1e3)
    } else if v >= 1.0 {
        format!("{v:.0}")
    } else {
        format!("{v}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splice_replaces_only_the_generated_part() {
        let doc = format!("# B\n\nintro\n\n{BEGIN}\nold\n{END}\n\n## Analysis\nkept\n");
        let new = splice(&doc, &format!("{BEGIN}\nnew\n{END}\n"), (BEGIN, END));
        assert!(new.contains("intro") && new.contains("new") && new.contains("kept"));
        assert!(!new.contains("old"));
    }

    #[test]
    fn sizes_have_short_names() {
        assert_eq!(size_name(32), "32 B");
        assert_eq!(size_name(64 << 10), "64 KiB");
        assert_eq!(size_name(16 << 20), "16 MiB");
    }

    #[test]
    fn the_plot_draws_what_it_has() {
        let mut results = Results::default();
        results.latency.insert(
            (System::Rpc, 32),
            Latency {
                calls: 1,
                p50: 20.0,
                p99: 30.0,
                p999: 40.0,
            },
        );
        results.throughput.insert((System::Raw, 1024, 16), 1e5);
        let svg = svg(&results);
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert!(svg.contains("<circle"));
    }
}
