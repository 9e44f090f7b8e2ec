//! Installing, as a user meets it, on Debian's own packages: the dist binary
//! (`cargo xtask dist`) copied alone into debootstrap'd Debian 11 and 13
//! roots and run there (chroot, this host's kernel): `profiler doctor`, and an
//! attach to the synthetic trainer compared with its ground truth; and
//! `cargo xtask setup` in a Debian 12 root, its packages compared before and
//! after. The roots are debootstrap'd once (`--variant=minbase`) into
//! /var/cache/profiler/roots/ as tarballs, and unpacked afresh for each test.
use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    process::{Command, Output},
    time::Instant,
};

use integration_tests::{Agent, Trainer, assert_steps_match, last_session, skip, steps, workdir};

const ROOTS: &str = "/var/cache/profiler/roots";
const MIRROR: &str = "http://deb.debian.org/debian";
/// Where the tests put what they copy into a root.
const IN_ROOT_BIN: &str = "/usr/local/bin";
const IN_ROOT_FIXTURES: &str = "/opt/profiler-fixtures";

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

fn sh(cmd: &mut Command) -> Result<Output, String> {
    let out = cmd.output().map_err(|e| format!("cannot start {cmd:?}: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "{cmd:?} failed ({}): {}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(out)
}

/// `suite`'s minbase root as a tarball, debootstrap'd the first time (and
/// said with its time), without apt's package lists and downloaded .debs.
fn root_tarball(suite: &str) -> Result<PathBuf, String> {
    let tarball = Path::new(ROOTS).join(format!("{suite}-minbase.tar.gz"));
    if tarball.exists() {
        return Ok(tarball);
    }
    if Command::new("debootstrap").arg("--version").output().is_err() {
        return Err("no debootstrap here (Debian's debootstrap package; .ci/run installs it)".into());
    }
    std::fs::create_dir_all(ROOTS).map_err(|e| format!("cannot make {ROOTS}: {e}"))?;
    let dir = Path::new(ROOTS).join(format!("{suite}-minbase.building"));
    let _ = std::fs::remove_dir_all(&dir);
    let t0 = Instant::now();
    sh(Command::new("debootstrap").args(["--variant=minbase", suite]).arg(&dir).arg(MIRROR))
        .map_err(|e| format!("debootstrap {suite} from {MIRROR}: {e}"))?;
    let boot = t0.elapsed();
    for cached in ["var/cache/apt", "var/lib/apt/lists"] {
        for e in std::fs::read_dir(dir.join(cached)).into_iter().flatten().flatten() {
            let p = e.path();
            let _ = if p.is_dir() { std::fs::remove_dir_all(&p) } else { std::fs::remove_file(&p) };
        }
    }
    let _ = std::fs::create_dir_all(dir.join("var/cache/apt/archives/partial"));
    let _ = std::fs::create_dir_all(dir.join("var/lib/apt/lists/partial"));
    let partial = tarball.with_extension("partial");
    sh(Command::new("tar").arg("-C").arg(&dir).arg("-czf").arg(&partial).arg("."))?;
    std::fs::rename(&partial, &tarball).map_err(|e| e.to_string())?;
    let _ = std::fs::remove_dir_all(&dir);
    let size = std::fs::metadata(&tarball).map(|m| m.len()).unwrap_or(0);
    println!(
        "debootstrap --variant=minbase {suite}: {:.0} s, cached as {} ({:.0} MiB)",
        boot.as_secs_f64(),
        tarball.display(),
        size as f64 / (1 << 20) as f64
    );
    Ok(tarball)
}

/// A root unpacked for one test, with this host's /proc, /sys (its bpf and
/// debug file systems too) and /dev mounted in; unmounted when dropped.
struct Chroot {
    dir: PathBuf,
    mounts: Vec<PathBuf>,
}

impl Chroot {
    fn new(test: &str, suite: &str) -> Result<Chroot, String> {
        let tarball = root_tarball(suite)?;
        let dir = workdir(test).join("root");
        std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
        sh(Command::new("tar").arg("-C").arg(&dir).arg("-xzf").arg(&tarball))?;
        let mut root = Chroot { dir, mounts: Vec::new() };
        for m in ["/proc", "/sys", "/dev"] {
            root.bind(Path::new(m), m, false)?;
        }
        // The root's own apt reaches the mirror with the host's resolver.
        std::fs::copy("/etc/resolv.conf", root.path("/etc/resolv.conf")).map_err(|e| e.to_string())?;
        Ok(root)
    }

    fn path(&self, inside: &str) -> PathBuf {
        self.dir.join(inside.trim_start_matches('/'))
    }

    /// Mounts `src` (and what is mounted below it) at `inside`; slave, so
    /// that unmounting there never reaches the host's mounts.
    fn bind(&mut self, src: &Path, inside: &str, read_only: bool) -> Result<(), String> {
        let at = self.path(inside);
        std::fs::create_dir_all(&at).map_err(|e| e.to_string())?;
        sh(Command::new("mount").arg("--rbind").arg(src).arg(&at))?;
        self.mounts.push(at.clone());
        sh(Command::new("mount").arg("--make-rslave").arg(&at))?;
        if read_only {
            sh(Command::new("mount").args(["-o", "remount,bind,ro"]).arg(&at))?;
        }
        Ok(())
    }

    fn command(&self, program: &str) -> Command {
        let mut c = Command::new("chroot");
        c.arg(&self.dir).arg(program).env_clear().env("PATH", "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin");
        c
    }

    fn copy_in(&self, from: &Path, inside: &str) {
        let to = self.path(inside);
        std::fs::create_dir_all(to.parent().expect("a folder")).expect("make folder in root");
        std::fs::copy(from, &to).unwrap_or_else(|e| panic!("copy {} into the root: {e}", from.display()));
    }

    /// `Package Version` of each installed package.
    fn packages(&self) -> BTreeMap<String, String> {
        let out = sh(self.command("dpkg-query").args(["-W", "-f", "${Package} ${Version} ${db:Status-Abbrev}\\n"]))
            .expect("dpkg-query in the root");
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter(|l| l.ends_with("ii "))
            .filter_map(|l| l.split_once(' '))
            .map(|(p, rest)| (p.to_owned(), rest.trim_end().rsplit_once(' ').map_or(rest, |(v, _)| v).to_owned()))
            .collect()
    }

    /// Every file under `inside` with its contents.
    fn files(&self, inside: &str) -> BTreeMap<PathBuf, Vec<u8>> {
        fn walk(dir: &Path, out: &mut BTreeMap<PathBuf, Vec<u8>>) {
            for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
                let p = e.path();
                if p.is_dir() && !p.is_symlink() {
                    walk(&p, out);
                } else {
                    out.insert(p.clone(), std::fs::read(&p).unwrap_or_default());
                }
            }
        }
        let mut out = BTreeMap::new();
        walk(&self.path(inside), &mut out);
        out
    }
}

impl Drop for Chroot {
    fn drop(&mut self) {
        for m in self.mounts.iter().rev() {
            let ok = Command::new("umount").arg("-R").arg(m).status().is_ok_and(|s| s.success());
            if !ok {
                let _ = Command::new("umount").arg("-R").arg("-l").arg(m).status();
            }
        }
        if self.mounts.iter().all(|m| std::fs::read_dir(m).map_or(true, |mut d| d.next().is_none())) {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// The dist binary and its old-glibc fixtures, or why they are not here.
fn dist() -> Option<(PathBuf, PathBuf)> {
    if !is_root() {
        skip("chroot and mounts need root");
        return None;
    }
    let (Some(bin), Some(fx)) = (std::env::var_os("PROFILER_DIST_BIN"), std::env::var_os("PROFILER_DIST_FIXTURES"))
    else {
        let why =
            std::env::var("PROFILER_DIST_UNAVAILABLE").unwrap_or_else(|_| "run through `cargo xtask test`".into());
        skip(format!("no dist binary: {why}"));
        return None;
    };
    Some((bin.into(), fx.into()))
}

/// The dist binary alone in `suite`'s root: doctor says attach would work,
/// and an attach to the trainer there records exactly its steps and launches.
fn dist_binary_in(test: &str, suite: &str, version_id: &str, glibc: &str) {
    let Some((bin, fx)) = dist() else { return };
    let root = match Chroot::new(test, suite) {
        Ok(r) => r,
        Err(why) => return skip(format!("no Debian {suite} root: {why}")),
    };
    let os = std::fs::read_to_string(root.path("/etc/os-release")).expect("the root's os-release");
    assert!(os.contains(&format!("VERSION_ID=\"{version_id}\"")), "{os}");
    let libc = sh(&mut root.command("/lib/x86_64-linux-gnu/libc.so.6")).expect("the root's libc runs");
    let libc = String::from_utf8_lossy(&libc.stdout).into_owned();
    assert!(libc.contains(&format!("version {glibc}")), "the root's glibc is not {glibc}: {libc}");
    // Nothing of the host's toolchain in the root: no rustc, no LLVM, no compiler.
    for absent in ["usr/bin/rustc", "usr/bin/cc", "usr/bin/gcc", "usr/lib/llvm-22"] {
        assert!(!root.path(absent).exists(), "{absent} in a minbase root");
    }
    root.copy_in(&bin, &format!("{IN_ROOT_BIN}/profiler"));
    root.copy_in(&fx.join("trainer"), &format!("{IN_ROOT_FIXTURES}/trainer"));
    root.copy_in(&fx.join("libcuda.so.1"), &format!("{IN_ROOT_FIXTURES}/libcuda.so.1"));

    let doctor = root.command("profiler").arg("doctor").output().expect("run doctor in the root");
    let text = String::from_utf8_lossy(&doctor.stdout);
    println!("profiler doctor in Debian {version_id}:\n{text}{}", String::from_utf8_lossy(&doctor.stderr));
    assert!(doctor.status.success() && text.contains("attach would work"), "doctor in Debian {version_id}: {text}");

    let trainer_args = ["--steps", "50", "--launches", "100", "--threads", "2"];
    let mut trainer =
        Trainer::spawn_in_root(&root.dir, &format!("{IN_ROOT_FIXTURES}/trainer"), IN_ROOT_FIXTURES, &trainer_args);
    let mut attach = root.command("profiler");
    attach.args(["attach", &trainer.pid().to_string(), "-o", "/tmp/p.db", "--step-symbol", "train_step"]);
    let agent = Agent::spawn(attach, true);
    trainer.go();
    assert!(trainer.wait().success(), "trainer failed");
    let (status, stderr) = agent.finish();
    assert!(status.success(), "profiler failed in Debian {version_id}: {stderr}");
    let truth = trainer.truth();
    let db = root.path("/tmp/p.db");
    let s = last_session(&db);
    assert_eq!(s.end_reason.as_deref(), Some("target-exited"), "{stderr}");
    assert_eq!(s.lost_events, Some(0));
    assert_eq!(truth.steps.len(), 100);
    assert_steps_match(&truth.steps, &steps(&db, s.id), 50_000_000);
    assert_eq!(s.total_launches, Some(truth.total as i64));
    assert_eq!(truth.total, 100 * 100);
}

#[test]
fn dist_binary_on_debian_11() {
    dist_binary_in("dist-debian-11", "bullseye", "11", "2.31");
}

#[test]
fn dist_binary_on_debian_13() {
    dist_binary_in("dist-debian-13", "trixie", "13", "2.41");
}

/// `xtask setup` in a Debian 12 minbase root, with this host's rustup
/// toolchains (read-only) and a fresh CARGO_HOME: it installs gcc from
/// bookworm's archive and builds bpf-linker against nightly's libLLVM.
/// Afterwards no package has another version, the packages added are exactly
/// those it named before installing, and nothing under /etc/apt changed. A
/// second run installs nothing.
#[test]
fn setup_changes_only_what_it_names() {
    if !is_root() {
        return skip("chroot and mounts need root");
    }
    let (Some(xtask), Some(rustup_home)) =
        (std::env::var_os("PROFILER_XTASK_BIN"), std::env::var_os("PROFILER_RUSTUP_HOME"))
    else {
        return skip("PROFILER_XTASK_BIN / PROFILER_RUSTUP_HOME not set: run through `cargo xtask test`");
    };
    let mut root = match Chroot::new("setup-debian-12", "bookworm") {
        Ok(r) => r,
        Err(why) => return skip(format!("no Debian bookworm root: {why}")),
    };
    let rustup_home = PathBuf::from(rustup_home);
    let rustup_inside = rustup_home.to_str().expect("utf-8 RUSTUP_HOME").to_owned();
    root.bind(&rustup_home, &rustup_inside, true).expect("bind RUSTUP_HOME");
    // rustup and its proxies (cargo, rustc: argv[0] says which) outside
    // CARGO_HOME, which is the root's own and empty: what setup builds goes there.
    root.copy_in(&which_rustup(), "/opt/rustup-bin/rustup");
    for proxy in ["cargo", "rustc"] {
        std::os::unix::fs::symlink("rustup", root.path(&format!("/opt/rustup-bin/{proxy}"))).expect("proxy link");
    }
    root.copy_in(Path::new(&xtask), &format!("{IN_ROOT_BIN}/xtask"));
    // cargo reaches crates.io with the host's CA bundle (a minbase root has
    // none, and this network may present its own CA), as a file in /tmp: no
    // package, nothing under /etc.
    let host_ca = Path::new("/etc/ssl/certs/ca-certificates.crt");
    if host_ca.exists() {
        root.copy_in(host_ca, "/tmp/host-ca.crt");
    }

    // setup keeps bpf-linker's build in its cache (/var/cache/profiler/bpf-linker-build):
    // this root's is one kept beside the roots, for this test only, so that
    // a later run builds again only what changed (a new nightly), as on a
    // user's machine. The packages and /etc/apt are what is compared.
    let build_cache = Path::new(ROOTS).join("bookworm-bpf-linker-build");
    std::fs::create_dir_all(&build_cache).expect("make the root's bpf-linker build cache");
    root.bind(&build_cache, "/var/cache/profiler/bpf-linker-build", false).expect("bind the build cache");

    let before = root.packages();
    let apt_before = root.files("/etc/apt");
    assert!(!before.contains_key("gcc"), "gcc in a minbase root");
    let setup = |root: &Chroot| -> (bool, String) {
        let out = root
            .command(&format!("{IN_ROOT_BIN}/xtask"))
            .arg("setup")
            .env("PATH", "/root/.cargo/bin:/opt/rustup-bin:/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin")
            .env("HOME", "/root")
            .env("RUSTUP_HOME", &rustup_inside)
            .env("CARGO_HOME", "/root/.cargo")
            .env("CARGO_HTTP_CAINFO", "/tmp/host-ca.crt")
            .output()
            .expect("run xtask setup in the root");
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        (out.status.success(), text)
    };
    let t0 = Instant::now();
    let (ok, said) = setup(&root);
    println!("xtask setup in Debian 12 ({:.0} s):\n{said}", t0.elapsed().as_secs_f64());
    assert!(ok, "setup failed in the Debian 12 root:\n{said}");
    let after = root.packages();

    let announced = said.find("installing gcc and libc6-dev from Debian 12 (bookworm)'s own archive");
    let named_line = said.lines().find_map(|l| l.split_once(": adds ").map(|(_, names)| names.to_owned()));
    let (Some(announced), Some(named)) = (announced, named_line) else {
        panic!("setup did not say what it installs, from where, before installing:\n{said}")
    };
    assert!(announced < said.find(": adds ").unwrap_or(0));
    let named: Vec<&str> = named.split_whitespace().collect();
    assert!(named.contains(&"gcc") && named.contains(&"libc6-dev"), "{named:?}");
    let changed: Vec<String> = before
        .iter()
        .filter(|(p, v)| after.get(*p) != Some(v))
        .map(|(p, v)| format!("{p} {v} → {}", after.get(p).map_or("(removed)", String::as_str)))
        .collect();
    assert!(changed.is_empty(), "setup changed packages it did not name: {changed:?}");
    let added: Vec<&str> = after.keys().filter(|p| !before.contains_key(*p)).map(String::as_str).collect();
    let mut named_sorted = named.clone();
    named_sorted.sort_unstable();
    assert_eq!(added, named_sorted, "the packages added are not the ones setup named");
    assert!(root.files("/etc/apt") == apt_before, "setup changed files under /etc/apt");
    let linker = sh(root.command("/root/.cargo/bin/bpf-linker").arg("--version")).expect("bpf-linker runs in the root");
    assert_eq!(String::from_utf8_lossy(&linker.stdout).trim(), "bpf-linker 0.13.0");
    println!("setup added {} packages ({}), changed none", added.len(), added.join(" "));

    let (ok, again) = setup(&root);
    assert!(ok && !again.contains("installing"), "a second setup did something:\n{again}");
    assert_eq!(root.packages(), after, "a second setup changed packages");
}

/// rustup itself (the proxies are links to it).
fn which_rustup() -> PathBuf {
    let home = std::env::var_os("PROFILER_CARGO_HOME").map(PathBuf::from).unwrap_or_else(|| "/root/.cargo".into());
    let rustup = home.join("bin/rustup");
    assert!(rustup.exists(), "no rustup at {}", rustup.display());
    rustup
}
