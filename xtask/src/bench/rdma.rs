//! The RDMA part of `cargo xtask bench`: rdma-rpc over `rdma://` on the
//! Soft-RoCE device, next to perftest on the same device in the same guest
//! boot.
//!
//! One `cargo xtask rxe` guest runs perftest (`ib_send_lat -e` and
//! `ib_send_lat`, the latency floors for event-driven and busy-polling
//! completions; `ib_write_bw`, the throughput floor) through
//! [`rxe::baseline::SCRIPT`] and, for each completion mode, a `bench-node
//! server` on `rdma://$RDMA_TEST_IP:0` and one `bench-node client` per
//! payload size against it, interleaved (see [`guest_script`]). Client and server are separate
//! processes, both running the host-built release binary from the host's
//! (read-only) disk. The guest's output comes back through the console:
//! marker lines (`@@case`, `@@mode`) say what the result lines that follow
//! belong to.
//!
//! The guest's CPU is emulated (qemu TCG, ~10× slower than the host), so
//! every measurement is shorter than the TCP part's, and only ratios to
//! perftest from the same boot mean anything.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;
use std::time::Duration;

use super::{
    date, field, fields, machine, micros, plot, rate_name, ratio, shell_quote, size_name,
    target_row, Latency, Panel, Series, Settings, SIZES,
};
use crate::rxe::baseline::{self, Case};
use crate::{rxe, workspace_root};

/// The RDMA part's plot, next to `benchmarks.md`.
pub(super) const SVG_NAME: &str = "benchmarks-rdma.svg";
/// Marks the RDMA part's generated section of the report.
pub(super) const MARKERS: (&str, &str) = (
    "<!-- cargo xtask bench --rdma: generated from here -->",
    "<!-- cargo xtask bench --rdma: generated up to here -->",
);

/// The busy-poll window of the busy-poll mode, in µs: longer than a small
/// round trip in the guest, so a waiting receiver polls until its reply.
const BUSY_POLL_US: u64 = 1000;
/// Throughput runs with more payload than this in flight are skipped (the
/// guest has 2 GiB; a big call is held by the client and the server both).
const MAX_INFLIGHT_BYTES: usize = 128 << 20;
/// Calls in flight for the throughput measurements.
const CONCURRENCY: [usize; 4] = [1, 4, 16, 64];
const QUICK_CONCURRENCY: [usize; 2] = [1, 16];
/// The time limit of the whole guest run.
const TIMEOUT: Duration = Duration::from_secs(1800);
const QUICK_TIMEOUT: Duration = Duration::from_secs(900);

/// How rdma-rpc's completions are handled, and the perftest that matches.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
enum Mode {
    /// The default: sleep on the completion channel (`ib_send_lat -e`).
    Events,
    /// `RdmaTransport::busy_poll(Some(BUSY_POLL_US))` on both sides (`ib_send_lat`).
    BusyPoll,
}

impl Mode {
    const ALL: [Mode; 2] = [Mode::Events, Mode::BusyPoll];

    /// The name on `@@mode` lines.
    fn name(self) -> &'static str {
        match self {
            Mode::Events => "events",
            Mode::BusyPoll => "busy-poll",
        }
    }

    fn title(self) -> String {
        match self {
            Mode::Events => "rdma-rpc, events".into(),
            Mode::BusyPoll => format!("rdma-rpc, busy-poll {} ms", BUSY_POLL_US as f64 / 1000.0),
        }
    }

    /// bench-node's flags (server and client) for this mode.
    fn flags(self) -> String {
        match self {
            Mode::Events => String::new(),
            Mode::BusyPoll => format!("--rdma-busy-poll-us {BUSY_POLL_US}"),
        }
    }

    /// perftest's options for the matching latency floor.
    fn perftest_options(self) -> &'static str {
        match self {
            Mode::Events => "-e",
            Mode::BusyPoll => "",
        }
    }

    fn perftest_title(self) -> &'static str {
        match self {
            Mode::Events => "2 × `ib_send_lat -e`",
            Mode::BusyPoll => "2 × `ib_send_lat`",
        }
    }

    fn colour(self) -> &'static str {
        match self {
            Mode::Events => "#d62728",
            Mode::BusyPoll => "#ff7f0e",
        }
    }
}

const fn lat(options: &'static str, size: u32, iterations: u32) -> Case {
    Case {
        options,
        ..baseline::case("ib_send_lat", size, iterations)
    }
}

const fn bw(size: u32, iterations: u32) -> Case {
    baseline::case("ib_write_bw", size, iterations)
}

/// perftest in a full run: each latency size in both completion modes, and
/// the bandwidth floor at every size. perftest has no 16 MiB latency run
/// in `--quick` (a round trip takes over a second in the guest).
const CASES: &[Case] = &[
    lat("", 32, 1000),
    lat("-e", 32, 1000),
    lat("", 1024, 1000),
    lat("-e", 1024, 1000),
    lat("", 64 << 10, 200),
    lat("-e", 64 << 10, 200),
    lat("", 1 << 20, 20),
    lat("-e", 1 << 20, 20),
    lat("", 16 << 20, 5),
    lat("-e", 16 << 20, 5),
    bw(32, 5000),
    bw(1024, 5000),
    bw(64 << 10, 1000),
    bw(1 << 20, 100),
    bw(16 << 20, 10),
];

const QUICK_CASES: &[Case] = &[
    lat("", 32, 500),
    lat("-e", 32, 500),
    lat("", 1024, 500),
    lat("-e", 1024, 500),
    lat("", 64 << 10, 100),
    lat("-e", 64 << 10, 100),
    lat("", 1 << 20, 10),
    lat("-e", 1 << 20, 10),
    bw(32, 2000),
    bw(1024, 2000),
    bw(64 << 10, 300),
    bw(1 << 20, 30),
    bw(16 << 20, 5),
];

/// How long each client measures at `size`: (warm-up, latency run,
/// throughput run) in ms. Large calls take up to a second in the guest, so
/// their windows are longer (a window counts whole calls).
fn windows(quick: bool, size: usize) -> (u64, u64, u64) {
    match (quick, size) {
        (true, s) if s <= 64 << 10 => (200, 1000, 1000),
        (true, s) if s <= 1 << 20 => (300, 1500, 1500),
        (true, _) => (1000, 3000, 3000),
        (false, s) if s <= 64 << 10 => (500, 3000, 2000),
        (false, s) if s <= 1 << 20 => (1000, 3000, 3000),
        (false, _) => (2000, 8000, 6000),
    }
}

/// The arguments of one client run (after `--addr ADDR`).
fn client_args(quick: bool, size: usize) -> String {
    let (warmup, latency, throughput) = windows(quick, size);
    let concurrency: &[usize] = if quick {
        &QUICK_CONCURRENCY
    } else {
        &CONCURRENCY
    };
    let concurrency: Vec<String> = concurrency.iter().map(usize::to_string).collect();
    format!(
        "--sizes {size} --concurrency {} --warmup-ms {warmup} --latency-ms {latency} \
         --latency-calls {} --throughput-ms {throughput} --max-inflight-bytes {MAX_INFLIGHT_BYTES} \
         --throughput-call sink",
        concurrency.join(","),
        if quick { 20_000 } else { 100_000 },
    )
}

/// What the part produced.
pub(super) struct RdmaPart {
    /// The tables and targets, in markdown (printed at the end of the run).
    pub(super) tables: String,
    /// The section of `benchmarks.md`, markers included.
    pub(super) generated: String,
    /// The plot.
    pub(super) svg: String,
    /// Why the run is incomplete, if it is (the report is written anyway).
    pub(super) failed: Option<String>,
}

/// Everything measured in the guest.
#[derive(Default)]
struct Results {
    /// rdma-rpc's round trips in µs, by (mode, size).
    latency: BTreeMap<(Mode, usize), Latency>,
    /// rdma-rpc's `Sink` calls per second, by (mode, size, in flight).
    throughput: BTreeMap<(Mode, usize, usize), f64>,
    /// perftest's round trip (twice its half round trips) in µs, by
    /// (options, size).
    perftest_latency: BTreeMap<(&'static str, usize), Latency>,
    /// `ib_write_bw`'s average, in bytes/s, by size.
    write_bw: BTreeMap<usize, f64>,
}

/// Runs the guest, parses what it printed, and writes up the part.
pub(super) fn run(node: &Path, settings: &Settings) -> Result<RdmaPart, String> {
    let cases = if settings.quick { QUICK_CASES } else { CASES };
    let script = guest_script(node, settings.quick, cases);
    eprintln!(
        "xtask bench: RDMA part: booting the Soft-RoCE guest (perftest: {} runs and rdma-rpc: \
         {} modes × {} sizes, interleaved; its output follows)",
        cases.len(),
        Mode::ALL.len(),
        SIZES.len()
    );
    let (output, code) = rxe::run_captured(
        vec!["sh".into(), "-c".into(), script, "sh".into()],
        workspace_root(),
        vec![("PERFTEST_SCRIPT".into(), baseline::SCRIPT.into())],
        if settings.quick {
            QUICK_TIMEOUT
        } else {
            TIMEOUT
        },
    )?;
    let results = parse(&output, cases)?;
    let missing = missing(&results, cases);
    if !missing.is_empty() {
        eprintln!(
            "xtask bench: RDMA part: no result for {} (see the guest's output above)",
            missing.join(", ")
        );
    }
    if results.latency.is_empty() && results.throughput.is_empty() {
        return Err(format!(
            "the RDMA part gave no rdma-rpc result (guest exit status {code})"
        ));
    }
    let failed = (code != 0 || !missing.is_empty()).then(|| {
        format!(
            "the RDMA part's guest run failed (exit status {code}) or missed results; \
             its report has what was measured"
        )
    });
    let tables = tables(&results, settings.quick);
    let targets = targets(&results);
    let tables = format!("{tables}\n{targets}");
    let generated = report(settings, cases, &tables);
    Ok(RdmaPart {
        tables,
        generated,
        svg: svg(&results),
        failed,
    })
}

/// The guest's script. Each mode runs right after its own latency floor,
/// and `ib_write_bw` between the two modes, so a neighbour's load that comes
/// and goes during the run falls on a mode and its floors alike:
/// `ib_send_lat -e`, rdma-rpc with events, `ib_write_bw`, `ib_send_lat`,
/// rdma-rpc busy-polling.
fn guest_script(node: &Path, quick: bool, cases: &[Case]) -> String {
    let node = shell_quote(&node.to_string_lossy());
    let mut s = String::from("set -u\nfailed=0\n");
    // Only perftest's marker, header and result lines (and its complaints)
    // reach the console: its banners would bury the progress.
    let perftest = |s: &mut String, part: &str, cases: Vec<&Case>| {
        let args: Vec<String> = cases.iter().map(|c| shell_quote(&c.arg())).collect();
        let _ = writeln!(
            s,
            "echo '@@part {part}'\n\
             sh -c \"$PERFTEST_SCRIPT\" sh {} 2>&1 \\\n  \
             | grep --line-buffered -E '^@@|#bytes|^ *[0-9]|rror|nable|ailed'",
            args.join(" ")
        );
    };
    let latency_floor = |mode: Mode| -> Vec<&Case> {
        cases
            .iter()
            .filter(|c| c.program == "ib_send_lat" && c.options == mode.perftest_options())
            .collect()
    };
    for mode in Mode::ALL {
        let flags = mode.flags();
        let name = mode.name();
        let floor = format!("ib_send_lat {}", mode.perftest_options());
        perftest(&mut s, floor.trim_end(), latency_floor(mode));
        let _ = writeln!(
            s,
            r#"echo "@@mode {name}"
{node} server --system rpc --addr "rdma://$RDMA_TEST_IP:0" {flags} > /tmp/bench-server.log 2>&1 &
server=$!
addr=
for try in $(seq 1 150); do
    addr=$(sed -n 's/^listening on //p' /tmp/bench-server.log)
    [ -n "$addr" ] && break
    kill -0 "$server" 2>/dev/null || break
    sleep 0.2
done
if [ -z "$addr" ]; then
    echo "@@failed bench-node server ({name})"; cat /tmp/bench-server.log; failed=1
else"#
        );
        for size in SIZES {
            let _ = writeln!(
                s,
                "    timeout 300 {node} client --system rpc --addr \"$addr\" {} {flags} \\\n        \
                 || {{ echo \"@@failed bench-node client ({name}, {size} B)\"; failed=1; }}",
                client_args(quick, size)
            );
        }
        let _ = writeln!(s, "    kill \"$server\"; wait \"$server\" 2>/dev/null\nfi");
        if mode == Mode::Events {
            let bandwidth = cases
                .iter()
                .filter(|c| c.program == "ib_write_bw")
                .collect();
            perftest(&mut s, "ib_write_bw", bandwidth);
        }
    }
    s.push_str("exit $failed\n");
    s
}

/// Reads the guest's output: perftest's results (through
/// [`baseline::parse`]) and bench-node's result lines under each `@@mode`.
fn parse(output: &str, cases: &'static [Case]) -> Result<Results, String> {
    let mut results = Results::default();
    for m in baseline::parse(output, cases) {
        let size = m.size as usize;
        if m.program == "ib_send_lat" {
            let twice = |name| m.get(name).map(|us| 2.0 * us);
            if let (Some(p50), Some(p99), Some(p999)) =
                (twice("t_typical_us"), twice("t_p99_us"), twice("t_p999_us"))
            {
                let latency = Latency {
                    calls: u64::from(m.iterations),
                    p50,
                    p99,
                    p999,
                };
                results.perftest_latency.insert((m.options, size), latency);
            }
        } else if m.program == "ib_write_bw" {
            // perftest's MB are 2^20 bytes.
            if let Some(mb) = m.get("bw_avg_mb_s") {
                results.write_bw.insert(size, mb * (1u64 << 20) as f64);
            }
        }
    }
    let mut mode = None;
    for line in output.lines() {
        if let Some(name) = line.strip_prefix("@@mode ") {
            mode = Mode::ALL.into_iter().find(|m| m.name() == name.trim());
            continue;
        }
        if line.starts_with("@@part ") {
            mode = None;
            continue;
        }
        let Some(mode) = mode else { continue };
        let kind = line.split(' ').next();
        if !matches!(kind, Some("latency" | "throughput")) || !line.contains("system=rpc") {
            continue;
        }
        let fields = fields(line);
        let size = field(&fields, "size")?;
        if kind == Some("latency") {
            let us = |key| field(&fields, key).map(|ns| ns as f64 / 1000.0);
            let latency = Latency {
                calls: field(&fields, "calls")? as u64,
                p50: us("p50_ns")?,
                p99: us("p99_ns")?,
                p999: us("p999_ns")?,
            };
            results.latency.insert((mode, size), latency);
        } else {
            let concurrency = field(&fields, "concurrency")?;
            let rate: f64 = fields
                .get("calls_per_s")
                .and_then(|v| v.parse().ok())
                .ok_or_else(|| format!("no calls_per_s in {line:?}"))?;
            results.throughput.insert((mode, size, concurrency), rate);
        }
    }
    Ok(results)
}

/// What should have been measured and was not.
fn missing(results: &Results, cases: &[Case]) -> Vec<String> {
    let mut missing = Vec::new();
    for case in cases {
        let size = case.size as usize;
        let found = if case.program == "ib_write_bw" {
            results.write_bw.contains_key(&size)
        } else {
            results.perftest_latency.contains_key(&(case.options, size))
        };
        if !found {
            missing.push(format!("{} {} {} B", case.program, case.options, case.size));
        }
    }
    for mode in Mode::ALL {
        for size in SIZES {
            if !results.latency.contains_key(&(mode, size)) {
                missing.push(format!("rdma-rpc {} {}", mode.name(), size_name(size)));
            }
        }
    }
    missing
}

/// MB/s (10⁶ bytes/s) of `rate` calls/s of `size` bytes.
fn megabytes(rate: f64, size: usize) -> f64 {
    rate * size as f64 / 1e6
}

/// The best `Sink` rate at `size` over the calls-in-flight counts, in bytes/s.
fn best_bytes(results: &Results, mode: Mode, size: usize) -> Option<f64> {
    results
        .throughput
        .range((mode, size, 0)..=(mode, size, usize::MAX))
        .map(|(_, &rate)| rate * size as f64)
        .reduce(f64::max)
}

fn tables(results: &Results, quick: bool) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "### RDMA: unary round-trip latency, one call at a time\n\n\
         `Echo` calls (the payload goes and comes back). perftest reports half a round trip: its \
         comparator is twice `t_typical` (the median), twice its 99 % and 99.9 % percentiles. \
         Ratios are rdma-rpc's round trip over perftest's: below 1× is faster.\n\n\
         | size | percentile | {} | {} | ratio | {} | {} | ratio |\n\
         |---:|---|---:|---:|---:|---:|---:|---:|",
        Mode::Events.title(),
        Mode::Events.perftest_title(),
        Mode::BusyPoll.title(),
        Mode::BusyPoll.perftest_title(),
    );
    type Pick = fn(&Latency) -> f64;
    let percentiles: [(&str, Pick); 3] = [
        ("p50", |l| l.p50),
        ("p99", |l| l.p99),
        ("p99.9", |l| l.p999),
    ];
    for size in SIZES {
        for (name, pick) in percentiles {
            let _ = write!(out, "| {} | {name} |", size_name(size));
            for mode in Mode::ALL {
                let ours = results.latency.get(&(mode, size)).map(pick);
                let floor = results
                    .perftest_latency
                    .get(&(mode.perftest_options(), size))
                    .map(pick);
                let show = |v: Option<f64>| v.map_or("–".into(), micros);
                let _ = write!(
                    out,
                    " {} | {} | {} |",
                    show(ours),
                    show(floor),
                    ratio(ours, floor)
                );
            }
            out.push('\n');
        }
    }
    let calls: Vec<String> = Mode::ALL
        .iter()
        .map(|&mode| {
            let at = |size| results.latency.get(&(mode, size)).map_or(0, |l| l.calls);
            format!(
                "{} {} at 32 B, {} at 16 MiB",
                mode.name(),
                at(32),
                at(16 << 20)
            )
        })
        .collect();
    let _ = writeln!(
        out,
        "\nCalls measured: {}; perftest iterations are listed above the tables. With few calls \
         the high percentiles are the slowest calls.\n",
        calls.join("; ")
    );
    let concurrency: &[usize] = if quick {
        &QUICK_CONCURRENCY
    } else {
        &CONCURRENCY
    };
    let _ = writeln!(
        out,
        "### RDMA: throughput one way, calls in flight on one connection\n\n\
         `Sink` calls: the request carries the payload, the reply is empty, so the payload \
         streams one way as in `ib_write_bw` (which keeps up to 128 writes in flight). One task \
         per call in flight, all on one channel. MB/s counts payload (10⁶ bytes/s; perftest's \
         MB/sec are 2²⁰ bytes/s, converted). Ratios are rdma-rpc's over `ib_write_bw`'s: above \
         1× is faster.\n\n\
         | size | in flight | events calls/s | events MB/s | / `ib_write_bw` | busy-poll calls/s \
         | busy-poll MB/s | / `ib_write_bw` | `ib_write_bw` MB/s |\n\
         |---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    for size in SIZES {
        let floor = results.write_bw.get(&size).map(|b| b / 1e6);
        for &c in concurrency {
            let rates: Vec<Option<f64>> = Mode::ALL
                .iter()
                .map(|&mode| results.throughput.get(&(mode, size, c)).copied())
                .collect();
            if rates.iter().all(Option::is_none) {
                continue;
            }
            let _ = write!(out, "| {} | {c} |", size_name(size));
            for rate in rates {
                let mb = rate.map(|r| megabytes(r, size));
                let _ = write!(
                    out,
                    " {} | {} | {} |",
                    rate.map_or("–".into(), rate_name),
                    mb.map_or("–".into(), |v| format!("{v:.2}")),
                    ratio(mb, floor)
                );
            }
            let _ = writeln!(
                out,
                " {} |",
                floor.map_or("–".into(), |v| format!("{v:.2}"))
            );
        }
    }
    let _ = writeln!(
        out,
        "\nRuns with more than {} MiB of payload in flight are skipped.",
        MAX_INFLIGHT_BYTES >> 20
    );
    out
}

/// Issue 5's RDMA targets, checked against this run.
fn targets(results: &Results) -> String {
    let mut out = String::from(
        "### RDMA targets\n\n\
         Each mode against its own floor: event-driven rdma-rpc against `ib_send_lat -e`, \
         busy-polling rdma-rpc against `ib_send_lat`; throughput is the best over the calls in \
         flight.\n\n\
         | target | measured | verdict |\n|---|---:|---|\n",
    );
    for size in [32, 1024] {
        for mode in Mode::ALL {
            let ours = results.latency.get(&(mode, size)).map(|l| l.p50);
            let floor = results
                .perftest_latency
                .get(&(mode.perftest_options(), size))
                .map(|l| l.p50);
            let measured = match (ours, floor) {
                (Some(a), Some(b)) if b > 0.0 => Some(a / b),
                _ => None,
            };
            target_row(
                &mut out,
                &format!(
                    "{}: p50 at {} ≤ 1.3× {}",
                    mode.title(),
                    size_name(size),
                    mode.perftest_title()
                ),
                measured,
                1.3,
                true,
            );
        }
    }
    for size in [1 << 20, 16 << 20] {
        for mode in Mode::ALL {
            let measured = match (best_bytes(results, mode, size), results.write_bw.get(&size)) {
                (Some(a), Some(&b)) if b > 0.0 => Some(a / b),
                _ => None,
            };
            target_row(
                &mut out,
                &format!(
                    "{}: {} one way ≥ 0.8× `ib_write_bw`",
                    mode.title(),
                    size_name(size)
                ),
                measured,
                0.8,
                false,
            );
        }
    }
    out
}

/// The RDMA part's generated section of the report.
fn report(settings: &Settings, cases: &[Case], tables: &str) -> String {
    let perftest: Vec<String> = cases
        .iter()
        .map(|c| {
            let options = if c.options.is_empty() {
                String::new()
            } else {
                format!(" {}", c.options)
            };
            format!(
                "`{}{options}` {} × {}",
                c.program,
                size_name(c.size as usize),
                c.iterations
            )
        })
        .collect();
    let windows: Vec<String> = [32, 1 << 20, 16 << 20]
        .iter()
        .map(|&size| {
            let (w, l, t) = windows(settings.quick, size);
            let sizes = match size {
                32 => "32 B–64 KiB",
                s if s == 1 << 20 => "1 MiB",
                _ => "16 MiB",
            };
            format!("{sizes}: {w} / {l} / {t}")
        })
        .collect();
    format!(
        "{begin}\n\
         ## RDMA results (Soft-RoCE)\n\n\
         - Command: `{command}`{quick}\n\
         - Machine: {machine}; the guest: qemu TCG (emulated CPU, 2 vCPUs, 2 GiB), Soft-RoCE \
         `rxe0` on a dummy netdev (MTU 1500, RDMA path MTU 1024), booted once for everything \
         below\n\
         - Date: {date}\n\
         - perftest (server and client in the guest, `-R -F`; {perftest}) and, for each mode, \
         `bench-node server --system rpc --addr rdma://10.77.0.1:0 [FLAGS]` and one \
         `bench-node client --system rpc --addr ADDR --sizes SIZE [FLAGS]` per size (`{args}`), \
         client and server in separate processes, each a default multi-threaded tokio runtime. \
         In this order: `ib_send_lat -e`, rdma-rpc with events, `ib_write_bw`, `ib_send_lat`, \
         rdma-rpc busy-polling. \
         Modes: events (`transport-rdma`'s default: sleep on the completion channel), busy-poll \
         (FLAGS `--rdma-busy-poll-us {BUSY_POLL_US}` on both sides: poll the completion queue \
         for {BUSY_POLL_US} µs after each completion).\n\
         - Warm-up / latency / throughput windows per size, ms: {windows}.\n\n\
         ![p50 round trip by size; best one-way throughput by size]({SVG_NAME})\n\n\
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
        args = client_args(settings.quick, 32).trim_start_matches("--sizes 32 "),
        windows = windows.join("; "),
    )
}

/// The plot: p50 round trip against size, and the best one-way throughput
/// against size, rdma-rpc's modes next to their perftest floors.
fn svg(results: &Results) -> String {
    let grey = "#555555";
    let mut latency_series = Vec::new();
    let mut legend = Vec::new();
    for mode in Mode::ALL {
        let ys = SIZES
            .iter()
            .map(|&size| results.latency.get(&(mode, size)).map(|l| l.p50))
            .collect();
        latency_series.push(Series {
            name: mode.title(),
            colour: mode.colour(),
            dashed: false,
            ys,
        });
    }
    for (mode, colour) in [(Mode::Events, "#8c564b"), (Mode::BusyPoll, grey)] {
        let ys = SIZES
            .iter()
            .map(|&size| {
                results
                    .perftest_latency
                    .get(&(mode.perftest_options(), size))
                    .map(|l| l.p50)
            })
            .collect();
        latency_series.push(Series {
            name: mode.perftest_title().replace('`', ""),
            colour,
            dashed: true,
            ys,
        });
    }
    let mut throughput_series: Vec<Series> = Mode::ALL
        .iter()
        .map(|&mode| Series {
            name: mode.title(),
            colour: mode.colour(),
            dashed: false,
            ys: SIZES
                .iter()
                .map(|&size| best_bytes(results, mode, size).map(|b| b / 1e6))
                .collect(),
        })
        .collect();
    throughput_series.push(Series {
        name: "ib_write_bw".into(),
        colour: grey,
        dashed: true,
        ys: SIZES
            .iter()
            .map(|size| results.write_bw.get(size).map(|b| b / 1e6))
            .collect(),
    });
    for series in latency_series.iter().chain(&throughput_series[2..]) {
        legend.push(Series {
            name: series.name.clone(),
            colour: series.colour,
            dashed: series.dashed,
            ys: Vec::new(),
        });
    }
    let latency = Panel {
        title: "RDMA round trip, p50 (lower is better)",
        x_label: "payload size",
        y_label: "µs",
        xs: &SIZES,
        x_name: size_name,
        series: latency_series,
    };
    let throughput = Panel {
        title: "RDMA one-way throughput (higher is better)",
        x_label: "payload size (best of calls in flight)",
        y_label: "MB/s",
        xs: &SIZES,
        x_name: size_name,
        series: throughput_series,
    };
    plot(&[latency, throughput], &legend)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_perftest_and_bench_node_lines() {
        let output = "@@part perftest\n\
            @@case ib_send_lat 32 1000 -e\n #bytes #iterations ...\n \
            32 1000 100.0 900.0 200.0 250.0 10.0 400.0 800.0\n\
            @@case ib_write_bw 1048576 100\n #bytes ...\n \
            1048576 100 50.00 40.00 0.000040\n\
            @@mode events\n\
            latency system=rpc size=32 calls=50 p50_ns=500000 p99_ns=900000 p999_ns=990000 max_ns=1000000\n\
            throughput system=rpc call=sink size=1048576 concurrency=1 calls=30 secs=1.000 calls_per_s=30.0 gb_per_s=0.03\n\
            throughput system=rpc call=sink size=1048576 concurrency=16 calls=35 secs=1.000 calls_per_s=35.0 gb_per_s=0.03\n\
            @@mode busy-poll\n\
            latency system=rpc size=32 calls=60 p50_ns=100000 p99_ns=200000 p999_ns=300000 max_ns=300000\n";
        let r = parse(output, CASES).unwrap();
        let floor = r.perftest_latency[&("-e", 32)];
        assert_eq!((floor.p50, floor.p99, floor.p999), (400.0, 800.0, 1600.0));
        assert_eq!(r.write_bw[&(1 << 20)], 40.0 * 1048576.0);
        assert_eq!(r.latency[&(Mode::Events, 32)].p50, 500.0);
        assert_eq!(r.latency[&(Mode::BusyPoll, 32)].calls, 60);
        assert_eq!(
            best_bytes(&r, Mode::Events, 1 << 20),
            Some(35.0 * 1048576.0)
        );
        let targets = targets(&r);
        // 500 µs against 2 × 200 µs.
        assert!(targets.contains("p50 at 32 B ≤ 1.3× 2 × `ib_send_lat -e` | 1.25× | met"));
        // 35 MiB/s against 40.
        assert!(targets.contains("1 MiB one way ≥ 0.8× `ib_write_bw` | 0.88× | met"));
        let tables = tables(&r, false);
        assert!(tables.contains("| 32 B | p50 | 500 µs | 400 µs | 1.25× |"));
        let svg = svg(&r);
        assert!(svg.contains("stroke-dasharray") && svg.contains("<circle"));
    }

    #[test]
    fn the_guest_script_runs_every_case_and_size() {
        let script = guest_script(Path::new("/t/bench-node"), true, QUICK_CASES);
        assert!(script.contains("'ib_send_lat,32,500,-e'"));
        // Each mode comes right after its own floor.
        let at = |needle: &str| script.find(needle).expect(needle);
        assert!(at("'ib_send_lat,32,500,-e'") < at("@@mode events"));
        assert!(at("@@mode events") < at("'ib_write_bw,32,2000'"));
        assert!(at("'ib_write_bw,32,2000'") < at("'ib_send_lat,32,500'"));
        assert!(at("'ib_send_lat,32,500'") < at("@@mode busy-poll"));
        assert!(script.contains("--rdma-busy-poll-us 1000"));
        assert_eq!(
            script.matches(" client --system rpc").count(),
            2 * SIZES.len()
        );
        assert!(script.contains("--throughput-call sink"));
    }
}
