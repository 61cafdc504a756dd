//! `cargo xtask bench --instructions`: user-space instructions per unary
//! echo call, counted by `valgrind --tool=callgrind` (stable on a noisy,
//! shared machine, where times are not), for rdma-rpc, the raw echo (the
//! floor) and tonic on the same work (`benches/src/bin/call-instructions.rs`:
//! client and server in one process, current-thread runtime). Per call =
//! (count at 2,200 calls − count at 200) / 2,000, so set-up cancels out.
//! Large payloads (64 KiB-16 MiB, issue 10): the same, from 10 and 30
//! calls, per payload byte, to show where copies remain.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;
use std::process::Command;

use super::{date, machine, size_name};

/// Where the generated section begins and ends in `docs/benchmarks.md`.
pub(crate) const MARKERS: (&str, &str) = (
    "<!-- cargo xtask bench --instructions: generated from here -->",
    "<!-- cargo xtask bench --instructions: generated up to here -->",
);

/// The programs counted: `call-instructions` argument, and the row's title.
const SYSTEMS: [(&str, &str); 10] = [
    ("raw", "raw length-prefixed echo, loopback TCP (floor)"),
    ("rpc", "rdma-rpc over `tcp://`"),
    (
        "rpc-64",
        "rdma-rpc over `tcp://`, 64 calls in flight on one channel (× raw: the raw echo one at a time)",
    ),
    (
        "rpc-64-deadline",
        "rdma-rpc over `tcp://`, 64 calls in flight, every call with a timeout (64 deadlines on the connection's one timer)",
    ),
    (
        "rpc-inline",
        "rdma-rpc over `tcp://`, handlers run on the reader (`inline_handlers`)",
    ),
    (
        "rpc-deadline",
        "rdma-rpc over `tcp://`, every call with a timeout (the deadline's cost)",
    ),
    ("rpc-mem", "rdma-rpc over `mem://`"),
    (
        "rpc-intercept",
        "rdma-rpc over `tcp://`, a no-op interceptor both sides (the hooks' cost)",
    ),
    (
        "rpc-metrics",
        "rdma-rpc over `tcp://`, `rpc-metrics` both sides",
    ),
    ("tonic", "tonic, loopback TCP"),
];

const SIZES: [usize; 2] = [32, 1024];
const FEW: u64 = 200;
const MANY: u64 = 2200;

/// The programs counted with large payloads.
const LARGE_SYSTEMS: [(&str, &str); 3] = [
    (
        "raw",
        "raw echo (a 64 KiB read-ahead buffer: up to 64 KiB of each frame copied once)",
    ),
    ("rpc", "rdma-rpc over `tcp://`"),
    ("tonic", "tonic, loopback TCP"),
];
const LARGE_SIZES: [usize; 3] = [64 << 10, 1 << 20, 16 << 20];
const LARGE_FEW: u64 = 10;
const LARGE_MANY: u64 = 30;

/// Instructions per call, by (system, size).
type Counts = BTreeMap<(&'static str, usize), f64>;

/// Counts every system at every size; returns the markdown section.
pub(crate) fn run(binary: &Path, command: &str) -> Result<String, String> {
    let out = std::env::temp_dir().join(format!("xtask-callgrind-{}.out", std::process::id()));
    let mut counts = Counts::new();
    let runs = SYSTEMS
        .iter()
        .flat_map(|&(system, _)| SIZES.map(|size| (system, size, FEW, MANY)))
        .chain(LARGE_SYSTEMS.iter().flat_map(|&(system, _)| {
            LARGE_SIZES.map(|size| (system, size, LARGE_FEW, LARGE_MANY))
        }));
    for (system, size, few_calls, many_calls) in runs {
        let few = count(binary, &out, system, few_calls, size)?;
        let many = count(binary, &out, system, many_calls, size)?;
        let per_call = per_call(few, many, few_calls, many_calls)?;
        eprintln!("xtask bench: {system:<12} {size:>8} B  {per_call:>11.0} instructions a call");
        counts.insert((system, size), per_call);
    }
    let _ = std::fs::remove_file(&out);
    Ok(report(&counts, command))
}

/// Instructions callgrind counted for one run of `call-instructions`.
fn count(binary: &Path, out: &Path, system: &str, calls: u64, size: usize) -> Result<u64, String> {
    let output = Command::new("valgrind")
        .arg("--tool=callgrind")
        .arg(format!("--callgrind-out-file={}", out.display()))
        .arg(binary)
        .args([system, &calls.to_string(), &size.to_string()])
        .output()
        .map_err(|e| format!("could not run valgrind: {e}"))?;
    let stderr = String::from_utf8_lossy(&output.stderr);
    if !output.status.success() {
        return Err(format!(
            "call-instructions {system} {calls} {size} under callgrind failed ({}):\n{stderr}",
            output.status
        ));
    }
    collected(&stderr)
        .ok_or_else(|| format!("no instruction count in callgrind's output:\n{stderr}"))
}

/// The count in callgrind's `==PID== Collected : N` line.
fn collected(stderr: &str) -> Option<u64> {
    stderr.lines().find_map(|line| {
        let (_, count) = line.split_once("Collected :")?;
        count.trim().parse().ok()
    })
}

/// Instructions a call, from the counts of `few_calls` and `many_calls`.
fn per_call(few: u64, many: u64, few_calls: u64, many_calls: u64) -> Result<f64, String> {
    if many <= few {
        return Err(format!(
            "{many_calls} calls counted {many} instructions, {few_calls} counted {few}: not a per-call cost"
        ));
    }
    Ok((many - few) as f64 / (many_calls - few_calls) as f64)
}

/// Instructions per payload byte moved, each way: a call moves its payload
/// there and back.
fn per_byte(per_call: f64, size: usize) -> f64 {
    per_call / (2 * size) as f64
}

fn report(counts: &Counts, command: &str) -> String {
    let mut out = format!(
        "{}\n## Instructions per call\n\n\
         - Command: `{command}`\n\
         - Machine: {}\n\
         - Date: {}\n\
         - Program: `benches/src/bin/call-instructions.rs`, unary `Echo` of the benchmark's \
         proto (prost on both frameworks), client and server in one process on a current-thread \
         runtime, one call at a time unless the row says otherwise; user-space instructions counted by \
         `valgrind --tool=callgrind`, per call = (2,200 calls − 200 calls) / 2,000.\n\n\
         | program | 32 B | × raw | 1 KiB | × raw |\n|---|---:|---:|---:|---:|\n",
        MARKERS.0,
        machine(),
        date()
    );
    for (system, title) in SYSTEMS {
        let _ = write!(out, "| {title} |");
        for size in SIZES {
            let n = counts.get(&(system, size));
            let raw = counts.get(&("raw", size));
            let _ = match (n, raw) {
                (Some(n), Some(raw)) => write!(out, " {} | {:.1}× |", thousands(*n), n / raw),
                _ => write!(out, " – | – |"),
            };
        }
        out.push('\n');
    }
    out.push_str("\n| target | measured | verdict |\n|---|---:|---|\n");
    for size in SIZES {
        let ratio = |a: &str, b: &str| Some(counts.get(&(a, size))? / counts.get(&(b, size))?);
        let rows = [
            (
                format!("issue 11: rdma-rpc over `tcp://` ≤ 2× the raw echo, {size} B"),
                ratio("rpc", "raw"),
                2.0,
            ),
            (
                format!("issue 15: `rpc-metrics` costs ≤ 5 % a call, {size} B"),
                ratio("rpc-metrics", "rpc"),
                1.05,
            ),
        ];
        for (target, measured, limit) in rows {
            let _ = match measured {
                Some(r) => writeln!(
                    out,
                    "| {target} | {r:.2}× | {} |",
                    if r <= limit { "PASS" } else { "**MISS**" }
                ),
                None => writeln!(out, "| {target} | – | not measured |"),
            };
        }
    }
    large_report(counts, &mut out);
    let _ = writeln!(out, "\n{}", MARKERS.1);
    out
}

/// The large-payload table: instructions a call and per payload byte.
fn large_report(counts: &Counts, out: &mut String) {
    let _ = write!(
        out,
        "\n### Large payloads: instructions per payload byte\n\n\
         The same program and count, from {LARGE_FEW} and {LARGE_MANY} calls; per byte = per \
         call / (2 × payload), the payload going there and back.\n\n| program |"
    );
    for size in LARGE_SIZES {
        let _ = write!(out, " {} a call | per byte |", size_name(size));
    }
    out.push_str("\n|---|");
    out.push_str(&"---:|---:|".repeat(LARGE_SIZES.len()));
    out.push('\n');
    for (system, title) in LARGE_SYSTEMS {
        let _ = write!(out, "| {title} |");
        for size in LARGE_SIZES {
            let _ = match counts.get(&(system, size)) {
                Some(&n) => write!(out, " {} | {:.3} |", thousands(n), per_byte(n, size)),
                None => write!(out, " – | – |"),
            };
        }
        out.push('\n');
    }
    out.push_str("\n| target | measured | verdict |\n|---|---:|---|\n");
    for size in LARGE_SIZES {
        let target = format!(
            "issue 10: rdma-rpc over `tcp://` ≤ 0.1 instructions per payload byte above the raw echo, {}",
            size_name(size)
        );
        let above = |system| Some(per_byte(*counts.get(&(system, size))?, size));
        let _ = match above("rpc").zip(above("raw")) {
            Some((rpc, raw)) => writeln!(
                out,
                "| {target} | {:+.3} | {} |",
                rpc - raw,
                if rpc - raw <= 0.1 { "PASS" } else { "**MISS**" }
            ),
            None => writeln!(out, "| {target} | – | not measured |"),
        };
    }
}

/// `21345.6` as `21,346`.
fn thousands(n: f64) -> String {
    let digits = format!("{:.0}", n);
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_callgrinds_count() {
        let stderr = "==123== Callgrind, a call-graph generating cache profiler\n\
                      ==123== Events    : Ir\n==123== Collected : 47461520\n==123==\n\
                      ==123== I   refs:      47,461,520\n";
        assert_eq!(collected(stderr), Some(47_461_520));
        assert_eq!(collected("==1== nothing here\n"), None);
        assert_eq!(
            per_call(4_743_583, 47_461_520, FEW, MANY).unwrap(),
            21_358.968_5
        );
        assert!(per_call(10, 5, FEW, MANY).is_err());
        assert_eq!(per_call(100, 500, 10, 30).unwrap(), 20.0);
    }

    #[test]
    fn the_report_has_ratios_to_raw_and_the_targets() {
        let mut counts = Counts::new();
        for (size, raw, rpc, metrics) in [
            (32, 5_000.0, 21_000.0, 22_000.0),
            (1024, 5_000.0, 9_000.0, 9_900.0),
        ] {
            counts.insert(("raw", size), raw);
            counts.insert(("rpc", size), rpc);
            counts.insert(("rpc-metrics", size), metrics);
        }
        // rpc − raw per byte: 64 KiB (24,000 − 20,000) / 131,072 = 0.031;
        // 1 MiB (300,000 − 50,000) / 2,097,152 = 0.119.
        for (size, raw, rpc) in [
            (64 << 10, 20_000.0, 24_000.0),
            (1 << 20, 50_000.0, 300_000.0),
        ] {
            counts.insert(("raw", size), raw);
            counts.insert(("rpc", size), rpc);
        }
        let report = report(&counts, "cargo xtask bench --instructions");
        assert!(report.starts_with(MARKERS.0) && report.trim_end().ends_with(MARKERS.1));
        assert!(
            report.contains("| rdma-rpc over `tcp://` | 21,000 | 4.2× | 9,000 | 1.8× |"),
            "{report}"
        );
        assert!(
            report.contains("| tonic, loopback TCP | – | – | – | – |"),
            "{report}"
        );
        assert!(
            report.contains("raw echo, 32 B | 4.20× | **MISS** |"),
            "{report}"
        );
        assert!(
            report.contains("raw echo, 1024 B | 1.80× | PASS |"),
            "{report}"
        );
        assert!(report.contains("a call, 32 B | 1.05× | PASS |"), "{report}");
        assert!(
            report.contains("a call, 1024 B | 1.10× | **MISS** |"),
            "{report}"
        );
        assert!(
            report
                .contains("| rdma-rpc over `tcp://` | 24,000 | 0.183 | 300,000 | 0.143 | – | – |"),
            "{report}"
        );
        assert!(
            report.contains("above the raw echo, 64 KiB | +0.031 | PASS |"),
            "{report}"
        );
        assert!(
            report.contains("above the raw echo, 1 MiB | +0.119 | **MISS** |"),
            "{report}"
        );
        assert!(
            report.contains("above the raw echo, 16 MiB | – | not measured |"),
            "{report}"
        );
        assert_eq!(thousands(999.4), "999");
        assert_eq!(thousands(1_234_567.0), "1,234,567");
    }
}
