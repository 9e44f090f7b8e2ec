//! End-to-end checks of USDT attachment on a live CPython: they need root,
//! the eBPF object embedded in this binary, Debian's python3.11 and the
//! stand-in libcuda (`cargo xtask build`). Run with
//! `cargo test -p profiler python::usdt::root_tests -- --ignored --nocapture --test-threads 1`.
use std::{
    collections::BTreeMap,
    fs::File,
    io,
    num::NonZeroU32,
    os::unix::fs::{FileExt, MetadataExt},
    path::{Path, PathBuf},
    process::{Child, Command},
    time::{Duration, Instant},
};

use super::{PythonProbes, find_in_process};
use crate::{
    events::{Event, decode, records},
    probes::{
        Probes, in_target_root,
        maps::LibraryKind,
        python::spec::{PythonStepSpec, PythonTarget},
    },
    steps::{CompletedStep, StepTracker},
};

const PYTHON: &str = "/usr/bin/python3.11";

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn fixtures() -> PathBuf {
    repo().join("target/fixtures")
}

fn preconditions() {
    // SAFETY: geteuid has no preconditions.
    assert_eq!(unsafe { libc::geteuid() }, 0, "needs root: it loads eBPF programs");
    assert!(Path::new(PYTHON).exists(), "needs Debian's {PYTHON}, which has CPython's USDT probes");
    assert!(fixtures().join("libcuda.so.1").exists(), "needs the stand-in libcuda: run `cargo xtask build`");
}

/// A child that is killed if the test fails before it exits.
struct Target(Child);

impl Drop for Target {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Target {
    fn pid(&self) -> NonZeroU32 {
        NonZeroU32::new(self.0.id()).expect("a child has a PID")
    }
}

/// Starts `python3.11 args…`.
fn start_python(args: &[&str]) -> Target {
    start(Path::new(PYTHON), args)
}

/// Starts `exe args…` and waits until the exec has mapped the executable's
/// writable segment (the exe link changes before the segments are mapped),
/// so that its semaphores can be read.
fn start(exe: &Path, args: &[&str]) -> Target {
    let child = Command::new(exe).args(args).env("LD_LIBRARY_PATH", fixtures()).spawn().expect("start the target");
    let target = Target(child);
    let t0 = Instant::now();
    let ready = || {
        let maps = procfs::process::Process::new(target.0.id() as i32).and_then(|p| p.maps());
        maps.is_ok_and(|m| {
            m.iter().any(|m| {
                m.perms.contains(procfs::process::MMPermissions::WRITE)
                    && matches!(&m.pathname, procfs::process::MMapPath::Path(p) if p == exe)
            })
        })
    };
    while !ready() {
        assert!(t0.elapsed() < Duration::from_secs(10), "{} never started", exe.display());
        std::thread::sleep(Duration::from_millis(1));
    }
    target
}

fn start_trainer(args: &[&str], dir: &Path) -> Target {
    let script = repo().join("tests/fixtures/py_trainer.py");
    let truth = dir.join("truth.txt");
    let go = dir.join("go");
    let mut all: Vec<&str> = vec![script.to_str().expect("utf-8 path")];
    all.extend_from_slice(args);
    all.extend(["--truth", truth.to_str().expect("utf-8"), "--wait-file", go.to_str().expect("utf-8")]);
    start_python(&all)
}

#[derive(Debug, Default)]
struct Truth {
    /// (tid, start, end, launches, label)
    steps: Vec<(u32, u64, u64, u64, String)>,
    raised: u64,
    total: u64,
    calls: Option<(u64, u64)>,
}

fn read_truth(dir: &Path) -> Truth {
    let text = std::fs::read_to_string(dir.join("truth.txt")).expect("the trainer wrote its truth");
    let mut t = Truth::default();
    for line in text.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        let n = |i: usize| f[i].parse::<u64>().expect("a number");
        match f.first().copied() {
            Some("step") => t.steps.push((n(1) as u32, n(2), n(3), n(4), f[5].to_owned())),
            Some("raised") => t.raised = n(1),
            Some("total") => t.total = n(1),
            Some("calls") => t.calls = Some((n(1), n(2))),
            _ => {}
        }
    }
    t
}

/// One mapping of a file in a process (a line of /proc/PID/maps).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct FileMapping {
    start: u64,
    end: u64,
    /// Offset in the file of `start`.
    offset: u64,
    writable: bool,
}

/// Every mapping of `file` (a path this process can open) in process `pid`,
/// matched by device and inode.
fn file_mappings(pid: u32, file: &Path) -> io::Result<Vec<FileMapping>> {
    let meta = std::fs::metadata(file)?;
    let dev = (libc::major(meta.dev()) as i32, libc::minor(meta.dev()) as i32);
    let maps = procfs::process::Process::new(pid as i32)
        .and_then(|p| p.maps())
        .map_err(|e| io::Error::other(e.to_string()))?;
    Ok(maps
        .iter()
        .filter(|m| m.inode == meta.ino() && m.dev == dev)
        .map(|m| FileMapping {
            start: m.address.0,
            end: m.address.1,
            offset: m.offset,
            writable: m.perms.contains(procfs::process::MMPermissions::WRITE),
        })
        .collect())
}

/// Where the byte at `file_offset` of a file is in the process, given that
/// file's mappings. Like the kernel for a reference counter, only private
/// writable mappings count: the read-only ones of the same page are the
/// file's bytes, not the process's copy.
fn file_offset_to_address(mappings: &[FileMapping], file_offset: u64) -> Option<u64> {
    mappings
        .iter()
        .filter(|m| m.writable)
        .find(|m| file_offset >= m.offset && file_offset - m.offset < m.end - m.start)
        .map(|m| m.start + (file_offset - m.offset))
}

/// Reads the `unsigned short` semaphore at `file_offset` of `file` in
/// process `pid`: how many uprobes the kernel has counted into it.
fn read_semaphore(pid: u32, file: &Path, file_offset: u64) -> io::Result<u16> {
    let addr = file_offset_to_address(&file_mappings(pid, file)?, file_offset).ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::NotFound,
            format!("{} offset {file_offset:#x} not mapped writable", file.display()),
        )
    })?;
    let mut buf = [0u8; 2];
    File::open(format!("/proc/{pid}/mem"))?.read_exact_at(&mut buf, addr)?;
    Ok(u16::from_ne_bytes(buf))
}

#[test]
fn file_offsets_resolve_through_the_writable_mapping_only() {
    // python3.11 (non-PIE): the data segment's page 0x684000 is mapped
    // twice, read-only (RELRO) and then writable.
    let maps = [
        FileMapping { start: 0xa83000, end: 0xa84000, offset: 0x683000, writable: false },
        FileMapping { start: 0xa84000, end: 0xa85000, offset: 0x684000, writable: true },
    ];
    assert_eq!(file_offset_to_address(&maps, 0x684260), Some(0xa84260));
    assert_eq!(file_offset_to_address(&maps, 0x683010), None);
    assert_eq!(file_offset_to_address(&maps, 0x685000), None);
    // A PIE library: the load bias shows up in start - offset.
    let lib = [FileMapping { start: 0x7f00_0000_3000, end: 0x7f00_0000_5000, offset: 0x2000, writable: true }];
    assert_eq!(file_offset_to_address(&lib, 0x2ffe), Some(0x7f00_0000_3ffe));
}

/// The entry probe's semaphore and (CPython 3.11) the line probe's.
fn semaphore_of(pid: NonZeroU32, python: &PythonProbes) -> (u16, Option<u16>) {
    let path = in_target_root(pid.get(), &python.path);
    let read = |offset| read_semaphore(pid.get(), &path, offset).expect("read the semaphore");
    let entry = python.entry[0].semaphore_file_offset.expect("CPython's probes have semaphores");
    (read(entry), python.tracing_switch.as_ref().map(|t| read(t.line_semaphore_file_offset)))
}

/// Both rings' records (steps do not need the launches' order here: their
/// launch counts come with them).
fn drain(rings: &mut crate::probes::Rings, events: &mut Vec<Event>) {
    for ring in [&mut rings.launches, &mut rings.ordered] {
        while let Some(item) = ring.next() {
            events.extend(records(&item).map(|r| decode(r).expect("a valid record")));
        }
    }
}

struct Traced {
    truth: Truth,
    steps: Vec<CompletedStep>,
    unmatched_returns: u64,
}

/// Runs the trainer with `args`, traced with `specs` (label ids in order),
/// and the launch probes on the stand-in driver; returns what the kernel
/// reported, paired into steps by the session's own tracker.
fn run_traced(args: &[&str], specs: &[&str]) -> Traced {
    preconditions();
    let dir = tempfile::tempdir().expect("tempdir");
    let target = start_trainer(args, dir.path());
    let pid = target.pid();
    let (mut probes, mut ring) = Probes::load(pid, true, false).expect("load the eBPF object");
    // The trainer dlopens the driver after --wait-file: probes by inode apply
    // when it is mapped.
    let placed =
        probes.attach_cuda_library(LibraryKind::Driver, &fixtures().join("libcuda.so.1"), &[], 0).expect("cuda");
    assert!(placed.is_some_and(|p| !p.is_empty()));
    let python = find_in_process(pid.get()).expect("python3.11 has USDT probes");
    let targets: Vec<PythonTarget> = specs
        .iter()
        .enumerate()
        .map(|(i, s)| PythonTarget { spec: PythonStepSpec::parse(s).expect("spec"), label_id: i as u32 })
        .collect();
    let before = semaphore_of(pid, &python);
    let steps = probes.attach_python(&python, &targets).expect("attach USDT");
    assert_eq!(steps.sites(), python.entry.len() + python.ret.len());
    // Ground truth from the target's memory: the kernel set the semaphore.
    let line = |n| python.tracing_switch.as_ref().map(|_| n);
    assert_eq!((before, semaphore_of(pid, &python)), ((0, line(0)), (1, line(1))), "semaphores before/after");

    std::fs::write(dir.path().join("go"), b"").expect("go");
    let mut events = Vec::new();
    let mut target = target;
    let t0 = Instant::now();
    let status = loop {
        drain(&mut ring, &mut events);
        if let Some(s) = target.0.try_wait().expect("wait") {
            break s;
        }
        assert!(t0.elapsed() < Duration::from_secs(120), "trainer never finished");
        std::thread::sleep(Duration::from_millis(5));
    };
    assert!(status.success(), "trainer: {status}");
    drain(&mut ring, &mut events);
    steps.detach();
    probes.detach();

    let labels: Vec<&'static str> =
        targets.iter().map(|t| &*Box::leak(t.spec.label.clone().into_boxed_str())).collect();
    let mut tracker = StepTracker::new(labels);
    let mut completed = Vec::new();
    for e in events {
        match e {
            Event::StepEnter(s) => {
                tracker.enter(s.tid, s.probe, s.ts_ns, s.counters);
            }
            Event::StepExit(s) => completed.extend(tracker.exit(s.tid, s.probe, s.ts_ns, s.counters)),
            Event::Launch(_)
            | Event::SyncEnter(_)
            | Event::SyncExit(_)
            | Event::KernelName(_)
            | Event::ThreadExit(_)
            | Event::RegionEnter(_)
            | Event::RegionExit(_)
            | Event::Collective(_)
            | Event::Blas(_)
            | Event::Copy(_)
            | Event::OffCpu(_)
            | Event::CpuSample(_)
            | Event::JitEnter(_)
            | Event::JitExit(_)
            | Event::LoaderChange { .. }
            | Event::Process(_) => {}
        }
    }
    assert!(tracker.open_steps().is_empty(), "steps left open: {:?}", tracker.open_steps());
    Traced { truth: read_truth(dir.path()), steps: completed, unmatched_returns: tracker.unmatched_returns }
}

/// Per label and thread, the traced steps against the trainer's own: same
/// count, same launches each, and each traced interval encloses the one the
/// function measured from inside, by less than `slack`.
fn compare(t: &Traced, label_map: &[(&str, &str)], slack: Duration) {
    assert_eq!(t.unmatched_returns, 0);
    for &(label, truth_label) in label_map {
        let mut want: BTreeMap<u32, Vec<(u64, u64, u64)>> = BTreeMap::new();
        for (tid, s, e, l, lab) in &t.truth.steps {
            if lab == truth_label {
                want.entry(*tid).or_default().push((*s, *e, *l));
            }
        }
        let mut got: BTreeMap<u32, Vec<(u64, u64, u64)>> = BTreeMap::new();
        for s in t.steps.iter().filter(|s| s.label == label) {
            got.entry(s.tid).or_default().push((s.start_ns, s.end_ns, s.launches));
        }
        for v in want.values_mut().chain(got.values_mut()) {
            v.sort_unstable();
        }
        let count = |m: &BTreeMap<u32, Vec<_>>| m.values().map(Vec::len).sum::<usize>();
        assert!(count(&want) > 0, "the run has {truth_label} steps");
        assert_eq!(
            want.iter().map(|(k, v)| (*k, v.len())).collect::<Vec<_>>(),
            got.iter().map(|(k, v)| (*k, v.len())).collect::<Vec<_>>(),
            "{label}: steps per thread"
        );
        let mut worst = 0u64;
        for (tid, w) in &want {
            for (&(ws, we, wl), &(gs, ge, gl)) in w.iter().zip(&got[tid]) {
                assert_eq!(gl, wl, "{label} step of thread {tid} at {ws}: launches");
                assert!(gs <= ws && we <= ge, "{label}: traced [{gs}, {ge}] encloses measured [{ws}, {we}]");
                worst = worst.max((ws - gs) + (ge - we));
            }
        }
        assert!(worst < slack.as_nanos() as u64, "{label}: boundaries off by up to {worst} ns");
        eprintln!("{label}: {} steps match, boundaries within {worst} ns", count(&got));
    }
}

#[test]
#[ignore = "needs root, the eBPF object, /usr/bin/python3.11 and the stand-in libcuda"]
fn python_steps_by_name_match_the_trainers_truth() {
    let t = run_traced(
        &[
            "--steps",
            "25",
            "--launches",
            "7",
            "--val-every",
            "4",
            "--val-launches",
            "3",
            "--threads",
            "3",
            "--nest",
            "3",
            "--raise-every",
            "6",
        ],
        &["train_step", "val=validate"],
    );
    // Exceptions leave the step function too: function__return fires on unwinding.
    assert_eq!(t.truth.raised, 3 * 4);
    assert_eq!(t.truth.total, 3 * (25 * 7 + 6 * 3));
    compare(&t, &[("train", "train"), ("val", "validate")], Duration::from_millis(5));
}

#[test]
#[ignore = "needs root, the eBPF object, /usr/bin/python3.11 and the stand-in libcuda"]
fn file_suffixes_tell_same_named_functions_apart() {
    let t = run_traced(
        &["--steps", "12", "--launches", "5", "--threads", "2", "--nest", "2", "--nest-mode", "module"],
        &["py_trainer.py:train_step", "inner=py_helper.py:train_step"],
    );
    compare(&t, &[("train", "train"), ("inner", "helper")], Duration::from_millis(5));
    // A suffix matches at a path boundary only: `trainer.py` is not `py_trainer.py`.
    let t = run_traced(&["--steps", "3", "--launches", "2"], &["trainer.py:train_step", "other=train_step"]);
    assert!(t.steps.iter().all(|s| s.label == "other"), "{:?}", t.steps);
    assert_eq!(t.steps.len(), 3);
}

/// Every operand form the decoder handles, read by the kernel side from a
/// live process: each site of `usdt_forms.c` passes a different function
/// name through a different form, and each must be seen exactly as often as
/// the fixture calls it. Two targets also check the file name (argument 0),
/// passed in a register at one site and as an address constant at another.
#[test]
#[ignore = "needs root, the eBPF object and a C compiler"]
fn every_argument_form_reads_the_right_value() {
    preconditions();
    const COUNT: u64 = 50;
    let dir = tempfile::tempdir().expect("tempdir");
    let exe = dir.path().join("usdt_forms");
    let built = Command::new("cc")
        .args(["-O0", "-o"])
        .arg(&exe)
        .arg(repo().join("tests/fixtures/usdt_forms.c"))
        .status()
        .expect("run cc");
    assert!(built.success(), "cc usdt_forms.c: {built}");
    let go = dir.path().join("go");
    let exe_str = exe.to_str().expect("utf-8");
    let mut target = start(&exe, &["--count", &COUNT.to_string(), "--wait-file", go.to_str().expect("utf-8")]);
    let pid = target.pid();

    let notes = crate::probes::usdt::parse_notes(&std::fs::read(&exe).expect("read fixture")).expect("notes");
    let sites: Vec<_> = notes.iter().filter(|p| p.provider == "fixture").cloned().collect();
    assert_eq!(sites.len(), 6);
    for p in &sites {
        assert!(p.args.is_ok(), "{p}: {:?}", p.args);
    }
    let names = ["reg", "stack", "sib", "rip", "addr", "abs"];
    let specs: Vec<String> = names
        .iter()
        .map(|n| match *n {
            "stack" | "addr" => format!("{n}=usdt_forms.c:form_{n}"),
            _ => format!("{n}=form_{n}"),
        })
        .collect();
    let targets: Vec<PythonTarget> = specs
        .iter()
        .enumerate()
        .map(|(i, s)| PythonTarget { spec: PythonStepSpec::parse(s).expect("spec"), label_id: i as u32 })
        .collect();
    // The Python programs serve any provider whose probes pass (file, function).
    let probes_of_fixture = PythonProbes {
        path: PathBuf::from(exe_str),
        version: None,
        entry: sites.clone(),
        ret: vec![],
        tracing_switch: None,
    };
    let (mut probes, mut ring) = Probes::load(pid, false, false).expect("load");
    let steps = probes.attach_python(&probes_of_fixture, &targets).expect("attach");
    let semaphore = sites[0].semaphore_file_offset.expect("semaphore");
    // One count per uprobe: the six sites share the semaphore.
    assert_eq!(read_semaphore(pid.get(), &exe, semaphore).expect("read semaphore"), 6);

    std::fs::write(&go, b"").expect("go");
    assert!(target.0.wait().expect("wait").success());
    let mut events = Vec::new();
    drain(&mut ring, &mut events);
    steps.detach();
    probes.detach();
    let mut seen = vec![0u64; names.len()];
    for e in &events {
        if let Event::StepEnter(s) = e {
            seen[s.probe as usize] += 1;
        }
    }
    let want: Vec<(&str, u64)> = names.iter().map(|n| (*n, COUNT)).collect();
    let got: Vec<(&str, u64)> = names.iter().copied().zip(seen).collect();
    assert_eq!(got, want, "entries seen per operand form");
}

/// The kernel counts uprobes in the semaphore, not tracers: a second
/// attachment to the same probe leaves it at 1, and it returns to 0 once
/// the last one is dropped.
#[test]
#[ignore = "needs root, the eBPF object and /usr/bin/python3.11"]
fn the_semaphore_follows_attachments() {
    preconditions();
    let target = start_python(&["-c", "import time; time.sleep(60)"]);
    let pid = target.pid();
    let python = find_in_process(pid.get()).expect("probes");
    let targets = [PythonTarget { spec: PythonStepSpec::parse("nothing_calls_this").expect("spec"), label_id: 0 }];
    let line = |n| python.tracing_switch.as_ref().map(|_| n);
    assert_eq!(semaphore_of(pid, &python), (0, line(0)));
    let (mut a, _ring_a) = Probes::load(pid, false, false).expect("load");
    let steps_a = a.attach_python(&python, &targets).expect("attach a");
    assert_eq!(semaphore_of(pid, &python), (1, line(1)));
    let (mut b, _ring_b) = Probes::load(pid, false, false).expect("load");
    let steps_b = b.attach_python(&python, &targets).expect("attach b");
    assert_eq!(semaphore_of(pid, &python), (1, line(1)), "one uprobe, one count");
    drop(steps_a);
    assert_eq!(semaphore_of(pid, &python), (1, line(1)), "b still attached");
    let t0 = Instant::now();
    drop(steps_b);
    // The kernel releases the uprobe when the perf event's last reference
    // goes; allow for deferred work rather than assume it is synchronous.
    while semaphore_of(pid, &python) != (0, line(0)) {
        assert!(t0.elapsed() < Duration::from_secs(2), "semaphores not released");
        std::thread::sleep(Duration::from_millis(1));
    }
    eprintln!("semaphore released {:?} after the drop", t0.elapsed());
    a.detach();
    b.detach();
}
