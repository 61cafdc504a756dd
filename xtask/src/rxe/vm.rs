//! Running qemu guests: one, or two joined by a virtual wire.
//!
//! The guest's serial console is qemu's stdout. `job.sh` prints a start
//! marker right before the command and an end marker right after it: what
//! comes before the start (boot noise) is kept and shown only when something
//! fails; what lies between is the command's output, streamed line by line.
//! The run share's `status` file says how the run ended.

use std::fs;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use super::image::BootImage;

const START_MARKER: &str = "@@rxe-command-start@@";
const END_MARKER: &str = "@@rxe-command-end@@";

/// How long the other guest may go on once one of two has failed.
const PEER_FAILURE_GRACE: Duration = Duration::from_secs(10);

/// Kernel command line: see the fact sheet for why each item is there.
const KERNEL_APPEND: &str = "console=ttyS0 quiet loglevel=3 panic=-1 mitigations=off \
                             tsc=reliable cryptomgr.notests=1 rdinit=/init";

/// One guest to boot.
pub(super) struct GuestSpec {
    /// Prefix for its output lines (`[server] `), empty for a single guest.
    pub(super) label: String,
    /// The host folder shared read-write as `/rxe-run` (holds `job.sh`).
    pub(super) run_dir: PathBuf,
    /// The guest's end of the wire, in two-hosts mode.
    pub(super) nic: Option<Nic>,
}

/// A virtio-net NIC whose frames travel as UDP datagrams on the host's
/// loopback (`-netdev socket,udp=...`): no listen/connect ordering.
pub(super) struct Nic {
    pub(super) local_port: u16,
    pub(super) peer_port: u16,
    pub(super) mac: String,
}

/// How one guest's run ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum GuestEnd {
    /// The command ran and exited with this status.
    Exited(i32),
    /// The guest's set-up (modules, mounts, device, link) failed.
    SetupFailed(String),
    /// qemu failed or the guest died before the command finished.
    VmFailed(String),
    /// The run's time limit passed; qemu was killed.
    TimedOut,
    /// Killed because the other guest had failed.
    StoppedAfterPeerFailure,
}

/// One guest's result.
pub(super) struct GuestRun {
    pub(super) label: String,
    pub(super) end: GuestEnd,
    /// The command's output (only when capturing was asked for).
    pub(super) output: String,
    /// Console output before the command started, and qemu's stderr.
    pub(super) boot_log: String,
}

impl GuestEnd {
    fn is_failure(&self) -> bool {
        !matches!(self, GuestEnd::Exited(0))
    }
}

/// Boots the guests, waits for all (or the timeout), and reports each.
pub(super) fn run(
    image: &BootImage,
    guests: &[GuestSpec],
    timeout: Duration,
    capture: bool,
) -> Vec<GuestRun> {
    let started = Instant::now();
    let stdout_lock = Arc::new(Mutex::new(()));
    let mut running: Vec<Running> = Vec::new();
    let mut finished: Vec<Option<GuestRun>> = (0..guests.len()).map(|_| None).collect();

    for (i, spec) in guests.iter().enumerate() {
        let _ = fs::remove_file(spec.run_dir.join("status"));
        match spawn(image, spec, capture, Arc::clone(&stdout_lock)) {
            Ok(r) => running.push(Running { index: i, ..r }),
            Err(e) => {
                finished[i] = Some(GuestRun {
                    label: spec.label.clone(),
                    end: GuestEnd::VmFailed(e),
                    output: String::new(),
                    boot_log: String::new(),
                })
            }
        }
    }

    let mut grace_deadline: Option<Instant> = None;
    if finished.iter().any(Option::is_some) {
        grace_deadline = Some(Instant::now());
    }
    while !running.is_empty() {
        let mut still = Vec::new();
        for mut r in running {
            match r.child.try_wait() {
                Ok(Some(status)) => {
                    let index = r.index;
                    let result = r.finish(&guests[index], None, Some(status.to_string()));
                    if result.end.is_failure() && guests.len() > 1 && grace_deadline.is_none() {
                        grace_deadline = Some(Instant::now() + PEER_FAILURE_GRACE);
                    }
                    finished[index] = Some(result);
                }
                Ok(None) => still.push(r),
                Err(e) => {
                    let _ = r.child.kill();
                    let _ = r.child.wait();
                    let end = GuestEnd::VmFailed(format!("cannot wait for qemu: {e}"));
                    let index = r.index;
                    finished[index] = Some(r.finish(&guests[index], Some(end), None));
                }
            }
        }
        running = still;
        let now = Instant::now();
        let forced = if now.duration_since(started) >= timeout {
            Some(GuestEnd::TimedOut)
        } else if grace_deadline.is_some_and(|d| now >= d) {
            Some(GuestEnd::StoppedAfterPeerFailure)
        } else {
            None
        };
        if let Some(end) = forced {
            for mut r in running.drain(..) {
                let _ = r.child.kill();
                let _ = r.child.wait();
                let index = r.index;
                finished[index] = Some(r.finish(&guests[index], Some(end.clone()), None));
            }
        }
        thread::sleep(Duration::from_millis(20));
    }
    finished
        .into_iter()
        .map(|r| r.expect("every guest finished"))
        .collect()
}

struct Running {
    index: usize,
    child: Child,
    console: JoinHandle<Console>,
    stderr: JoinHandle<String>,
}

impl Running {
    /// Collects the guest's output and decides how it ended.
    fn finish(
        self,
        spec: &GuestSpec,
        forced: Option<GuestEnd>,
        qemu_status: Option<String>,
    ) -> GuestRun {
        let console = self.console.join().unwrap_or_default();
        let stderr = self.stderr.join().unwrap_or_default();
        let mut boot_log = console.before_start;
        if !stderr.trim().is_empty() {
            boot_log.push_str("--- qemu stderr ---\n");
            boot_log.push_str(&stderr);
        }
        let status = fs::read_to_string(spec.run_dir.join("status")).unwrap_or_default();
        let status = status.trim();
        let end = forced.unwrap_or_else(|| {
            if let Some(code) = status.strip_prefix("exit ") {
                match code.parse() {
                    Ok(code) => GuestEnd::Exited(code),
                    Err(_) => GuestEnd::VmFailed(format!("unreadable status line {status:?}")),
                }
            } else if let Some(what) = status.strip_prefix("setup-failed ") {
                GuestEnd::SetupFailed(what.to_string())
            } else if console.started {
                GuestEnd::VmFailed(format!(
                    "the guest stopped while the command was running (qemu {}; a kernel panic or out of memory?)",
                    qemu_status.unwrap_or_default()
                ))
            } else {
                GuestEnd::VmFailed(format!(
                    "qemu exited ({}) before the command started",
                    qemu_status.unwrap_or_default()
                ))
            }
        });
        GuestRun {
            label: spec.label.clone(),
            end,
            output: console.output,
            boot_log,
        }
    }
}

fn spawn(
    image: &BootImage,
    spec: &GuestSpec,
    capture: bool,
    lock: Arc<Mutex<()>>,
) -> Result<Running, String> {
    let mut qemu = Command::new("qemu-system-x86_64");
    qemu.args([
        "-accel",
        "tcg,thread=multi,tb-size=512",
        "-cpu",
        "Nehalem-v1",
        "-machine",
        "pc",
    ])
    .args(["-m", "2048M", "-smp", "2"])
    .args([
        "-nodefaults",
        "-no-user-config",
        "-display",
        "none",
        "-no-reboot",
        "-serial",
        "stdio",
    ])
    .arg("-kernel")
    .arg(&image.vmlinux)
    .arg("-initrd")
    .arg(&image.initramfs)
    .args(["-append", KERNEL_APPEND])
    .args([
        "-virtfs",
        "local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap",
    ])
    .arg("-virtfs")
    .arg(format!(
        "local,path={},mount_tag=rxerun,security_model=none,multidevs=remap",
        spec.run_dir.display()
    ));
    if let Some(nic) = &spec.nic {
        qemu.arg("-netdev")
            .arg(format!(
                "socket,id=wire,udp=127.0.0.1:{},localaddr=127.0.0.1:{}",
                nic.peer_port, nic.local_port
            ))
            .arg("-device")
            .arg(format!("virtio-net-pci,netdev=wire,mac={}", nic.mac));
    }
    qemu.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = qemu
        .spawn()
        .map_err(|e| format!("cannot start qemu-system-x86_64: {e}"))?;
    let stdout = child.stdout.take().expect("stdout is piped");
    let mut stderr = child.stderr.take().expect("stderr is piped");
    let label = spec.label.clone();
    let console = thread::spawn(move || read_console(stdout, &label, capture, &lock));
    let stderr = thread::spawn(move || {
        let mut text = String::new();
        let _ = stderr.read_to_string(&mut text);
        text
    });
    Ok(Running {
        index: 0,
        child,
        console,
        stderr,
    })
}

#[derive(Default)]
struct Console {
    before_start: String,
    output: String,
    started: bool,
}

/// Splits the console into boot noise and the command's output, streaming
/// the latter to our stdout.
fn read_console(stdout: impl Read, label: &str, capture: bool, lock: &Mutex<()>) -> Console {
    let mut console = Console::default();
    let mut reader = BufReader::new(stdout);
    let mut raw = Vec::new();
    let mut ended = false;
    loop {
        raw.clear();
        match reader.read_until(b'\n', &mut raw) {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
        let text = String::from_utf8_lossy(&raw);
        // The guest's tty turns "\n" into "\r\n".
        let line = text.trim_end_matches(['\n', '\r']);
        if ended {
            continue;
        }
        if !console.started {
            if line.contains(START_MARKER) {
                console.started = true;
            } else {
                console.before_start.push_str(line);
                console.before_start.push('\n');
            }
            continue;
        }
        let (line, last) = match line.find(END_MARKER) {
            Some(at) => (&line[..at], true),
            None => (line, false),
        };
        if !last || !line.is_empty() {
            let _guard = lock.lock();
            let mut out = std::io::stdout().lock();
            let _ = writeln!(out, "{label}{line}");
            let _ = out.flush();
            if capture {
                console.output.push_str(line);
                console.output.push('\n');
            }
        }
        ended = last;
    }
    console
}
