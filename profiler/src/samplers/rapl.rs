//! CPU package and DRAM energy from RAPL: choosing the source (the perf `power`
//! PMU, else powercap sysfs) and the domains that never overlap, reading them
//! as wrap-corrected joules summed over sockets (`rapl_samples`), and the
//! resolutions the store needs to assign them to steps (`step_energy`).
//!
//! RAPL domains nest: psys (the whole platform) ⊇ package ⊇ core, uncore;
//! dram is beside the package. Each kind is its own series, summed over
//! sockets but never added to another kind. CPU energy is the package series,
//! DRAM energy the dram series. A machine without a domain (AMD has no DRAM
//! domain; a VM has no RAPL at all) gets NULL and the reason in
//! `capabilities`, never a figure derived from TDP or utilization.
use std::{
    collections::{BTreeMap, BTreeSet},
    fmt,
    fs::File,
    io,
    os::unix::fs::FileExt,
    path::{Path, PathBuf},
    time::Duration,
};

use super::{CapabilityLog, Sampler};
use crate::store::{AtFinish, RaplSampleRow, RowSender, StoreMsg};

/// How often the RAPL sampler should tick. The counters update about every
/// millisecond and are read exactly, so the interval sets the error bound
/// (about P·interval per step boundary): 20 ms keeps it near 1% of a
/// 1 s step for a few rows per tick.
pub const DEFAULT_INTERVAL: Duration = Duration::from_millis(20);

/// Where the kernel describes the perf `power` PMU.
pub const PERF_POWER_PMU: &str = "/sys/bus/event_source/devices/power";

/// Where powercap zones are, unless `--powercap-root` says otherwise.
pub const POWERCAP_ROOT: &str = "/sys/class/powercap";

/// The coarsest RAPL energy status unit in use (2^-14 J; Intel client parts;
/// servers and AMD count 2^-16 J). Both interfaces show finer numbers (µJ,
/// 2^-32 J) than the hardware counts, so this, not the shown unit, is one
/// reading's quantisation.
const RAPL_ENERGY_QUANTUM_J: f64 = 1.0 / 16384.0;

/// What a RAPL counter measures.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Domain {
    /// The whole CPU package (cores, caches, uncore): reported as CPU energy.
    Package,
    /// The DIMMs attached to the package: reported as DRAM energy.
    Dram,
    /// The whole platform (client parts); contains the package.
    Psys,
    /// The cores only; inside the package.
    Core,
    /// The uncore (often the integrated GPU); inside the package.
    Uncore,
}

impl Domain {
    pub fn as_str(self) -> &'static str {
        match self {
            Domain::Package => "package",
            Domain::Dram => "dram",
            Domain::Psys => "psys",
            Domain::Core => "core",
            Domain::Uncore => "uncore",
        }
    }

    /// Kinds that exist once per package; the others are platform-wide.
    fn per_package(self) -> bool {
        matches!(self, Domain::Dram | Domain::Core | Domain::Uncore)
    }
}

/// Why a reported domain is missing; the sentence ends up in `capabilities`.
fn missing_reason(d: Domain) -> String {
    match d {
        Domain::Package => "no RAPL package domain on this machine; CPU energy is NULL, never estimated".into(),
        Domain::Dram => "no RAPL DRAM domain on this machine (AMD CPUs have none, nor do most client Intel CPUs); \
                         DRAM energy is NULL, never estimated"
            .into(),
        other => format!("no RAPL {} domain on this machine", other.as_str()),
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RaplError {
    /// Neither interface exists: a VM, a non-x86 machine, or the RAPL drivers
    /// (`intel_rapl_msr`, the perf `power` PMU) are not loaded.
    #[error(
        "RAPL unavailable: no perf power PMU at {pmu} and no RAPL zones under {powercap} (a VM, or the intel_rapl drivers are not loaded); CPU and DRAM energy will be NULL"
    )]
    Absent { pmu: PathBuf, powercap: PathBuf },
    /// The interface is there but this process may not read it (powercap
    /// `energy_uj` is root-only; the PMU needs CAP_PERFMON or
    /// `perf_event_paranoid` ≤ 0).
    #[error(
        "RAPL unavailable: {what} is not readable ({source}); run as root (or with CAP_PERFMON); CPU and DRAM energy will be NULL"
    )]
    NotPermitted { what: String, source: io::Error },
    /// The interface is there but does not look as documented, or the kernel
    /// refused the counters.
    #[error("RAPL unavailable: {what}: {reason}; CPU and DRAM energy will be NULL")]
    Unusable { what: String, reason: String },
}

impl RaplError {
    fn io(what: impl Into<String>, source: io::Error) -> Self {
        let what = what.into();
        match source.kind() {
            io::ErrorKind::PermissionDenied => RaplError::NotPermitted { what, source },
            _ => RaplError::Unusable { what, reason: source.to_string() },
        }
    }

    /// Opening a perf event fails with EACCES or EPERM when not permitted.
    fn perf_open(what: String, source: io::Error) -> Self {
        match source.raw_os_error() {
            Some(libc::EACCES | libc::EPERM) => RaplError::NotPermitted { what, source },
            _ => RaplError::Unusable { what, reason: source.to_string() },
        }
    }
}

/// Where the readings come from, recorded in `capabilities`.
#[derive(Clone, Debug, PartialEq)]
pub enum RaplSource {
    /// perf `power` PMU: 64-bit counters (no wrap), one CPU per package.
    PerfPmu { pmu_type: u32, cpus: Vec<usize> },
    /// powercap sysfs: `energy_uj`, wrapping at `max_energy_range_uj`.
    Powercap { root: PathBuf, control: String },
}

impl fmt::Display for RaplSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RaplSource::PerfPmu { pmu_type, cpus } => {
                let cpus: Vec<String> = cpus.iter().map(|c| c.to_string()).collect();
                write!(f, "perf power PMU (type {pmu_type}, CPUs {})", cpus.join(","))
            }
            RaplSource::Powercap { root, control } => write!(f, "powercap {control} zones under {}", root.display()),
        }
    }
}

// ---------------------------------------------------------------------------
// Wraparound

/// Energy between two readings of a counter that runs from 0 to `max_range`
/// and then starts again at 0 (powercap's `max_energy_range_uj`). Every value
/// in [0, max_range] is a reading, so a wrap passes through max_range → 0,
/// one count; the hardware's count may be coarser (the quantum above), which
/// this undercounts by less than one quantum per wrap. Assumes at most one
/// wrap between readings: at 20 ms a wrap takes minutes even at kilowatts.
pub fn wrapped_delta(prev: u64, cur: u64, max_range: u64) -> u64 {
    if cur >= prev { cur - prev } else { max_range.saturating_sub(prev).saturating_add(cur).saturating_add(1) }
}

/// One hardware counter's running total, in its raw unit, since its first reading.
#[derive(Clone, Debug)]
struct EnergyCounter {
    last: Option<u64>,
    total: u64,
    /// `Some(max)` for powercap; None for perf's 64-bit counters.
    wraps_at: Option<u64>,
}

impl EnergyCounter {
    fn new(wraps_at: Option<u64>) -> Self {
        Self { last: None, total: 0, wraps_at }
    }

    fn update(&mut self, raw: u64) -> u64 {
        if let Some(prev) = self.last {
            let delta = match self.wraps_at {
                Some(max) => wrapped_delta(prev, raw, max),
                // A 64-bit counter that went backwards was reset under us;
                // the reset interval's energy is lost, not negative.
                None => raw.saturating_sub(prev),
            };
            self.total = self.total.saturating_add(delta);
        }
        self.last = Some(raw);
        self.total
    }
}

// ---------------------------------------------------------------------------
// powercap: which zones

/// A powercap zone as sysfs lists it: `intel-rapl:0:1` and its `name` file.
#[derive(Clone, Debug, PartialEq)]
pub struct ZoneDesc {
    pub id: String,
    pub name: String,
}

/// The zones chosen, and why the others were not.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ZoneSelection {
    /// The control type read (`intel-rapl`, or another interface to the same
    /// hardware when that is the only one).
    pub control: String,
    /// Zone ids to read, by domain kind; a kind's zones are summed.
    pub domains: BTreeMap<Domain, Vec<String>>,
    /// Reported kinds (package, dram) that are not there, with the reason.
    pub missing: Vec<(Domain, String)>,
    /// Zones not read, with the reason.
    pub ignored: Vec<(String, String)>,
}

/// `intel-rapl:0:1` → (`intel-rapl`, [0, 1]).
fn parse_zone_id(id: &str) -> Option<(&str, Vec<u32>)> {
    let mut parts = id.split(':');
    let control = parts.next()?;
    let path: Vec<u32> = parts.map(|p| p.parse().ok()).collect::<Option<_>>()?;
    (!path.is_empty()).then_some((control, path))
}

/// The domain kind from a zone's `name`: `package-N` (also `package-N-die-M`
/// on multi-die parts), `dram`, `core`, `uncore`, `psys`.
fn zone_domain(name: &str) -> Option<Domain> {
    match name {
        "dram" => Some(Domain::Dram),
        "core" => Some(Domain::Core),
        "uncore" => Some(Domain::Uncore),
        "psys" => Some(Domain::Psys),
        n if n.starts_with("package") => Some(Domain::Package),
        _ => None,
    }
}

/// Chooses the zones to read. Pure, so the overlap rules are unit-tested.
///
/// - One control type only: `intel-rapl-mmio` (and TPMI) expose the same
///   package counters as `intel-rapl`; reading both would count them twice.
/// - Zones of a kind are summed over sockets (and dies); kinds are never added.
/// - A per-package kind (dram, core, uncore) present on only some packages is
///   dropped: its sum would silently leave the others out.
pub fn select_zones(zones: &[ZoneDesc]) -> ZoneSelection {
    let mut sel = ZoneSelection::default();
    let controls: BTreeSet<&str> = zones
        .iter()
        .filter_map(|z| parse_zone_id(&z.id))
        .map(|(c, _)| c)
        .filter(|c| c.starts_with("intel-rapl"))
        .collect();
    let Some(control) = controls.get("intel-rapl").or_else(|| controls.first()).copied() else {
        sel.missing =
            vec![(Domain::Package, missing_reason(Domain::Package)), (Domain::Dram, missing_reason(Domain::Dram))];
        return sel;
    };
    sel.control = control.to_owned();

    // Zone id → (kind, package index); the package index is the top-level number.
    let mut chosen: Vec<(Domain, &str, u32)> = Vec::new();
    for z in zones {
        match parse_zone_id(&z.id) {
            Some((c, path)) if c == control => match zone_domain(&z.name) {
                Some(d) => chosen.push((d, &z.id, path[0])),
                None => sel.ignored.push((z.id.clone(), format!("unknown RAPL zone name {:?}", z.name))),
            },
            Some((c, _)) if c.starts_with("intel-rapl") => {
                sel.ignored.push((z.id.clone(), format!("same counters as the {control} zones, through {c}")))
            }
            _ => {}
        }
    }
    let packages: BTreeSet<u32> = chosen.iter().filter(|(d, ..)| *d == Domain::Package).map(|&(_, _, p)| p).collect();
    let kinds: BTreeSet<Domain> = chosen.iter().map(|&(d, ..)| d).collect();
    for kind in kinds {
        let of_kind: Vec<&(Domain, &str, u32)> = chosen.iter().filter(|(d, ..)| *d == kind).collect();
        if kind.per_package() {
            let covered: BTreeSet<u32> = of_kind.iter().map(|&&(_, _, p)| p).collect();
            if !packages.is_empty() && !packages.is_subset(&covered) {
                let reason = format!(
                    "RAPL {} domain on {} of {} packages: a sum would leave the others out",
                    kind.as_str(),
                    covered.intersection(&packages).count(),
                    packages.len()
                );
                for &&(_, id, _) in &of_kind {
                    sel.ignored.push((id.to_owned(), reason.clone()));
                }
                if matches!(kind, Domain::Dram) {
                    sel.missing.push((kind, reason));
                }
                continue;
            }
        }
        let mut ids: Vec<String> = of_kind.iter().map(|&&(_, id, _)| id.to_owned()).collect();
        ids.sort();
        sel.domains.insert(kind, ids);
    }
    for kind in [Domain::Package, Domain::Dram] {
        if !sel.domains.contains_key(&kind) && !sel.missing.iter().any(|(d, _)| *d == kind) {
            sel.missing.push((kind, missing_reason(kind)));
        }
    }
    sel
}

/// Lists the zones under a powercap root (`intel-rapl:0`, `intel-rapl:0:0`, …)
/// with their `name` files.
pub fn scan_powercap(root: &Path) -> io::Result<Vec<ZoneDesc>> {
    let mut zones = Vec::new();
    for entry in std::fs::read_dir(root)? {
        let entry = entry?;
        let Some(id) = entry.file_name().to_str().map(str::to_owned) else { continue };
        if parse_zone_id(&id).is_none() {
            continue;
        }
        // A zone without a readable name cannot be classified; leave it out.
        let Ok(name) = std::fs::read_to_string(entry.path().join("name")) else { continue };
        zones.push(ZoneDesc { id, name: name.trim().to_owned() });
    }
    zones.sort_by(|a, b| a.id.cmp(&b.id));
    Ok(zones)
}

/// A sysfs integer (`energy_uj`, `max_energy_range_uj`, `type`).
fn parse_u64(text: &str) -> Result<u64, String> {
    text.trim().parse().map_err(|e| format!("{:?} is not an integer ({e})", text.trim()))
}

// ---------------------------------------------------------------------------
// perf `power` PMU: which events

/// The PMU's energy events and the domain each measures. `energy-gpu` (the
/// integrated GPU, inside the package) is not read.
const PERF_EVENTS: &[(&str, Domain)] = &[
    ("energy-pkg", Domain::Package),
    ("energy-ram", Domain::Dram),
    ("energy-psys", Domain::Psys),
    ("energy-cores", Domain::Core),
];

/// Where a `format/<term>` puts its value: `config:0-7` or `config:0-7,32-35`.
#[derive(Clone, Debug, PartialEq)]
pub struct FormatSpec {
    /// Bit ranges of `config`, low to high, inclusive; the value's bits fill them in order.
    pub ranges: Vec<(u32, u32)>,
}

pub fn parse_format(text: &str) -> Result<FormatSpec, String> {
    let text = text.trim();
    let (field, bits) = text.split_once(':').ok_or_else(|| format!("{text:?} has no ':'"))?;
    if field != "config" {
        // The power PMU only uses `config`; config1/config2 would need attr fields we do not set.
        return Err(format!("{text:?} targets {field}, not config"));
    }
    let mut ranges = Vec::new();
    for part in bits.split(',') {
        let (lo, hi) = match part.split_once('-') {
            Some((lo, hi)) => (lo, hi),
            None => (part, part),
        };
        let lo: u32 = lo.trim().parse().map_err(|e| format!("{text:?}: {e}"))?;
        let hi: u32 = hi.trim().parse().map_err(|e| format!("{text:?}: {e}"))?;
        if lo > hi || hi > 63 {
            return Err(format!("{text:?}: bad bit range {lo}-{hi}"));
        }
        ranges.push((lo, hi));
    }
    Ok(FormatSpec { ranges })
}

/// The `config` for an event file such as `event=0x02` (terms `name=value` or
/// a bare `name` meaning 1, separated by commas), placed by the PMU's formats.
pub fn event_config(text: &str, formats: &BTreeMap<String, FormatSpec>) -> Result<u64, String> {
    let mut config = 0u64;
    for term in text.trim().split(',').filter(|t| !t.is_empty()) {
        let (name, value) = match term.split_once('=') {
            Some((n, v)) => (n.trim(), v.trim()),
            None => (term.trim(), "1"),
        };
        let value = match value.strip_prefix("0x").or_else(|| value.strip_prefix("0X")) {
            Some(hex) => u64::from_str_radix(hex, 16),
            None => value.parse(),
        }
        .map_err(|e| format!("term {term:?}: {e}"))?;
        let spec = formats.get(name).ok_or_else(|| format!("term {term:?} has no format/{name}"))?;
        let mut rest = value;
        for &(lo, hi) in &spec.ranges {
            let width = hi - lo + 1;
            let mask = if width == 64 { u64::MAX } else { (1u64 << width) - 1 };
            config |= (rest & mask) << lo;
            rest = if width == 64 { 0 } else { rest >> width };
        }
        if rest != 0 {
            return Err(format!("term {term:?} does not fit format/{name}"));
        }
    }
    Ok(config)
}

/// `events/<name>.scale`: joules per count, e.g. `2.3283064365386962890625e-10`.
pub fn parse_scale(text: &str) -> Result<f64, String> {
    let s: f64 = text.trim().parse().map_err(|e| format!("{:?} is not a number ({e})", text.trim()))?;
    if s.is_finite() && s > 0.0 { Ok(s) } else { Err(format!("scale {s} is not a positive number")) }
}

/// A sysfs CPU list (`cpumask`): `0,28` or `0-3,8`.
pub fn parse_cpu_list(text: &str) -> Result<Vec<usize>, String> {
    let mut cpus = Vec::new();
    for part in text.trim().split(',').filter(|p| !p.is_empty()) {
        let bad = |e: std::num::ParseIntError| format!("{:?} is not a CPU list ({e})", text.trim());
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b): (usize, usize) = (a.parse().map_err(bad)?, b.parse().map_err(bad)?);
                cpus.extend(a..=b);
            }
            None => cpus.push(part.parse().map_err(bad)?),
        }
    }
    if cpus.is_empty() {
        return Err("empty CPU list".into());
    }
    Ok(cpus)
}

/// One energy event of the power PMU, ready to open.
#[derive(Clone, Debug, PartialEq)]
pub struct PmuEvent {
    pub name: &'static str,
    pub domain: Domain,
    pub config: u64,
    /// Joules per count.
    pub scale: f64,
}

/// What sysfs says about the power PMU.
#[derive(Clone, Debug, PartialEq)]
pub struct PmuDescription {
    pub pmu_type: u32,
    /// One CPU per package: the counters are package-wide, read on any of its CPUs.
    pub cpus: Vec<usize>,
    pub events: Vec<PmuEvent>,
    pub missing: Vec<(Domain, String)>,
}

/// Reads the PMU's `type`, `cpumask`, `format/*` and `events/*` (with their
/// `.scale` and `.unit`).
pub fn describe_power_pmu(dir: &Path) -> Result<PmuDescription, RaplError> {
    let read = |rel: &str| -> Result<String, RaplError> {
        let p = dir.join(rel);
        std::fs::read_to_string(&p).map_err(|e| RaplError::io(p.display().to_string(), e))
    };
    let unusable =
        |rel: &str, reason: String| RaplError::Unusable { what: dir.join(rel).display().to_string(), reason };
    let pmu_type = u32::try_from(parse_u64(&read("type")?).map_err(|r| unusable("type", r))?)
        .map_err(|e| unusable("type", e.to_string()))?;
    let cpus = parse_cpu_list(&read("cpumask")?).map_err(|r| unusable("cpumask", r))?;
    let mut formats = BTreeMap::new();
    let format_dir = dir.join("format");
    let entries = std::fs::read_dir(&format_dir).map_err(|e| RaplError::io(format_dir.display().to_string(), e))?;
    for entry in entries {
        let entry = entry.map_err(|e| RaplError::io(format_dir.display().to_string(), e))?;
        let Some(name) = entry.file_name().to_str().map(str::to_owned) else { continue };
        let rel = format!("format/{name}");
        let spec = parse_format(&read(&rel)?).map_err(|r| unusable(&rel, r))?;
        formats.insert(name, spec);
    }
    let mut events = Vec::new();
    for &(name, domain) in PERF_EVENTS {
        let rel = format!("events/{name}");
        if !dir.join(&rel).exists() {
            continue;
        }
        let config = event_config(&read(&rel)?, &formats).map_err(|r| unusable(&rel, r))?;
        let scale = parse_scale(&read(&format!("{rel}.scale"))?).map_err(|r| unusable(&format!("{rel}.scale"), r))?;
        let unit = read(&format!("{rel}.unit"))?;
        if unit.trim() != "Joules" {
            // The scale turns counts into this unit; any other unit would be mislabelled joules.
            return Err(unusable(&format!("{rel}.unit"), format!("unit is {:?}, not Joules", unit.trim())));
        }
        events.push(PmuEvent { name, domain, config, scale });
    }
    if events.is_empty() {
        return Err(unusable("events", "no energy-* events".into()));
    }
    let missing = [Domain::Package, Domain::Dram]
        .into_iter()
        .filter(|d| !events.iter().any(|e| e.domain == *d))
        .map(|d| (d, missing_reason(d)))
        .collect();
    Ok(PmuDescription { pmu_type, cpus, events, missing })
}

/// A power PMU event for perf-event2: the dynamic PMU's type number and the config.
#[derive(Clone, Copy, Debug)]
struct PowerEvent {
    pmu_type: u32,
    config: u64,
}

impl perf_event::events::Event for PowerEvent {
    fn update_attrs(self, attr: &mut perf_event_open_sys::bindings::perf_event_attr) {
        attr.type_ = self.pmu_type;
        attr.config = self.config;
    }
}

// ---------------------------------------------------------------------------
// The reader

enum Handle {
    /// `energy_uj`, re-read at offset 0 (sysfs regenerates the text on each read).
    Sysfs(File),
    Perf(perf_event::Counter),
}

impl Handle {
    fn read_raw(&mut self) -> io::Result<u64> {
        match self {
            Handle::Sysfs(f) => {
                let mut buf = [0u8; 32];
                let n = f.read_at(&mut buf, 0)?;
                let text = std::str::from_utf8(&buf[..n]).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
                parse_u64(text).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
            }
            Handle::Perf(c) => c.read(),
        }
    }
}

/// One hardware counter: a zone's `energy_uj`, or one event on one package.
struct EnergyInput {
    domain: Domain,
    label: String,
    handle: Handle,
    /// Joules per raw count.
    unit_j: f64,
    counter: EnergyCounter,
    warned: bool,
}

/// Open RAPL counters, read as cumulative joules per domain kind.
pub struct RaplReader {
    source: RaplSource,
    inputs: Vec<EnergyInput>,
    missing: Vec<(Domain, String)>,
}

impl RaplReader {
    pub fn source(&self) -> &RaplSource {
        &self.source
    }

    /// Domain kinds read (each summed over its counters).
    pub fn domains(&self) -> Vec<Domain> {
        let set: BTreeSet<Domain> = self.inputs.iter().map(|i| i.domain).collect();
        set.into_iter().collect()
    }

    /// Reported kinds that are not there, with the reason.
    pub fn missing(&self) -> &[(Domain, String)] {
        &self.missing
    }

    /// Which counters make up a domain, for the record.
    fn labels(&self, d: Domain) -> Vec<&str> {
        self.inputs.iter().filter(|i| i.domain == d).map(|i| i.label.as_str()).collect()
    }

    /// The quantisation of a domain's sum, J.
    pub fn resolution_j(&self, d: Domain) -> f64 {
        self.inputs.iter().filter(|i| i.domain == d).map(|i| i.unit_j.max(RAPL_ENERGY_QUANTUM_J)).sum()
    }

    /// Joules per domain kind since the first `read`, wrap-corrected and
    /// summed over its counters; None for a kind one of whose counters could
    /// not be read this time (a partial sum would be wrong; the next reading
    /// catches up, the counters being cumulative).
    pub fn read(&mut self) -> Vec<(Domain, Option<f64>)> {
        let mut sums: BTreeMap<Domain, Option<f64>> = BTreeMap::new();
        for input in &mut self.inputs {
            let value = match input.handle.read_raw() {
                Ok(raw) => Some(input.counter.update(raw) as f64 * input.unit_j),
                Err(e) => {
                    if !input.warned {
                        log::warn!("reading RAPL {}: {e}; its domain has gaps", input.label);
                        input.warned = true;
                    }
                    None
                }
            };
            let slot = sums.entry(input.domain).or_insert(Some(0.0));
            *slot = slot.zip(value).map(|(a, b)| a + b);
        }
        sums.into_iter().collect()
    }
}

/// Opens RAPL. With `powercap_root` None: the perf power PMU if it can be
/// opened, else powercap at [`POWERCAP_ROOT`]. With `Some(root)` (the user
/// named a tree, e.g. a fake one in a test): powercap there, only.
pub fn open(powercap_root: Option<&Path>) -> Result<RaplReader, RaplError> {
    match powercap_root {
        Some(root) => open_powercap(root),
        None => open_with(Path::new(PERF_POWER_PMU), Path::new(POWERCAP_ROOT)),
    }
}

/// The PMU at `pmu_dir` first, powercap at `powercap_root` second.
pub fn open_with(pmu_dir: &Path, powercap_root: &Path) -> Result<RaplReader, RaplError> {
    let pmu_err = if pmu_dir.exists() {
        match open_perf(pmu_dir) {
            Ok(r) => return Ok(r),
            Err(e) => Some(e),
        }
    } else {
        None
    };
    match open_powercap(powercap_root) {
        Ok(r) => {
            if let Some(e) = pmu_err {
                log::info!("perf power PMU not used ({e}); reading powercap instead");
            }
            Ok(r)
        }
        // No zones at all: the PMU's reason (if it was there) says more.
        Err(RaplError::Absent { .. }) => {
            Err(pmu_err.unwrap_or(RaplError::Absent { pmu: pmu_dir.to_owned(), powercap: powercap_root.to_owned() }))
        }
        Err(e) => Err(e),
    }
}

/// powercap zones under `root`.
pub fn open_powercap(root: &Path) -> Result<RaplReader, RaplError> {
    let absent = || RaplError::Absent { pmu: PathBuf::from(PERF_POWER_PMU), powercap: root.to_owned() };
    let zones = match scan_powercap(root) {
        Ok(z) => z,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Err(absent()),
        Err(e) => return Err(RaplError::io(root.display().to_string(), e)),
    };
    let sel = select_zones(&zones);
    if sel.domains.is_empty() {
        return Err(absent());
    }
    for (id, why) in &sel.ignored {
        log::debug!("RAPL zone {id} not read: {why}");
    }
    let mut inputs = Vec::new();
    for (&domain, ids) in &sel.domains {
        for id in ids {
            let dir = root.join(id);
            let max_path = dir.join("max_energy_range_uj");
            let max = std::fs::read_to_string(&max_path)
                .map_err(|e| RaplError::io(max_path.display().to_string(), e))
                .and_then(|t| {
                    parse_u64(&t).map_err(|reason| RaplError::Unusable { what: max_path.display().to_string(), reason })
                })?;
            let energy_path = dir.join("energy_uj");
            let what = || energy_path.display().to_string();
            let file = File::open(&energy_path).map_err(|e| RaplError::io(what(), e))?;
            let mut handle = Handle::Sysfs(file);
            // Read once now: a counter that cannot be read should fail here, with a clear line,
            // rather than leave NULLs behind a capability that says available.
            handle.read_raw().map_err(|e| RaplError::io(what(), e))?;
            inputs.push(EnergyInput {
                domain,
                label: id.clone(),
                handle,
                unit_j: 1e-6,
                counter: EnergyCounter::new(Some(max)),
                warned: false,
            });
        }
    }
    Ok(RaplReader {
        source: RaplSource::Powercap { root: root.to_owned(), control: sel.control },
        inputs,
        missing: sel.missing,
    })
}

/// Counters on the power PMU at `dir`: each event on one CPU per package,
/// except psys, which is one platform-wide counter (reading it on every
/// package would count it once per socket).
fn open_perf(dir: &Path) -> Result<RaplReader, RaplError> {
    let desc = describe_power_pmu(dir)?;
    let mut inputs = Vec::new();
    for ev in &desc.events {
        let cpus: &[usize] =
            if ev.domain.per_package() || ev.domain == Domain::Package { &desc.cpus } else { &desc.cpus[..1] };
        for &cpu in cpus {
            let what = format!("perf event power/{}/ on CPU {cpu}", ev.name);
            let mut builder = perf_event::Builder::new(PowerEvent { pmu_type: desc.pmu_type, config: ev.config });
            // The power PMU counts system-wide on one CPU and rejects mode filters.
            builder.one_cpu(cpu).any_pid().exclude_kernel(false).exclude_hv(false).enabled(true);
            let counter = builder.build().map_err(|e| RaplError::perf_open(what.clone(), e))?;
            let mut handle = Handle::Perf(counter);
            handle.read_raw().map_err(|e| RaplError::perf_open(what.clone(), e))?;
            inputs.push(EnergyInput {
                domain: ev.domain,
                label: format!("{}@cpu{cpu}", ev.name),
                handle,
                unit_j: ev.scale,
                counter: EnergyCounter::new(None),
                warned: false,
            });
        }
    }
    Ok(RaplReader {
        source: RaplSource::PerfPmu { pmu_type: desc.pmu_type, cpus: desc.cpus },
        inputs,
        missing: desc.missing,
    })
}

// ---------------------------------------------------------------------------
// The sampler

/// Capability metrics (prov4ml's names) and the domain behind each.
const METRICS: &[(&str, Domain)] = &[
    ("cpu_energy", Domain::Package),
    ("cpu_power", Domain::Package),
    ("ram_energy", Domain::Dram),
    ("ram_power", Domain::Dram),
];

/// Samples RAPL into `rapl_samples`; at the end, asks the store for `step_energy`.
pub struct RaplSampler {
    reader: Option<RaplReader>,
    sender: RowSender,
    /// (domain, resolution J) for the domains read.
    resolutions: Vec<(Domain, f64)>,
    /// `--prometheus`/`--otlp`: the live series each reading updates.
    pub live: Option<crate::metrics::MachineMetrics>,
}

impl RaplSampler {
    /// Records in `capabilities` where CPU and DRAM energy come from, or why
    /// they are missing (the error's line when RAPL could not be opened).
    pub fn new(reader: Result<RaplReader, RaplError>, sender: RowSender) -> Self {
        let mut caps = CapabilityLog::new(sender.clone(), "rapl");
        match &reader {
            Ok(r) => {
                for &(metric, domain) in METRICS {
                    match r.missing().iter().find(|(d, _)| *d == domain) {
                        Some((_, why)) => caps.record(metric, false, Some(why.clone())),
                        None if r.domains().contains(&domain) => {
                            let how = format!("{} ({} summed)", r.source(), r.labels(domain).join(" + "));
                            caps.record(metric, true, Some(how));
                        }
                        None => caps.record(metric, false, Some(missing_reason(domain))),
                    }
                }
            }
            Err(e) => {
                for &(metric, _) in METRICS {
                    caps.record(metric, false, Some(e.to_string()));
                }
            }
        }
        let reader = reader.ok();
        let resolutions = reader
            .as_ref()
            .map(|r| r.domains().into_iter().map(|d| (d, r.resolution_j(d))).collect())
            .unwrap_or_default();
        Self { reader, sender, resolutions, live: None }
    }
}

impl Sampler for RaplSampler {
    fn tick(&mut self, now_ns: u64) {
        let Some(reader) = &mut self.reader else { return };
        let rows: Vec<RaplSampleRow> = reader
            .read()
            .into_iter()
            .filter_map(|(d, j)| Some(RaplSampleRow { ts_ns: now_ns, domain: d.as_str(), energy_j: j? }))
            .collect();
        if let Some(live) = &mut self.live {
            live.rapl_sample(&rows);
        }
        if !rows.is_empty() {
            self.sender.send(StoreMsg::RaplSamples(rows));
        }
    }

    fn finish(&mut self) -> Option<AtFinish> {
        let resolution = |d: Domain| self.resolutions.iter().find(|(x, _)| *x == d).map(|&(_, r)| r);
        Some(AtFinish::StepEnergy {
            package_resolution_j: resolution(Domain::Package),
            dram_resolution_j: resolution(Domain::Dram),
        })
    }
}

#[cfg(test)]
mod tests {
    use rusqlite::Connection;

    use super::*;
    use crate::{
        samplers::testing::{capabilities, end, open_store, step_row},
        store::StepRow,
    };

    const MS: u64 = 1_000_000;

    fn zone(id: &str, name: &str) -> ZoneDesc {
        ZoneDesc { id: id.into(), name: name.into() }
    }

    #[test]
    fn wrap_adds_the_distance_to_the_top_and_from_zero() {
        assert_eq!(wrapped_delta(100, 250, 1000), 150);
        assert_eq!(wrapped_delta(990, 10, 1000), 21, "991..=1000 is 10 counts, 1000→0 one, 0→10 ten");
        assert_eq!(wrapped_delta(1000, 0, 1000), 1);
        assert_eq!(wrapped_delta(5, 5, 1000), 0);
        // A counter running at a constant rate gives the same delta whether or not it wrapped.
        let max = 262_143_328_850u64;
        let modulus = max + 1;
        for start in [0, max - 7, max - 1_000_000, max] {
            let (a, b) = (start % modulus, (start + 3_000_000) % modulus);
            assert_eq!(wrapped_delta(a, b, max), 3_000_000, "from {start}");
        }
    }

    #[test]
    fn counter_total_is_monotone_across_wraps_and_resets() {
        let mut c = EnergyCounter::new(Some(99));
        let readings = [90, 95, 99, 0, 4, 50, 98, 3];
        let totals: Vec<u64> = readings.iter().map(|&r| c.update(r)).collect();
        assert_eq!(totals, vec![0, 5, 9, 10, 14, 60, 108, 113]);
        let mut p = EnergyCounter::new(None);
        assert_eq!([10, 30, 5, 7].map(|r| p.update(r)), [0, 20, 20, 22], "a 64-bit reset loses, never subtracts");
    }

    #[test]
    fn two_packages_are_summed_and_psys_and_core_kept_apart() {
        let sel = select_zones(&[
            zone("intel-rapl:0", "package-0"),
            zone("intel-rapl:0:0", "core"),
            zone("intel-rapl:0:1", "dram"),
            zone("intel-rapl:1", "package-1"),
            zone("intel-rapl:1:0", "dram"),
            zone("intel-rapl:1:1", "core"),
            zone("intel-rapl:2", "psys"),
        ]);
        assert_eq!(sel.control, "intel-rapl");
        assert_eq!(sel.domains[&Domain::Package], ["intel-rapl:0", "intel-rapl:1"]);
        assert_eq!(sel.domains[&Domain::Dram], ["intel-rapl:0:1", "intel-rapl:1:0"]);
        assert_eq!(sel.domains[&Domain::Core], ["intel-rapl:0:0", "intel-rapl:1:1"]);
        assert_eq!(sel.domains[&Domain::Psys], ["intel-rapl:2"]);
        assert!(sel.missing.is_empty(), "{:?}", sel.missing);
    }

    #[test]
    fn mmio_duplicates_are_not_read() {
        let sel = select_zones(&[
            zone("intel-rapl:0", "package-0"),
            zone("intel-rapl:0:0", "dram"),
            zone("intel-rapl-mmio:0", "package-0"),
        ]);
        assert_eq!(sel.domains[&Domain::Package], ["intel-rapl:0"]);
        assert_eq!(sel.ignored.len(), 1);
        assert_eq!(sel.ignored[0].0, "intel-rapl-mmio:0");
        // With only the MMIO interface, it is the one read.
        let sel = select_zones(&[zone("intel-rapl-mmio:0", "package-0")]);
        assert_eq!(sel.control, "intel-rapl-mmio");
        assert_eq!(sel.domains[&Domain::Package], ["intel-rapl-mmio:0"]);
    }

    #[test]
    fn amd_without_dram_reports_package_and_a_reason_for_dram() {
        let sel = select_zones(&[
            zone("intel-rapl:0", "package-0"),
            zone("intel-rapl:0:0", "core"),
            zone("intel-rapl:1", "package-1"),
            zone("intel-rapl:1:0", "core"),
        ]);
        assert_eq!(sel.domains[&Domain::Package].len(), 2);
        assert!(!sel.domains.contains_key(&Domain::Dram));
        let (d, why) = &sel.missing[0];
        assert_eq!(*d, Domain::Dram);
        assert!(why.contains("AMD") && why.contains("never estimated"), "{why}");
    }

    #[test]
    fn dram_on_some_packages_only_is_dropped_not_half_summed() {
        let sel = select_zones(&[
            zone("intel-rapl:0", "package-0"),
            zone("intel-rapl:0:0", "dram"),
            zone("intel-rapl:1", "package-1"),
        ]);
        assert!(!sel.domains.contains_key(&Domain::Dram));
        assert!(sel.missing.iter().any(|(d, why)| *d == Domain::Dram && why.contains("1 of 2")), "{:?}", sel.missing);
    }

    #[test]
    fn psys_alone_is_not_cpu_energy() {
        let sel = select_zones(&[zone("intel-rapl:0", "psys"), zone("intel-rapl", "x"), zone("dtpm:0", "soc")]);
        assert_eq!(sel.domains.keys().copied().collect::<Vec<_>>(), [Domain::Psys]);
        assert!(sel.missing.iter().any(|(d, _)| *d == Domain::Package));
        assert!(select_zones(&[]).domains.is_empty());
    }

    #[test]
    fn multi_die_packages_are_all_package() {
        let sel = select_zones(&[zone("intel-rapl:0", "package-0-die-0"), zone("intel-rapl:1", "package-0-die-1")]);
        assert_eq!(sel.domains[&Domain::Package].len(), 2);
    }

    /// Writes a powercap zone: name, max range and a counter value.
    fn write_zone(root: &Path, id: &str, name: &str, max: u64, value: u64) {
        let dir = root.join(id);
        std::fs::create_dir_all(&dir).expect("mkdir");
        std::fs::write(dir.join("name"), format!("{name}\n")).expect("name");
        std::fs::write(dir.join("max_energy_range_uj"), format!("{max}\n")).expect("max");
        std::fs::write(dir.join("energy_uj"), format!("{value}\n")).expect("energy");
    }

    #[test]
    fn a_fake_powercap_tree_is_scanned_and_read() {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path();
        std::fs::create_dir(root.join("intel-rapl")).expect("control dir");
        write_zone(root, "intel-rapl:0", "package-0", 1_000_000, 999_990);
        write_zone(root, "intel-rapl:0:0", "dram", 1_000_000, 10);
        write_zone(root, "intel-rapl:1", "psys", 1_000_000, 0);
        write_zone(root, "intel-rapl-mmio:0", "package-0", 1_000_000, 999_990);
        let zones = scan_powercap(root).expect("scan");
        assert_eq!(
            zones.iter().map(|z| z.id.as_str()).collect::<Vec<_>>(),
            ["intel-rapl-mmio:0", "intel-rapl:0", "intel-rapl:0:0", "intel-rapl:1"]
        );
        let mut r = open(Some(root)).expect("open");
        assert_eq!(r.source(), &RaplSource::Powercap { root: root.to_owned(), control: "intel-rapl".into() });
        assert_eq!(r.domains(), [Domain::Package, Domain::Dram, Domain::Psys]);
        assert_eq!(r.read(), [(Domain::Package, Some(0.0)), (Domain::Dram, Some(0.0)), (Domain::Psys, Some(0.0))]);
        // The package wraps: 999_990 → 1_000_000 → 0 → 20 is 31 µJ.
        std::fs::write(root.join("intel-rapl:0/energy_uj"), "20\n").expect("w");
        std::fs::write(root.join("intel-rapl:0:0/energy_uj"), "1010\n").expect("w");
        let v = r.read();
        assert!((v[0].1.expect("pkg") - 31e-6).abs() < 1e-12, "{v:?}");
        assert!((v[1].1.expect("dram") - 1000e-6).abs() < 1e-12, "{v:?}");
        // A counter that cannot be read makes its domain's sum None, not partial.
        std::fs::write(root.join("intel-rapl:0:0/energy_uj"), "garbage\n").expect("w");
        assert_eq!(r.read()[1], (Domain::Dram, None));
    }

    #[test]
    fn no_rapl_is_one_clear_line() {
        let dir = tempfile::tempdir().expect("tempdir");
        let err = open_with(&dir.path().join("no-pmu"), &dir.path().join("no-powercap")).err().expect("must fail");
        let line = err.to_string();
        assert!(matches!(err, RaplError::Absent { .. }), "{line}");
        assert!(line.starts_with("RAPL unavailable: ") && !line.contains('\n'), "{line}");
        assert!(line.contains("NULL"), "{line}");
        // An empty powercap class (no zones) is the same.
        assert!(matches!(open(Some(dir.path())), Err(RaplError::Absent { .. })));
        // Permission errors say what to do.
        let e = RaplError::io("/x/energy_uj", io::Error::from(io::ErrorKind::PermissionDenied));
        assert!(e.to_string().contains("run as root"), "{e}");
        let e = RaplError::perf_open("power/energy-pkg/".into(), io::Error::from_raw_os_error(libc::EACCES));
        assert!(matches!(e, RaplError::NotPermitted { .. }), "{e}");
    }

    /// What `open` says on this machine follows what it has: "absent" exactly
    /// where there is neither the perf power PMU nor a RAPL powercap zone;
    /// where there is one, RAPL opens or says why it cannot (a permission, an
    /// unusable file), never "absent". The same checks on every host.
    #[test]
    fn this_machines_rapl_verdict_follows_what_it_has() {
        let has_pmu = Path::new(PERF_POWER_PMU).exists();
        let has_zones =
            scan_powercap(Path::new(POWERCAP_ROOT)).map(|z| !select_zones(&z).domains.is_empty()).unwrap_or(false);
        match open(None) {
            Err(e @ RaplError::Absent { .. }) => {
                assert!(!has_pmu && !has_zones, "absent on a host with RAPL: {e}");
                assert!(e.to_string().starts_with("RAPL unavailable: no perf power PMU"), "{e}");
            }
            Err(e) => {
                assert!(has_pmu || has_zones, "not 'absent' on a host without RAPL: {e}");
                assert!(e.to_string().starts_with("RAPL unavailable: ") && !e.to_string().contains('\n'), "{e}");
            }
            Ok(r) => {
                assert!(has_pmu || has_zones, "RAPL opened on a host without it: {}", r.source());
                assert!(!r.domains().is_empty(), "{}", r.source());
            }
        }
        // powercap alone, as `--powercap-root /sys/class/powercap` reads it.
        match open(Some(Path::new(POWERCAP_ROOT))) {
            Err(e @ RaplError::Absent { .. }) => assert!(!has_zones, "absent with RAPL zones: {e}"),
            Err(e) => assert!(has_zones, "not 'absent' without RAPL zones: {e}"),
            Ok(r) => assert!(has_zones, "powercap opened without RAPL zones: {}", r.source()),
        }
    }

    #[test]
    fn perf_pmu_sysfs_is_parsed() {
        assert_eq!(parse_scale("2.3283064365386962890625e-10\n"), Ok(2f64.powi(-32)));
        assert!(parse_scale("0").is_err() && parse_scale("Joules").is_err());
        assert_eq!(parse_cpu_list("0,28\n"), Ok(vec![0, 28]));
        assert_eq!(parse_cpu_list("0-2,8"), Ok(vec![0, 1, 2, 8]));
        assert!(parse_cpu_list("\n").is_err());
        assert_eq!(parse_format("config:0-7\n"), Ok(FormatSpec { ranges: vec![(0, 7)] }));
        assert!(parse_format("config1:0-7").is_err());
        let formats = BTreeMap::from([
            ("event".to_owned(), FormatSpec { ranges: vec![(0, 7)] }),
            ("umask".to_owned(), FormatSpec { ranges: vec![(8, 11), (32, 35)] }),
            ("edge".to_owned(), FormatSpec { ranges: vec![(18, 18)] }),
        ]);
        assert_eq!(event_config("event=0x02\n", &formats), Ok(0x02));
        assert_eq!(event_config("event=0x3c,umask=0x1f,edge", &formats), Ok(0x3c_u64 | 0xf << 8 | 1 << 32 | 1 << 18));
        assert!(event_config("event=0x100", &formats).is_err(), "does not fit 8 bits");
        assert!(event_config("cmask=1", &formats).is_err());

        let dir = tempfile::tempdir().expect("tempdir");
        let pmu = dir.path();
        for (rel, text) in [
            ("type", "23\n"),
            ("cpumask", "0,28\n"),
            ("format/event", "config:0-7\n"),
            ("events/energy-pkg", "event=0x02\n"),
            ("events/energy-pkg.scale", "2.3283064365386962890625e-10\n"),
            ("events/energy-pkg.unit", "Joules\n"),
            ("events/energy-psys", "event=0x05\n"),
            ("events/energy-psys.scale", "2.3283064365386962890625e-10\n"),
            ("events/energy-psys.unit", "Joules\n"),
        ] {
            std::fs::create_dir_all(pmu.join(rel).parent().expect("parent")).expect("mkdir");
            std::fs::write(pmu.join(rel), text).expect("write");
        }
        let d = describe_power_pmu(pmu).expect("describe");
        assert_eq!((d.pmu_type, d.cpus.as_slice()), (23, &[0, 28][..]));
        assert_eq!(
            d.events[0],
            PmuEvent { name: "energy-pkg", domain: Domain::Package, config: 2, scale: 2f64.powi(-32) }
        );
        assert_eq!((d.events[1].domain, d.events[1].config), (Domain::Psys, 5));
        assert_eq!(d.missing.len(), 1);
        assert_eq!(d.missing[0].0, Domain::Dram);
        std::fs::write(pmu.join("events/energy-pkg.unit"), "Watts\n").expect("write");
        let err = describe_power_pmu(pmu).expect_err("wrong unit");
        assert!(err.to_string().contains("not Joules"), "{err}");
    }

    /// A simulated machine: per-zone power over time, integrated exactly.
    struct FakeZone {
        id: &'static str,
        name: &'static str,
        max: u64,
        start_uj: u64,
        /// Watts as a piecewise-constant function: (from_s, W) in order.
        power: &'static [(f64, f64)],
    }

    impl FakeZone {
        /// Joules drawn from 0 to `t` seconds.
        fn energy(&self, t: f64) -> f64 {
            let mut e = 0.0;
            for (k, &(from, w)) in self.power.iter().enumerate() {
                let until = self.power.get(k + 1).map_or(f64::INFINITY, |&(next, _)| next);
                if t > from {
                    e += w * (t.min(until) - from);
                }
            }
            e
        }

        fn counter_at(&self, t: f64) -> u64 {
            (self.start_uj + (self.energy(t) * 1e6).floor() as u64) % (self.max + 1)
        }
    }

    #[test]
    fn steps_get_package_and_dram_energy_within_the_bound_across_a_wrap() {
        // Two packages (package-1's counter wraps at 0.33 s and every 0.5 s after), DRAM on
        // both, a core subzone and psys (which must be neither added to the
        // package nor mistaken for it), and an MMIO duplicate of package 0.
        let zones = [
            FakeZone {
                id: "intel-rapl:0",
                name: "package-0",
                max: 262_143_328_850,
                start_uj: 7,
                power: &[(0.0, 45.0), (0.713, 120.0), (1.4, 60.0)],
            },
            FakeZone { id: "intel-rapl:0:0", name: "core", max: 262_143_328_850, start_uj: 0, power: &[(0.0, 30.0)] },
            FakeZone {
                id: "intel-rapl:0:1",
                name: "dram",
                max: 65_712_999_613,
                start_uj: 5,
                power: &[(0.0, 6.0), (1.05, 9.0)],
            },
            FakeZone {
                id: "intel-rapl:1",
                name: "package-1",
                max: 40_000_000,
                start_uj: 30_000_000,
                power: &[(0.0, 25.0), (0.3, 80.0)],
            },
            FakeZone { id: "intel-rapl:1:0", name: "dram", max: 65_712_999_613, start_uj: 0, power: &[(0.0, 4.0)] },
            FakeZone { id: "intel-rapl:2", name: "psys", max: 262_143_328_850, start_uj: 0, power: &[(0.0, 200.0)] },
            FakeZone {
                id: "intel-rapl-mmio:0",
                name: "package-0",
                max: 262_143_328_850,
                start_uj: 7,
                power: &[(0.0, 45.0), (0.713, 120.0), (1.4, 60.0)],
            },
        ];
        let tree = tempfile::tempdir().expect("tempdir");
        let root = tree.path();
        let t0 = 1_000 * MS; // monotonic ns of simulated time 0
        let set_time = |t: f64| {
            for z in &zones {
                write_zone(root, z.id, z.name, z.max, z.counter_at(t));
            }
        };
        set_time(0.0);
        let reader = open(Some(root)).expect("open fake tree");

        let db = tempfile::tempdir().expect("tempdir");
        let (store, id) = open_store(&db.path().join("p.db"));
        let writer = store.spawn_writer(id);
        let mut sampler = RaplSampler::new(Ok(reader), writer.sender());
        // Ticks every 20 ms for 2 s, at the sampler thread's cadence.
        let ticks: Vec<u64> = (0..=100).map(|k| k * 20 * MS).collect();
        for &dt in &ticks {
            set_time(dt as f64 / 1e9);
            sampler.tick(t0 + dt);
        }
        // Back-to-back steps of uneven length from 0.1 s to 1.9 s, one very short,
        // two ending inside a sampling interval where the power changes (710 ms,
        // 1047 ms), then one that never ended and one before the first sample.
        let bounds_ms = [100u64, 250, 333, 337, 420, 710, 1001, 1047, 1234, 1500, 1900];
        let mut rows: Vec<StepRow> = bounds_ms
            .windows(2)
            .enumerate()
            .map(|(k, w)| step_row(k as u64, t0 + w[0] * MS, Some(t0 + w[1] * MS)))
            .collect();
        let n = rows.len() as u64;
        rows.push(step_row(n, t0 + 1950 * MS, None));
        rows.push(step_row(n + 1, t0 / 2, Some(t0 + 50 * MS)));
        writer.send(StoreMsg::Steps(rows));
        let work = sampler.finish().expect("per-step energy");
        let stats = writer.finish(end(), vec![work]).expect("finish");
        assert_eq!((stats.failed_rows, stats.first_error), (0, None));

        let conn = Connection::open(db.path().join("p.db")).expect("reopen");
        let truth = |ids: &[&str], a_ms: u64, b_ms: u64| -> f64 {
            zones
                .iter()
                .filter(|z| ids.contains(&z.id))
                .map(|z| z.energy(b_ms as f64 / 1e3) - z.energy(a_ms as f64 / 1e3))
                .sum()
        };
        let pkg = ["intel-rapl:0", "intel-rapl:1"];
        let dram = ["intel-rapl:0:1", "intel-rapl:1:0"];
        let mut stmt = conn
            .prepare(
                "SELECT step, cpu_energy_j, cpu_energy_error_j, cpu_power_w, dram_energy_j, dram_energy_error_j,
                        below_resolution, note
                 FROM step_energy WHERE session_id = ?1 ORDER BY label, step",
            )
            .expect("prepare");
        type Row = (i64, Option<f64>, Option<f64>, Option<f64>, Option<f64>, Option<f64>, Option<bool>, Option<String>);
        let got: Vec<Row> = stmt
            .query_map([id], |r| {
                Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?, r.get(5)?, r.get(6)?, r.get(7)?))
            })
            .expect("query")
            .collect::<rusqlite::Result<_>>()
            .expect("rows");
        assert_eq!(got.len(), bounds_ms.len() + 1);
        let (mut cpu_sum, mut dram_sum) = (0.0, 0.0);
        for (k, w) in bounds_ms.windows(2).enumerate() {
            let (step, cpu, cpu_err, cpu_w, dram_j, dram_err, below, note) = &got[k];
            assert_eq!(*step, k as i64);
            let (cpu, cpu_err, cpu_w) = (cpu.expect("cpu"), cpu_err.expect("err"), cpu_w.expect("power"));
            let (dram_j, dram_err) = (dram_j.expect("dram"), dram_err.expect("err"));
            let real = truth(&pkg, w[0], w[1]);
            assert!(cpu >= 0.0, "step {k}: negative energy {cpu}");
            assert!((cpu - real).abs() <= cpu_err, "step {k} {w:?}: {cpu} J vs true {real} J (bound {cpu_err})");
            // The counters here are read without lag, so the error is only interpolation
            // across a power change: at most ΔP·T/4 per boundary (75 W · 20 ms / 4).
            assert!((cpu - real).abs() <= 2.0 * 0.375 + 1e-3, "step {k}: {cpu} vs {real}");
            assert!((cpu_w - cpu / ((w[1] - w[0]) as f64 / 1e3)).abs() < 1e-9);
            let real_dram = truth(&dram, w[0], w[1]);
            assert!(
                (dram_j - real_dram).abs() <= dram_err,
                "step {k}: dram {dram_j} vs {real_dram} (bound {dram_err})"
            );
            assert_eq!(*below, Some(w[1] - w[0] < 20), "step {k} {w:?}");
            assert_eq!(*note, None);
            cpu_sum += cpu;
            dram_sum += dram_j;
        }
        // The first and last boundaries fall on samples (100 ms and 1900 ms),
        // where the counters are exact to a µJ: the steps add up to the truth.
        let (first, last) = (bounds_ms[0], bounds_ms[bounds_ms.len() - 1]);
        let real_total = truth(&pkg, first, last);
        assert!((cpu_sum - real_total).abs() < 1e-3, "steps sum {cpu_sum} J vs true {real_total} J");
        assert!((dram_sum - truth(&dram, first, last)).abs() < 1e-3, "dram sum {dram_sum}");
        // Not psys, not package + psys, not package-0 twice (MMIO).
        let with_psys = real_total + truth(&["intel-rapl:2"], first, last);
        assert!((cpu_sum - with_psys).abs() > 100.0);
        let (open_step, early) = (&got[bounds_ms.len() - 1], &got[bounds_ms.len()]);
        assert_eq!((open_step.1, open_step.7.as_deref()), (None, Some("step never ended")));
        assert_eq!((early.1, early.7.as_deref()), (None, Some("step not inside the sampled range")));

        // rapl_samples: cumulative from 0, never decreasing, psys its own series.
        let series: Vec<(String, f64)> = conn
            .prepare("SELECT domain, energy_j FROM rapl_samples WHERE session_id = ?1 ORDER BY domain, ts_ns")
            .expect("prepare")
            .query_map([id], |r| Ok((r.get(0)?, r.get(1)?)))
            .expect("query")
            .collect::<rusqlite::Result<_>>()
            .expect("rows");
        // core is on package 0 only: dropped rather than summed over half the packages.
        assert!(series.iter().all(|(x, _)| x != "core"));
        for d in ["package", "dram", "psys"] {
            let v: Vec<f64> = series.iter().filter(|(x, _)| x == d).map(|&(_, j)| j).collect();
            assert_eq!(v.len(), ticks.len(), "{d}");
            assert_eq!(v[0], 0.0);
            assert!(v.windows(2).all(|w| w[1] >= w[0]), "{d} decreases");
        }
        let last_pkg = series.iter().filter(|(x, _)| x == "package").map(|&(_, j)| j).next_back().expect("pkg");
        assert!((last_pkg - truth(&pkg, 0, 2000)).abs() < 1e-3, "{last_pkg}");
        let caps = capabilities(&conn, "rapl");
        assert_eq!(caps.len(), 4);
        assert!(caps.iter().all(|(_, ok, why)| *ok && why.is_some()), "{caps:?}");
        assert!(caps[0].2.as_deref().is_some_and(|w| w.contains("intel-rapl:0 + intel-rapl:1")), "{caps:?}");
    }

    #[test]
    fn without_rapl_steps_are_null_and_the_reason_is_recorded() {
        let db = tempfile::tempdir().expect("tempdir");
        let (store, id) = open_store(&db.path().join("p.db"));
        let writer = store.spawn_writer(id);
        let err = open_with(&db.path().join("none"), &db.path().join("none")).err().expect("no RAPL");
        let line = err.to_string();
        let mut sampler = RaplSampler::new(Err(err), writer.sender());
        sampler.tick(100 * MS);
        sampler.tick(200 * MS);
        writer.send(StoreMsg::Steps(vec![step_row(0, 100 * MS, Some(200 * MS))]));
        let work = sampler.finish().expect("per-step energy");
        writer.finish(end(), vec![work]).expect("finish");
        let conn = Connection::open(db.path().join("p.db")).expect("reopen");
        let (cpu, dram, note): (Option<f64>, Option<f64>, Option<String>) = conn
            .query_row("SELECT cpu_energy_j, dram_energy_j, note FROM step_energy WHERE step = 0", [], |r| {
                Ok((r.get(0)?, r.get(1)?, r.get(2)?))
            })
            .expect("row");
        assert_eq!((cpu, dram, note), (None, None, None));
        let n: i64 = conn.query_row("SELECT count(*) FROM rapl_samples", [], |r| r.get(0)).expect("q");
        assert_eq!(n, 0);
        let reasons = capabilities(&conn, "rapl");
        assert_eq!(reasons.len(), 4);
        assert!(reasons.iter().all(|(_, ok, why)| !ok && why.as_deref() == Some(line.as_str())), "{reasons:?}");
    }

    #[test]
    fn sampler_can_move_to_its_thread() {
        fn is_send<T: Send>() {}
        is_send::<RaplSampler>();
    }
}
