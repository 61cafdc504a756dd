//! The guest's boot image: a Debian kernel (downloaded and unpacked, never
//! installed) and a busybox initramfs with the modules Soft-RoCE needs.
//!
//! Everything is cached under `target/rxe/`: a warm run only checks that the
//! files are there and that the initramfs was built from the current
//! `init.sh` and module list.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use super::{command_output, run_quiet};

/// The guest's PID 1.
const INIT_SCRIPT: &str = include_str!("init.sh");

/// Modules to load, each with its dependencies (resolved with `modprobe
/// --show-depends` against the unpacked kernel), and the arguments to pass.
const MODULES: &[(&str, &str)] = &[
    ("virtio_pci", ""),
    ("virtio_net", ""),
    ("9pnet_virtio", ""),
    ("9p", ""),
    ("overlay", ""),
    // rxe's ICRC uses crc32; the generic one avoids crc32-pclmul on the
    // emulated CPU.
    ("crc32_generic", ""),
    ("rdma_rxe", ""),
    ("ib_uverbs", ""),
    ("rdma_ucm", ""),
    ("dummy", "numdummies=0"),
    // So tests can degrade the wire (`tc qdisc add dev eth0 root netem ...`).
    ("sch_netem", ""),
];

/// The Debian package that names the current kernel package.
const KERNEL_META_PACKAGE: &str = "linux-image-amd64";

/// What qemu boots.
pub(super) struct BootImage {
    /// The uncompressed kernel (ELF), extracted from the package's bzImage.
    pub(super) vmlinux: PathBuf,
    /// The initramfs (uncompressed newc cpio).
    pub(super) initramfs: PathBuf,
}

/// Returns the cached boot image, building whatever is missing or stale.
pub(super) fn ensure(cache: &Path) -> Result<BootImage, String> {
    fs::create_dir_all(cache).map_err(|e| format!("cannot create {}: {e}", cache.display()))?;
    let vmlinux = cache.join("vmlinux");
    let initramfs = cache.join("initramfs.cpio");
    let stamp_path = cache.join("initramfs.stamp");
    let kver_path = cache.join("kernel-version");
    let stamp = image_stamp();

    let cached_kver = fs::read_to_string(&kver_path)
        .ok()
        .map(|s| s.trim().to_string());
    let warm = cached_kver.is_some()
        && vmlinux.is_file()
        && initramfs.is_file()
        && fs::read_to_string(&stamp_path).is_ok_and(|s| s == stamp);
    if warm {
        return Ok(BootImage { vmlinux, initramfs });
    }

    let started = std::time::Instant::now();
    let kver = match cached_kver {
        Some(k) if !k.is_empty() => k,
        _ => current_kernel_version()?,
    };
    eprintln!(
        "xtask rxe: building the guest image for kernel {kver} (once; cached in {})",
        cache.display()
    );
    // Per-process names: two runs building at once do not collide (the
    // results are renamed into place).
    let work = cache.join(format!("work-{}", std::process::id()));
    if work.exists() {
        fs::remove_dir_all(&work).map_err(|e| format!("cannot clear {}: {e}", work.display()))?;
    }
    fs::create_dir_all(&work).map_err(|e| format!("cannot create {}: {e}", work.display()))?;

    let deb = download_kernel(&work, &kver)?;
    let root = work.join("root");
    run_quiet(Command::new("dpkg").arg("-x").arg(&deb).arg(&root))?;
    run_quiet(Command::new("depmod").arg("-b").arg(&root).arg(&kver))?;
    extract_vmlinux(&root.join("boot").join(format!("vmlinuz-{kver}")), &vmlinux)?;
    build_initramfs(&root, &kver, &work.join("initramfs"), &initramfs)?;

    fs::write(&kver_path, format!("{kver}\n"))
        .map_err(|e| format!("cannot write {}: {e}", kver_path.display()))?;
    fs::write(&stamp_path, &stamp)
        .map_err(|e| format!("cannot write {}: {e}", stamp_path.display()))?;
    fs::remove_dir_all(&work).map_err(|e| format!("cannot remove {}: {e}", work.display()))?;
    eprintln!(
        "xtask rxe: guest image ready in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    Ok(BootImage { vmlinux, initramfs })
}

/// What the initramfs is built from; a change rebuilds it.
fn image_stamp() -> String {
    let modules: Vec<String> = MODULES.iter().map(|(m, a)| format!("{m} {a}")).collect();
    format!("{}\n--modules--\n{}\n", INIT_SCRIPT, modules.join("\n"))
}

/// The kernel package `linux-image-amd64` currently depends on, e.g.
/// `6.1.0-56-amd64`.
fn current_kernel_version() -> Result<String, String> {
    let query = || command_output(Command::new("apt-cache").args(["depends", KERNEL_META_PACKAGE]));
    let parse = |text: &str| {
        text.lines()
            .filter_map(|l| l.trim().strip_prefix("Depends: linux-image-"))
            .map(str::trim)
            .find(|v| v.ends_with("-amd64") && v.as_bytes().first().is_some_and(u8::is_ascii_digit))
            .map(str::to_string)
    };
    if let Some(v) = query().ok().as_deref().and_then(parse) {
        return Ok(v);
    }
    // A fresh machine may have no package lists yet.
    run_quiet(Command::new("apt-get").args(["update", "-qq"]))?;
    let text = query()?;
    parse(&text).ok_or_else(|| {
        format!("`apt-cache depends {KERNEL_META_PACKAGE}` names no linux-image-*-amd64:\n{text}")
    })
}

fn download_kernel(work: &Path, kver: &str) -> Result<PathBuf, String> {
    let package = format!("linux-image-{kver}");
    run_quiet(
        Command::new("apt-get")
            .args(["download", "-qq", &package])
            .current_dir(work),
    )?;
    fs::read_dir(work)
        .map_err(|e| format!("cannot list {}: {e}", work.display()))?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(&package) && n.ends_with(".deb"))
        })
        .ok_or_else(|| {
            format!(
                "`apt-get download {package}` left no .deb in {}",
                work.display()
            )
        })
}

/// Writes the uncompressed kernel: the bzImage carries it as an XZ stream,
/// and booting it directly saves the guest ~6 s of emulated decompression.
fn extract_vmlinux(bzimage: &Path, out: &Path) -> Result<(), String> {
    const XZ_MAGIC: &[u8] = &[0xFD, 0x37, 0x7A, 0x58, 0x5A, 0x00];
    let data = fs::read(bzimage).map_err(|e| format!("cannot read {}: {e}", bzimage.display()))?;
    let start = data
        .windows(XZ_MAGIC.len())
        .position(|w| w == XZ_MAGIC)
        .ok_or_else(|| format!("no XZ stream in {}", bzimage.display()))?;
    let tmp = out.with_extension(format!("partial-{}", std::process::id()));
    let file =
        fs::File::create(&tmp).map_err(|e| format!("cannot create {}: {e}", tmp.display()))?;
    let mut xz = Command::new("xz")
        .args(["-dc", "--single-stream"])
        .stdin(Stdio::piped())
        .stdout(file)
        .spawn()
        .map_err(|e| format!("cannot run xz: {e}"))?;
    let mut stdin = xz.stdin.take().expect("stdin is piped");
    let written = stdin.write_all(&data[start..]);
    drop(stdin);
    let status = xz.wait().map_err(|e| format!("xz: {e}"))?;
    // xz stops reading after the first stream, so the write may see EPIPE.
    if !status.success() {
        return Err(format!(
            "xz could not decompress the kernel in {} ({status}, {written:?})",
            bzimage.display()
        ));
    }
    fs::rename(&tmp, out).map_err(|e| format!("cannot rename {}: {e}", tmp.display()))
}

/// Builds the initramfs: busybox, `init`, the modules and their load order.
fn build_initramfs(kroot: &Path, kver: &str, dir: &Path, out: &Path) -> Result<(), String> {
    let mkdir =
        |p: &Path| fs::create_dir_all(p).map_err(|e| format!("cannot create {}: {e}", p.display()));
    mkdir(&dir.join("bin"))?;
    mkdir(&dir.join("modules"))?;
    copy(Path::new("/bin/busybox"), &dir.join("bin/busybox"))?;
    let init = dir.join("init");
    fs::write(&init, INIT_SCRIPT).map_err(|e| format!("cannot write {}: {e}", init.display()))?;
    set_executable(&init)?;

    let mut order: Vec<(String, String)> = Vec::new();
    for (module, args) in MODULES {
        let text = command_output(Command::new("modprobe").arg("-d").arg(kroot).args([
            "-S",
            kver,
            "--show-depends",
            module,
        ]))?;
        for line in text.lines() {
            let Some(rest) = line.strip_prefix("insmod ") else {
                continue; // `builtin X`: nothing to load
            };
            let path = rest.split_whitespace().next().unwrap_or_default();
            let name = Path::new(path)
                .file_name()
                .and_then(|n| n.to_str())
                .ok_or_else(|| format!("odd modprobe output line: {line}"))?
                .to_string();
            if order.iter().any(|(n, _)| *n == name) {
                continue;
            }
            if !name.ends_with(".ko") {
                return Err(format!(
                    "module {path} is compressed; busybox insmod needs plain .ko files"
                ));
            }
            copy(Path::new(path), &dir.join("modules").join(&name))?;
            let own = Path::new(&name).file_stem().and_then(|s| s.to_str())
                == Some(&module.replace('-', "_"));
            order.push((
                name,
                if own {
                    (*args).to_string()
                } else {
                    String::new()
                },
            ));
        }
    }
    let order_text: String = order.iter().map(|(n, a)| format!("{n} {a}\n")).collect();
    fs::write(dir.join("modules/order"), order_text)
        .map_err(|e| format!("cannot write the module order: {e}"))?;

    let tmp = out.with_extension(format!("partial-{}", std::process::id()));
    let file =
        fs::File::create(&tmp).map_err(|e| format!("cannot create {}: {e}", tmp.display()))?;
    let status = Command::new("sh")
        .args([
            "-c",
            "find . -print | LC_ALL=C sort | cpio --quiet -o -H newc",
        ])
        .current_dir(dir)
        .stdout(file)
        .status()
        .map_err(|e| format!("cannot run cpio: {e}"))?;
    if !status.success() {
        return Err(format!("building the initramfs with cpio failed: {status}"));
    }
    fs::rename(&tmp, out).map_err(|e| format!("cannot rename {}: {e}", tmp.display()))
}

fn copy(from: &Path, to: &Path) -> Result<(), String> {
    fs::copy(from, to)
        .map(drop)
        .map_err(|e| format!("cannot copy {} to {}: {e}", from.display(), to.display()))
}

fn set_executable(path: &Path) -> Result<(), String> {
    use std::os::unix::fs::PermissionsExt;
    fs::set_permissions(path, fs::Permissions::from_mode(0o755))
        .map_err(|e| format!("cannot chmod {}: {e}", path.display()))
}
