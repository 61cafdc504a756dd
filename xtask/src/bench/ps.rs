//! The parameter-server part of `cargo xtask bench` (`--ps`, issue 10's
//! benchmark): the real `ps-server` / `ps-worker` programs (crate
//! `examples`, release build) pushing gradients and pulling tensors of
//! 64 KiB to 64 MiB, with 1 and 4 workers, each worker with its own
//! channel to each of 2 shards.
//!
//! - **TCP** (loopback, on the host): against `ps-raw` (crate `benches`), a
//!   raw TCP program doing the same work (the same bytes between per-key
//!   buffers, pushes summed) with the same connections and the same order of
//!   requests (see its docs for how it is tuned), the
//!   two taking turns run by run.
//! - **RDMA** (one Soft-RoCE guest boot, [`guest_script`]): per size,
//!   `ib_write_bw` and `ib_read_bw` at that message size through
//!   [`rxe::baseline::SCRIPT`], then `ps-worker` against two `ps-server`s on
//!   `rdma://`, per worker count and per RDMA [`System`] (rendezvous on and off).
//!
//! Every run starts fresh servers (the shards keep their tensors), runs
//! one warm-up round and then [`rounds`] measured ones; `ps-worker --lines`
//! and `ps-raw` print each measured round's GB/s and the tables give the
//! medians. Push is compared with `ib_write_bw` (the payload goes to the
//! server), pull with `ib_read_bw` (the client fetches it).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use super::{
    date, fields, machine, median, plot, ratio, shell_quote, size_name, target_row, Panel, Series,
    ServerProcess, Settings,
};
use crate::rxe::baseline::{self, Case};
use crate::{rxe, workspace_root};

/// The part's plot, next to `benchmarks.md`.
pub(super) const SVG_NAME: &str = "benchmarks-ps.svg";
/// Marks the part's generated section of the report.
pub(super) const MARKERS: (&str, &str) = (
    "<!-- cargo xtask bench --ps: generated from here -->",
    "<!-- cargo xtask bench --ps: generated up to here -->",
);

/// Tensor sizes, in bytes.
const SIZES: [usize; 4] = [64 << 10, 1 << 20, 16 << 20, 64 << 20];
/// Workers (one process, each worker its own channel per shard).
const WORKERS: [usize; 2] = [1, 4];
/// Shards: one `ps-server` process each.
const SHARDS: usize = 2;
/// The time limit of the whole guest run.
const TIMEOUT: Duration = Duration::from_secs(2400);
const QUICK_TIMEOUT: Duration = Duration::from_secs(900);

/// Measured rounds per run (after one warm-up round), and perftest runs
/// per case in the guest: more on the host, where a round is short.
fn rounds(quick: bool, guest: bool) -> u64 {
    match (quick, guest) {
        (true, _) => 1,
        (false, false) => 5,
        (false, true) => 3,
    }
}

/// Bytes each worker pushes (and pulls) per round, at least: small
/// tensors come as many keys, so a round is not over before it is timed.
/// Large tensors are one key per shard.
fn bytes_per_worker(quick: bool, guest: bool) -> usize {
    match (quick, guest) {
        (false, false) => 64 << 20,
        (true, false) => 16 << 20,
        (false, true) => 8 << 20,
        (true, true) => 4 << 20,
    }
}

/// Keys (tensors) per run: enough for [`bytes_per_worker`], at least one
/// per shard, a whole number per shard.
fn keys(size: usize, per_worker: usize) -> u64 {
    let keys = (per_worker / size).max(SHARDS);
    keys.div_ceil(SHARDS) as u64 * SHARDS as u64
}

/// How a run's rdma-rpc is set up.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
enum System {
    /// `ps-server` / `ps-worker` over `tcp://127.0.0.1:0`.
    RpcTcp,
    /// `ps-raw` over TCP loopback.
    Raw,
    /// `ps-server` / `ps-worker` over `rdma://` with the rendezvous on at
    /// its measured threshold (`RDMA_RPC_RENDEZVOUS=131072`: frames of
    /// 128 KiB and more read by the receiver with RDMA READ into its pool;
    /// the transport's default is off).
    RpcRdma,
    /// The same with `RDMA_RPC_RENDEZVOUS=off`: every frame through the
    /// staging region.
    RpcRdmaNoRendezvous,
}

/// The RDMA systems of a run: the rendezvous off too, except in `--quick`.
fn rdma_systems(quick: bool) -> &'static [System] {
    if quick {
        &[System::RpcRdma]
    } else {
        &[System::RpcRdma, System::RpcRdmaNoRendezvous]
    }
}

impl System {
    fn name(self) -> &'static str {
        match self {
            System::RpcTcp => "rpc-tcp",
            System::Raw => "raw",
            System::RpcRdma => "rpc-rdma",
            System::RpcRdmaNoRendezvous => "rpc-rdma-no-rendezvous",
        }
    }

    fn title(self) -> &'static str {
        match self {
            System::RpcTcp => "rdma-rpc `tcp://`",
            System::Raw => "raw TCP (`ps-raw`)",
            System::RpcRdma => "rdma-rpc `rdma://`",
            System::RpcRdmaNoRendezvous => "rdma-rpc `rdma://`, rendezvous off",
        }
    }

    /// What goes before the programs on the guest's command line.
    fn env(self) -> &'static str {
        match self {
            System::RpcRdma => "env RDMA_RPC_RENDEZVOUS=131072 ",
            System::RpcRdmaNoRendezvous => "env RDMA_RPC_RENDEZVOUS=off ",
            _ => "",
        }
    }
}

/// Push or pull.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
enum Phase {
    Push,
    Pull,
}

impl Phase {
    const ALL: [Phase; 2] = [Phase::Push, Phase::Pull];

    fn name(self) -> &'static str {
        match self {
            Phase::Push => "push",
            Phase::Pull => "pull",
        }
    }

    /// The perftest program moving a payload the same way.
    fn perftest(self) -> &'static str {
        match self {
            Phase::Push => "ib_write_bw",
            Phase::Pull => "ib_read_bw",
        }
    }
}

/// perftest's iterations at `size`: about 64 MiB a run (32 MiB quick), at
/// least 5 (perftest's bandwidth tests refuse fewer).
const fn iterations(quick: bool, size: u32) -> u32 {
    let total: u32 = if quick { 32 << 20 } else { 64 << 20 };
    if total / size > 5 {
        total / size
    } else {
        5
    }
}

/// perftest's options for the floor of `workers` workers at `size`: as
/// many queue pairs as they have connections (one per worker and shard),
/// each moving `size` messages, but no more than 128 MiB of messages in
/// all: perftest registers two buffers per queue pair, and `-q 8` at
/// 64 MiB (1 GiB a side) does not fit in the guest's 2 GiB.
fn qp_options(workers: usize, size: usize) -> &'static str {
    match (workers * SHARDS).min((128 << 20) / size).max(1) {
        1 => "",
        2 => "-q 2",
        4 => "-q 4",
        8 => "-q 8",
        n => panic!("no perftest options for {n} queue pairs"),
    }
}

/// Every perftest run of the part: both programs at every size, with the
/// queue pairs of each worker count.
fn cases(quick: bool) -> &'static [Case] {
    static FULL: std::sync::OnceLock<Vec<Case>> = std::sync::OnceLock::new();
    static QUICK: std::sync::OnceLock<Vec<Case>> = std::sync::OnceLock::new();
    let cases = if quick { &QUICK } else { &FULL };
    cases.get_or_init(|| {
        let mut all = Vec::new();
        for size in SIZES {
            for workers in WORKERS {
                let options = qp_options(workers, size);
                if all
                    .iter()
                    .any(|c: &Case| c.size as usize == size && c.options == options)
                {
                    continue;
                }
                for phase in Phase::ALL {
                    all.push(Case {
                        options,
                        ..baseline::case(
                            phase.perftest(),
                            size as u32,
                            iterations(quick, size as u32),
                        )
                    });
                }
            }
        }
        all
    })
}

/// What the part produced.
pub(super) struct PsPart {
    /// The tables and targets, in markdown.
    pub(super) tables: String,
    /// The section of `benchmarks.md`, markers included.
    pub(super) generated: String,
    /// The plot.
    pub(super) svg: String,
    /// Why the run is incomplete, if it is (the report is written anyway).
    pub(super) failed: Option<String>,
}

/// Everything measured.
#[derive(Default)]
struct Results {
    /// GB/s of each measured round, by (system, workers, size, phase).
    rates: BTreeMap<(System, usize, usize, Phase), Vec<f64>>,
    /// perftest's average, in GB/s, one per round, by (program, options, size).
    perftest: BTreeMap<(&'static str, &'static str, usize), Vec<f64>>,
    /// Keys of each run, by size and whether in the guest.
    keys: BTreeMap<(bool, usize), u64>,
}

impl Results {
    fn rate(&self, system: System, workers: usize, size: usize, phase: Phase) -> Option<f64> {
        median(self.rates.get(&(system, workers, size, phase)))
    }

    /// perftest's median at `size` with the queue pairs of `workers`.
    fn floor(&self, phase: Phase, workers: usize, size: usize) -> Option<f64> {
        median(
            self.perftest
                .get(&(phase.perftest(), qp_options(workers, size), size)),
        )
    }

    /// Reads one `ps phase=... ` line of `ps-worker --lines` or `ps-raw`.
    fn record(&mut self, system: System, line: &str) -> Result<(), String> {
        let fields = fields(line);
        let number = |key: &str| -> Result<f64, String> {
            fields
                .get(key)
                .and_then(|v| v.parse().ok())
                .ok_or_else(|| format!("no {key} in {line:?}"))
        };
        let phase = match fields.get("phase") {
            Some(&"push") => Phase::Push,
            Some(&"pull") => Phase::Pull,
            _ => return Err(format!("no phase in {line:?}")),
        };
        let key = (
            system,
            number("workers")? as usize,
            number("size")? as usize,
            phase,
        );
        self.rates.entry(key).or_default().push(number("gb_per_s")?);
        Ok(())
    }
}

/// Runs the TCP half on the host, then the RDMA half in one guest, and
/// writes up the part.
pub(super) fn run(bin: &Path, raw: &Path, settings: &Settings) -> Result<PsPart, String> {
    let quick = settings.quick;
    // What the binaries were built from, read before anything else changes it.
    let source = source();
    let mut results = Results::default();
    let mut failures = Vec::new();
    for size in SIZES {
        results
            .keys
            .insert((false, size), keys(size, bytes_per_worker(quick, false)));
        results
            .keys
            .insert((true, size), keys(size, bytes_per_worker(quick, true)));
    }
    eprintln!(
        "xtask bench: parameter-server part over TCP: {} sizes × {} worker counts, ps-raw and \
         rdma-rpc taking turns",
        SIZES.len(),
        WORKERS.len()
    );
    for size in SIZES {
        for workers in WORKERS {
            for system in [System::Raw, System::RpcTcp] {
                let run = TcpRun {
                    bin,
                    raw,
                    system,
                    workers,
                    size,
                    quick,
                };
                if let Err(e) = run.measure(&mut results) {
                    eprintln!("xtask bench: {e}");
                    failures.push(e);
                }
            }
        }
    }
    let cases = cases(quick);
    eprintln!(
        "xtask bench: parameter-server part over RDMA: booting the Soft-RoCE guest (per size: \
         ib_write_bw and ib_read_bw × {}, then ps-worker with {:?} workers; its output follows)",
        rounds(quick, true),
        WORKERS
    );
    let (output, code) = rxe::run_captured(
        vec![
            "sh".into(),
            "-c".into(),
            guest_script(bin, quick, cases),
            "sh".into(),
        ],
        workspace_root(),
        vec![("PERFTEST_SCRIPT".into(), baseline::SCRIPT.into())],
        if quick { QUICK_TIMEOUT } else { TIMEOUT },
    )?;
    parse_guest(&output, cases, &mut results)?;
    let missing = missing(&results, quick);
    if !missing.is_empty() {
        eprintln!(
            "xtask bench: parameter-server part: no result for {}",
            missing.join(", ")
        );
    }
    let failed = (code != 0 || !failures.is_empty() || !missing.is_empty()).then(|| {
        format!(
            "the parameter-server part is incomplete (guest exit status {code}, {} host run(s) \
             failed, {} result(s) missing); its report has what was measured",
            failures.len(),
            missing.len()
        )
    });
    let tables = format!("{}\n{}", tables(&results, quick), targets(&results));
    let generated = report(settings, cases, &tables, &missing, &source);
    Ok(PsPart {
        tables,
        generated,
        svg: svg(&results),
        failed,
    })
}

/// One run on the host: fresh shards, one worker process.
struct TcpRun<'a> {
    /// Where `ps-server` and `ps-worker` are.
    bin: &'a Path,
    raw: &'a Path,
    system: System,
    workers: usize,
    size: usize,
    quick: bool,
}

impl TcpRun<'_> {
    fn measure(&self, results: &mut Results) -> Result<(), String> {
        let keys = keys(self.size, bytes_per_worker(self.quick, false));
        let mut shards = Vec::new();
        let mut addresses = Vec::new();
        for shard in 0..SHARDS {
            let mut command = match self.system {
                System::Raw => {
                    let mut c = Command::new(self.raw);
                    c.args(["server", "--addr", "127.0.0.1:0"]);
                    c
                }
                _ => {
                    let mut c = Command::new(self.bin.join("ps-server"));
                    c.args(["--addr", "tcp://127.0.0.1:0"])
                        .args(["--shard", &shard.to_string()])
                        .args(["--shards", &SHARDS.to_string()]);
                    c
                }
            };
            let (process, address) = spawn_listening(&mut command)?;
            shards.push(process);
            addresses.push(address);
        }
        let program = match self.system {
            System::Raw => self.raw.to_path_buf(),
            _ => self.bin.join("ps-worker"),
        };
        let mut command = Command::new(&program);
        if self.system == System::Raw {
            command.arg("worker");
        }
        command
            .args(["--addr", &addresses.join(",")])
            .args(worker_args(
                self.workers,
                keys,
                self.size,
                self.quick,
                false,
            ));
        if self.system != System::Raw {
            command.args(["--timeout-s", "120", "--lines"]);
        }
        let output = command
            .stderr(Stdio::inherit())
            .output()
            .map_err(|e| format!("could not start {}: {e}", program.display()))?;
        drop(shards);
        let stdout = String::from_utf8_lossy(&output.stdout);
        for line in stdout.lines().filter(|l| l.starts_with("ps ")) {
            results.record(self.system, line)?;
        }
        let shown = |phase| {
            results
                .rate(self.system, self.workers, self.size, phase)
                .map_or("–".into(), |r| format!("{r:.3}"))
        };
        eprintln!(
            "xtask bench: {:<20} {:>6}, {} worker(s), {keys} keys: push {} GB/s, pull {} GB/s",
            self.system.title(),
            size_name(self.size),
            self.workers,
            shown(Phase::Push),
            shown(Phase::Pull)
        );
        if !output.status.success() {
            return Err(format!(
                "{} with {} worker(s) at {} failed with {}",
                self.system.title(),
                self.workers,
                size_name(self.size),
                output.status
            ));
        }
        Ok(())
    }
}

/// The worker arguments after `--addr`, common to `ps-worker` and `ps-raw worker`.
fn worker_args(workers: usize, keys: u64, size: usize, quick: bool, guest: bool) -> Vec<String> {
    [
        ("--workers", workers as u64),
        ("--keys", keys),
        ("--size", size as u64),
        ("--rounds", rounds(quick, guest)),
        ("--warmup-rounds", 1),
    ]
    .into_iter()
    .flat_map(|(flag, value)| [flag.to_string(), value.to_string()])
    .collect()
}

/// Starts `command`, which prints `listening on ADDR` first; returns it and ADDR.
fn spawn_listening(command: &mut Command) -> Result<(ServerProcess, String), String> {
    let mut process = ServerProcess(
        command
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| format!("could not start {command:?}: {e}"))?,
    );
    let mut line = String::new();
    BufReader::new(process.0.stdout.take().expect("piped stdout"))
        .read_line(&mut line)
        .map_err(|e| format!("reading {command:?}'s output: {e}"))?;
    match line.trim().strip_prefix("listening on ") {
        Some(address) => Ok((process, address.to_string())),
        None => Err(format!("{command:?} did not start (said {line:?})")),
    }
}

/// The guest's script: per size, perftest ([`rounds`] × `ib_write_bw` and
/// `ib_read_bw`), then per worker count two fresh `ps-server`s on
/// `rdma://` and one `ps-worker`; `@@run SYSTEM` says whose lines follow.
fn guest_script(bin: &Path, quick: bool, cases: &[Case]) -> String {
    let server = shell_quote(&bin.join("ps-server").to_string_lossy());
    let worker = shell_quote(&bin.join("ps-worker").to_string_lossy());
    // `start VAR LOG ARGS...`: runs ARGS in the background, sets $VAR_pid
    // and $VAR_addr (empty if it never said where it listens).
    let mut s = String::from(
        r#"set -u
failed=0
start() {
    var=$1 log=$2; shift 2
    "$@" > "$log" 2>&1 &
    pid=$!
    addr=
    for try in $(seq 1 150); do
        addr=$(sed -n 's/^listening on //p' "$log")
        [ -n "$addr" ] && break
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.2
    done
    [ -n "$addr" ] || { echo "@@failed $*"; cat "$log"; failed=1; }
    eval "${var}_pid=$pid ${var}_addr=$addr"
}
"#,
    );
    for size in SIZES {
        let perftest: Vec<String> = (0..rounds(quick, true))
            .flat_map(|_| cases.iter().filter(|c| c.size as usize == size))
            .map(|c| shell_quote(&c.arg()))
            .collect();
        let _ = writeln!(
            s,
            "echo '@@part perftest {size}'\n\
             sh -c \"$PERFTEST_SCRIPT\" sh {} 2>&1 \\\n  \
             | grep --line-buffered -E '^@@|#bytes|^ *[0-9]|rror|nable|ailed'",
            perftest.join(" ")
        );
        let keys = keys(size, bytes_per_worker(quick, true));
        for (workers, &system) in WORKERS
            .into_iter()
            .flat_map(|w| rdma_systems(quick).iter().map(move |s| (w, s)))
        {
            let args = worker_args(workers, keys, size, quick, true).join(" ");
            let _ = writeln!(
                s,
                "echo '@@run {name} {workers} {size}'\n\
                 start s0 /tmp/ps-0.log {env}{server} --addr \"rdma://$RDMA_TEST_IP:0\" --shard 0 --shards {SHARDS}\n\
                 start s1 /tmp/ps-1.log {env}{server} --addr \"rdma://$RDMA_TEST_IP:0\" --shard 1 --shards {SHARDS}\n\
                 timeout 900 {env}{worker} --addr \"$s0_addr,$s1_addr\" {args} --timeout-s 600 --lines \\\n  \
                 || {{ echo '@@failed ps-worker {name} {workers} {size}'; failed=1; }}\n\
                 kill \"$s0_pid\" \"$s1_pid\" 2>/dev/null; wait \"$s0_pid\" \"$s1_pid\" 2>/dev/null",
                name = system.name(),
                env = system.env(),
            );
        }
    }
    s.push_str("exit $failed\n");
    s
}

/// Reads the guest's output: perftest through [`baseline::parse`], and
/// `ps` lines under each `@@run`.
fn parse_guest(output: &str, cases: &'static [Case], results: &mut Results) -> Result<(), String> {
    for m in baseline::parse(output, cases) {
        // perftest's MB are 2^20 bytes.
        if let Some(mb) = m.get("bw_avg_mb_s") {
            results
                .perftest
                .entry((m.program, m.options, m.size as usize))
                .or_default()
                .push(mb * (1u64 << 20) as f64 / 1e9);
        }
    }
    let mut system = None;
    for line in output.lines() {
        if let Some(run) = line.strip_prefix("@@run ") {
            let name = run.split(' ').next().unwrap_or("");
            system = [System::RpcRdma, System::RpcRdmaNoRendezvous]
                .into_iter()
                .find(|s| s.name() == name);
        } else if line.starts_with("@@part ") {
            system = None;
        } else if let (Some(system), true) = (system, line.starts_with("ps phase=")) {
            results.record(system, line)?;
        }
    }
    Ok(())
}

/// What should have been measured and was not.
fn missing(results: &Results, quick: bool) -> Vec<String> {
    let mut missing = Vec::new();
    for size in SIZES {
        for phase in Phase::ALL {
            for workers in WORKERS {
                if results.floor(phase, workers, size).is_none() {
                    let options = qp_options(workers, size);
                    missing.push(format!(
                        "{} {options} {}",
                        phase.perftest(),
                        size_name(size)
                    ));
                }
            }
            for &system in [System::RpcTcp, System::Raw]
                .iter()
                .chain(rdma_systems(quick))
            {
                for workers in WORKERS {
                    if results.rate(system, workers, size, phase).is_none() {
                        missing.push(format!(
                            "{} {} {workers} worker(s) {}",
                            system.name(),
                            phase.name(),
                            size_name(size)
                        ));
                    }
                }
            }
        }
    }
    missing
}

fn gb(v: Option<f64>) -> String {
    v.map_or("–".into(), |v| format!("{v:.3}"))
}

fn mb(v: Option<f64>) -> String {
    v.map_or("–".into(), |v| format!("{:.1}", v * 1e3))
}

fn over(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => Some(a / b),
        _ => None,
    }
}

fn tables(results: &Results, quick: bool) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "### Parameter server over TCP (loopback): rdma-rpc against the raw floor\n\n\
         GB/s of payload (10⁹ bytes/s, every worker's tensors over the phase's wall time), the \
         median of {} measured rounds; ratios are rdma-rpc's over `ps-raw`'s (above 1× is \
         faster).\n\n\
         | size | workers | keys | push rdma-rpc | push raw | ratio | pull rdma-rpc | pull raw | ratio |\n\
         |---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        rounds(quick, false)
    );
    for size in SIZES {
        for workers in WORKERS {
            let get = |system, phase| results.rate(system, workers, size, phase);
            let _ = writeln!(
                out,
                "| {} | {workers} | {} | {} | {} | {} | {} | {} | {} |",
                size_name(size),
                results.keys.get(&(false, size)).copied().unwrap_or(0),
                gb(get(System::RpcTcp, Phase::Push)),
                gb(get(System::Raw, Phase::Push)),
                ratio(
                    get(System::RpcTcp, Phase::Push),
                    get(System::Raw, Phase::Push)
                ),
                gb(get(System::RpcTcp, Phase::Pull)),
                gb(get(System::Raw, Phase::Pull)),
                ratio(
                    get(System::RpcTcp, Phase::Pull),
                    get(System::Raw, Phase::Pull)
                ),
            );
        }
    }
    for phase in Phase::ALL {
        let _ = write!(
            out,
            "\n### Parameter server over RDMA (Soft-RoCE): {} against `{}`\n\n\
             MB/s of payload (10⁶ bytes/s; perftest's 2²⁰-byte MB converted), medians of {} \
             rounds each. `{}` moves messages of the tensor's size over as many queue pairs as \
             the workers have connections (`-q 2` for 1 worker, `-q 8` for 4: one per worker \
             and shard; at most 128 MiB of messages in all, so `-q 2` at 64 MiB). Ratios above 1× are faster.\n\n\
             | size | workers | keys | rdma-rpc | / `{}` |",
            phase.name(),
            phase.perftest(),
            rounds(quick, true),
            phase.perftest(),
            phase.perftest(),
        );
        let others = &rdma_systems(quick)[1..];
        for _ in others {
            let _ = write!(out, " rendezvous off | / `{}` |", phase.perftest());
        }
        let _ = writeln!(
            out,
            " `{}` |\n|---:|---:|---:|---:|---:|{}---:|",
            phase.perftest(),
            "---:|---:|".repeat(others.len())
        );
        for size in SIZES {
            for workers in WORKERS {
                let floor = results.floor(phase, workers, size);
                let _ = write!(
                    out,
                    "| {} | {workers} | {} |",
                    size_name(size),
                    results.keys.get(&(true, size)).copied().unwrap_or(0),
                );
                for &system in rdma_systems(quick) {
                    let rate = results.rate(system, workers, size, phase);
                    let _ = write!(out, " {} | {} |", mb(rate), ratio(rate, floor));
                }
                let _ = writeln!(out, " {} |", mb(floor));
            }
        }
    }
    out
}

/// The issue's targets for this workload, checked against this run.
fn targets(results: &Results) -> String {
    let mut out = String::from(
        "### Parameter-server targets\n\n\
         RDMA: issue 10's 1 MiB+ push and pull ≥ 0.9× `ib_write_bw` / `ib_read_bw` at the same \
         size. TCP: the issue's ≤ 1.2× the raw floor's time, as throughput: ≥ 0.83× the raw \
         floor's GB/s, 64 KiB and up.\n\n\
         | target | measured | verdict |\n|---|---:|---|\n",
    );
    for size in SIZES.into_iter().filter(|&s| s >= 1 << 20) {
        for workers in WORKERS {
            for phase in Phase::ALL {
                target_row(
                    &mut out,
                    &format!(
                        "RDMA {} {}, {workers} worker(s) ≥ 0.9× `{}`",
                        phase.name(),
                        size_name(size),
                        phase.perftest()
                    ),
                    over(
                        results.rate(System::RpcRdma, workers, size, phase),
                        results.floor(phase, workers, size),
                    ),
                    0.9,
                    false,
                );
            }
        }
    }
    for size in SIZES {
        for workers in WORKERS {
            for phase in Phase::ALL {
                target_row(
                    &mut out,
                    &format!(
                        "TCP {} {}, {workers} worker(s) ≥ 0.83× raw",
                        phase.name(),
                        size_name(size)
                    ),
                    over(
                        results.rate(System::RpcTcp, workers, size, phase),
                        results.rate(System::Raw, workers, size, phase),
                    ),
                    0.83,
                    false,
                );
            }
        }
    }
    out
}

/// The part's generated section of the report.
fn report(
    settings: &Settings,
    cases: &[Case],
    tables: &str,
    missing: &[String],
    source: &str,
) -> String {
    let quick = settings.quick;
    let perftest: Vec<String> = cases
        .iter()
        .map(|c| {
            format!(
                "`{} {}` {} × {}",
                c.program,
                c.options,
                size_name(c.size as usize),
                c.iterations
            )
        })
        .collect();
    let missing = if missing.is_empty() {
        String::new()
    } else {
        format!("- Not measured (failed): {}.\n", missing.join(", "))
    };
    format!(
        "{begin}\n\
         ## Parameter-server results\n\n\
         - Command: `{command}`{quick_note}\n\
         - Machine: {machine}; the RDMA half in the guest: qemu TCG (emulated CPU, 2 vCPUs, \
         2 GiB), Soft-RoCE `rxe0` on a dummy netdev (MTU 1500, RDMA path MTU 1024), booted once \
         for all of it\n\
         - Date: {date}\n\
         - Per size and worker count: two fresh shards (`ps-server --addr URL --shard I --shards \
         2`), then `ps-worker --addr SHARD0,SHARD1 --workers W --keys K --size SIZE --rounds \
         R --warmup-rounds 1 --lines` (R = {host_rounds} on the host, {rounds} in the guest): \
         each worker its own channel per shard, a shard's keys one after the other, the shards at once; every round all workers push \
         every key (the shard sums them), a barrier, then all pull every key, which the worker \
         checks against the expected sums (outside the timed phases). K gives each worker at \
         least {host_mib} MiB per phase on the host ({guest_mib} MiB in the guest), at least \
         one key per shard. Release builds; every process a default multi-threaded tokio \
         runtime; `transport-rdma` and `transport-tcp` at their defaults.\n\
         - TCP floor: `ps-raw server` ×2 and `ps-raw worker` with the same arguments (same \
         connections, keys, order and barriers; every key a buffer of its own on both sides, \
         as a parameter server's tensors; push: a 9-byte header and the tensor in one \
         `write_all`, read into the server's buffer for the key, summed into the key's tensor \
         with `ps-server`'s loop, a 1-byte acknowledgement; pull: a 9-byte request, the length \
         and the key's tensor in one `write_all`, read into the worker's buffer for the key; \
         `TCP_NODELAY`; `read_exact` straight into the destination; no encoding), the two \
         systems taking turns run by run.\n\
         - RDMA: per size, perftest first (server and client in the guest, `-R -F`; \
         {perftest}; {rounds} round(s) each), then rdma-rpc on `rdma://10.77.0.1:0` per \
         worker count: {modes}.\n\
         - Built from {source}.\n\
         {missing}\n\
         ![push and pull GB/s by tensor size, TCP and RDMA]({SVG_NAME})\n\n\
         {tables}\n{end}\n",
        begin = MARKERS.0,
        end = MARKERS.1,
        command = settings.command,
        quick_note = if quick {
            " (short measurements: indicative only)"
        } else {
            ""
        },
        machine = machine(),
        date = date(),
        rounds = rounds(quick, true),
        host_rounds = rounds(quick, false),
        host_mib = bytes_per_worker(quick, false) >> 20,
        guest_mib = bytes_per_worker(quick, true) >> 20,
        perftest = perftest.join(", "),
        modes = if quick {
            "`RDMA_RPC_RENDEZVOUS=131072` (large frames by rendezvous)"
        } else {
            "`RDMA_RPC_RENDEZVOUS=131072` on both sides (frames of 128 KiB and more read by the \
             receiver with RDMA READ into its pool; the transport's default is off), then \
             `RDMA_RPC_RENDEZVOUS=off` (every frame through the staging region)"
        },
    )
}

/// The commit the binaries were built from, and the crates on the data
/// path that differed from it.
fn source() -> String {
    let git = |args: &[&str]| {
        Command::new("git")
            .args(args)
            .current_dir(workspace_root())
            .output()
            .ok()
            // Not trimmed at the start: `status --porcelain` lines begin
            // with a two-column status that may be a space.
            .map(|o| String::from_utf8_lossy(&o.stdout).trim_end().to_string())
            .unwrap_or_default()
    };
    let head = git(&["rev-parse", "--short", "HEAD"]);
    let changed = git(&[
        "status",
        "--porcelain",
        "--",
        "rpc-core",
        "transport-tcp",
        "transport-rdma",
        "examples",
        "benches",
    ]);
    let crates: std::collections::BTreeSet<&str> = changed
        .lines()
        .filter_map(|l| l.get(3..)?.split('/').next())
        .collect();
    if crates.is_empty() {
        format!("commit `{head}`")
    } else {
        let crates: Vec<&str> = crates.into_iter().collect();
        format!(
            "commit `{head}` with uncommitted changes in {}",
            crates.join(", ")
        )
    }
}

/// The plot: one panel per transport and phase, GB/s against tensor size,
/// rdma-rpc solid, its comparator dashed.
fn svg(results: &Results) -> String {
    let sizes: &[usize] = &SIZES;
    let colours = [
        ("#d62728", "#555555"), // 1 worker: rdma-rpc, comparator
        ("#ff7f0e", "#1f77b4"), // 4 workers
    ];
    let series = |system: System, workers: usize, phase: Phase, colour| Series {
        name: format!(
            "{}, {workers} worker{}",
            if system == System::Raw {
                "raw TCP"
            } else {
                "rdma-rpc"
            },
            if workers == 1 { "" } else { "s" }
        ),
        colour,
        dashed: system == System::Raw,
        ys: sizes
            .iter()
            .map(|&size| results.rate(system, workers, size, phase))
            .collect(),
    };
    let tcp = |phase: Phase| -> Vec<Series> {
        let mut all = Vec::new();
        for (&workers, &(ours, theirs)) in WORKERS.iter().zip(&colours) {
            all.push(series(System::RpcTcp, workers, phase, ours));
            all.push(series(System::Raw, workers, phase, theirs));
        }
        all
    };
    let rdma = |phase: Phase| -> Vec<Series> {
        let mut all: Vec<Series> = WORKERS
            .iter()
            .zip(&colours)
            .map(|(&workers, &(ours, _))| series(System::RpcRdma, workers, phase, ours))
            .collect();
        for (&workers, &(_, theirs)) in WORKERS.iter().zip(&colours) {
            all.push(Series {
                name: format!("{}, {workers} worker(s)", phase.perftest()),
                colour: theirs,
                dashed: true,
                ys: sizes
                    .iter()
                    .map(|&size| results.floor(phase, workers, size))
                    .collect(),
            });
        }
        all
    };
    // Each worker count's comparators share a colour, dashed: raw TCP in
    // the TCP panels, perftest with as many queue pairs in the RDMA ones.
    let legend: Vec<Series> = WORKERS
        .iter()
        .zip(&colours)
        .flat_map(|(&workers, &(ours, theirs))| {
            let plural = if workers == 1 { "" } else { "s" };
            [
                Series {
                    name: format!("rdma-rpc, {workers} worker{plural}"),
                    colour: ours,
                    dashed: false,
                    ys: Vec::new(),
                },
                Series {
                    name: format!(
                        "floor, {workers} worker{plural} (raw, {})",
                        qp_options(workers, 1 << 20)
                    ),
                    colour: theirs,
                    dashed: true,
                    ys: Vec::new(),
                },
            ]
        })
        .collect();
    let panel = |title, series| Panel {
        title,
        x_label: "tensor size",
        y_label: "GB/s",
        xs: sizes,
        x_name: size_name,
        series,
    };
    plot(
        &[
            panel("TCP push (higher is better)", tcp(Phase::Push)),
            panel("TCP pull", tcp(Phase::Pull)),
            panel("RDMA push (Soft-RoCE)", rdma(Phase::Push)),
            panel("RDMA pull (Soft-RoCE)", rdma(Phase::Pull)),
        ],
        &legend,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_cover_the_bytes_and_every_shard() {
        assert_eq!(keys(64 << 10, 8 << 20), 128);
        assert_eq!(keys(1 << 20, 8 << 20), 8);
        assert_eq!(keys(16 << 20, 8 << 20), 2);
        assert_eq!(keys(64 << 20, 64 << 20), 2);
        assert_eq!(keys(3 << 20, 8 << 20), 2);
        assert_eq!(iterations(false, 64 << 20), 5);
        assert_eq!(cases(false)[0].iterations, iterations(false, 64 << 10));
        assert_eq!(cases(true)[7].program, "ib_read_bw");
        assert_eq!(qp_options(4, 16 << 20), "-q 8");
        assert_eq!(qp_options(4, 64 << 20), "-q 2");
        // 64 MiB: both worker counts share one floor, measured once.
        assert_eq!(cases(false).len(), 3 * 4 + 2);
    }

    #[test]
    fn reads_the_guest_and_checks_targets() {
        let output = "@@part perftest 1048576\n\
            @@case ib_write_bw 1048576 64 -q 8\n #bytes ...\n \
            1048576 64 50.00 40.00 0.000040\n\
            @@case ib_read_bw 1048576 64 -q 8\n #bytes ...\n \
            1048576 64 50.00 50.00 0.000040\n\
            @@run rpc-rdma 4 1048576\n\
            ps phase=push round=0 workers=4 shards=2 keys=8 size=1048576 bytes=33554432 secs=1 gb_per_s=0.0400\n\
            ps phase=push round=1 workers=4 shards=2 keys=8 size=1048576 bytes=33554432 secs=1 gb_per_s=0.0300\n\
            ps phase=push round=2 workers=4 shards=2 keys=8 size=1048576 bytes=33554432 secs=1 gb_per_s=0.0500\n\
            ps phase=pull round=0 workers=4 shards=2 keys=8 size=1048576 bytes=33554432 secs=1 gb_per_s=0.0200\n";
        let mut r = Results::default();
        parse_guest(output, cases(false), &mut r).unwrap();
        assert_eq!(r.rate(System::RpcRdma, 4, 1 << 20, Phase::Push), Some(0.04));
        let floor = r.floor(Phase::Push, 4, 1 << 20).unwrap();
        assert!((floor - 40.0 * 1048576.0 / 1e9).abs() < 1e-9);
        let targets = targets(&r);
        // 40 MB/s against 41.9: 0.95×; a pull of 20 against 52.4: 0.38×.
        assert!(
            targets.contains("RDMA push 1 MiB, 4 worker(s) ≥ 0.9× `ib_write_bw` | 0.95× | met"),
            "{targets}"
        );
        assert!(
            targets.contains("RDMA pull 1 MiB, 4 worker(s) ≥ 0.9× `ib_read_bw` | 0.38× | missed")
        );
        let tables = tables(&r, false);
        assert!(
            tables.contains("| 1 MiB | 4 | 0 | 40.0 | 0.95× | – | – | 41.9 |"),
            "{tables}"
        );
        assert!(tables.contains("| 1 MiB | 4 | 0 | 20.0 | 0.38× | – | – | 52.4 |"));
        assert!(missing(&r, false).contains(&"raw push 1 worker(s) 64 KiB".to_string()));
        assert!(svg(&r).contains("<circle"));
    }

    #[test]
    fn the_guest_script_runs_perftest_before_each_size() {
        let script = guest_script(Path::new("/t/release"), true, cases(true));
        let at = |needle: &str| script.find(needle).expect(needle);
        assert!(at("'ib_read_bw,65536,512,-q,8'") < at("@@run rpc-rdma 1 65536"));
        assert!(at("@@run rpc-rdma 4 65536") < at("'ib_write_bw,1048576,32,-q,2'"));
        assert!(script.contains("'/t/release/ps-worker' --addr \"$s0_addr,$s1_addr\" --workers 4 --keys 64 --size 65536 --rounds 1 --warmup-rounds 1"));
        assert_eq!(
            script.matches("@@run ").count(),
            SIZES.len() * WORKERS.len()
        );
        let full = guest_script(Path::new("/t/release"), false, cases(false));
        assert_eq!(
            full.matches("@@run rpc-rdma-no-rendezvous ").count(),
            SIZES.len() * WORKERS.len()
        );
        assert!(full.contains("env RDMA_RPC_RENDEZVOUS=off '/t/release/ps-server'"));
    }
}
