//! The fan-out part of `cargo xtask bench` (`--fanout`): one query to every
//! shard of a sharded service, 4, 16 and 64 shards of 2 replicas each, its
//! latency being the whole fan-out's (the slowest shard's).
//!
//! For each number of shards, `fanout-bench server` processes (every replica
//! in one process, each listening on its own port, answering `Echo` after
//! an exponential service time, mean 1 ms) and one `fanout-bench client`
//! process per scenario:
//!
//! - **rdma-rpc**: `FanOut` over one `Channel::balance(.., LeastOutstanding)`
//!   per shard;
//! - **tonic + `join_all`**: one tonic channel (one HTTP/2 connection) per
//!   replica, the shard's two replicas taken in turn by hand;
//! - **rdma-rpc, 1 slow** and **tonic + `join_all`, 1 slow**: replica 0
//!   of shard 0 ten times slower;
//! - **rdma-rpc, 1 slow, hedged** at the p95 of recent shard calls, and at
//!   a fixed 3 ms (the service time's p95), both with budget 0.1.
//!
//! Over TCP on loopback everything runs; over RDMA (Soft-RoCE, in one
//! `cargo xtask rxe` guest) the rdma-rpc scenarios run (tonic has no RDMA).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use super::{date, fields, machine, plot, Panel, Series, ServerProcess, Settings};
use crate::{rxe, workspace_root};

/// The part's plot, next to `benchmarks.md`.
pub(super) const SVG_NAME: &str = "benchmarks-fanout.svg";
/// Marks the part's generated section of the report.
pub(super) const MARKERS: (&str, &str) = (
    "<!-- cargo xtask bench --fanout: generated from here -->",
    "<!-- cargo xtask bench --fanout: generated up to here -->",
);

/// Shards per fan-out.
const SHARDS: [usize; 3] = [4, 16, 64];
/// Replicas per shard.
const REPLICAS: usize = 2;
/// Shard calls in flight: each client keeps `SHARD_CALLS / shards` fan-outs
/// in flight (16, 4 and 1).
const SHARD_CALLS: usize = 64;
/// The service time's mean, µs (exponential).
const MEAN_US: u64 = 1000;
/// The slow replica is this many times slower.
const SLOW_FACTOR: u64 = 10;
/// The fixed hedging delay, ms: the p95 of an exponential with mean 1 ms.
const HEDGE_FIXED_MS: &str = "3";
/// The hedging budget: at most 10 % more calls.
const HEDGE_BUDGET: &str = "0.1";
/// Bytes of payload per shard request.
const PAYLOAD: usize = 64;
/// The time limit of the guest run.
const GUEST_TIMEOUT: Duration = Duration::from_secs(900);

/// Where a fan-out runs.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
pub(super) enum Transport {
    Tcp,
    Rdma,
}

impl Transport {
    fn title(self) -> &'static str {
        match self {
            Transport::Tcp => "TCP (loopback)",
            Transport::Rdma => "RDMA (Soft-RoCE guest)",
        }
    }
}

/// What one client run measures.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
enum Scenario {
    /// (a) rdma-rpc, FanOut + least-outstanding balancing.
    Rpc,
    /// (b) tonic with `join_all`.
    Tonic,
    /// (c) rdma-rpc with one replica 10× slower, no hedging.
    RpcSlow,
    /// (c') tonic with `join_all`, the same slow replica.
    TonicSlow,
    /// (d) the same, hedged at the p95 of recent shard calls.
    RpcSlowHedgedP95,
    /// (d') the same, hedged after a fixed 3 ms.
    RpcSlowHedgedFixed,
}

impl Scenario {
    const ALL: [Scenario; 6] = [
        Scenario::Rpc,
        Scenario::Tonic,
        Scenario::RpcSlow,
        Scenario::TonicSlow,
        Scenario::RpcSlowHedgedP95,
        Scenario::RpcSlowHedgedFixed,
    ];

    /// The name on `@@scenario` lines.
    fn name(self) -> &'static str {
        match self {
            Scenario::Rpc => "rpc",
            Scenario::Tonic => "tonic",
            Scenario::RpcSlow => "rpc-slow",
            Scenario::TonicSlow => "tonic-slow",
            Scenario::RpcSlowHedgedP95 => "rpc-slow-hedged-p95",
            Scenario::RpcSlowHedgedFixed => "rpc-slow-hedged-fixed",
        }
    }

    fn title(self) -> String {
        match self {
            Scenario::Rpc => "rdma-rpc".into(),
            Scenario::Tonic => "tonic + join_all".into(),
            Scenario::RpcSlow => "rdma-rpc, 1 slow".into(),
            Scenario::TonicSlow => "tonic + join_all, 1 slow".into(),
            Scenario::RpcSlowHedgedP95 => "rdma-rpc, 1 slow, hedged p95".into(),
            Scenario::RpcSlowHedgedFixed => {
                format!("rdma-rpc, 1 slow, hedged {HEDGE_FIXED_MS} ms")
            }
        }
    }

    fn system(self) -> &'static str {
        match self {
            Scenario::Tonic | Scenario::TonicSlow => "tonic",
            _ => "rpc",
        }
    }

    fn slow(self) -> bool {
        !matches!(self, Scenario::Rpc | Scenario::Tonic)
    }

    fn hedge(self) -> &'static str {
        match self {
            Scenario::RpcSlowHedgedP95 => "p95",
            Scenario::RpcSlowHedgedFixed => HEDGE_FIXED_MS,
            _ => "off",
        }
    }

    fn colour(self) -> &'static str {
        match self {
            Scenario::Rpc => "#d62728",
            Scenario::Tonic => "#1f77b4",
            Scenario::RpcSlow => "#7f7f7f",
            Scenario::TonicSlow => "#9467bd",
            Scenario::RpcSlowHedgedP95 => "#ff7f0e",
            Scenario::RpcSlowHedgedFixed => "#2ca02c",
        }
    }

    /// The scenarios each transport runs.
    fn of(transport: Transport) -> Vec<Scenario> {
        Scenario::ALL
            .into_iter()
            .filter(|s| transport == Transport::Tcp || s.system() == "rpc")
            .collect()
    }
}

/// One client's result line.
#[derive(Clone, Copy, Debug, Default)]
struct Measured {
    queries: u64,
    qps: f64,
    /// µs.
    p50: f64,
    p99: f64,
    p999: f64,
    partial: u64,
    shard_calls: u64,
    hedges: u64,
    hedges_won: u64,
}

impl Measured {
    fn extra_calls(&self) -> f64 {
        self.hedges as f64 / self.shard_calls.max(1) as f64
    }
}

type Results = BTreeMap<(Transport, usize, Scenario), Measured>;

/// What the part produced.
pub(super) struct FanOutPart {
    /// The tables and targets, in markdown (printed at the end of the run).
    pub(super) tables: String,
    /// The section of `benchmarks.md`, markers included.
    pub(super) generated: String,
    /// The plot.
    pub(super) svg: String,
    /// Why the run is incomplete, if it is (the report is written anyway).
    pub(super) failed: Option<String>,
}

/// Measurement windows: (warm-up, measured), ms.
fn windows(quick: bool, transport: Transport) -> (u64, u64) {
    match (quick, transport) {
        (true, Transport::Tcp) => (300, 1500),
        (false, Transport::Tcp) => (1000, 6000),
        (true, Transport::Rdma) => (1000, 3000),
        (false, Transport::Rdma) => (2000, 8000),
    }
}

/// A client's arguments after its shards.
fn client_args(quick: bool, transport: Transport, shards: usize, scenario: Scenario) -> String {
    let (warmup, measure) = windows(quick, transport);
    format!(
        "--system {} --concurrency {} --warmup-ms {warmup} --measure-ms {measure} \
         --hedge {} --hedge-budget {HEDGE_BUDGET} --payload {PAYLOAD}",
        scenario.system(),
        (SHARD_CALLS / shards).max(1),
        scenario.hedge()
    )
}

/// A server's arguments after `--addr`.
fn server_args(system: &str, shards: usize, slow: bool) -> String {
    let slow = if slow {
        format!(" --slow 0:0 --slow-factor {SLOW_FACTOR}")
    } else {
        String::new()
    };
    format!("--system {system} --shards {shards} --replicas {REPLICAS} --mean-us {MEAN_US}{slow}")
}

/// Runs the part: over TCP, and over RDMA in the guest when `rdma`.
pub(super) fn run(node: &Path, settings: &Settings, rdma: bool) -> Result<FanOutPart, String> {
    let started = Instant::now();
    let mut results = Results::new();
    let mut problems = Vec::new();
    if let Err(e) = tcp(node, settings, &mut results) {
        eprintln!("xtask bench: fan-out over TCP failed: {e}");
        problems.push(format!("TCP: {e}"));
    }
    eprintln!(
        "xtask bench: fan-out over TCP measured in {:.0} s",
        started.elapsed().as_secs_f64()
    );
    if rdma {
        if let Err(e) = guest(node, settings, &mut results) {
            eprintln!("xtask bench: fan-out over RDMA failed: {e}");
            problems.push(format!("RDMA: {e}"));
        }
    }
    let mut missing = Vec::new();
    for transport in [Transport::Tcp, Transport::Rdma] {
        if transport == Transport::Rdma && !rdma {
            continue;
        }
        for shards in SHARDS {
            for scenario in Scenario::of(transport) {
                if !results.contains_key(&(transport, shards, scenario)) {
                    missing.push(format!("{:?} {shards} {}", transport, scenario.name()));
                }
            }
        }
    }
    if !missing.is_empty() {
        problems.push(format!("no result for {}", missing.join(", ")));
    }
    if results.is_empty() {
        return Err(format!(
            "the fan-out part gave no result: {}",
            problems.join("; ")
        ));
    }
    let tables = format!("{}\n{}", tables(&results, rdma), targets(&results, rdma));
    let generated = report(settings, rdma, &tables, &missing);
    Ok(FanOutPart {
        tables,
        generated,
        svg: svg(&results, rdma),
        failed: (!problems.is_empty()).then(|| problems.join("; ")),
    })
}

/// Starts a `fanout-bench server`; returns it and its shards' `--shard` values.
fn start_server(
    node: &Path,
    shards: usize,
    system: &str,
    slow: bool,
) -> Result<(ServerProcess, Vec<String>), String> {
    let args = server_args(system, shards, slow);
    let mut server = ServerProcess(
        Command::new(node)
            .args(["server", "--addr", "tcp://127.0.0.1:0"])
            .args(args.split(' '))
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| format!("could not start fanout-bench server: {e}"))?,
    );
    let mut replicas = Vec::new();
    for line in BufReader::new(server.0.stdout.take().expect("piped stdout")).lines() {
        let line = line.map_err(|e| format!("reading fanout-bench server's output: {e}"))?;
        if line == "ready" {
            return Ok((server, replicas));
        }
        match line.split_once(": ") {
            Some((_, addresses)) if line.starts_with("shard ") => {
                replicas.push(addresses.to_string())
            }
            _ => return Err(format!("fanout-bench server said {line:?}")),
        }
    }
    Err("fanout-bench server ended before it was ready".into())
}

/// Every scenario over TCP: for each number of shards, the servers the
/// scenarios need, one at a time.
fn tcp(node: &Path, settings: &Settings, results: &mut Results) -> Result<(), String> {
    let scenarios = Scenario::of(Transport::Tcp);
    let total = SHARDS.len() * scenarios.len();
    let mut done = 0;
    for shards in SHARDS {
        for (system, slow) in [
            ("rpc", false),
            ("tonic", false),
            ("rpc", true),
            ("tonic", true),
        ] {
            let (server, replicas) = start_server(node, shards, system, slow)?;
            for &scenario in scenarios
                .iter()
                .filter(|s| s.system() == system && s.slow() == slow)
            {
                done += 1;
                let output = Command::new(node)
                    .arg("client")
                    .args(replicas.iter().flat_map(|r| ["--shard", r.as_str()]))
                    .args(client_args(settings.quick, Transport::Tcp, shards, scenario).split(' '))
                    .stderr(Stdio::inherit())
                    .output()
                    .map_err(|e| format!("could not run fanout-bench client: {e}"))?;
                let stdout = String::from_utf8_lossy(&output.stdout);
                let Some(measured) = stdout.lines().find_map(parse_line) else {
                    return Err(format!(
                        "{} with {shards} shards: no result ({}, said {stdout:?})",
                        scenario.title(),
                        output.status
                    ));
                };
                progress(done, total, Transport::Tcp, shards, scenario, &measured);
                results.insert((Transport::Tcp, shards, scenario), measured);
            }
            drop(server);
        }
    }
    Ok(())
}

fn progress(
    done: usize,
    total: usize,
    transport: Transport,
    shards: usize,
    scenario: Scenario,
    m: &Measured,
) {
    let hedges = if scenario.hedge() == "off" {
        String::new()
    } else {
        format!(
            ", {:.1} % extra calls ({} won)",
            100.0 * m.extra_calls(),
            m.hedges_won
        )
    };
    eprintln!(
        "[{done:>2}/{total}] {:?} {shards:>2} shards, {:<30} p50 {:>6.2} ms  p99 {:>6.2} ms  \
         ({} queries, {:.0}/s{hedges})",
        transport,
        scenario.title(),
        m.p50 / 1000.0,
        m.p99 / 1000.0,
        m.queries,
        m.qps
    );
}

/// Reads a `fanout ...` result line.
fn parse_line(line: &str) -> Option<Measured> {
    if !line.starts_with("fanout ") {
        return None;
    }
    let fields = fields(line);
    let int = |key: &str| fields.get(key).and_then(|v| v.parse::<u64>().ok());
    let us = |key: &str| int(key).map(|ns| ns as f64 / 1000.0);
    Some(Measured {
        queries: int("queries")?,
        qps: fields.get("qps").and_then(|v| v.parse().ok())?,
        p50: us("p50_ns")?,
        p99: us("p99_ns")?,
        p999: us("p999_ns")?,
        partial: int("partial")?,
        shard_calls: int("shard_calls")?,
        hedges: int("hedges")?,
        hedges_won: int("hedges_won")?,
    })
}

/// The rdma-rpc scenarios over `rdma://` in one Soft-RoCE guest boot.
fn guest(node: &Path, settings: &Settings, results: &mut Results) -> Result<(), String> {
    let script = guest_script(node, settings.quick);
    eprintln!("xtask bench: fan-out over RDMA: booting the Soft-RoCE guest (its output follows)");
    let (output, code) = rxe::run_captured(
        vec!["sh".into(), "-c".into(), script, "sh".into()],
        workspace_root(),
        Vec::new(),
        GUEST_TIMEOUT,
    )?;
    let mut current: Option<(usize, Scenario)> = None;
    for line in output.lines() {
        if let Some(rest) = line.strip_prefix("@@scenario ") {
            let mut words = rest.split_whitespace();
            let shards = words.next().and_then(|n| n.parse().ok());
            let scenario = words
                .next()
                .and_then(|name| Scenario::ALL.into_iter().find(|s| s.name() == name));
            current = shards.zip(scenario);
        } else if let (Some((shards, scenario)), Some(measured)) = (current, parse_line(line)) {
            results.insert((Transport::Rdma, shards, scenario), measured);
            current = None;
        }
    }
    if code != 0 {
        return Err(format!("the guest run ended with status {code}"));
    }
    Ok(())
}

/// The guest's script: for each number of shards, a fast and a slow
/// `fanout-bench server` on `rdma://$RDMA_TEST_IP:0`, and the clients.
fn guest_script(node: &Path, quick: bool) -> String {
    let node = format!("'{}'", node.to_string_lossy().replace('\'', r"'\''"));
    let mut s = String::from("set -u\nfailed=0\nulimit -l unlimited 2>/dev/null\n");
    for shards in SHARDS {
        for slow in [false, true] {
            let args = server_args("rpc", shards, slow);
            let _ = writeln!(
                s,
                r#"echo "@@server {shards} slow={slow}"
{node} server --addr "rdma://$RDMA_TEST_IP:0" {args} > /tmp/fanout-server.txt 2>&1 &
server=$!
ready=
for try in $(seq 1 300); do
    grep -q '^ready$' /tmp/fanout-server.txt && {{ ready=1; break; }}
    kill -0 "$server" 2>/dev/null || break
    sleep 0.2
done
if [ -z "$ready" ]; then
    echo "@@failed fanout-bench server ({shards} shards, slow={slow})"; tail -5 /tmp/fanout-server.txt; failed=1
else"#
            );
            for scenario in Scenario::of(Transport::Rdma)
                .into_iter()
                .filter(|sc| sc.slow() == slow)
            {
                let _ = writeln!(
                    s,
                    "    echo \"@@scenario {shards} {name}\"\n    \
                     timeout 120 {node} client --shards-from /tmp/fanout-server.txt {args} \
                     || {{ echo \"@@failed {shards} {name}\"; failed=1; }}",
                    name = scenario.name(),
                    args = client_args(quick, Transport::Rdma, shards, scenario),
                );
            }
            let _ = writeln!(s, "    kill \"$server\"; wait \"$server\" 2>/dev/null\nfi");
        }
    }
    s.push_str("exit $failed\n");
    s
}

fn ms(us: f64) -> String {
    format!("{:.2} ms", us / 1000.0)
}

fn ratio(a: f64, b: f64) -> String {
    if b > 0.0 {
        format!("{:.2}×", a / b)
    } else {
        "–".into()
    }
}

/// One table per transport.
fn tables(results: &Results, rdma: bool) -> String {
    let mut out = String::new();
    for transport in [Transport::Tcp, Transport::Rdma] {
        if transport == Transport::Rdma && !rdma {
            continue;
        }
        let _ = writeln!(
            out,
            "### Fan-out over {}\n\n\
             Whole fan-out latency (the slowest shard's answer). p99 ratio: against rdma-rpc \
             with no slow replica at the same number of shards. Extra calls: hedges sent per \
             shard call.\n\n\
             | shards | in flight | system | p50 | p99 | p99.9 | p99 ratio | extra calls | queries | queries/s |\n\
             |---:|---:|---|---:|---:|---:|---:|---:|---:|---:|",
            transport.title()
        );
        for shards in SHARDS {
            let base = results.get(&(transport, shards, Scenario::Rpc)).copied();
            for scenario in Scenario::of(transport) {
                let Some(m) = results.get(&(transport, shards, scenario)) else {
                    let _ = writeln!(
                        out,
                        "| {shards} | {} | {} | – | – | – | – | – | – | – |",
                        SHARD_CALLS / shards,
                        scenario.title()
                    );
                    continue;
                };
                let extra = if scenario.hedge() == "off" {
                    "–".to_string()
                } else {
                    format!("{:.1} %", 100.0 * m.extra_calls())
                };
                let partial = if m.partial > 0 {
                    format!(" ({} partial)", m.partial)
                } else {
                    String::new()
                };
                let _ = writeln!(
                    out,
                    "| {shards} | {} | {} | {} | {} | {} | {} | {extra} | {}{partial} | {:.0} |",
                    SHARD_CALLS / shards,
                    scenario.title(),
                    ms(m.p50),
                    ms(m.p99),
                    ms(m.p999),
                    base.map_or("–".into(), |b| ratio(m.p99, b.p99)),
                    m.queries,
                    m.qps,
                );
            }
        }
        out.push('\n');
    }
    out
}

/// The issue's targets, checked against this run.
fn targets(results: &Results, rdma: bool) -> String {
    let mut out =
        String::from("### Fan-out targets\n\n| target | measured | verdict |\n|---|---:|---|\n");
    let get = |t, n, s| results.get(&(t, n, s)).copied();
    let verdict = |pass: bool| if pass { "PASS" } else { "**MISS**" };
    // The issue's "p99 ≤ 0.3× tonic at 16 shards", read both ways: with
    // equal replicas (where the service times set the tail for both), and
    // with one slow replica (where balancing and hedging are what differ).
    for (ours, theirs, what) in [
        (Scenario::Rpc, Scenario::Tonic, "equal replicas"),
        (
            Scenario::RpcSlowHedgedP95,
            Scenario::TonicSlow,
            "one replica 10× slower, rdma-rpc hedged at p95",
        ),
    ] {
        let target = format!("fan-out of 16 over TCP, {what}: p99 ≤ 0.3× tonic + join_all");
        match (
            get(Transport::Tcp, 16, ours),
            get(Transport::Tcp, 16, theirs),
        ) {
            (Some(a), Some(b)) => {
                let r = a.p99 / b.p99;
                let _ = writeln!(
                    out,
                    "| {target} | {r:.2}× ({} / {}) | {} |",
                    ms(a.p99),
                    ms(b.p99),
                    verdict(r <= 0.3)
                );
            }
            _ => {
                let _ = writeln!(out, "| {target} | – | not measured |");
            }
        }
    }
    for transport in [Transport::Tcp, Transport::Rdma] {
        if transport == Transport::Rdma && !rdma {
            continue;
        }
        for scenario in [Scenario::RpcSlowHedgedP95, Scenario::RpcSlowHedgedFixed] {
            for shards in SHARDS {
                let target = format!(
                    "{}, {shards} shards, one replica 10× slower, hedged {}: p99 ≤ 1.5× \
                     no-slow p99 at ≤ 10 % extra calls",
                    match transport {
                        Transport::Tcp => "TCP",
                        Transport::Rdma => "RDMA",
                    },
                    match scenario {
                        Scenario::RpcSlowHedgedP95 => "at p95".to_string(),
                        _ => format!("after {HEDGE_FIXED_MS} ms"),
                    }
                );
                match (
                    get(transport, shards, scenario),
                    get(transport, shards, Scenario::Rpc),
                ) {
                    (Some(h), Some(base)) => {
                        let r = h.p99 / base.p99;
                        let extra = h.extra_calls();
                        let _ = writeln!(
                            out,
                            "| {target} | {r:.2}×, {:.1} % | {} |",
                            100.0 * extra,
                            verdict(r <= 1.5 && extra <= 0.10)
                        );
                    }
                    _ => {
                        let _ = writeln!(out, "| {target} | – | not measured |");
                    }
                }
            }
        }
    }
    out
}

/// The part's generated section of the report.
fn report(settings: &Settings, rdma: bool, tables: &str, missing: &[String]) -> String {
    let (tcp_warmup, tcp_measure) = windows(settings.quick, Transport::Tcp);
    let (rdma_warmup, rdma_measure) = windows(settings.quick, Transport::Rdma);
    let rdma_line = if rdma {
        format!(
            "- RDMA: the rdma-rpc scenarios in one `cargo xtask rxe` guest boot (qemu TCG, 2 \
             vCPUs, Soft-RoCE `rxe0`), servers on `rdma://10.77.0.1:0`, the same service times; \
             warm-up {rdma_warmup} ms, measured {rdma_measure} ms per scenario.\n"
        )
    } else {
        "- RDMA: not run (`--fanout-tcp`).\n".to_string()
    };
    let missing = if missing.is_empty() {
        String::new()
    } else {
        format!("- **Not measured** (failed): {}.\n", missing.join(", "))
    };
    format!(
        "{begin}\n\
         ## Fan-out results\n\n\
         - Command: `{command}`{quick}\n\
         - Machine: {machine}\n\
         - Date: {date}\n\
         - Shards: 4, 16, 64, each {REPLICAS} replicas; every replica of a run in one \
         `fanout-bench server` process, each on its own port, answering `Echo` ({PAYLOAD} B) \
         after an exponential service time, mean {MEAN_US} µs (drawn per call, waited out on a \
         timer thread, not tokio's 1 ms timer wheel); \"1 slow\": replica 0 of shard 0 has a \
         {SLOW_FACTOR}× longer mean.\n\
         - Client: one `fanout-bench client` process per scenario, a closed loop of \
         {SHARD_CALLS} / shards fan-outs in flight (16, 4, 1: {SHARD_CALLS} shard calls), \
         default multi-threaded tokio runtime (one worker per core) on both sides, as is tonic's. \
         rdma-rpc: `FanOut::within(2 s)` over one `Channel::balance(replicas, \
         LeastOutstanding)` per shard; hedging: one `Hedging` policy for all shard calls, \
         `at_percentile(95)` or `after({HEDGE_FIXED_MS} ms)`, `budget({HEDGE_BUDGET})`. \
         tonic 0.14: `futures::future::join_all` over one call per shard, each shard's two \
         replicas taken in turn by hand, one `Channel` (HTTP/2 connection) per replica, \
         `tcp_nodelay(true)`, default HTTP/2 windows (adaptive window off: 64 B messages never \
         fill them), servers with `TCP_NODELAY`.\n\
         - TCP: loopback, warm-up {tcp_warmup} ms, measured {tcp_measure} ms per scenario.\n\
         {rdma_line}{missing}\n\
         ![p99 of the whole fan-out by shards]({SVG_NAME})\n\n\
         {tables}\n{end}\n",
        begin = MARKERS.0,
        end = MARKERS.1,
        command = settings.command,
        quick = if settings.quick {
            " (short measurements: indicative only)"
        } else {
            ""
        },
        machine = machine(),
        date = date(),
    )
}

/// The plot: p99 against shards, one panel per transport.
fn svg(results: &Results, rdma: bool) -> String {
    let panel = |transport: Transport, title: &'static str| Panel {
        title,
        x_label: "shards (× 2 replicas)",
        y_label: "p99, ms",
        xs: &SHARDS,
        x_name: |n| n.to_string(),
        series: Scenario::of(transport)
            .into_iter()
            .map(|scenario| Series {
                name: scenario.title(),
                colour: scenario.colour(),
                dashed: scenario.system() == "tonic",
                ys: SHARDS
                    .iter()
                    .map(|&n| results.get(&(transport, n, scenario)).map(|m| m.p99 / 1e3))
                    .collect(),
            })
            .collect(),
    };
    let mut panels = vec![panel(
        Transport::Tcp,
        "Fan-out p99 over TCP (lower is better)",
    )];
    if rdma {
        panels.push(panel(Transport::Rdma, "Fan-out p99 over RDMA, Soft-RoCE"));
    }
    let legend: Vec<Series> = Scenario::ALL
        .iter()
        .map(|s| Series {
            name: s.title(),
            colour: s.colour(),
            dashed: s.system() == "tonic",
            ys: Vec::new(),
        })
        .collect();
    plot(&panels, &legend)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_result_lines_and_checks_targets() {
        let line = "fanout system=rpc shards=16 concurrency=4 queries=2961 qps=985.6 \
                    p50_ns=3715071 p99_ns=8486911 p999_ns=31391743 max_ns=35192831 partial=0 \
                    shard_calls=47376 hedges=2000 hedges_won=1000 over_budget=0";
        let m = parse_line(line).expect("a result");
        assert_eq!(m.queries, 2961);
        assert!((m.p99 - 8486.911).abs() < 1e-6);
        let mut results = Results::new();
        results.insert((Transport::Tcp, 16, Scenario::Rpc), m);
        let tonic = Measured { p99: 30_000.0, ..m };
        results.insert((Transport::Tcp, 16, Scenario::Tonic), tonic);
        let hedged = Measured { p99: 12_000.0, ..m };
        results.insert((Transport::Tcp, 16, Scenario::RpcSlowHedgedP95), hedged);
        let tonic_slow = Measured { p99: 50_000.0, ..m };
        results.insert((Transport::Tcp, 16, Scenario::TonicSlow), tonic_slow);
        let targets = targets(&results, false);
        assert!(
            targets.contains(
                "equal replicas: p99 ≤ 0.3× tonic + join_all | 0.28× (8.49 ms / 30.00 ms) | PASS |"
            ),
            "{targets}"
        );
        assert!(targets.contains("| 1.41×, 4.2 % | PASS |"), "{targets}");
        assert!(
            targets.contains(
                "hedged at p95: p99 ≤ 0.3× tonic + join_all | 0.24× (12.00 ms / 50.00 ms) | PASS |"
            ),
            "{targets}"
        );
        assert!(
            targets.contains(
                "after 3 ms: p99 ≤ 1.5× no-slow p99 at ≤ 10 % extra calls | – | not measured |"
            ),
            "{targets}"
        );
        assert!(tables(&results, false).contains("| 16 | 4 | tonic + join_all |"));
        assert!(svg(&results, true).contains("<circle"));
    }

    #[test]
    fn the_guest_script_runs_every_rdma_scenario() {
        let script = guest_script(Path::new("/t/fanout-bench"), true);
        assert_eq!(
            script.matches("@@scenario ").count(),
            SHARDS.len() * Scenario::of(Transport::Rdma).len()
        );
        assert!(!script.contains("--system tonic"));
        assert!(script.contains("--slow 0:0 --slow-factor 10"));
    }
}
