//! A job: every process one profiler run traces — the first target, whose session the samplers
//! feed, and the others (further PIDs named, the children the kernel side follows) — each with a
//! session row, a consumer and a library watcher of its own; records routed to their process by
//! the tgid in their header; process forks, execs and exits turned into sessions begun, updated
//! and ended.
use std::{
    collections::{BTreeSet, HashMap},
    ffi::{OsStr, OsString},
    path::Path,
    sync::Arc,
    time::{Duration, Instant},
};

use super::{
    config::SessionConfig,
    consumer::Consumer,
    drain::{RingDrain, Sink},
    torch::TorchWatch,
    watcher::LibraryWatcher,
};
use crate::{
    clock,
    correlate::mfu::Peaks,
    events::{self, Event, ProcessChange, ProcessEvent},
    probes::{self, Probes, python::frame_hook::FrameHookMembers},
    regions::RegionSteps,
    store::{AtFinish, Losses, RowSender, SessionEnd, SessionStart, StoreMsg},
};

/// How long `attach` waits for the frame hook's first look into each
/// process it names before it says it is tracing (milliseconds, normally).
const FIRST_LOOK_WAIT: Duration = Duration::from_secs(2);

/// What every process's session shares with the first one's.
pub(super) struct JobContext {
    pub cfg: SessionConfig,
    /// The first session's row: the others' are made from it.
    pub template: SessionStart,
    /// The first session's sender (the others' wrap it, see `RowSender::for_process`).
    pub sender: RowSender,
    pub labels: Vec<&'static str>,
    pub regions: RegionSteps,
    /// The jitted functions that make JAX steps.
    pub jax: crate::jax_steps::JitSources,
    /// The jitted functions' names, the session's `NameReader`'s.
    pub jit_names: crate::probes::jax::SharedJitNames,
    /// The logical GPUs sampled, and the first target's CUDA_VISIBLE_DEVICES
    /// they are numbered by (see [`rank_gpus`]).
    pub gpus: Vec<u32>,
    pub sampler_cvd: Option<String>,
    /// The processes NVML has listed on those GPUs (none without NVML).
    pub nvml_processes: Option<crate::samplers::gpu::GpuProcesses>,
    /// The dense peaks of the sampled GPUs the peak table knows (live MFU).
    pub gpu_peaks: Arc<HashMap<u32, &'static Peaks>>,
    /// `--prometheus`/`--otlp`: registers each process's series.
    pub live: Option<crate::metrics::LiveSessions>,
    /// The CPU sampler, when on (`--cpu-sample`): every process's samples name its stacks.
    pub cpu_sampler: Option<crate::probes::cpu::CpuSampler>,
    /// Names the samples' stacks, for every session of the job (with the sampler).
    pub(super) stack_namer: Option<super::cpu_stacks::StackNamer>,
}

impl JobContext {
    /// Live series for the process whose session row is `start` (its job and
    /// rank); its MFU is over the GPUs [`rank_gpus`] gives it from its
    /// `local_rank` and CUDA_VISIBLE_DEVICES `cvd` (the first target's: none
    /// given, as for its `step_gpu` rows).
    pub fn live_for(
        &self,
        start: &SessionStart,
        local_rank: Option<i64>,
        cvd: Option<String>,
    ) -> Option<crate::metrics::SessionMetrics> {
        let labels = crate::metrics::SeriesLabels::of_process(&start.job, start.rank);
        let (sampled, peaks, listed) = (self.gpus.clone(), self.gpu_peaks.clone(), self.nvml_processes.clone());
        let (sampler_cvd, pid) = (self.sampler_cvd.clone(), start.pid);
        // Asked at each step's end: NVML lists a process once it has a context.
        let peak = move |precision| {
            let seen = listed.as_ref().and_then(|l| l.lock().ok()?.get(&pid).cloned());
            let gpus = rank_gpus(&sampled, seen.as_ref(), local_rank, cvd.as_deref(), sampler_cvd.as_deref());
            let each = gpus.iter().map(|g| peaks.get(g)?.flops_per_s(precision));
            each.sum::<Option<f64>>().filter(|_| !gpus.is_empty())
        };
        self.live.as_ref().map(|l| l.session(&labels, &self.labels).with_peak(Box::new(peak)))
    }
}

/// A traced process other than the first.
struct Member {
    start: SessionStart,
    consumer: Consumer,
    watcher: LibraryWatcher,
    cvd: Option<String>,
    /// (the drain it was seen in, when) its exit was seen: its session ends
    /// after one more drain, which brings its threads' last records (those
    /// the ring had with the exit are held for one drain, see `OrderedQueue`).
    exited: Option<(u64, u64)>,
}

/// Every process of the job.
pub(super) struct Job {
    ctx: JobContext,
    first_pid: u32,
    pub first: Consumer,
    pub watcher: LibraryWatcher,
    members: HashMap<u32, Member>,
    /// The processes whose sessions ended, by pid, with when: all that is
    /// kept of them (a member is large; a job that forks for hours ends
    /// thousands), to tell a late record of one from a new process's.
    ended: HashMap<u32, u64>,
    drain: RingDrain,
    /// Process events of the current drain, handled after it.
    pending: Vec<ProcessEvent>,
    drains: u64,
    /// (when, completed steps per pid) at the last status line.
    last_status: Option<(Instant, HashMap<u32, u64>)>,
    /// Set at teardown: records from then on are dropped (see `set_cutoff`).
    cutoff_ns: Option<u64>,
    /// The frame hook's write for the other processes that run the first
    /// target's CPython (`--step-python` on a build without USDT probes).
    pub frame_hook: Option<FrameHookMembers>,
    /// Scheduler totals taken out of the kernel for sessions about to end.
    sched_totals: HashMap<u32, profiler_common::ProcessSched>,
    /// Scheduler switches that did not fit a thread's state, over every
    /// process of the job taken so far (`ProcessSched::mismatches`).
    pub sched_mismatches: u64,
    /// Records that came for a process whose session had already ended,
    /// dropped (counted with the lost events; 0 expected).
    pub late_records: u64,
}

impl Job {
    /// The first target's PID (the one `attach` named, or the `run` command).
    pub fn first_pid(&self) -> u32 {
        self.first_pid
    }

    pub fn new(ctx: JobContext, first_pid: u32, first: Consumer, watcher: LibraryWatcher) -> Self {
        Self {
            ctx,
            first_pid,
            first,
            watcher,
            members: HashMap::new(),
            ended: HashMap::new(),
            drain: RingDrain::default(),
            pending: Vec::new(),
            drains: 0,
            last_status: None,
            cutoff_ns: None,
            frame_hook: None,
            sched_totals: HashMap::new(),
            sched_mismatches: 0,
            late_records: 0,
        }
    }

    /// The CPU sampler's rate and counts, for the first session's row; says
    /// what was lost (`--cpu-sample`). None when the sampler is off.
    pub fn cpu_sampling(&self, quiet: bool) -> Option<crate::store::CpuSampling> {
        let sampler = self.ctx.cpu_sampler.as_ref()?;
        let counts = sampler.counts();
        if counts.lost > 0 {
            eprintln!(
                "profiler: warning: {} of {} CPU samples found the ring full and were lost (sessions.lost_cpu_samples)",
                counts.lost, counts.taken
            );
        }
        // A few bucket collisions are the map's nature and change no share a
        // user reads; the report and the sessions row count every one. Say
        // it at the end only where it is more than 1 % of the samples.
        if counts.stack_failures * 100 > counts.taken && !quiet {
            eprintln!(
                "profiler: {} of {} CPU samples kept only their leaf function: the kernel's stack map had no room \
                 for their stacks (sessions.cpu_stack_failures)",
                counts.stack_failures, counts.taken
            );
        }
        let kernel = sampler.kernel_cost();
        if let Err(e) = &kernel {
            log::info!("the CPU sampler's kernel cost is not counted: {e}");
        }
        Some(crate::store::CpuSampling { hz: sampler.hz, counts, kernel })
    }

    /// See [`super::cpu_stacks::StackNamer::read_kallsyms`]; nothing without CPU samples.
    pub fn read_kallsyms(&self) {
        if let Some(namer) = &self.ctx.stack_namer {
            namer.read_kallsyms();
        }
    }

    pub fn name(&self) -> &str {
        &self.ctx.template.job
    }

    /// The size budget has stopped every row (see `store::budget`).
    pub fn budget_spent(&self) -> bool {
        self.ctx.sender.budget_spent()
    }

    /// The further PIDs named on the command line, and with `--children` the
    /// live descendants of all of them (with their parents): a session each,
    /// their CUDA libraries probed now. Returns how many there are.
    pub fn add_named(&mut self, pids: &[(u32, Option<u32>)], probes: &mut Probes) -> usize {
        for &(pid, parent) in pids {
            self.adopt(pid, parent, if parent.is_some() { "child" } else { "attach" });
            if let Some(m) = self.members.get_mut(&pid) {
                m.watcher.scan(probes, &mut m.consumer, self.ctx.cfg.quiet, "maps");
            }
        }
        // Tracing means tracing: a process named now that runs the CPython of
        // the frame hook has the write before the session says it has begun.
        if let Some(hook) = &self.frame_hook {
            for pid in hook.wait_first_looks(FIRST_LOOK_WAIT) {
                eprintln!(
                    "profiler: PID {pid}: the frame hook is not written yet ({} s): its first Python steps may go \
                     unseen",
                    FIRST_LOOK_WAIT.as_secs()
                );
            }
        }
        pids.len()
    }

    /// Begins the session of process `pid` (forked from `parent`, or named).
    fn adopt(&mut self, pid: u32, parent: Option<u32>, mode: &'static str) {
        let (start, cvd) = process_start(&self.ctx.template, pid, parent, mode);
        self.ctx.sender.send(StoreMsg::Process(Box::new(start.clone())));
        let mut consumer =
            Consumer::new(self.ctx.sender.for_process(pid), self.ctx.labels.clone(), self.ctx.regions.clone(), pid);
        consumer.live = self.ctx.live_for(&start, start.local_rank, cvd.clone());
        consumer.use_jit_steps(self.ctx.jax.clone(), self.ctx.jit_names.clone(), self.ctx.cfg.quiet);
        // Adopted during teardown: the cutoff applies to it too.
        consumer.cutoff_ns = self.cutoff_ns;
        consumer.keep_gemm_rows(self.ctx.cfg.launch_mode.keeps_rows());
        consumer.keep_copy_rows(self.ctx.cfg.launch_mode.keeps_rows());
        consumer.trace_sched(self.ctx.cfg.sched);
        if let Some(namer) = &self.ctx.stack_namer {
            consumer.sample_cpu(namer.clone());
        }
        let mut watcher = LibraryWatcher::new(pid, TorchWatch::new(&self.ctx.cfg, &self.ctx.regions));
        // Its loader is the first target's (file-wide probe), usually.
        watcher.loader_hooked = self.watcher.loader_hooked;
        let rank = start.rank.map_or(String::new(), |r| format!(" (rank {r})"));
        say!(self.ctx.cfg.quiet, "tracing PID {pid}{rank}: {}", start.command);
        self.members.insert(pid, Member { start, consumer, watcher, cvd, exited: None });
        if let Some(hook) = &self.frame_hook {
            hook.add(pid);
        }
    }

    /// Drains the rings into every process's consumer, then handles the
    /// forks, execs and exits seen, the libraries loaded, and hands the rows on.
    pub fn tick(&mut self, rings: &mut probes::Rings, probes: &mut Probes) {
        self.drain_rings(rings);
        self.after_drain(probes);
    }

    fn drain_rings(&mut self, rings: &mut probes::Rings) {
        let mut router = Router { job: self };
        let mut drain = std::mem::take(&mut router.job.drain);
        drain.drain(rings, &mut router);
        self.drain = drain;
        self.drains += 1;
    }

    fn after_drain(&mut self, probes: &mut Probes) {
        for e in std::mem::take(&mut self.pending) {
            self.process_event(e, probes);
        }
        let quiet = self.ctx.cfg.quiet;
        if std::mem::take(&mut self.first.loader_changed) {
            self.watcher.scan(probes, &mut self.first, quiet, "dlopen");
        }
        self.watcher.look_for_python(probes, &mut self.first);
        self.first.flush();
        let drains = self.drains;
        let mut ended = Vec::new();
        for (pid, m) in &mut self.members {
            let c = &mut m.consumer;
            if std::mem::take(&mut c.loader_changed) {
                m.watcher.scan(probes, c, quiet, "dlopen");
            }
            m.watcher.look_for_python(probes, c);
            c.flush();
            if let Some((seen, at)) = m.exited
                && seen < drains
            {
                ended.push((*pid, at));
            }
        }
        for (pid, at) in ended {
            self.take_sched(probes, pid);
            self.end_member(pid, "target-exited", at);
        }
    }

    /// Takes process `pid`'s scheduler totals out of the kernel, for its session's end.
    fn take_sched(&mut self, probes: &mut Probes, pid: u32) {
        if let Some(t) = probes.take_process_sched(pid) {
            self.sched_mismatches += t.mismatches;
            self.sched_totals.insert(pid, t);
        }
    }

    /// Before the probes go: every live session's scheduler totals; returns the first process's.
    pub fn take_all_sched(&mut self, probes: &mut Probes) -> Option<profiler_common::ProcessSched> {
        let pids: Vec<u32> = self.members.keys().copied().collect();
        for pid in pids {
            self.take_sched(probes, pid);
        }
        let first = probes.take_process_sched(self.first_pid);
        self.sched_mismatches += first.map_or(0, |t| t.mismatches);
        first
    }

    fn process_event(&mut self, e: ProcessEvent, probes: &mut Probes) {
        let pid = e.pid;
        if pid == self.first_pid {
            // Its exit is the event loop's (the pidfd); its exec, `run`'s own.
            return;
        }
        match e.change {
            ProcessChange::Forked { parent } => {
                // A pid the job had before, whose process ended: a new process, a new session.
                self.ended.remove(&pid);
                match self.members.get_mut(&pid) {
                    // Its records came before the fork's: adopted already, parent unknown then.
                    Some(m) => {
                        m.start.parent_pid = Some(parent);
                        self.ctx.sender.send(StoreMsg::Process(Box::new(m.start.clone())));
                    }
                    None => self.adopt(pid, Some(parent), "child"),
                }
            }
            ProcessChange::Exec => {
                // First seen at its exec: adopted as the program it is now (the frame hook's look too).
                let adopted_now = !self.members.contains_key(&pid);
                if adopted_now {
                    self.ended.remove(&pid);
                    self.adopt(pid, None, "child");
                }
                let ctx = &self.ctx;
                let quiet = ctx.cfg.quiet;
                if let Some(m) = self.members.get_mut(&pid) {
                    let (start, cvd) = process_start(&ctx.template, pid, m.start.parent_pid, m.start.mode);
                    m.start = SessionStart { started_ns: m.start.started_ns, ..start };
                    m.cvd = cvd;
                    ctx.sender.send(StoreMsg::Process(Box::new(m.start.clone())));
                    // A new program: its libraries are to be looked at afresh.
                    let loader_hooked = m.watcher.loader_hooked;
                    m.watcher = LibraryWatcher::new(pid, TorchWatch::new(&ctx.cfg, &ctx.regions));
                    m.watcher.loader_hooked = loader_hooked;
                    // Its rank is known from the new program's environment.
                    m.consumer.live = ctx.live_for(&m.start, m.start.local_rank, m.cvd.clone());
                    m.consumer.code_changed();
                    m.watcher.scan(probes, &mut m.consumer, quiet, "exec");
                }
                if let Some(hook) = self.frame_hook.as_ref().filter(|_| !adopted_now) {
                    hook.add(pid);
                }
            }
            ProcessChange::Exited => {
                if let Some(m) = self.members.get_mut(&pid) {
                    match &mut m.exited {
                        // Found gone by a maps scan first: this is the exact moment.
                        Some((_, at)) => *at = (*at).min(e.ts_ns),
                        None => m.exited = Some((self.drains, e.ts_ns)),
                    }
                }
            }
        }
    }

    /// Ends process `pid`'s session: its open steps stored, its rows flushed,
    /// its end and per-step work sent (derived at the job's end).
    fn end_member(&mut self, pid: u32, reason: &str, ended_ns: u64) {
        let Some(m) = self.members.remove(&pid) else { return };
        self.ended.insert(pid, ended_ns);
        let mut consumer = m.consumer;
        if let Some(hook) = &self.frame_hook {
            hook.remove(pid);
        }
        let incomplete = consumer.take_incomplete_steps();
        let totals = consumer.close();
        let local_rank = m.start.local_rank;
        // Taken out: a later process with this PID starts with none.
        let seen = self.ctx.nvml_processes.as_ref().and_then(|p| p.lock().ok()?.remove(&pid));
        let gpus =
            rank_gpus(&self.ctx.gpus, seen.as_ref(), local_rank, m.cvd.as_deref(), self.ctx.sampler_cvd.as_deref());
        let end = SessionEnd {
            ended_ns,
            end_reason: reason.into(),
            lost_events: 0,
            total_launches: 0,
            unmatched_returns: totals.unmatched_returns,
        };
        let losses = Losses { lost_step_records: 0, lost_off_cpu_records: 0, map_failures: 0, incomplete };
        let mut work = vec![AtFinish::Losses(losses), AtFinish::RankGpus(gpus)];
        work.extend(self.sched_totals.remove(&pid).map(AtFinish::ContextSwitches));
        self.ctx.sender.send(StoreMsg::EndProcess(pid, end, work));
        let rank = m.start.rank.map_or(String::new(), |r| format!(" (rank {r})"));
        say!(self.ctx.cfg.quiet, "PID {pid}{rank} ended ({reason}): {} steps", totals.completed_steps);
    }

    /// Looks at every live process's maps for new CUDA libraries. A process
    /// found gone before its exit record was read (the agent behind the
    /// rings, or the record lost) ends as if its exit had been read now:
    /// after the drains that bring the records its threads wrote before they
    /// went. Ending it at once dropped a loaded machine's last steps.
    pub fn scan_maps(&mut self, probes: &mut Probes) {
        let quiet = self.ctx.cfg.quiet;
        self.watcher.scan(probes, &mut self.first, quiet, "maps");
        // As a record read by the next drain would have it (`process_event`).
        let seen = self.drains + 1;
        for (pid, m) in &mut self.members {
            if m.exited.is_none() && !Path::new(&format!("/proc/{pid}")).exists() {
                m.exited = Some((seen, clock::monotonic_ns()));
                continue;
            }
            m.watcher.scan(probes, &mut m.consumer, quiet, "maps");
        }
    }

    /// Processes other than the first whose sessions are still open.
    pub fn live_members(&self) -> usize {
        self.members.len()
    }

    /// From `ns` on, records are dropped (see `teardown`).
    pub fn set_cutoff(&mut self, ns: u64) {
        self.cutoff_ns = Some(ns);
        self.first.cutoff_ns = Some(ns);
        for c in self.members.values_mut().map(|m| &mut m.consumer) {
            c.cutoff_ns = Some(ns);
        }
    }

    /// The probes are gone: the rings' last records, those held for their
    /// place, and the launches still staged.
    pub fn drain_last(&mut self, rings: &mut probes::Rings, staged: &[profiler_common::LaunchRecord]) {
        self.drain_rings(rings);
        let mut drain = std::mem::take(&mut self.drain);
        let mut router = Router { job: self };
        drain.release_held_steps(&mut router);
        RingDrain::take_staged(staged, &mut router);
        self.drain = drain;
        for e in std::mem::take(&mut self.pending) {
            if let (ProcessChange::Exited, Some(m)) = (e.change, self.members.get_mut(&e.pid)) {
                m.exited.get_or_insert((self.drains, e.ts_ns));
            }
        }
    }

    /// Ends every other process's session (those that exited with
    /// `target-exited`, the others with the job's `reason`) and hands back
    /// the first process's consumer, to finish the first session.
    pub fn into_first(mut self, reason: &str, ended_ns: u64) -> Consumer {
        let pids: Vec<u32> = self.members.keys().copied().collect();
        for pid in pids {
            match self.members.get(&pid).and_then(|m| m.exited) {
                Some((_, at)) => self.end_member(pid, "target-exited", at),
                None => self.end_member(pid, reason, ended_ns),
            }
        }
        self.first
    }

    /// Steps completed so far, all processes together.
    pub fn completed_steps(&self) -> u64 {
        self.first.completed_steps + self.members.values().map(|m| m.consumer.completed_steps).sum::<u64>()
    }

    /// For the status line, when the job has more than one process: the
    /// processes traced, and the slowest one's steps/s since the last call.
    pub fn ranks_status(&mut self) -> Option<String> {
        if self.members.is_empty() {
            return None;
        }
        let now = Instant::now();
        let mut counts: HashMap<u32, u64> = HashMap::from([(self.first_pid, self.first.completed_steps)]);
        let mut ranks: HashMap<u32, Option<i64>> = HashMap::from([(self.first_pid, self.ctx.template.rank)]);
        for (pid, m) in &self.members {
            counts.insert(*pid, m.consumer.completed_steps);
            ranks.insert(*pid, m.start.rank);
        }
        let slowest = match &self.last_status {
            Some((t, last)) => slowest_rate(&counts, last, (now - *t).as_secs_f64()),
            None => None,
        };
        let live = counts.len();
        let named = ranks.values().filter(|r| r.is_some()).count();
        self.last_status = Some((now, counts));
        let mut line = format!("{live} processes, {named} ranks");
        if let Some((pid, rate)) = slowest {
            let who = match ranks.get(&pid).copied().flatten() {
                Some(r) => format!("rank {r}"),
                None => format!("PID {pid}"),
            };
            line.push_str(&format!(", slowest {who} {rate:.1} steps/s"));
        }
        Some(line)
    }
}

/// The slowest process among those that have completed a step: (pid, steps/s
/// over the last `secs`).
fn slowest_rate(now: &HashMap<u32, u64>, last: &HashMap<u32, u64>, secs: f64) -> Option<(u32, f64)> {
    now.iter()
        .filter(|(_, steps)| **steps > 0)
        .map(|(pid, steps)| (*pid, (steps - last.get(pid).copied().unwrap_or(0).min(*steps)) as f64 / secs.max(1e-3)))
        .min_by(|a, b| a.1.total_cmp(&b.1).then(a.0.cmp(&b.0)))
}

/// Routes each record to its process's consumer (by the tgid in its
/// header), and keeps process events for after the drain.
struct Router<'a> {
    job: &'a mut Job,
}

impl Sink for Router<'_> {
    fn take(&mut self, event: Result<Event, events::DecodeError>) {
        let tgid = match &event {
            Ok(Event::Process(p)) => {
                self.job.pending.push(*p);
                return;
            }
            Ok(e) => e.tgid(),
            Err(_) => self.job.first_pid,
        };
        if tgid == self.job.first_pid || tgid == 0 {
            return self.job.first.take(event);
        }
        if let Some(&ended_ns) = self.job.ended.get(&tgid) {
            match &event {
                // A process's threads killed by its exit_group may exit, and
                // be switched to (and sampled), after its main thread: that loses nothing.
                Ok(Event::ThreadExit(_) | Event::OffCpu(_) | Event::CpuSample(_)) => return,
                // Its session ended before this record was read: dropped, counted.
                Ok(e) if e.ts_ns() <= ended_ns => {
                    self.job.late_records += 1;
                    return;
                }
                // A new process with that pid, its records before its fork's.
                _ => {
                    self.job.ended.remove(&tgid);
                }
            }
        }
        // A child's records can come before its fork's (another ring, or the
        // parent not yet back from `kernel_clone`): it is adopted now.
        if !self.job.members.contains_key(&tgid) {
            self.job.adopt(tgid, None, "child");
        }
        if let Some(m) = self.job.members.get_mut(&tgid) {
            m.consumer.take(event);
        }
    }
}

/// Process `pid`'s session row, from /proc (its environment: ranks, and its
/// CUDA_VISIBLE_DEVICES, returned beside), on `template`'s shared fields.
fn process_start(
    template: &SessionStart,
    pid: u32,
    parent: Option<u32>,
    mode: &'static str,
) -> (SessionStart, Option<String>) {
    let process = procfs::process::Process::new(pid as i32).ok();
    let env = process.as_ref().and_then(|p| p.environ().ok()).unwrap_or_default();
    let command = process.as_ref().and_then(|p| p.cmdline().ok()).map(|a| a.join(" ")).unwrap_or_default();
    let exe = process.as_ref().and_then(|p| p.exe().ok()).map(|e| e.display().to_string());
    let var = |k: &str| env_var(&env, k);
    let (rank, local_rank, world_size) = ranks(&var);
    let start = SessionStart {
        pid,
        command: if command.is_empty() { format!("[PID {pid}]") } else { command },
        exe,
        mode,
        launch_mode: template.launch_mode,
        step_source: template.step_source.clone(),
        started_ns: clock::monotonic_ns(),
        unix_offset_ns: template.unix_offset_ns,
        hostname: template.hostname.clone(),
        kernel_release: template.kernel_release.clone(),
        job: template.job.clone(),
        rank,
        local_rank,
        world_size,
        parent_pid: parent,
    };
    (start, var("CUDA_VISIBLE_DEVICES"))
}

/// RANK, LOCAL_RANK and WORLD_SIZE from an environment (None when absent or
/// not a number).
pub(super) fn ranks(var: &dyn Fn(&str) -> Option<String>) -> (Option<i64>, Option<i64>, Option<i64>) {
    let n = |k: &str| var(k).and_then(|v| v.trim().parse().ok());
    (n("RANK"), n("LOCAL_RANK"), n("WORLD_SIZE"))
}

/// The job id: `--job`, else the first target's TORCHELASTIC_RUN_ID (torchrun
/// sets it, the same on every node; "none" when not elastic), else
/// HOST-UNIXTIME-PID.
pub(super) fn job_name(flag: Option<&str>, run_id: Option<&str>, host: Option<&str>, unix_s: u64, pid: u32) -> String {
    if let Some(f) = flag {
        return f.to_owned();
    }
    match run_id.map(str::trim) {
        Some(id) if !id.is_empty() && id != "none" => id.to_owned(),
        _ => format!("{}-{unix_s}-{pid}", host.unwrap_or("host")),
    }
}

/// The logical GPUs (of `sampled`, numbered by the first target's
/// CUDA_VISIBLE_DEVICES `sampler_cvd`) a rank's steps get `step_gpu` rows for:
/// those NVML listed it on (`nvml_seen`), when it did; else, with the same
/// visible devices as the first target and a LOCAL_RANK k among
/// them, GPU k alone (the device torchrun's ranks take, `cuda:LOCAL_RANK`);
/// else every sampled GPU (a rank whose devices are its own, or no rank).
pub(super) fn rank_gpus(
    sampled: &[u32],
    nvml_seen: Option<&BTreeSet<u32>>,
    local_rank: Option<i64>,
    own_cvd: Option<&str>,
    sampler_cvd: Option<&str>,
) -> Vec<u32> {
    // NVML's process lists name the GPUs the process had contexts on: the fact, where there is one.
    let listed: Vec<u32> = nvml_seen.into_iter().flatten().copied().filter(|g| sampled.contains(g)).collect();
    if !listed.is_empty() {
        return listed;
    }
    let same_devices = own_cvd.map(str::trim) == sampler_cvd.map(str::trim);
    match local_rank.and_then(|k| u32::try_from(k).ok()) {
        Some(k) if same_devices && sampled.contains(&k) => vec![k],
        _ => sampled.to_vec(),
    }
}

/// The job of a session about to begin (see [`job_name`]).
pub(super) fn name_for(cfg: &SessionConfig, run_id: Option<String>, host: Option<&str>, pid: u32) -> String {
    let unix_s = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    job_name(cfg.job.as_deref(), run_id.as_deref(), host, unix_s, pid)
}

/// The further PIDs that exist: one that does not is named once and skipped.
pub(super) fn existing(pids: &[u32], first: u32) -> Vec<u32> {
    let mut out: Vec<u32> = Vec::new();
    for &pid in pids {
        if pid == first || out.contains(&pid) {
            continue;
        }
        if crate::probes::is_alive(pid) {
            out.push(pid);
        } else {
            eprintln!("profiler: no process with PID {pid} (or it has exited): skipped; the others are traced");
        }
    }
    out
}

/// The live descendants of `roots` (children, theirs, …), each with its
/// parent, from /proc: `attach --children` traces those already started too.
pub(super) fn descendants(roots: &[u32]) -> Vec<(u32, u32)> {
    let parents: Vec<(u32, u32)> = procfs::process::all_processes()
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|p| p.stat().ok())
        .filter(|st| !crate::probes::has_exited(st))
        .filter_map(|st| Some((u32::try_from(st.pid).ok()?, u32::try_from(st.ppid).ok()?)))
        .collect();
    tree_below(roots, &parents)
}

/// Of `(pid, parent)` pairs, those below `roots`, parents before children.
fn tree_below(roots: &[u32], parents: &[(u32, u32)]) -> Vec<(u32, u32)> {
    let mut out: Vec<(u32, u32)> = Vec::new();
    let mut frontier: Vec<u32> = roots.to_vec();
    while let Some(parent) = frontier.pop() {
        for &(pid, ppid) in parents {
            if ppid == parent && !roots.contains(&pid) && !out.iter().any(|(p, _)| *p == pid) {
                out.push((pid, ppid));
                frontier.push(pid);
            }
        }
    }
    out
}

/// An environment map's variable, as a `var` function for [`ranks`].
pub(super) fn env_var(env: &HashMap<OsString, OsString>, key: &str) -> Option<String> {
    env.get(OsStr::new(key)).map(|v| v.to_string_lossy().into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_job_is_the_flag_else_torchelastic_else_generated() {
        assert_eq!(job_name(Some("mine"), Some("abc"), Some("h"), 5, 7), "mine");
        assert_eq!(job_name(None, Some("abc"), Some("h"), 5, 7), "abc");
        assert_eq!(job_name(None, Some("none"), Some("h"), 5, 7), "h-5-7");
        assert_eq!(job_name(None, Some(""), None, 5, 7), "host-5-7");
        assert_eq!(job_name(None, None, Some("node1"), 1700000000, 42), "node1-1700000000-42");
    }

    #[test]
    fn ranks_come_from_the_environment_and_are_none_when_absent_or_not_numbers() {
        let env: HashMap<OsString, OsString> =
            [("RANK", "3"), ("LOCAL_RANK", " 1 "), ("WORLD_SIZE", "x")].map(|(k, v)| (k.into(), v.into())).into();
        assert_eq!(ranks(&|k| env_var(&env, k)), (Some(3), Some(1), None));
        assert_eq!(ranks(&|_| None), (None, None, None));
    }

    #[test]
    fn a_rank_gets_its_local_rank_gpu_when_it_sees_the_same_devices() {
        let all = [0, 1, 2, 3];
        assert_eq!(rank_gpus(&all, None, Some(2), None, None), vec![2]);
        assert_eq!(rank_gpus(&all, None, Some(1), Some("4,5,6,7"), Some("4,5,6,7")), vec![1]);
        // Its own devices (a launcher that gives each rank one GPU): all of them.
        assert_eq!(rank_gpus(&all, None, Some(1), Some("1"), None), all.to_vec());
        // A LOCAL_RANK past the sampled GPUs (CPU ranks), or none.
        assert_eq!(rank_gpus(&all, None, Some(9), None, None), all.to_vec());
        assert_eq!(rank_gpus(&all, None, None, None, None), all.to_vec());
        assert_eq!(rank_gpus(&[], None, Some(0), None, None), Vec::<u32>::new());
    }

    #[test]
    fn nvmls_process_list_names_a_ranks_gpus_before_its_local_rank() {
        let all = [0, 1, 2, 3];
        let seen = |g: &[u32]| g.iter().copied().collect::<BTreeSet<u32>>();
        assert_eq!(rank_gpus(&all, Some(&seen(&[3])), Some(0), None, None), vec![3]);
        assert_eq!(rank_gpus(&all, Some(&seen(&[1, 2])), None, Some("1"), None), vec![1, 2]);
        // Listed nowhere, or only on GPUs not sampled: the LOCAL_RANK rule.
        assert_eq!(rank_gpus(&all, Some(&seen(&[])), Some(2), None, None), vec![2]);
        assert_eq!(rank_gpus(&all, Some(&seen(&[7])), Some(2), None, None), vec![2]);
    }

    #[test]
    fn descendants_are_children_and_theirs_parents_first() {
        let parents = [(10, 1), (11, 10), (12, 10), (13, 11), (20, 1), (21, 20), (30, 99)];
        let mut below = tree_below(&[10], &parents);
        below.sort_unstable();
        assert_eq!(below, vec![(11, 10), (12, 10), (13, 11)]);
        // A named PID below another is not listed twice.
        assert_eq!(tree_below(&[10, 11], &parents).iter().filter(|(p, _)| *p == 11).count(), 0);
        assert!(tree_below(&[30], &parents).is_empty());
    }

    #[test]
    fn the_slowest_rank_is_the_one_with_the_fewest_new_steps() {
        let last = HashMap::from([(1, 10), (2, 10), (3, 0)]);
        let now = HashMap::from([(1, 30), (2, 15), (3, 0)]);
        assert_eq!(slowest_rate(&now, &last, 1.0), Some((2, 5.0)));
        assert_eq!(slowest_rate(&HashMap::from([(3, 0)]), &last, 1.0), None);
    }
}
