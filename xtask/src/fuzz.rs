//! `cargo xtask fuzz`: builds the cargo-fuzz targets in `fuzz/` on the
//! stable toolchain (`--sanitizer none`) and runs each for a while, seeded
//! with the committed corpus. Not part of CI: a fuzzing run has no fixed
//! length and finds things at random moments.

use std::path::Path;
use std::process::{Command, Stdio};

use crate::{run, setup, workspace_root, BUILD_PACKAGES};

pub(crate) const FUZZ_USAGE: &str = "details of fuzz:
  cargo xtask fuzz [--minutes N] [TARGET...]
    --minutes N   run each target for N minutes (default 1; fractions allowed)
    TARGET        frame_decode tcp_reader rdma_hello rdma_header rdma_region
                  rdma_reassembly rdma_credit rdma_connection (default: all)
  Installs cargo-fuzz if missing, builds fuzz/ into target/fuzz-build, runs
  each target with fuzz/corpus/TARGET as seeds; new inputs go to
  target/fuzz-run/corpus/TARGET (never into the committed corpus), crashes to
  target/fuzz-run/artifacts/TARGET, libFuzzer's log to target/fuzz-run/TARGET.log.
  Reproduce a crash: target/fuzz-build/x86_64-unknown-linux-gnu/release/TARGET CRASH_FILE";

/// Every target in `fuzz/Cargo.toml`.
const TARGETS: &[&str] = &[
    "frame_decode",
    "rdma_hello",
    "rdma_header",
    "rdma_region",
    "rdma_reassembly",
    "rdma_credit",
    "rdma_connection",
    "tcp_reader",
];

/// What one target's run came to.
struct Outcome {
    target: String,
    /// Seconds it actually ran (less than asked when it crashed).
    seconds: u64,
    executions: Option<u64>,
    corpus_files: usize,
    crash: Option<String>,
    failure: Option<String>,
}

pub(crate) fn fuzz_main(args: &[String]) -> Result<(), String> {
    let mut minutes = 1.0f64;
    let mut targets: Vec<String> = Vec::new();
    let mut args = args.iter();
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--minutes" => {
                let value = args.next().ok_or("--minutes needs a number")?;
                minutes = value
                    .parse()
                    .ok()
                    .filter(|m: &f64| m.is_finite() && *m > 0.0)
                    .ok_or_else(|| format!("--minutes {value:?}: not a positive number"))?;
            }
            "-h" | "--help" => return Err(FUZZ_USAGE.to_string()),
            target if TARGETS.contains(&target) => targets.push(target.to_string()),
            other => return Err(format!("unknown target or option {other:?}\n{FUZZ_USAGE}")),
        }
    }
    if targets.is_empty() {
        targets = TARGETS.iter().map(|t| t.to_string()).collect();
    }
    let seconds = ((minutes * 60.0).round() as u64).max(1);

    setup::ensure_debian_packages(BUILD_PACKAGES)?;
    setup::ensure_debian_packages(crate::rxe::RDMA_BUILD_PACKAGES)?;
    ensure_cargo_fuzz()?;

    let root = workspace_root();
    let build_dir = root.join("target/fuzz-build");
    let mut build = Command::new(crate::env_cargo());
    build
        .args(["fuzz", "build", "--sanitizer", "none", "--target-dir"])
        .arg(&build_dir)
        .current_dir(root.join("fuzz"));
    // All targets (`cargo fuzz build` takes one or all; the others are a
    // re-link at most).
    run(&mut build)?;
    let bin_dir = build_dir.join(format!("{}/release", host_triple()?));

    let mut outcomes = Vec::new();
    for target in &targets {
        println!("== fuzz {target} for {seconds} s");
        outcomes.push(run_target(&root, &bin_dir, target, seconds)?);
    }

    println!(
        "\n{:<16} {:>8} {:>14} {:>10} {:>8}  result",
        "target", "seconds", "executions", "exec/s", "corpus"
    );
    for o in &outcomes {
        let (executions, rate) = match o.executions {
            Some(n) => (n.to_string(), (n / o.seconds.max(1)).to_string()),
            None => ("?".into(), "?".into()),
        };
        let result = match (&o.crash, &o.failure) {
            (Some(path), _) => format!("CRASH: reproducer {path}"),
            (None, Some(why)) => format!("FAILED: {why}"),
            (None, None) => "ok".into(),
        };
        println!(
            "{:<16} {:>8} {:>14} {:>10} {:>8}  {result}",
            o.target, o.seconds, executions, rate, o.corpus_files
        );
    }
    let bad = outcomes
        .iter()
        .filter(|o| o.crash.is_some() || o.failure.is_some())
        .count();
    if bad > 0 {
        return Err(format!(
            "{bad} fuzz target(s) crashed or failed (logs in target/fuzz-run/)"
        ));
    }
    Ok(())
}

/// Installs cargo-fuzz unless `cargo fuzz` already works.
fn ensure_cargo_fuzz() -> Result<(), String> {
    let present = Command::new(crate::env_cargo())
        .args(["fuzz", "--version"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if present {
        return Ok(());
    }
    eprintln!("xtask: installing cargo-fuzz");
    run(Command::new(crate::env_cargo()).args(["install", "cargo-fuzz", "--locked"]))
}

/// The host's target triple (cargo fuzz builds for it explicitly).
fn host_triple() -> Result<String, String> {
    let output = Command::new("rustc")
        .arg("-vV")
        .output()
        .map_err(|e| format!("could not run rustc -vV: {e}"))?;
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("host: ").map(str::to_string))
        .ok_or_else(|| "rustc -vV did not name the host".to_string())
}

/// Runs one target for `seconds`, its log to `target/fuzz-run/TARGET.log`.
fn run_target(root: &Path, bin_dir: &Path, target: &str, seconds: u64) -> Result<Outcome, String> {
    let work = root.join("target/fuzz-run");
    let scratch = work.join("corpus").join(target);
    let artifacts = work.join("artifacts").join(target);
    let seeds = root.join("fuzz/corpus").join(target);
    for dir in [&scratch, &artifacts, &seeds] {
        std::fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    }
    let log_path = work.join(format!("{target}.log"));
    let log = std::fs::File::create(&log_path)
        .map_err(|e| format!("creating {}: {e}", log_path.display()))?;
    let started = std::time::Instant::now();
    let status = Command::new(bin_dir.join(target))
        .arg(format!("-max_total_time={seconds}"))
        .arg("-timeout=10")
        .arg("-rss_limit_mb=4096")
        .arg("-print_final_stats=1")
        .arg(format!("-artifact_prefix={}/", artifacts.display()))
        // The first directory receives new inputs; the committed seeds are only read.
        .arg(&scratch)
        .arg(&seeds)
        .stdout(Stdio::null())
        .stderr(log)
        .status()
        .map_err(|e| format!("could not start fuzz target {target}: {e}"))?;
    let elapsed = started.elapsed().as_secs();
    let text = std::fs::read_to_string(&log_path).unwrap_or_default();
    let executions = text
        .lines()
        .find_map(|l| l.strip_prefix("stat::number_of_executed_units:"))
        .and_then(|n| n.trim().parse().ok());
    let crash = text
        .lines()
        .find_map(|l| l.split_once("Test unit written to "))
        .map(|(_, path)| path.trim().to_string());
    let failure = (!status.success() && crash.is_none())
        .then(|| format!("exited with {status}; see {}", log_path.display()));
    if let Some(path) = &crash {
        let summary: Vec<&str> = text
            .lines()
            .filter(|l| l.contains("panicked at") || l.starts_with("SUMMARY"))
            .collect();
        println!(
            "{target}: CRASH {}\n  reproducer: {path}",
            summary.join(" | ")
        );
    }
    let corpus_files = std::fs::read_dir(&scratch).map_or(0, |d| d.count());
    Ok(Outcome {
        target: target.to_string(),
        seconds: elapsed,
        executions,
        corpus_files,
        crash,
        failure,
    })
}
