#!/usr/bin/env python3
"""The prepared GPU check: runs loop.py (a PyTorch CUDA training loop) under
the bundled profiler with NVML, and compares what the profiler stored with
PyTorch's own profiler (CUPTI), the loop's own clocks, and NVML read directly.

Prints one table (part | expected | measured | verdict), then every part it
could not run and why, and exits with:

  0  every part ran and agreed within its tolerance
  1  a mismatch beyond tolerance (FAIL rows above say which)
  2  the check itself could not run (broken bundle, loop crashed, timeout)
  3  nothing to check here: no NVIDIA GPU with a CUDA PyTorch
  4  what ran agreed, but some parts were skipped (e.g. no eBPF under gVisor)

Standard library only (the loop imports torch); Python 3.8+.
"""

import argparse
import json
import os
import re
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
STEP_SYMBOL = "gpu_check_train_step"
EXIT_OK, EXIT_MISMATCH, EXIT_BROKEN, EXIT_NOTHING, EXIT_PARTIAL = 0, 1, 2, 3, 4
MS = 1_000_000


class Report:
    """The table's rows and the skipped parts."""

    def __init__(self):
        self.rows, self.skipped, self.notes = [], [], []

    def row(self, part, expected, measured, verdict):
        self.rows.append((part, str(expected), str(measured), verdict))

    def check(self, part, expected, measured, ok):
        self.row(part, expected, measured, "PASS" if ok else "FAIL")

    def skip(self, part, why):
        self.rows.append((part, "-", "-", "SKIP"))
        self.skipped.append((part, why))

    def info(self, part, expected, measured):
        self.row(part, expected, measured, "info")

    def failed(self):
        return [r for r in self.rows if r[3] == "FAIL"]

    def render(self):
        head = ("part", "expected", "measured", "verdict")
        widths = [max(len(r[i]) for r in self.rows + [head]) for i in range(4)]
        widths[1], widths[2] = min(widths[1], 44), min(widths[2], 58)
        lines = []

        def line(r):
            cells = [r[0].ljust(widths[0]), wrap(r[1], widths[1]), wrap(r[2], widths[2]), r[3]]
            depth = max(len(cells[1]), len(cells[2]))
            for k in range(depth):
                a = cells[1][k] if k < len(cells[1]) else ""
                b = cells[2][k] if k < len(cells[2]) else ""
                first = cells[0] if k == 0 else " " * widths[0]
                lines.append("| %s | %s | %s | %s |" % (first, a.ljust(widths[1]), b.ljust(widths[2]),
                                                       (cells[3] if k == 0 else "").ljust(7)))

        line(head)
        lines.append("|-%s-|-%s-|-%s-|-%s-|" % tuple("-" * w for w in widths[:3] + [7]))
        for r in self.rows:
            line(r)
        if self.skipped:
            lines.append("")
            lines.append("not run here:")
            for part, why in self.skipped:
                lines.append("  - %s: %s" % (part, why))
        for n in self.notes:
            lines.append("note: " + n)
        return "\n".join(lines)


def wrap(text, width):
    """Splits text into lines of at most width characters, at spaces where possible."""
    out, cur = [], ""
    for word in text.split(" "):
        while len(word) > width:
            if cur:
                out.append(cur)
                cur = ""
            out.append(word[:width])
            word = word[width:]
        if not cur:
            cur = word
        elif len(cur) + 1 + len(word) <= width:
            cur += " " + word
        else:
            out.append(cur)
            cur = word
    out.append(cur)
    return out


def sh(cmd, timeout=30, env=None):
    """(rc, stdout+stderr) of a short command; rc None if it could not start."""
    try:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout, env=env)
        return p.returncode, p.stdout.decode(errors="replace")
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, str(e)


# ---------------------------------------------------------------- environment


def probe_torch(python, device):
    """What the loop's Python says about torch and its device, in a child process
    (the checker itself never initialises CUDA)."""
    code = (
        "import json,sys\n"
        "try:\n import torch\nexcept Exception as e:\n print(json.dumps({'error': 'no torch: %s' % e})); sys.exit()\n"
        "d = {'torch': torch.__version__, 'cuda': torch.version.cuda, 'available': torch.cuda.is_available()}\n"
        "if d['available']:\n"
        " p = torch.cuda.get_device_properties(0); d['name'] = p.name; d['count'] = torch.cuda.device_count()\n"
        "print(json.dumps(d))\n"
    )
    rc, out = sh([python, "-c", code], timeout=180)
    for ln in reversed(out.strip().splitlines()):
        if ln.startswith("{"):
            try:
                return json.loads(ln)
            except ValueError:
                break
    return {"error": "probing torch failed (rc %s): %s" % (rc, out.strip()[-300:])}


def find_nvml():
    """The path of libnvidia-ml.so.1 as the dynamic loader finds it, else in the
    usual driver folders; None when there is none."""
    try:
        import ctypes

        ctypes.CDLL("libnvidia-ml.so.1")
        with open("/proc/self/maps") as f:
            for ln in f:
                if "libnvidia-ml.so" in ln:
                    return ln.split()[-1]
    except OSError:
        pass
    for d in ("/usr/local/nvidia/lib64", "/usr/local/nvidia/lib", "/usr/lib/x86_64-linux-gnu", "/usr/lib64",
              "/usr/lib/wsl/lib", "/run/nvidia/driver/usr/lib/x86_64-linux-gnu"):
        p = os.path.join(d, "libnvidia-ml.so.1")
        if os.path.exists(p):
            return p
    return None


def nvidia_smi():
    if not shutil.which("nvidia-smi"):
        return None
    rc, out = sh(["nvidia-smi", "--query-gpu=index,name,driver_version,power.draw", "--format=csv,noheader"])
    return out.strip() if rc == 0 else "nvidia-smi failed (rc %s): %s" % (rc, out.strip()[:200])


# ---------------------------------------------------------------- CUPTI traces

LAUNCH_API = re.compile(r"^cu(da)?(LaunchKernel|LaunchCooperativeKernel|GraphLaunch)")


def read_trace(path):
    """(kernel names, launch-API events as (tid, name)) of one chrome trace."""
    with open(path) as f:
        doc = json.load(f)
    events = doc.get("traceEvents", []) if isinstance(doc, dict) else doc
    kernels, api = [], []
    for e in events:
        if not isinstance(e, dict) or e.get("ph") != "X":
            continue
        cat = str(e.get("cat", "")).lower()
        if cat == "kernel":
            kernels.append(str(e.get("name", "")))
        elif cat in ("cuda_runtime", "cuda_driver") and LAUNCH_API.match(str(e.get("name", ""))):
            api.append((e.get("tid"), str(e.get("name"))))
    return kernels, api


def normalize(name):
    """A kernel name compared as text: no return type, no whitespace."""
    n = name.strip()
    if n.startswith("void "):
        n = n[5:]
    return re.sub(r"\s+", "", n)


def base_name(name):
    """The qualified function name: no template arguments, no parameters."""
    n = normalize(name)
    out, depth = [], 0
    for ch in n:
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth = max(0, depth - 1)
        elif ch == "(" and depth == 0:
            break
        elif depth == 0:
            out.append(ch)
    return "".join(out)


# ---------------------------------------------------------------- energy


class Counter:
    """NVML's energy counter as the profiler interpolates it (correlate.rs): the
    first sample of each new value, the last sample closing the range, linear
    in between."""

    def __init__(self, samples):
        pts = []
        for t, v in samples:
            if not pts or v != pts[-1][1]:
                pts.append((t, v))
        changes = [b[0] - a[0] for a, b in zip(pts, pts[1:])]
        self.update_ns = sorted(changes)[len(changes) // 2] if changes else 0
        if samples and pts and samples[-1][0] > pts[-1][0]:
            pts.append(samples[-1])
        self.pts = pts
        gaps = [b[0] - a[0] for a, b in zip(samples, samples[1:])]
        self.sample_ns = sorted(gaps)[len(gaps) // 2] if gaps else 0

    def at(self, t):
        p = self.pts
        if len(p) < 2 or t < p[0][0] or t > p[-1][0]:
            return None
        lo, hi = 0, len(p) - 1
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if p[mid][0] <= t:
                lo = mid
            else:
                hi = mid
        (t0, v0), (t1, v1) = p[lo], p[hi]
        return v0 if t1 == t0 else v0 + (v1 - v0) * (t - t0) / (t1 - t0)


def median(v):
    v = sorted(v)
    return v[len(v) // 2] if v else None


def fmt_counts(values):
    """'412 ×5' when all equal, else the list."""
    if values and all(v == values[0] for v in values):
        return "%s ×%d" % (values[0], len(values))
    return ", ".join(str(v) for v in values)


# ---------------------------------------------------------------- the parts


def part_doctor(rep, ctx):
    cmd = [ctx.profiler, "doctor"] + (["--nvml-lib", ctx.nvml_lib] if ctx.nvml_lib else [])
    rc, out = sh(cmd, timeout=60, env=dict(os.environ, **ctx.env))
    with open(os.path.join(ctx.out, "doctor.txt"), "w") as f:
        f.write("$ %s\nexit %s\n%s" % (" ".join(cmd), rc, out))
    if rc is None or rc in (126, 127) or "GLIBC_" in out:
        # The binary itself does not run here (e.g. a glibc older than the build machine's).
        rep.check("profiler doctor", "the bundled binary runs", "exit %s: %s" % (rc, out.strip()[:200]), False)
        return False
    fails = [ln[1:].strip() for ln in out.splitlines() if ln.startswith("✗")]
    rep.row("profiler doctor", "attach would work (exit 0)",
            "exit 0" if rc == 0 else "exit %d: %s" % (rc, "; ".join(fails)[:200] or out.strip().splitlines()[-1]),
            "PASS" if rc == 0 else "info")
    nvml_line = next((ln.strip() for ln in out.splitlines() if "NVML" in ln), None)
    if ctx.gpu_name:
        ok = nvml_line is not None and ctx.gpu_name.lower() in nvml_line.lower()
        rep.check("doctor: NVML", "sees %s" % ctx.gpu_name, nvml_line or "no NVML line", ok)
    elif nvml_line:
        rep.info("doctor: NVML", "-", nvml_line)
    return rc == 0


def run_loop(rep, ctx, with_profiler):
    """Runs the loop (under the profiler when with_profiler); False if it broke."""
    truth = os.path.join(ctx.out, "truth.json")
    loop = [ctx.python, os.path.join(HERE, "loop.py"), "--backend", ctx.backend, "--device", ctx.device,
            "--marker", os.path.join(HERE, "libgpucheck_step.so"), "--out", truth,
            "--trace-dir", ctx.traces, "--steps", str(ctx.steps), "--cupti-steps", str(ctx.cupti_steps)]
    loop += ["--nvml-lib", ctx.nvml_lib] if ctx.nvml_lib else ["--no-nvml"]
    loop += ctx.loop_args
    if with_profiler:
        cmd = [ctx.profiler, "run", "-o", ctx.db, "--step-symbol",
               "%s:%s" % (os.path.join(HERE, "libgpucheck_step.so"), STEP_SYMBOL), "--gpu-interval", "20"]
        cmd += ["--nvml-lib", ctx.nvml_lib] if ctx.nvml_lib else ["--no-gpu"]
        cmd += ["--"] + loop
    else:
        cmd = loop
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.update(ctx.env)
    print("check: running %s" % " ".join(cmd), flush=True)
    t0 = time.monotonic()
    log = os.path.join(ctx.out, "log.txt")
    with open(log, "a") as f:
        f.write("$ %s\n" % " ".join(cmd))
        f.flush()
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=ctx.timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout after %d s" % ctx.timeout
    took = time.monotonic() - t0
    what = "profiler run -- loop.py" if with_profiler else "loop.py (no profiler)"
    if rc != 0 or not os.path.exists(truth):
        with open(log) as f:
            tail = f.read()[-1500:]
        rep.check(what, "exit 0", "exit %s after %.1f s" % (rc, took), False)
        print(tail, file=sys.stderr)
        return False
    rep.check(what, "exit 0", "exit 0 after %.1f s" % took, True)
    return True


def load_profile(ctx):
    db = sqlite3.connect(ctx.db)
    q = lambda sql, *a: db.execute(sql, a).fetchall()  # noqa: E731
    sess = q("SELECT id, lost_events, total_launches, stored_launches, end_reason FROM sessions ORDER BY id DESC LIMIT 1")
    if not sess:
        raise RuntimeError("no session in %s" % ctx.db)
    sid, lost, total, stored, end_reason = sess[0]
    p = {"sid": sid, "lost": lost, "total": total, "stored": stored, "end_reason": end_reason}
    p["steps"] = q("SELECT step, tid, start_ns, end_ns, launches, sync_wait_ns, cpu_ns, h2d_bytes, copy_calls FROM steps "
                   "WHERE session_id = ? AND label = 'train' ORDER BY step", sid)
    p["launches"] = q("SELECT ts_ns, tid, function FROM launches WHERE session_id = ? ORDER BY ts_ns", sid)
    names = {}
    for fn, name, dem in q("SELECT function, name, demangled_name FROM kernels WHERE session_id = ?", sid):
        names.setdefault(fn, []).extend(n for n in (name, dem) if n)
    p["names"] = names
    p["syncs"] = q("SELECT tid, start_ns, end_ns FROM syncs WHERE session_id = ?", sid)
    p["gpus"] = q("SELECT gpu, nvml_index, uuid, name, energy_update_period_ms, used_by_target FROM gpus "
                  "WHERE session_id = ?", sid)
    p["db"] = db
    return p


def in_window(rows, t0, t1, key=lambda r: r[0]):
    """Rows (sorted by key) with t0 <= key <= t1."""
    import bisect

    keys = [key(r) for r in rows]
    return rows[bisect.bisect_left(keys, t0):bisect.bisect_right(keys, t1)]


def part_steps(rep, truth, prof):
    loop_steps = truth["steps"]
    ps = prof["steps"]
    rep.check("steps", "%d (the loop's), exact" % len(loop_steps), "%d" % len(ps), len(ps) == len(loop_steps))
    rep.check("lost events", "0", str(prof["lost"]), prof["lost"] == 0)
    pairs = []
    for ls, pstep in zip(loop_steps, ps):
        pairs.append((ls, {"step": pstep[0], "tid": pstep[1], "start": pstep[2], "end": pstep[3],
                           "launches": pstep[4], "sync": pstep[5], "cpu": pstep[6], "h2d": pstep[7],
                           "copy_calls": pstep[8]}))
    errs = []
    for ls, pstep in pairs:
        if pstep["end"] is None:
            errs.append(float("inf"))
            continue
        errs.append(max(abs(pstep["start"] - ls["start_ns"]), abs(ls["end_ns"] - pstep["end"])))
    tids_ok = all(p["tid"] == ls["tid"] for ls, p in pairs)
    if errs:
        worst = max(errs)
        rep.check("step boundaries", "within 2 ms of the loop's clock, same thread",
                  "p50 %.1f µs, max %.1f µs%s" % (median(errs) / 1e3, worst / 1e3,
                                                  "" if tids_ok else ", thread differs"),
                  worst <= 2 * MS and tids_ok)
    return pairs


def part_launches(rep, truth, prof, pairs):
    launches = prof["launches"]
    cupti = [(ls, p) for ls, p in pairs if ls["kind"] == "cupti" and ls.get("trace")]
    steady = [(ls, p) for ls, p in pairs if ls["kind"] == "steady" and p["end"] is not None]
    window = lambda p: in_window(launches, p["start"], p["end"])  # noqa: E731

    # The kernel's per-thread counter against the stored rows of that thread.
    if prof["stored"] == prof["total"] and prof["lost"] == 0:
        bad = [p["step"] for _, p in pairs if p["end"] is not None
               and p["launches"] != sum(1 for r in window(p) if r[1] == p["tid"])]
        rep.check("steps.launches = rows", "launch rows on the step's thread, exact",
                  "all %d steps agree" % len(pairs) if not bad else "differs in steps %s" % bad[:8], not bad)
    else:
        rep.skip("steps.launches = rows", "launch rows were not all stored (%s of %s, %s lost)"
                 % (prof["stored"], prof["total"], prof["lost"]))

    cupti_k, win, names_cupti, names_prof, unnamed, total_win = [], [], set(), set(), 0, 0
    api_tid, tid_known = [], True
    for ls, p in cupti:
        kernels, api = read_trace(ls["trace"])
        cupti_k.append(len(kernels))
        rows = window(p)
        win.append(len(rows))
        mine = [a for a in api if a[0] == ls["tid"]]
        tid_known = tid_known and (not api or bool(mine))
        api_tid.append(len(mine))
        names_cupti.update(kernels)
        for _, _, fn in rows:
            total_win += 1
            n = prof["names"].get(fn)
            if n:
                names_prof.update(n)
            else:
                unnamed += 1
    if not cupti:
        rep.skip("launches/step vs CUPTI", "no CUPTI steps ran")
    elif truth["info"].get("device") == "cpu":
        rep.info("launches/step vs CUPTI", fmt_counts(cupti_k), fmt_counts(win))
    else:
        rep.check("launches/step vs CUPTI", "%s kernels (CUPTI), exact" % fmt_counts(cupti_k),
                  "%s launches in the step (all threads)" % fmt_counts(win), win == cupti_k and sum(win) > 0)
        steps_l = [p["launches"] for _, p in cupti]
        if tid_known:
            rep.check("steps.launches vs CUPTI", "%s launch calls on the step thread (CUPTI)" % fmt_counts(api_tid),
                      "%s (steps.launches)" % fmt_counts(steps_l), steps_l == api_tid)
        else:
            rep.skip("steps.launches vs CUPTI", "CUPTI's trace names threads differently from the loop's native ids")
        off = [w - (s or 0) for w, s in zip(win, steps_l)]
        if any(off):
            rep.info("launches off the step thread", "-",
                     "%s per step (autograd's device thread runs backward); steps.launches counts only the "
                     "step's thread" % fmt_counts(off))
    if steady:
        counts = [len(window(p)) for _, p in steady]
        ref = cupti_k[0] if cupti_k and all(k == cupti_k[0] for k in cupti_k) and truth["info"].get("device") != "cpu" \
            else None
        expected = ("%d per step (CUPTI's), exact" % ref) if ref is not None else "the same count in every step"
        ok = all(c == (ref if ref is not None else counts[0]) for c in counts)
        rep.check("launches/step, steady", expected,
                  fmt_counts(counts) if len(set(counts)) > 1 else "%d ×%d" % (counts[0], len(counts)), ok)

    if cupti and names_cupti:
        exact_p = {normalize(n) for n in names_prof}
        base_p = {base_name(n) for n in names_prof}
        exact = sum(1 for n in names_cupti if normalize(n) in exact_p)
        base = sum(1 for n in names_cupti if base_name(n) in base_p)
        share = base / len(names_cupti)
        unnamed_share = unnamed / total_win if total_win else 0.0
        missing = sorted(n for n in names_cupti if base_name(n) not in base_p)
        rep.check("kernel names vs CUPTI", ">= 90%% of CUPTI's %d names; <= 10%% launches unnamed" % len(names_cupti),
                  "%d found by name (%d exactly), %.0f%%; %d of %d launches unnamed"
                  % (base, exact, 100 * share, unnamed, total_win),
                  share >= 0.9 and unnamed_share <= 0.1)
        if missing:
            rep.notes.append("kernel names CUPTI saw that the profiler did not: " + "; ".join(missing[:6])
                             + (" …" if len(missing) > 6 else ""))
    elif cupti:
        rep.skip("kernel names vs CUPTI", "CUPTI recorded no kernels (device %s)" % truth["info"].get("device"))


def part_sync(rep, truth, prof, pairs):
    steady = [(ls, p) for ls, p in pairs if ls["kind"] == "steady" and p["end"] is not None]
    if not steady:
        rep.skip("sync wait", "no steady steps")
        return
    syncs = sorted(prof["syncs"], key=lambda r: r[1])
    counts, diffs, bad = [], [], []
    for ls, p in steady:
        mine = [s for s in in_window(syncs, p["start"], p["end"], key=lambda r: r[1]) if s[0] == p["tid"]]
        counts.append(len(mine))
        loop_ns = ls["sync_end_ns"] - ls["sync_start_ns"]
        d = (p["sync"] or 0) - loop_ns
        diffs.append(d)
        if not (-(0.5 * MS + 0.05 * loop_ns) <= d <= 0.2 * MS):
            bad.append(p["step"])
    rep.check("sync calls/step", "1 (torch.cuda.synchronize), exact", fmt_counts(counts), all(c == 1 for c in counts))
    loop_med = median([ls["sync_end_ns"] - ls["sync_start_ns"] for ls, _ in steady])
    prof_med = median([p["sync"] or 0 for _, p in steady])
    rep.check("sync wait/step", "loop's synchronize() time, -(0.5 ms+5%)..+0.2 ms",
              "median %.3f ms vs loop %.3f ms; diff median %+.1f µs, worst %+.1f µs%s"
              % (prof_med / MS, loop_med / MS, median(diffs) / 1e3, max(diffs, key=abs) / 1e3,
                 "; out in steps %s" % bad[:8] if bad else ""), not bad)


COPY_API = re.compile(r"^(cudaMemcpy|cudaMemset|cuMemcpy|cuMemset)")


def part_copies_and_cpu(rep, truth, prof, pairs):
    """Host→device bytes per step against the loop's own input size, copy calls
    against CUPTI's runtime/driver copy events, and on-CPU time against the
    loop's own thread CPU time."""
    done = [(ls, p) for ls, p in pairs if p["end"] is not None and ls["kind"] in ("steady", "cupti")]
    if not done:
        rep.skip("copies, cpu_ns", "no steps to compare")
        return
    if truth["info"].get("device") == "cpu":
        rep.info("h2d bytes/step", "0 (CPU device)", fmt_counts([p["h2d"] for _, p in done]))
    else:
        want = [ls["h2d_bytes"] for ls, _ in done]
        got = [p["h2d"] for _, p in done]
        rep.check("h2d bytes/step", "the input's %s bytes, at least" % fmt_counts(want), fmt_counts(got),
                  all(g is not None and g >= w for g, w in zip(got, want)))
        calls, cupti = [], []
        for ls, p in done:
            if ls.get("trace"):
                _, api = read_trace_copies(ls["trace"])
                cupti.append(sum(1 for a in api if a[0] == ls["tid"]))
                calls.append(p["copy_calls"])
        if cupti:
            rep.check("copy calls/step vs CUPTI", "%s copy/memset API calls (CUPTI)" % fmt_counts(cupti),
                      "%s (steps.copy_calls)" % fmt_counts(calls), calls == cupti)
    ratios = [p["cpu"] / ls["cpu_ns"] for ls, p in done if p["cpu"] is not None and ls.get("cpu_ns")]
    if not ratios:
        rep.skip("cpu_ns vs thread CPU time", "no scheduler figures (no eBPF, or --no-sched)")
    else:
        rep.check("cpu_ns vs thread CPU time", "the loop's thread_time_ns() per step, ±10 %",
                  "ratio median %.3f, min %.3f, max %.3f" % (median(ratios), min(ratios), max(ratios)),
                  all(0.9 <= r <= 1.1 for r in ratios))


def read_trace_copies(path):
    """(memcpy/memset GPU events, copy-API events as (tid, name)) of one chrome trace."""
    with open(path) as f:
        doc = json.load(f)
    events = doc.get("traceEvents", []) if isinstance(doc, dict) else doc
    gpu, api = [], []
    for e in events:
        if not isinstance(e, dict) or e.get("ph") != "X":
            continue
        cat = str(e.get("cat", "")).lower()
        if cat in ("gpu_memcpy", "gpu_memset"):
            gpu.append(e)
        elif cat in ("cuda_runtime", "cuda_driver") and COPY_API.match(str(e.get("name", ""))):
            api.append((e.get("tid"), str(e.get("name"))))
    return gpu, api


def pick_gpu(truth, prof):
    uuid = (truth.get("nvml") or {}).get("uuid")
    for g in prof["gpus"]:
        if uuid and g[2] == uuid:
            return g
    for g in prof["gpus"]:
        if g[5]:
            return g
    return prof["gpus"][0] if prof["gpus"] else None


def part_energy(rep, truth, prof, pairs):
    g = pick_gpu(truth, prof)
    if g is None:
        rep.skip("energy (profiler)", "the profiler sampled no GPU (see doctor.txt and the capabilities table)")
        return
    db, sid, gpu = prof["db"], prof["sid"], g[0]
    raw = db.execute("SELECT ts_ns, energy_j, power_w FROM gpu_samples WHERE session_id = ? AND gpu = ? "
                     "AND energy_j IS NOT NULL ORDER BY ts_ns", (sid, gpu)).fetchall()
    if len(raw) < 3:
        rep.skip("energy (profiler)", "GPU %s has %d energy samples (counter unsupported?)" % (gpu, len(raw)))
        return
    counter = Counter([(t, e) for t, e, _ in raw])
    step_e = dict(db.execute("SELECT step, energy_j FROM step_gpu WHERE session_id = ? AND label = 'train' AND gpu = ?",
                             (sid, gpu)).fetchall())
    # Each step's energy is the interpolated counter's difference (correlate.rs), checked on real samples.
    diffs = []
    for _, p in pairs:
        mine = (counter.at(p["end"]), counter.at(p["start"])) if p["end"] is not None else (None, None)
        if None in mine or step_e.get(p["step"]) is None:
            continue
        diffs.append((abs(step_e[p["step"]] - (mine[0] - mine[1])), mine[0] - mine[1]))
    if diffs:
        worst = max(diffs, key=lambda d: d[0] - 0.01 * abs(d[1]))
        rep.check("step energy = counter", "interpolated counter at the step's ends, 1% + 0.05 J",
                  "%d steps, worst off by %.3f J of %.3f J" % (len(diffs), worst[0], worst[1]),
                  all(d <= 0.01 * abs(e) + 0.05 for d, e in diffs))
    steady = [p for ls, p in pairs if ls["kind"] == "steady" and p["end"] is not None]
    if len(steady) < 2:
        return
    t0, t1 = steady[0]["start"], steady[-1]["end"]
    e0, e1 = counter.at(t0), counter.at(t1)
    if e0 is None or e1 is None:
        rep.skip("energy: Σ steps = Δ counter", "the counter's samples do not cover the steady steps")
        return
    delta, span = e1 - e0, (t1 - t0) / 1e9
    power = delta / span if span > 0 else 0.0
    steps_sum = sum(step_e.get(p["step"]) or 0.0 for p in steady)
    busy = sum(p["end"] - p["start"] for p in steady) / 1e9
    gap = 1 - busy / span if span > 0 else 0.0
    tol = delta * (gap + 0.01) + 0.1
    rep.check("energy: Σ steps = Δ counter", "Δ %.2f J over the %d steady steps (%.2f s), ± gaps %.1f%% + 1%%"
              % (delta, len(steady), span, 100 * gap), "Σ steps %.2f J (%+.2f%%)"
              % (steps_sum, 100 * (steps_sum - delta) / delta if delta else 0.0), abs(steps_sum - delta) <= tol)
    reads = (truth.get("nvml") or {}).get("reads") or {}
    a, b = reads.get("steady_start"), reads.get("steady_end")
    if a and b and a.get("mj") is not None and b.get("mj") is not None:
        pa, pb = counter.at(a["t_ns"]), counter.at(b["t_ns"])
        if pa is not None and pb is not None:
            own = (b["mj"] - a["mj"]) / 1000.0
            lag = (max(counter.update_ns, g[4] * MS if g[4] else 0) + counter.sample_ns) / 1e9
            tol = 2 * power * lag + 0.01 * abs(own) + 1.0
            rep.check("energy: Δ vs loop's NVML", "loop read %.2f J, ± 2·P·(T_u+T_s) + 1%% + 1 J = %.1f J" % (own, tol),
                      "profiler %.2f J (%+.2f J)" % (pb - pa, pb - pa - own), abs(pb - pa - own) <= tol)
        else:
            rep.skip("energy: Δ vs loop's NVML", "the profiler's samples do not cover the loop's reads")
    else:
        rep.skip("energy: Δ vs loop's NVML", "the loop could not read NVML: %s" % truth.get("nvml_error"))
    pw = [w for t, _, w in raw if t0 <= t <= t1 and w is not None]
    if pw:
        mean = sum(pw) / len(pw)
        rep.check("power: counter vs samples", "Δ/span %.1f W, ± 15%%" % power, "mean sampled %.1f W (%+.1f%%)"
                  % (mean, 100 * (mean - power) / power if power else 0.0),
                  power > 0 and abs(mean - power) <= 0.15 * power)
    rep.info("GPU %s (profiler)" % gpu, "-", "%s %s, counter updates every %.0f ms, sampled every %.0f ms"
             % (g[3], g[2], counter.update_ns / 1e6, counter.sample_ns / 1e6))


def part_nvml_direct(rep, truth):
    """NVML read by the loop itself: needs no eBPF and no profiler."""
    nv = truth.get("nvml")
    if not nv:
        rep.skip("NVML direct", "the loop could not use NVML: %s" % truth.get("nvml_error"))
        return
    s = [x for x in nv["samples"] if x.get("mj") is not None]
    if len(s) < 3:
        rep.skip("NVML direct", "the loop got %d energy readings (counter unsupported?)" % len(s))
        return
    key = "instant_mw" if all(x.get("instant_mw") is not None for x in s) else "power_mw"
    if any(x.get(key) is None for x in s):
        rep.skip("NVML direct: ∫power = Δ counter", "power readings missing")
    else:
        integral = sum((b["t_ns"] - a["t_ns"]) / 1e9 * (a[key] + b[key]) / 2 / 1000 for a, b in zip(s, s[1:]))
        delta = (s[-1]["mj"] - s[0]["mj"]) / 1000.0
        rep.check("NVML direct: ∫power = Δ", "Δ counter %.2f J over %.1f s, ± 15%%" % (delta, (s[-1]["t_ns"] - s[0]["t_ns"]) / 1e9),
                  "∫ %s %.2f J (%+.1f%%)" % ("instant power (field 186)" if key == "instant_mw" else "power (1 s avg)",
                                            integral, 100 * (integral - delta) / delta if delta else 0.0),
                  delta > 0 and abs(integral - delta) <= 0.15 * delta)
    mono = all(b["mj"] >= a["mj"] for a, b in zip(s, s[1:]))
    c = Counter([(x["t_ns"], x["mj"]) for x in s])
    rep.check("NVML direct: counter", "never decreases, updates <= 200 ms apart",
              "%s, updates every %.0f ms (median)" % ("monotonic" if mono else "DECREASED", c.update_ns / 1e6),
              mono and 0 < c.update_ns <= 200 * MS)


# ---------------------------------------------------------------- main


class Ctx:
    pass


def main():
    ap = argparse.ArgumentParser(description="The profiler's prepared GPU check (see README.txt).")
    ap.add_argument("--out", default="gpu-check-out", help="where the results go (created)")
    ap.add_argument("--python", default=sys.executable, help="the Python with CUDA PyTorch that runs the loop")
    ap.add_argument("--device", default="cuda", help="torch device for the loop (cpu: plumbing only)")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--cupti-steps", type=int, default=5)
    ap.add_argument("--timeout", type=int, default=240, help="seconds the profiled loop may take")
    ap.add_argument("--no-profiler", action="store_true", help="run only the parts that need no eBPF")
    ap.add_argument("--standin", metavar="FIXTURES",
                    help="rehearsal without a GPU: the project's stand-in libcuda/libnvidia-ml from FIXTURES")
    ap.add_argument("--nvml-lib", help="libnvidia-ml.so.1 to use (default: found as the loader finds it)")
    ap.add_argument("loop_args", nargs="*", help="after --: passed on to loop.py (e.g. --hidden 2048)")
    args = ap.parse_args()

    ctx = Ctx()
    ctx.out = os.path.abspath(args.out)
    os.makedirs(ctx.out, exist_ok=True)
    for stale in ("profile.db", "truth.json", "log.txt", "summary.txt", "result.json", "doctor.txt", "cupti.json"):
        if os.path.exists(os.path.join(ctx.out, stale)):
            os.remove(os.path.join(ctx.out, stale))
    ctx.db = os.path.join(ctx.out, "profile.db")
    # CUPTI's raw traces stay out of --out (a device run brings back 8 files at most).
    ctx.traces = tempfile.mkdtemp(prefix="gpu-check-traces-")
    ctx.profiler = os.path.join(HERE, "profiler")
    ctx.python, ctx.device, ctx.steps, ctx.cupti_steps = args.python, args.device, args.steps, args.cupti_steps
    ctx.timeout, ctx.loop_args, ctx.env = args.timeout, args.loop_args, {}
    ctx.backend = "standin" if args.standin else "torch"
    ctx.gpu_name = None
    rep = Report()

    print("profiler GPU check — bundle %s" % HERE)
    print("machine: kernel %s, %s; python %s (%s)" % (os.uname().release, os.uname().machine,
                                                       sys.version.split()[0], ctx.python))
    nothing = None
    if args.standin:
        fx = os.path.abspath(args.standin)
        ctx.nvml_lib = args.nvml_lib or os.path.join(fx, "libnvidia-ml.so.1")
        ctx.env = {"LD_LIBRARY_PATH": fx, "STANDIN_NVML_GPUS": "1", "STANDIN_SYNC_US": "3000"}
        ctx.device = "standin"
        ctx.gpu_name = "Stand-in H200"
        print("rehearsal: stand-in libcuda.so.1 and libnvidia-ml.so.1 from %s (no GPU, no PyTorch)" % fx)
    else:
        ctx.nvml_lib = args.nvml_lib or find_nvml()
        smi = nvidia_smi()
        print("nvidia-smi: %s" % (smi or "not on PATH"))
        print("NVML: %s" % (ctx.nvml_lib or "libnvidia-ml.so.1 not found"))
        t = probe_torch(ctx.python, ctx.device)
        print("torch: %s" % json.dumps(t))
        if ctx.device.startswith("cuda"):
            if "error" in t:
                nothing = "%s (%s)" % (t["error"], ctx.python)
            elif not t.get("available"):
                nothing = "torch %s (CUDA %s) sees no CUDA device" % (t.get("torch"), t.get("cuda"))
            else:
                ctx.gpu_name = t.get("name")
            if smi and ctx.gpu_name:
                rep.check("nvidia-smi", "lists %s" % ctx.gpu_name, smi.splitlines()[0][:60], ctx.gpu_name in smi)
        elif "error" in t:
            nothing = t["error"]

    if not os.access(ctx.profiler, os.X_OK):
        print("check: the bundle has no profiler binary at %s" % ctx.profiler, file=sys.stderr)
        return EXIT_BROKEN
    ebpf = part_doctor(rep, ctx)
    profiled_parts = ["steps", "launches/step vs CUPTI", "kernel names vs CUPTI", "sync wait", "copies, cpu_ns", "energy (profiler)"]
    if nothing is not None:
        for part in profiled_parts + ["NVML direct"]:
            rep.skip(part, nothing)
        print()
        print(rep.render())
        print("\nnothing to check here: %s. Run the bundle on a machine with an NVIDIA GPU and a CUDA PyTorch "
              "(exit %d)." % (nothing, EXIT_NOTHING))
        finish(rep, ctx, EXIT_NOTHING)
        return EXIT_NOTHING

    with_profiler = ebpf and not args.no_profiler
    ran = run_loop(rep, ctx, with_profiler)
    skip_why = "profiler doctor says attach would not work (see doctor.txt)" if not ebpf else "--no-profiler"
    if not ran and with_profiler:
        # The profiler failed (its FAIL row stands): still run what needs no profiler.
        with_profiler, skip_why = False, "profiler run failed (log.txt)"
        ran = run_loop(rep, ctx, False)
    if not ran:
        print(rep.render())
        finish(rep, ctx, EXIT_BROKEN)
        return EXIT_BROKEN
    with open(os.path.join(ctx.out, "truth.json")) as f:
        truth = json.load(f)
    collect_cupti(ctx, truth)
    if with_profiler:
        try:
            prof = load_profile(ctx)
        except (sqlite3.Error, RuntimeError) as e:
            rep.check("profile.db", "a session", "unreadable: %s" % e, False)
            prof = None
        if prof is not None:
            pairs = part_steps(rep, truth, prof)
            part_launches(rep, truth, prof, pairs)
            part_sync(rep, truth, prof, pairs)
            part_copies_and_cpu(rep, truth, prof, pairs)
            part_energy(rep, truth, prof, pairs)
            prof["db"].close()
    else:
        for part in profiled_parts:
            rep.skip(part, skip_why)
        cupti_only(rep, truth)
    part_nvml_direct(rep, truth)

    print()
    print(rep.render())
    code = EXIT_MISMATCH if rep.failed() else EXIT_PARTIAL if rep.skipped else EXIT_OK
    verdict = {EXIT_OK: "all parts agree", EXIT_PARTIAL: "what ran agrees; some parts were skipped (above)",
               EXIT_MISMATCH: "MISMATCH: %d part(s) failed: %s" % (len(rep.failed()),
                                                                   ", ".join(r[0] for r in rep.failed()))}[code]
    print("\n%s (exit %d); results in %s" % (verdict, code, ctx.out))
    finish(rep, ctx, code)
    shutil.rmtree(ctx.traces, ignore_errors=True)
    return code


def cupti_only(rep, truth):
    """Without the profiler: CUPTI's per-step counts, as what the profiler would be compared with."""
    ks = []
    for s in truth["steps"]:
        if s["kind"] == "cupti" and s.get("trace"):
            ks.append(len(read_trace(s["trace"])[0]))
    if ks:
        rep.info("CUPTI kernels/step", "-", fmt_counts(ks))


def collect_cupti(ctx, truth):
    """Keeps CUPTI's per-step kernel lists in one small file; drops the raw traces."""
    per_step = {}
    for s in truth["steps"]:
        if s.get("trace") and os.path.exists(s["trace"]):
            kernels, api = read_trace(s["trace"])
            per_step[s["step"]] = {"kernels": kernels, "launch_api": api}
    with open(os.path.join(ctx.out, "cupti.json"), "w") as f:
        json.dump(per_step, f)


def finish(rep, ctx, code):
    with open(os.path.join(ctx.out, "summary.txt"), "w") as f:
        f.write(rep.render() + "\nexit %d\n" % code)
    with open(os.path.join(ctx.out, "result.json"), "w") as f:
        json.dump({"exit": code, "rows": rep.rows, "skipped": rep.skipped, "notes": rep.notes}, f, indent=1)


def guarded():
    """An error in the check itself is exit 2, never 1 (1 means a mismatch)."""
    try:
        return main()
    except KeyboardInterrupt:
        return EXIT_BROKEN
    except Exception:  # noqa: BLE001 - any bug here must not read as a measured mismatch
        traceback.print_exc()
        print("check: the check itself failed (exit %d)" % EXIT_BROKEN, file=sys.stderr)
        return EXIT_BROKEN


if __name__ == "__main__":
    sys.exit(guarded())
