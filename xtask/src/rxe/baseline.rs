//! `cargo xtask rxe-baseline`: perftest on the Soft-RoCE device, the
//! yardstick for the project's own RDMA path (compare ratios, measured in the
//! same guest set-up, never absolute numbers: the CPU is emulated).

use std::fmt::Write as _;
use std::fs;
use std::process::ExitCode;

use super::{report, run, rxe_dir, RunRequest, EXIT_VM_FAILED};

/// One perftest run: program, options, message size, iterations.
pub(crate) struct Case {
    pub(crate) program: &'static str,
    /// Extra options for both sides (`-e`: sleep on completion events), or "".
    pub(crate) options: &'static str,
    pub(crate) size: u32,
    pub(crate) iterations: u32,
}

pub(crate) const fn case(program: &'static str, size: u32, iterations: u32) -> Case {
    Case {
        program,
        options: "",
        size,
        iterations,
    }
}

impl Case {
    /// The argument [`SCRIPT`] takes for this case: `program,size,iterations[,options]`.
    pub(crate) fn arg(&self) -> String {
        let mut arg = format!("{},{},{}", self.program, self.size, self.iterations);
        for option in self.options.split_whitespace() {
            arg.push(',');
            arg.push_str(option);
        }
        arg
    }
}

const CASES: &[Case] = &[
    case("ib_send_lat", 2, 1000),
    case("ib_send_lat", 4096, 1000),
    case("ib_send_lat", 65536, 200),
    case("ib_write_lat", 2, 1000),
    case("ib_write_lat", 4096, 1000),
    case("ib_write_lat", 65536, 200),
    case("ib_send_bw", 4096, 5000),
    case("ib_send_bw", 65536, 1000),
    case("ib_send_bw", 1 << 20, 100),
    case("ib_write_bw", 4096, 5000),
    case("ib_write_bw", 65536, 1000),
    case("ib_write_bw", 1 << 20, 100),
];

/// The guest side: server in the background, client (with retries until the
/// server listens) in the foreground, each case announced by a marker line.
/// Takes one [`Case::arg`] per case. Each perftest process gets 120 s: one
/// that hangs (seen once with `-e`) fails its case, not the whole run.
/// `-R`: connect through librdmacm, which picks the RoCE v2 GID itself.
pub(crate) const SCRIPT: &str = r#"
set -u
failed=0
for c in "$@"; do
    set -- $(echo "$c" | tr , ' ')
    prog=$1 size=$2 iters=$3
    shift 3
    opts="$*"
    echo "@@case $prog $size $iters $opts"
    timeout 120 "$prog" -d "$RDMA_TEST_DEVICE" -R -F $opts -s "$size" -n "$iters" > /tmp/server.log 2>&1 &
    server=$!
    ok=0
    for try in 1 2 3 4 5 6 7 8 9 10; do
        sleep 0.5
        if timeout 120 "$prog" -d "$RDMA_TEST_DEVICE" -R -F $opts -s "$size" -n "$iters" "$RDMA_TEST_IP" > /tmp/client.log 2>&1; then
            ok=1; break
        fi
        kill -0 "$server" 2>/dev/null || break
    done
    cat /tmp/client.log
    if [ "$ok" = 1 ]; then wait "$server"; else
        echo "@@failed $prog $size"; cat /tmp/server.log; kill "$server" 2>/dev/null; wait "$server"; failed=1
    fi
done
exit $failed
"#;

/// A parsed result line.
pub(crate) struct Measurement {
    pub(crate) program: &'static str,
    pub(crate) options: &'static str,
    pub(crate) size: u32,
    pub(crate) iterations: u32,
    /// How many runs `values` summarize (their median).
    pub(crate) runs: usize,
    /// (name, value, unit)
    pub(crate) values: Vec<(&'static str, f64, &'static str)>,
}

impl Measurement {
    /// The value named `name` (`t_typical_us`, `bw_avg_mb_s`, ...).
    pub(crate) fn get(&self, name: &str) -> Option<f64> {
        self.values.iter().find(|v| v.0 == name).map(|v| v.1)
    }
}

/// `cargo xtask rxe-baseline [--repeat N] [--timeout SECS]`
pub(crate) fn baseline_main(args: &[String]) -> ExitCode {
    let mut timeout = match super::default_timeout() {
        Ok(t) => t,
        Err(e) => return usage_error(&e),
    };
    let mut repeat = 1usize;
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        match (arg.as_str(), it.next()) {
            ("--timeout", Some(v)) => match super::parse_timeout(v) {
                Ok(t) => timeout = t,
                Err(e) => return usage_error(&e),
            },
            ("--repeat", Some(v)) => match v.parse() {
                Ok(n) if n > 0 => repeat = n,
                _ => return usage_error(&format!("--repeat wants a positive number, not {v:?}")),
            },
            _ => return usage_error(&format!("unexpected argument {arg}")),
        }
    }
    let mut command = vec!["sh".to_string(), "-c".into(), SCRIPT.into(), "sh".into()];
    for c in CASES {
        for _ in 0..repeat {
            command.push(c.arg());
        }
    }
    let request = RunRequest {
        hosts: 1,
        timeout,
        mtu: 1500,
        env: Vec::new(),
        command,
        cwd: std::env::temp_dir(),
        capture: true,
    };
    let outcome = match run(&request) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("xtask rxe-baseline: set-up failed: {e}");
            return ExitCode::from(EXIT_VM_FAILED);
        }
    };
    let code = report(&request, &outcome);
    let output = &outcome.guests[0].output;
    let results = summarize(&parse(output, CASES));
    if results.is_empty() {
        eprintln!("xtask rxe-baseline: no perftest results in the guest's output");
        return ExitCode::from(if code == 0 { 1 } else { code });
    }
    let dir = rxe_dir();
    let table = table(&results);
    let json = json(&results);
    println!("\n{table}");
    let write = |name: &str, text: &str| {
        let path = dir.join(name);
        match fs::write(&path, text) {
            Ok(()) => eprintln!("xtask rxe-baseline: wrote {}", path.display()),
            Err(e) => eprintln!("xtask rxe-baseline: cannot write {}: {e}", path.display()),
        }
    };
    write("baseline.md", &table);
    write("baseline.json", &json);
    if results.len() != CASES.len() && code == 0 {
        eprintln!(
            "xtask rxe-baseline: only {} of {} cases gave a result",
            results.len(),
            CASES.len()
        );
        return ExitCode::FAILURE;
    }
    ExitCode::from(code)
}

fn usage_error(e: &str) -> ExitCode {
    eprintln!(
        "xtask rxe-baseline: {e}\nusage: cargo xtask rxe-baseline [--repeat N] [--timeout SECS]"
    );
    ExitCode::from(EXIT_VM_FAILED)
}

/// Reads perftest's result lines of [`SCRIPT`] run with `cases`: after a
/// `#bytes` header, the first line that starts with a number.
pub(crate) fn parse(output: &str, cases: &'static [Case]) -> Vec<Measurement> {
    let mut results = Vec::new();
    let mut current: Option<&Case> = None;
    let mut header = false;
    for line in output.lines() {
        if let Some(rest) = line.strip_prefix("@@case ") {
            let mut words = rest.split_whitespace();
            let (p, s) = (
                words.next().unwrap_or(""),
                words.next().and_then(|s| s.parse().ok()),
            );
            let options: Vec<&str> = words.skip(1).collect();
            current = cases.iter().find(|c| {
                c.program == p
                    && Some(c.size) == s
                    && c.options.split_whitespace().eq(options.iter().copied())
            });
            header = false;
            continue;
        }
        let Some(case) = current else { continue };
        let trimmed = line.trim();
        if trimmed.starts_with("#bytes") {
            header = true;
            continue;
        }
        if !header || !trimmed.starts_with(|c: char| c.is_ascii_digit()) {
            continue;
        }
        let nums: Vec<f64> = trimmed
            .split_whitespace()
            .filter_map(|w| w.parse().ok())
            .collect();
        let values = if case.program.ends_with("_lat") && nums.len() >= 9 {
            vec![
                ("t_min_us", nums[2], "us"),
                ("t_typical_us", nums[4], "us"),
                ("t_avg_us", nums[5], "us"),
                ("t_p99_us", nums[7], "us"),
                ("t_p999_us", nums[8], "us"),
            ]
        } else if case.program.ends_with("_bw") && nums.len() >= 5 {
            vec![
                ("bw_peak_mb_s", nums[2], "MB/s"),
                ("bw_avg_mb_s", nums[3], "MB/s"),
                ("msg_rate_mpps", nums[4], "Mpps"),
            ]
        } else {
            continue;
        };
        results.push(Measurement {
            program: case.program,
            options: case.options,
            size: case.size,
            iterations: case.iterations,
            runs: 1,
            values,
        });
        current = None;
    }
    results
}

/// One line per case, each value the median of the case's runs.
fn summarize(runs: &[Measurement]) -> Vec<Measurement> {
    let mut out = Vec::new();
    for case in CASES {
        let mine: Vec<&Measurement> = runs
            .iter()
            .filter(|m| {
                m.program == case.program && m.options == case.options && m.size == case.size
            })
            .collect();
        let Some(first) = mine.first() else { continue };
        let values = first
            .values
            .iter()
            .map(|&(name, _, unit)| {
                let mut v: Vec<f64> = mine
                    .iter()
                    .filter_map(|m| m.values.iter().find(|x| x.0 == name).map(|x| x.1))
                    .collect();
                v.sort_by(f64::total_cmp);
                let median = if v.len() % 2 == 1 {
                    v[v.len() / 2]
                } else {
                    (v[v.len() / 2 - 1] + v[v.len() / 2]) / 2.0
                };
                (name, median, unit)
            })
            .collect();
        out.push(Measurement {
            program: case.program,
            options: case.options,
            size: case.size,
            iterations: case.iterations,
            runs: mine.len(),
            values,
        });
    }
    out
}

fn table(results: &[Measurement]) -> String {
    let mut s = String::from(
        "Soft-RoCE baseline (perftest, server and client in one TCG guest, rxe0, MTU 1024; compare ratios only)\n\n\
         | test | bytes | iterations | runs | typical / avg latency (us) | p99 (us) | avg bandwidth (MB/s) | Mpps |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for m in results {
        let get = |k: &str| m.values.iter().find(|v| v.0 == k).map(|v| v.1);
        let lat = match (get("t_typical_us"), get("t_avg_us")) {
            (Some(t), Some(a)) => format!("{t:.2} / {a:.2}"),
            _ => "-".into(),
        };
        let p99 = get("t_p99_us").map_or("-".into(), |v| format!("{v:.2}"));
        let bw = get("bw_avg_mb_s").map_or("-".into(), |v| format!("{v:.2}"));
        let rate = get("msg_rate_mpps").map_or("-".into(), |v| format!("{v:.6}"));
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {lat} | {p99} | {bw} | {rate} |",
            m.program, m.size, m.iterations, m.runs
        );
    }
    s
}

fn json(results: &[Measurement]) -> String {
    let mut s = String::from(
        "{\n  \"device\": \"rxe0 (Soft-RoCE in a TCG qemu guest)\",\n  \"path_mtu\": 1024,\n  \"summary\": \"median over runs; latencies in us, bandwidth in MB/s, message rate in Mpps\",\n  \"results\": [\n",
    );
    for (i, m) in results.iter().enumerate() {
        let values: Vec<String> = m
            .values
            .iter()
            .map(|(k, v, _)| format!("\"{k}\": {v}"))
            .collect();
        let _ = write!(
            s,
            "    {{\"test\": \"{}\", \"bytes\": {}, \"iterations\": {}, \"runs\": {}, {}}}",
            m.program,
            m.size,
            m.iterations,
            m.runs,
            values.join(", ")
        );
        s.push_str(if i + 1 < results.len() { ",\n" } else { "\n" });
    }
    s.push_str("  ]\n}\n");
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_latency_and_bandwidth_lines() {
        let out = "@@case ib_send_lat 2 1000\n #bytes #iterations    t_min[usec] ...\n \
                   2       1000          35.20          200.10       42.70     48.10     5.00    90.00   150.00\n\
                   @@case ib_write_bw 65536 1000\n #bytes     #iterations    BW peak[MB/sec] ...\n \
                   65536      1000             39.50              39.10          0.000625\n";
        let r = parse(out, CASES);
        assert_eq!(r.len(), 2);
        assert_eq!(r[0].values[1], ("t_typical_us", 42.7, "us"));
        assert_eq!(r[1].values[1], ("bw_avg_mb_s", 39.1, "MB/s"));
        assert!(json(&r).contains("\"bw_avg_mb_s\": 39.1"));
        assert!(table(&r).contains("| ib_send_lat | 2 | 1000 | 1 | 42.70 / 48.10 |"));
    }

    #[test]
    fn tells_cases_apart_by_their_options() {
        static EVENTS: &[Case] = &[
            case("ib_send_lat", 32, 100),
            Case {
                options: "-e",
                ..case("ib_send_lat", 32, 100)
            },
        ];
        assert_eq!(EVENTS[1].arg(), "ib_send_lat,32,100,-e");
        let out = "@@case ib_send_lat 32 100 -e\n #bytes ...\n \
                   32 100 1.0 2.0 3.0 4.0 0.1 5.0 6.0\n\
                   @@case ib_send_lat 32 100 \n #bytes ...\n \
                   32 100 1.0 2.0 0.5 4.0 0.1 5.0 6.0\n";
        let r = parse(out, EVENTS);
        assert_eq!(r.len(), 2);
        assert_eq!((r[0].options, r[0].get("t_typical_us")), ("-e", Some(3.0)));
        assert_eq!((r[1].options, r[1].get("t_typical_us")), ("", Some(0.5)));
    }

    #[test]
    fn summarizes_runs_by_their_median() {
        let run = |bw: f64| Measurement {
            program: "ib_write_bw",
            options: "",
            size: 65536,
            iterations: 1000,
            runs: 1,
            values: vec![("bw_avg_mb_s", bw, "MB/s")],
        };
        let s = summarize(&[run(50.0), run(10.0), run(30.0)]);
        assert_eq!(s.len(), 1);
        assert_eq!(s[0].runs, 3);
        assert_eq!(s[0].values[0].1, 30.0);
    }
}
