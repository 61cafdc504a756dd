//! `cargo xtask bench --hol`: small calls beside large ones (issue 10's
//! head-of-line target: with a large push in flight on the same channel,
//! 32 B calls keep their p99 within 3× of an idle channel's).
//!
//! Each case is a `hol-bench` run (`benches/src/bin/hol-bench.rs`: server
//! and client in one process; 32 B `Echo` calls one at a time on an idle
//! channel, then beside back-to-back `Sink` calls of the large size). Over
//! TCP on the host, then over RDMA in one Soft-RoCE guest boot; every case
//! [`RUNS`] times, the cases taking turns. A channel of its own for the
//! large calls is the comparator: what is left there is the process's
//! (two cores shared by both ends and the copies), not the channel's.

use std::fmt::Write as _;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use super::{date, machine, median, micros, shell_quote};
use crate::{rxe, workspace_root};

/// Where the generated section begins and ends in `docs/benchmarks.md`.
pub(crate) const MARKERS: (&str, &str) = (
    "<!-- cargo xtask bench --hol: generated from here -->",
    "<!-- cargo xtask bench --hol: generated up to here -->",
);

/// Runs of each case (and with `--quick`).
const RUNS: usize = 5;
const QUICK_RUNS: usize = 2;

/// The guest's time limit.
const TIMEOUT: Duration = Duration::from_secs(1200);

/// Issue 10's target: loaded p99 over idle p99 at most this.
const TARGET: f64 = 3.0;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
struct Case {
    rdma: bool,
    title: &'static str,
    large_mib: usize,
    /// `hol-bench` arguments besides the address and the size.
    args: &'static [&'static str],
    /// Whether issue 10's target applies (the same channel).
    target: bool,
}

const CASES: [Case; 5] = [
    Case {
        rdma: false,
        title: "`tcp://` (host), same channel",
        large_mib: 64,
        args: &["--large-channel", "same"],
        target: true,
    },
    Case {
        rdma: false,
        title: "`tcp://` (host), a channel of their own",
        large_mib: 64,
        args: &["--large-channel", "own"],
        target: false,
    },
    Case {
        rdma: true,
        title: "`rdma://` (guest), same channel, region chunks",
        large_mib: 16,
        args: &["--large-channel", "same"],
        target: true,
    },
    Case {
        rdma: true,
        title: "`rdma://` (guest), same channel, rendezvous ≥ 64 KiB",
        large_mib: 16,
        args: &["--large-channel", "same", "--rendezvous-kib", "64"],
        target: true,
    },
    Case {
        rdma: true,
        title: "`rdma://` (guest), a channel of their own",
        large_mib: 16,
        args: &["--large-channel", "own"],
        target: false,
    },
];

/// One run's figures (µs, and the large calls' GB/s).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct Run {
    idle_p99: f64,
    loaded_p50: f64,
    loaded_p99: f64,
    loaded_max: f64,
    small_calls: f64,
    gb_per_s: f64,
}

impl Run {
    fn ratio(&self) -> f64 {
        self.loaded_p99 / self.idle_p99
    }
}

/// The part's report, and whether anything failed.
pub(crate) struct HolPart {
    pub(crate) generated: String,
    pub(crate) tables: String,
    pub(crate) failed: Option<String>,
}

/// Runs every case; `bin` is `hol-bench`.
pub(crate) fn run(bin: &Path, quick: bool, command: &str) -> Result<HolPart, String> {
    let runs = if quick { QUICK_RUNS } else { RUNS };
    let mut results: Vec<Vec<Run>> = vec![Vec::new(); CASES.len()];
    let mut failures = Vec::new();
    eprintln!("xtask bench: head-of-line part over TCP: {runs} rounds of the TCP cases");
    for _ in 0..runs {
        for (i, case) in CASES.iter().enumerate().filter(|(_, c)| !c.rdma) {
            let output = Command::new(bin)
                .args(["--addr", "tcp://127.0.0.1:0", "--large-mib"])
                .arg(case.large_mib.to_string())
                .args(case.args)
                .output()
                .map_err(|e| format!("could not run {}: {e}", bin.display()))?;
            let stdout = String::from_utf8_lossy(&output.stdout);
            match parse_run(&stdout) {
                Some(run) if output.status.success() => results[i].push(run),
                _ => failures.push(format!(
                    "{}: {} {}{}",
                    case.title,
                    output.status,
                    stdout,
                    String::from_utf8_lossy(&output.stderr)
                )),
            }
        }
    }
    eprintln!("xtask bench: head-of-line part over RDMA: booting the Soft-RoCE guest");
    let (output, code) = rxe::run_captured(
        vec![
            "sh".into(),
            "-c".into(),
            guest_script(bin, runs),
            "sh".into(),
        ],
        workspace_root(),
        Vec::new(),
        TIMEOUT,
    )?;
    parse_guest(&output, &mut results);
    if code != 0 {
        failures.push(format!("the guest's script exited with status {code}"));
    }
    let missing: Vec<&str> = CASES
        .iter()
        .zip(&results)
        .filter(|(_, r)| r.len() < runs)
        .map(|(c, _)| c.title)
        .collect();
    let failed = (!failures.is_empty() || !missing.is_empty()).then(|| {
        for failure in &failures {
            eprintln!("xtask bench: {failure}");
        }
        format!(
            "the head-of-line part is incomplete ({} failure(s); runs missing for: {}); its \
             report has what was measured",
            failures.len(),
            missing.join(", ")
        )
    });
    let tables = tables(&results);
    let generated = format!(
        "{begin}\n\
         ## Small calls beside large ones (head-of-line blocking)\n\n\
         - Command: `{command}`{quick}\n\
         - Machine: {machine}; the RDMA cases in one Soft-RoCE guest boot (qemu TCG, \
         emulated CPU)\n\
         - Date: {date}\n\
         - Program: `benches/src/bin/hol-bench.rs` (release), server and client in one \
         process on 2 tokio workers: 300 `Echo` calls of 32 B one at a time on an idle \
         channel, then as many (and more, until 3 large calls ended) beside back-to-back \
         `Sink` calls of the large size on the same channel, or on a channel of their own \
         (the process's share of the stalls: its CPUs, its memory). `hol-bench --addr \
         tcp://127.0.0.1:0|rdma://$RDMA_TEST_IP:0 --large-mib N [--large-channel same|own] \
         [--rendezvous-kib 64]`, each case {runs} times, the cases taking turns; medians \
         over the runs, ranges in brackets.\n\n\
         {tables}\n{end}\n",
        begin = MARKERS.0,
        end = MARKERS.1,
        quick = if quick {
            " (short: indicative only)"
        } else {
            ""
        },
        machine = machine(),
        date = date(),
    );
    Ok(HolPart {
        generated,
        tables,
        failed,
    })
}

/// The figures of one `hol-bench` output, if it has them all.
fn parse_run(output: &str) -> Option<Run> {
    let line = |prefix: &str| output.lines().find(|l| l.starts_with(prefix));
    let value = |line: &str, key: &str| -> Option<f64> {
        line.split_whitespace()
            .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))?
            .parse()
            .ok()
    };
    let idle = line("phase=idle ")?;
    let loaded = line("phase=loaded ")?;
    let large = line("large ")?;
    Some(Run {
        idle_p99: value(idle, "p99_us")?,
        loaded_p50: value(loaded, "p50_us")?,
        loaded_p99: value(loaded, "p99_us")?,
        loaded_max: value(loaded, "max_us")?,
        small_calls: value(loaded, "calls")?,
        gb_per_s: value(large, "gb_per_s")?,
    })
}

/// The guest's script: `runs` rounds of the RDMA cases, each run's output
/// after an `@@case N` line.
fn guest_script(bin: &Path, runs: usize) -> String {
    let bin = shell_quote(&bin.to_string_lossy());
    let mut s = String::from("set -u\nfailed=0\n");
    for _ in 0..runs {
        for (i, case) in CASES.iter().enumerate().filter(|(_, c)| c.rdma) {
            let _ = writeln!(
                s,
                "echo '@@case {i}'\n\
                 timeout 300 {bin} --addr \"rdma://$RDMA_TEST_IP:0\" --large-mib {} {} \
                 || {{ echo '@@failed case {i}'; failed=1; }}",
                case.large_mib,
                case.args.join(" ")
            );
        }
    }
    s.push_str("exit $failed\n");
    s
}

/// Adds the guest's runs to `results`.
fn parse_guest(output: &str, results: &mut [Vec<Run>]) {
    let mut blocks = output.split("@@case ").skip(1);
    for block in blocks.by_ref() {
        let Some((index, rest)) = block.split_once('\n') else {
            continue;
        };
        let Ok(index) = index.trim().parse::<usize>() else {
            continue;
        };
        if let (Some(slot), Some(run)) = (results.get_mut(index), parse_run(rest)) {
            slot.push(run);
        }
    }
}

fn tables(results: &[Vec<Run>]) -> String {
    let mut out = String::from(
        "| case | large calls | small calls | idle p99 | loaded p50 | loaded p99 | largest wait | \
         p99 / idle p99 | large calls' GB/s |\n\
         |---|---|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    let cell = |runs: &[Run], f: &dyn Fn(&Run) -> f64, show: &dyn Fn(f64) -> String| {
        let values: Vec<f64> = runs.iter().map(f).collect();
        let (lo, hi) = values
            .iter()
            .fold((f64::MAX, f64::MIN), |(lo, hi), &v| (lo.min(v), hi.max(v)));
        match median(Some(&values)) {
            Some(m) if values.len() > 1 => format!("{} [{}–{}]", show(m), show(lo), show(hi)),
            Some(m) => show(m),
            None => "–".into(),
        }
    };
    let times = |v: f64| format!("{v:.1}×");
    for (case, runs) in CASES.iter().zip(results) {
        let _ = writeln!(
            out,
            "| {} | {} MiB | {} | {} | {} | {} | {} | {} | {} |",
            case.title,
            case.large_mib,
            cell(runs, &|r| r.small_calls, &|v| format!("{v:.0}")),
            cell(runs, &|r| r.idle_p99, &micros),
            cell(runs, &|r| r.loaded_p50, &micros),
            cell(runs, &|r| r.loaded_p99, &micros),
            cell(runs, &|r| r.loaded_max, &micros),
            cell(runs, &Run::ratio, &times),
            cell(runs, &|r| r.gb_per_s, &|v| format!("{v:.3}")),
        );
    }
    out.push_str("\n| target | measured (median p99 / idle p99) | verdict |\n|---|---:|---|\n");
    for (case, runs) in CASES.iter().zip(results).filter(|(c, _)| c.target) {
        let ratios: Vec<f64> = runs.iter().map(Run::ratio).collect();
        let (measured, verdict) = match median(Some(&ratios)) {
            Some(m) => (
                format!("{m:.1}×"),
                if m <= TARGET { "met" } else { "**MISS**" },
            ),
            None => ("–".into(), "not measured"),
        };
        let _ = writeln!(
            out,
            "| issue 10: 32 B p99 beside {} MiB calls ≤ {TARGET}× idle, {} | {measured} | {verdict} |",
            case.large_mib, case.title
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const OUTPUT: &str = "phase=idle calls=300 p50_us=82.5 p99_us=214.1 max_us=288.3\n\
                          phase=loaded calls=353 p50_us=319.7 p99_us=1611.8 max_us=2895.9\n\
                          large size=67108864 calls=4 gb_per_s=1.475\n\
                          ratio p50=3.88 p99=7.53\n";

    #[test]
    fn a_run_is_read_from_hol_bench_output() {
        let run = parse_run(OUTPUT).unwrap();
        assert_eq!(run.idle_p99, 214.1);
        assert_eq!(run.loaded_p50, 319.7);
        assert_eq!(run.loaded_p99, 1611.8);
        assert_eq!(run.loaded_max, 2895.9);
        assert_eq!(run.small_calls, 353.0);
        assert_eq!(run.gb_per_s, 1.475);
        assert!(
            parse_run("phase=idle calls=300 p50_us=82.5 p99_us=214.1 max_us=288.3\n").is_none()
        );
    }

    #[test]
    fn guest_runs_go_to_their_case_and_the_target_is_judged_on_the_median_ratio() {
        let guest = format!("boot noise\n@@case 2\n{OUTPUT}@@case 3\nhol-bench: failed\n@@failed case 3\n@@case 2\n{}", OUTPUT.replace("p99_us=1611.8", "p99_us=428.2"));
        let mut results = vec![Vec::new(); CASES.len()];
        parse_guest(&guest, &mut results);
        assert_eq!(results[2].len(), 2);
        assert!(results[3].is_empty());
        let tables = tables(&results);
        // Ratios 7.5× and 2.0×: median 4.8×, missed.
        assert!(tables.contains("| 4.8× | **MISS** |"), "{tables}");
        assert!(tables.contains("| not measured |"), "{tables}");
    }

    #[test]
    fn the_guest_script_runs_each_rdma_case_each_round() {
        let script = guest_script(Path::new("/t/hol-bench"), 2);
        assert_eq!(script.matches("@@case 2'").count(), 2);
        assert_eq!(script.matches("@@case 3'").count(), 2);
        assert_eq!(script.matches("@@case 4'").count(), 2);
        assert!(!script.contains("@@case 0'"));
        assert!(script.contains("--rendezvous-kib 64"));
        assert!(script.ends_with("exit $failed\n"));
    }
}
