//! The byte-stream part of `cargo xtask bench` (`--stream`): tonic carried
//! by `transport_rdma::RdmaStream` against tonic over the guest's TCP and
//! rdma-rpc's own `rdma://`, and a one-way `RdmaStream` bulk copy against
//! `ib_write_bw`, all in one Soft-RoCE guest boot (issue 13).
//!
//! The guest script ([`guest_script`]) first interleaves, per write size
//! ([`BULK_SIZES`], 16 KiB to 16 MiB), `ib_write_bw` (through [`rxe::baseline::SCRIPT`]) and
//! `bench-node stream-send` against one `bench-node stream-sink` (which
//! confirms the byte count, so a short copy fails rather than looks fast).
//! Then it starts three `bench-node server`s (tonic on an `RdmaListener`,
//! tonic on `tcp://$RDMA_TEST_IP:0`, the guest's only interface besides
//! loopback, and rdma-rpc on `rdma://`) and, size by size
//! ([`RPC_SIZES`]), runs one `bench-node client` per system, the systems
//! taking turns: unary `Echo` latency one call at a time, then `Echo`
//! calls with 64 in flight on one connection. The guest's CPU is emulated
//! (qemu TCG), so only ratios within the run mean anything.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;
use std::time::Duration;

use super::{
    date, field, fields, machine, median, micros, rate_name, ratio, shell_quote, size_name,
    target_row, Latency, Settings,
};
use crate::rxe::baseline::{self, Case};
use crate::{rxe, workspace_root};

/// Marks the byte-stream part's generated section of the report.
pub(super) const MARKERS: (&str, &str) = (
    "<!-- cargo xtask bench --stream: generated from here -->",
    "<!-- cargo xtask bench --stream: generated up to here -->",
);

/// Write sizes of the bulk copy (and of `ib_write_bw`'s messages): the
/// issue's, and 16 KiB, the size of the HTTP/2 DATA frames hyper writes
/// one per write (what tonic over `RdmaStream` sends as messages).
const BULK_SIZES: [usize; 4] = [16 << 10, 64 << 10, 1 << 20, 16 << 20];
/// Payload sizes of the RPC comparison.
const RPC_SIZES: [usize; 4] = [32, 1024, 64 << 10, 1 << 20];
/// Calls in flight for the throughput runs.
const IN_FLIGHT: usize = 64;
/// The time limit of the whole guest run.
const TIMEOUT: Duration = Duration::from_secs(1500);
const QUICK_TIMEOUT: Duration = Duration::from_secs(900);

const fn bw(size: u32, iterations: u32) -> Case {
    baseline::case("ib_write_bw", size, iterations)
}

const CASES: &[Case] = &[
    bw(16 << 10, 5000),
    bw(64 << 10, 2000),
    bw(1 << 20, 200),
    bw(16 << 20, 16),
];
const QUICK_CASES: &[Case] = &[
    bw(16 << 10, 1500),
    bw(64 << 10, 500),
    bw(1 << 20, 50),
    bw(16 << 20, 5),
];

/// Rounds of the bulk comparison (each: every write size, `ib_write_bw`
/// then the copy); the tables give medians over them.
fn rounds(quick: bool) -> usize {
    if quick {
        1
    } else {
        3
    }
}

/// MiB each bulk copy carries.
fn bulk_mib(quick: bool) -> u64 {
    if quick {
        64
    } else {
        256
    }
}

/// The systems compared, in the order they take turns.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
enum System {
    TonicRdma,
    TonicTcp,
    Rpc,
}

impl System {
    const ALL: [System; 3] = [System::TonicRdma, System::TonicTcp, System::Rpc];

    /// bench-node's `--system`.
    fn arg(self) -> &'static str {
        match self {
            System::TonicRdma => "tonic-rdma",
            System::TonicTcp => "tonic",
            System::Rpc => "rpc",
        }
    }

    /// Where its server listens in the guest.
    fn listen(self) -> &'static str {
        match self {
            System::TonicRdma | System::Rpc => "rdma://$RDMA_TEST_IP:0",
            System::TonicTcp => "tcp://$RDMA_TEST_IP:0",
        }
    }

    fn title(self) -> &'static str {
        match self {
            System::TonicRdma => "tonic over `RdmaStream`",
            System::TonicTcp => "tonic over TCP",
            System::Rpc => "rdma-rpc `rdma://`",
        }
    }

    /// A shell variable's name for its server.
    fn var(self) -> &'static str {
        match self {
            System::TonicRdma => "tonic_rdma",
            System::TonicTcp => "tonic_tcp",
            System::Rpc => "rpc",
        }
    }
}

/// (warm-up, latency run, throughput run) in ms at `size`.
fn windows(quick: bool, size: usize) -> (u64, u64, u64) {
    match (quick, size) {
        (true, s) if s <= 64 << 10 => (200, 1000, 1000),
        (true, _) => (300, 1500, 1500),
        (false, s) if s <= 64 << 10 => (1000, 4000, 3000),
        (false, _) => (1000, 4000, 4000),
    }
}

/// The arguments of one client run (after `--addr ADDR`).
fn client_args(quick: bool, size: usize) -> String {
    let (warmup, latency, throughput) = windows(quick, size);
    format!(
        "--sizes {size} --concurrency {IN_FLIGHT} --warmup-ms {warmup} --latency-ms {latency} \
         --latency-calls {} --throughput-ms {throughput} --max-inflight-bytes {} \
         --throughput-call echo",
        if quick { 20_000 } else { 100_000 },
        128 << 20,
    )
}

/// What the part produced.
pub(super) struct StreamPart {
    /// The tables and targets, in markdown.
    pub(super) tables: String,
    /// The section of `benchmarks.md`, markers included.
    pub(super) generated: String,
    /// Why the run is incomplete, if it is (the report is written anyway).
    pub(super) failed: Option<String>,
}

/// Everything measured in the guest.
#[derive(Default)]
struct Results {
    /// The bulk copy's bytes/s, by write size, one per round.
    bulk: BTreeMap<usize, Vec<f64>>,
    /// `ib_write_bw`'s average, bytes/s, by size, one per round.
    write_bw: BTreeMap<usize, Vec<f64>>,
    /// Round trips in µs, by (system, size).
    latency: BTreeMap<(System, usize), Latency>,
    /// `Echo` calls/s with [`IN_FLIGHT`] in flight, by (system, size).
    throughput: BTreeMap<(System, usize), f64>,
    /// tonic over `RdmaStream`'s client: stream writes (RDMA messages)
    /// and bytes of its latency run, by size.
    writes: BTreeMap<usize, (f64, f64)>,
}

/// Runs the guest, parses what it printed, and writes up the part.
pub(super) fn run(node: &Path, settings: &Settings) -> Result<StreamPart, String> {
    let quick = settings.quick;
    let cases = if quick { QUICK_CASES } else { CASES };
    eprintln!(
        "xtask bench: byte-stream part: booting the Soft-RoCE guest (ib_write_bw and the \
         RdmaStream bulk copy at {} write sizes, then {} systems × {} sizes; its output follows)",
        BULK_SIZES.len(),
        System::ALL.len(),
        RPC_SIZES.len()
    );
    let (output, code) = rxe::run_captured(
        vec![
            "sh".into(),
            "-c".into(),
            guest_script(node, quick, cases),
            "sh".into(),
        ],
        workspace_root(),
        vec![("PERFTEST_SCRIPT".into(), baseline::SCRIPT.into())],
        if quick { QUICK_TIMEOUT } else { TIMEOUT },
    )?;
    let results = parse(&output, cases)?;
    let missing = missing(&results);
    if !missing.is_empty() {
        eprintln!(
            "xtask bench: byte-stream part: no result for {} (see the guest's output above)",
            missing.join(", ")
        );
    }
    if results.bulk.is_empty() && results.latency.is_empty() {
        return Err(format!(
            "the byte-stream part gave no result (guest exit status {code})"
        ));
    }
    let failed = (code != 0 || !missing.is_empty()).then(|| {
        format!(
            "the byte-stream part's guest run failed (exit status {code}) or missed results; \
             its report has what was measured"
        )
    });
    let tables = format!("{}\n{}", tables(&results), targets(&results));
    let generated = report(settings, cases, &tables, &missing);
    Ok(StreamPart {
        tables,
        generated,
        failed,
    })
}

/// The guest's script: [`rounds`] of, per write size, `ib_write_bw` then
/// the bulk copy; then, per payload size, one client per system, the
/// systems taking turns.
fn guest_script(node: &Path, quick: bool, cases: &[Case]) -> String {
    let node = shell_quote(&node.to_string_lossy());
    // `start VAR LOG ARGS...`: runs bench-node ARGS in the background, sets
    // $VAR_pid and $VAR_addr (empty if it never said where it listens).
    let mut s = format!(
        r#"set -u
failed=0
start() {{
    var=$1 log=$2; shift 2
    {node} "$@" > "$log" 2>&1 &
    pid=$!
    addr=
    for try in $(seq 1 150); do
        addr=$(sed -n 's/^listening on //p' "$log")
        [ -n "$addr" ] && break
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.2
    done
    [ -n "$addr" ] || {{ echo "@@failed bench-node $*"; cat "$log"; failed=1; }}
    eval "${{var}}_pid=$pid ${{var}}_addr=$addr"
}}
echo '@@part bulk'
start sink /tmp/stream-sink.log stream-sink --addr "rdma://$RDMA_TEST_IP:0"
"#
    );
    for size in std::iter::repeat_n(BULK_SIZES, rounds(quick)).flatten() {
        let perftest: Vec<String> = cases
            .iter()
            .filter(|c| c.size as usize == size)
            .map(|c| shell_quote(&c.arg()))
            .collect();
        // Only perftest's marker, header and result lines (and its
        // complaints) reach the console.
        let _ = writeln!(
            s,
            "sh -c \"$PERFTEST_SCRIPT\" sh {} 2>&1 \\\n  \
             | grep --line-buffered -E '^@@|#bytes|^ *[0-9]|rror|nable|ailed'\n\
             echo '@@part bulk {size}'\n\
             timeout 300 {node} stream-send --addr \"$sink_addr\" --sizes {size} --total-mib {} \\\n  \
             || {{ echo '@@failed stream-send {size}'; failed=1; }}",
            perftest.join(" "),
            bulk_mib(quick),
        );
    }
    s.push_str("kill \"$sink_pid\"; wait \"$sink_pid\" 2>/dev/null\ncat /tmp/stream-sink.log\n");
    s.push_str("echo '@@part rpc'\n");
    for system in System::ALL {
        let _ = writeln!(
            s,
            "start {var} /tmp/server-{var}.log server --system {arg} --addr \"{listen}\"",
            var = system.var(),
            arg = system.arg(),
            listen = system.listen(),
        );
    }
    for size in RPC_SIZES {
        for system in System::ALL {
            let _ = writeln!(
                s,
                "timeout 300 {node} client --system {arg} --addr \"${var}_addr\" {args} \\\n  \
                 || {{ echo '@@failed client {arg} {size}'; failed=1; }}",
                arg = system.arg(),
                var = system.var(),
                args = client_args(quick, size),
            );
        }
    }
    for system in System::ALL {
        let _ = writeln!(
            s,
            "kill \"${var}_pid\"; wait \"${var}_pid\" 2>/dev/null",
            var = system.var()
        );
    }
    s.push_str("exit $failed\n");
    s
}

/// Reads the guest's output: `ib_write_bw` through [`baseline::parse`],
/// bench-node's `stream`, `latency` and `throughput` lines.
fn parse(output: &str, cases: &'static [Case]) -> Result<Results, String> {
    let mut results = Results::default();
    for m in baseline::parse(output, cases) {
        // perftest's MB are 2^20 bytes.
        if let Some(mb) = m.get("bw_avg_mb_s") {
            results
                .write_bw
                .entry(m.size as usize)
                .or_default()
                .push(mb * (1u64 << 20) as f64);
        }
    }
    for line in output.lines() {
        let kind = line.split(' ').next();
        if !matches!(kind, Some("stream" | "latency" | "throughput" | "writes")) {
            continue;
        }
        let fields = fields(line);
        let size = field(&fields, "size")?;
        let number = |key: &str| -> Result<f64, String> {
            fields
                .get(key)
                .and_then(|v| v.parse().ok())
                .ok_or_else(|| format!("no {key} in {line:?}"))
        };
        if kind == Some("stream") {
            results
                .bulk
                .entry(size)
                .or_default()
                .push(number("bytes_per_s")?);
            continue;
        }
        if kind == Some("writes") {
            results
                .writes
                .insert(size, (number("writes")?, number("bytes")?));
            continue;
        }
        let Some(&name) = fields.get("system") else {
            continue;
        };
        let Some(system) = System::ALL.into_iter().find(|s| s.arg() == name) else {
            continue;
        };
        if kind == Some("latency") {
            let us = |key| number(key).map(|ns| ns / 1000.0);
            let latency = Latency {
                calls: number("calls")? as u64,
                p50: us("p50_ns")?,
                p99: us("p99_ns")?,
                p999: us("p999_ns")?,
            };
            results.latency.insert((system, size), latency);
        } else {
            results
                .throughput
                .insert((system, size), number("calls_per_s")?);
        }
    }
    Ok(results)
}

/// What should have been measured and was not.
fn missing(results: &Results) -> Vec<String> {
    let mut missing = Vec::new();
    for size in BULK_SIZES {
        if !results.write_bw.contains_key(&size) {
            missing.push(format!("ib_write_bw {}", size_name(size)));
        }
        if !results.bulk.contains_key(&size) {
            missing.push(format!("bulk copy {}", size_name(size)));
        }
    }
    for size in RPC_SIZES {
        for system in System::ALL {
            if !results.latency.contains_key(&(system, size)) {
                missing.push(format!("{} latency {}", system.arg(), size_name(size)));
            }
            if !results.throughput.contains_key(&(system, size)) {
                missing.push(format!("{} throughput {}", system.arg(), size_name(size)));
            }
        }
    }
    missing
}

/// `min–max` of `values` in MB/s, or `–`.
fn spread(values: Option<&Vec<f64>>) -> String {
    match values {
        Some(v) if v.len() > 1 => {
            let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
            let hi = v.iter().copied().fold(0.0, f64::max);
            format!("{:.1}–{:.1}", lo / 1e6, hi / 1e6)
        }
        _ => "–".into(),
    }
}

fn over(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => Some(a / b),
        _ => None,
    }
}

fn mb(bytes_per_s: Option<f64>) -> String {
    bytes_per_s.map_or("–".into(), |b| format!("{:.2}", b / 1e6))
}

fn tables(results: &Results) -> String {
    let mut out = String::from(
        "### Bulk one-way copy: `RdmaStream` against `ib_write_bw`\n\n\
         One stream, `write_all` of the whole buffer each time, the sink reading with \
         `recv_bytes` and confirming the byte count; `ib_write_bw` right before it at the \
         same message size, each round going through every size. MB/s are 10⁶ bytes/s \
         (perftest's 2²⁰-byte MB converted): the median over the rounds, and the lowest and \
         highest; the ratio is of the medians.\n\n\
         | write size | `RdmaStream` MB/s | range | `ib_write_bw` MB/s | range | ratio |\n\
         |---:|---:|---:|---:|---:|---:|\n",
    );
    for size in BULK_SIZES {
        let (ours, floor) = (results.bulk.get(&size), results.write_bw.get(&size));
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} |",
            size_name(size),
            mb(median(ours)),
            spread(ours),
            mb(median(floor)),
            spread(floor),
            ratio(median(ours), median(floor))
        );
    }
    let _ = writeln!(
        out,
        "\n### Unary round trip, one call at a time\n\n\
         `Echo` calls (the payload goes and comes back). Ratios are tonic over `RdmaStream` \
         over the other system: below 1× is faster.\n\n\
         | size | percentile | {} | {} | {} | / tonic TCP | / rdma-rpc |\n\
         |---:|---|---:|---:|---:|---:|---:|",
        System::TonicRdma.title(),
        System::TonicTcp.title(),
        System::Rpc.title(),
    );
    type Pick = fn(&Latency) -> f64;
    let percentiles: [(&str, Pick); 2] = [("p50", |l| l.p50), ("p99", |l| l.p99)];
    for size in RPC_SIZES {
        for (name, pick) in percentiles {
            let get = |system| results.latency.get(&(system, size)).map(pick);
            let show = |v: Option<f64>| v.map_or("–".into(), micros);
            let _ = writeln!(
                out,
                "| {} | {name} | {} | {} | {} | {} | {} |",
                size_name(size),
                show(get(System::TonicRdma)),
                show(get(System::TonicTcp)),
                show(get(System::Rpc)),
                ratio(get(System::TonicRdma), get(System::TonicTcp)),
                ratio(get(System::TonicRdma), get(System::Rpc)),
            );
        }
    }
    let calls: Vec<String> = System::ALL
        .iter()
        .map(|&system| {
            let at = |size| results.latency.get(&(system, size)).map_or(0, |l| l.calls);
            format!(
                "{} {} at 32 B, {} at 1 MiB",
                system.arg(),
                at(32),
                at(1 << 20)
            )
        })
        .collect();
    let _ = writeln!(
        out,
        "\nCalls measured: {}.\n\n\
         ### Throughput, {IN_FLIGHT} `Echo` calls in flight on one connection\n\n\
         One task per call in flight on one channel (one HTTP/2 connection for tonic). MB/s \
         counts the payload one way (10⁶ bytes/s; as much comes back). Ratios are tonic over \
         `RdmaStream` over the other system: above 1× is faster.\n\n\
         | size | {} calls/s | MB/s | {} calls/s | {} calls/s | / tonic TCP | / rdma-rpc |\n\
         |---:|---:|---:|---:|---:|---:|---:|",
        calls.join("; "),
        System::TonicRdma.title(),
        System::TonicTcp.title(),
        System::Rpc.title(),
    );
    for size in RPC_SIZES {
        let get = |system| results.throughput.get(&(system, size)).copied();
        let show = |v: Option<f64>| v.map_or("–".into(), rate_name);
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} | {} |",
            size_name(size),
            show(get(System::TonicRdma)),
            mb(get(System::TonicRdma).map(|r| r * size as f64)),
            show(get(System::TonicTcp)),
            show(get(System::Rpc)),
            ratio(get(System::TonicRdma), get(System::TonicTcp)),
            ratio(get(System::TonicRdma), get(System::Rpc)),
        );
    }
    let _ = writeln!(
        out,
        "\nWhat hyper's HTTP/2 writes on tonic's `RdmaStream` (client side, the latency run \
         with its warm-up; each write is one RDMA message):\n\n\
         | size | writes | mean bytes per write |\n|---:|---:|---:|"
    );
    for size in RPC_SIZES {
        if let Some(&(writes, bytes)) = results.writes.get(&size) {
            let mean = if writes > 0.0 { bytes / writes } else { 0.0 };
            let _ = writeln!(out, "| {} | {writes:.0} | {mean:.0} |", size_name(size));
        }
    }
    out
}

/// Issue 13's target, and the ratios it asks to report.
fn targets(results: &Results) -> String {
    let mut out = String::from(
        "### Byte-stream targets\n\n\
         | target | measured | verdict |\n|---|---:|---|\n",
    );
    for size in BULK_SIZES {
        let measured = over(
            median(results.bulk.get(&size)),
            median(results.write_bw.get(&size)),
        );
        if size == 1 << 20 {
            target_row(
                &mut out,
                "`RdmaStream` bulk one way at 1 MiB writes ≥ 0.9× `ib_write_bw`",
                measured,
                0.9,
                false,
            );
        } else {
            report_row(
                &mut out,
                &format!(
                    "`RdmaStream` bulk one way at {} writes / `ib_write_bw`",
                    size_name(size)
                ),
                measured,
            );
        }
    }
    let p50 = |system, size| results.latency.get(&(system, size)).map(|l| l.p50);
    let rate = |system, size| results.throughput.get(&(system, size)).copied();
    for other in [System::TonicTcp, System::Rpc] {
        for size in RPC_SIZES {
            report_row(
                &mut out,
                &format!(
                    "tonic over `RdmaStream` / {}: p50 at {} (below 1× is faster)",
                    other.title(),
                    size_name(size)
                ),
                over(p50(System::TonicRdma, size), p50(other, size)),
            );
        }
        for size in RPC_SIZES {
            report_row(
                &mut out,
                &format!(
                    "tonic over `RdmaStream` / {}: calls/s at {} × {IN_FLIGHT} in flight \
                     (above 1× is faster)",
                    other.title(),
                    size_name(size)
                ),
                over(rate(System::TonicRdma, size), rate(other, size)),
            );
        }
    }
    out
}

/// A row of the targets table with no limit: the issue asks for the ratio.
fn report_row(out: &mut String, what: &str, measured: Option<f64>) {
    let (shown, verdict) = match measured {
        Some(m) => (format!("{m:.2}×"), "reported (no target)"),
        None => ("–".into(), "not measured"),
    };
    let _ = writeln!(out, "| {what} | {shown} | {verdict} |");
}

/// The part's generated section of the report.
fn report(settings: &Settings, cases: &[Case], tables: &str, missing: &[String]) -> String {
    let perftest: Vec<String> = cases
        .iter()
        .map(|c| {
            format!(
                "`{}` {} × {}",
                c.program,
                size_name(c.size as usize),
                c.iterations
            )
        })
        .collect();
    let windows: Vec<String> = [32, 1 << 20]
        .iter()
        .map(|&size| {
            let (w, l, t) = windows(settings.quick, size);
            let sizes = if size == 32 { "32 B–64 KiB" } else { "1 MiB" };
            format!("{sizes}: {w} / {l} / {t}")
        })
        .collect();
    let missing = if missing.is_empty() {
        String::new()
    } else {
        format!("- Not measured (failed): {}.\n", missing.join(", "))
    };
    format!(
        "{begin}\n\
         ## Byte streams over RDMA: `RdmaStream` (Soft-RoCE)\n\n\
         - Command: `{command}`{quick}\n\
         - Machine: {machine}; the guest: qemu TCG (emulated CPU, 2 vCPUs, 2 GiB), Soft-RoCE \
         `rxe0` on a dummy netdev (MTU 1500, RDMA path MTU 1024), booted once for everything \
         below\n\
         - Date: {date}\n\
         - Bulk: {rounds} round(s) of, per write size, perftest (server and client in the guest, `-R -F`; \
         {perftest}), then `bench-node stream-send --addr ADDR --sizes SIZE --total-mib {mib}` \
         against one `bench-node stream-sink --addr rdma://10.77.0.1:0`.\n\
         - RPC: `bench-node server --system tonic-rdma|tonic|rpc` on `rdma://10.77.0.1:0`, \
         `tcp://10.77.0.1:0` (the guest's own address, \
         which Linux routes over loopback: the guest has no other NIC) and \
         `rdma://10.77.0.1:0`, all up at once; per size, one `bench-node client --system SYSTEM \
         --addr ADDR` per system, the systems taking turns (`{args}`). Every process a default \
         multi-threaded tokio runtime; `transport-rdma` at its defaults (completion events, \
         a 1 MiB region: messages of at most 512 KiB). tonic is tuned as in the TCP part: 64 MiB message \
         limits (over TCP also `TCP_NODELAY`).\n\
         - Warm-up / latency / throughput windows per size, ms: {windows}.\n\
         {missing}\n\
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
        perftest = perftest.join(", "),
        mib = bulk_mib(settings.quick),
        rounds = rounds(settings.quick),
        args = client_args(settings.quick, 32).trim_start_matches("--sizes 32 "),
        windows = windows.join("; "),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_perftest_and_bench_node_lines() {
        let output = "@@part bulk\n\
            @@case ib_write_bw 1048576 200\n #bytes ...\n \
            1048576 200 50.00 40.00 0.000040\n\
            @@part bulk 1048576\n\
            stream size=1048576 bytes=268435456 secs=7.000 bytes_per_s=38000000\n\
            @@part rpc\n\
            latency system=tonic-rdma size=32 calls=50 p50_ns=8000000 p99_ns=9000000 p999_ns=9900000 max_ns=10000000\n\
            latency system=tonic size=32 calls=60 p50_ns=4000000 p99_ns=5000000 p999_ns=6000000 max_ns=6000000\n\
            latency system=rpc size=32 calls=60 p50_ns=500000 p99_ns=900000 p999_ns=990000 max_ns=1000000\n\
            throughput system=tonic-rdma call=echo size=32 concurrency=64 calls=1300 secs=1.000 calls_per_s=1300.0 gb_per_s=0.0000\n\
            throughput system=rpc call=echo size=32 concurrency=64 calls=6500 secs=1.000 calls_per_s=6500.0 gb_per_s=0.0000\n\
            writes system=tonic-rdma size=32 writes=400 bytes=40000\n";
        let r = parse(output, CASES).unwrap();
        assert_eq!(r.write_bw[&(1 << 20)], vec![40.0 * 1048576.0]);
        assert_eq!(r.bulk[&(1 << 20)], vec![38e6]);
        assert_eq!(r.latency[&(System::TonicTcp, 32)].p50, 4000.0);
        assert_eq!(r.throughput[&(System::Rpc, 32)], 6500.0);
        let targets = targets(&r);
        // 38e6 against 40 × 2^20 = 41.9e6.
        assert!(
            targets.contains("≥ 0.9× `ib_write_bw` | 0.91× | met"),
            "{targets}"
        );
        assert!(targets.contains("tonic over TCP: p50 at 32 B (below 1× is faster) | 2.00×"));
        assert!(targets.contains(
            "rdma-rpc `rdma://`: calls/s at 32 B × 64 in flight (above 1× is faster) | 0.20×"
        ));
        let tables = tables(&r);
        assert!(
            tables.contains("| 1 MiB | 38.00 | – | 41.94 | – | 0.91× |"),
            "{tables}"
        );
        assert!(tables.contains("| 32 B | p50 | 8000 µs | 4000 µs | 500 µs | 2.00× | 16.00× |"));
        assert!(tables.contains("| 32 B | 400 | 100 |"), "{tables}");
        assert!(missing(&r).contains(&"bulk copy 64 KiB".to_string()));
    }

    #[test]
    fn medians_of_rounds() {
        assert_eq!(median(Some(&vec![3.0, 1.0, 2.0])), Some(2.0));
        assert_eq!(median(Some(&vec![4.0, 1.0, 2.0, 3.0])), Some(2.5));
        assert_eq!(median(Some(&vec![])), None);
        assert_eq!(spread(Some(&vec![2e6, 1e6, 3e6])), "1.0–3.0");
        let script = guest_script(Path::new("/t/bench-node"), false, CASES);
        assert_eq!(script.matches("'ib_write_bw,1048576,200'").count(), 3);
        assert_eq!(script.matches("--sizes 1048576 --total-mib 256").count(), 3);
    }

    #[test]
    fn the_guest_script_interleaves_perftest_and_the_bulk_copy() {
        let script = guest_script(Path::new("/t/bench-node"), true, QUICK_CASES);
        let at = |needle: &str| script.find(needle).expect(needle);
        assert!(at("'ib_write_bw,65536,500'") < at("--sizes 65536 --total-mib 64"));
        assert!(at("--sizes 65536 --total-mib 64") < at("'ib_write_bw,1048576,50'"));
        assert!(at("'ib_write_bw,16777216,5'") < at("--sizes 16777216 --total-mib 64"));
        assert!(at("--sizes 16777216 --total-mib 64") < at("@@part rpc"));
        assert!(script.contains("--system tonic-rdma --addr \"rdma://$RDMA_TEST_IP:0\""));
        assert!(script.contains("--system tonic --addr \"tcp://$RDMA_TEST_IP:0\""));
        assert_eq!(
            script.matches(" client --system ").count(),
            3 * RPC_SIZES.len()
        );
        assert!(script.contains("--concurrency 64 "));
    }
}
