#!/usr/bin/env python3
"""The GPU check's training loop: a small MLP trained on a CUDA device for a
fixed number of steps, each step run inside the native step function
`gpu_check_train_step` (libgpucheck_step.so, through a ctypes callback) so the
profiler can see its boundaries on any Python.

It writes its own ground truth to --out (JSON): per step the CLOCK_MONOTONIC
start/end (time.monotonic_ns) around the native call, the thread, and the
time spent in torch.cuda.synchronize(); the GPU energy counter read directly
from NVML before and after the steady steps, and NVML samples (counter, power)
taken every --nvml-interval-ms by a thread of its own. A block of steps runs
under torch.profiler (CUPTI); each one's trace is written to --trace-dir.

Schedule: steps [0, warmup) warm up; then 1 + cupti_steps steps under CUPTI
(the first one discarded: CUPTI's own start-up); then the steady steps.

--backend standin replaces PyTorch by the project's stand-in libcuda.so.1
(launches of named kernels from the step thread and a worker thread, like
autograd's device thread) and writes CUPTI-shaped traces itself: a rehearsal
of the whole check on a machine without a GPU. --device cpu runs PyTorch on
the CPU (no kernels, no CUPTI kernels): for exercising the plumbing only.

Standard library only, besides torch; Python 3.8+.
"""

import argparse
import ctypes
import json
import os
import sys
import threading
import time

NVML_FIELD_POWER_INSTANT = 186


class FieldValue(ctypes.Structure):
    """nvmlFieldValue_t."""

    _fields_ = [
        ("fieldId", ctypes.c_uint),
        ("scopeId", ctypes.c_uint),
        ("timestamp", ctypes.c_longlong),
        ("latencyUsec", ctypes.c_longlong),
        ("valueType", ctypes.c_int),
        ("nvmlReturn", ctypes.c_int),
        ("value", ctypes.c_ulonglong),
    ]


class Nvml:
    """The few NVML calls the loop makes, through ctypes (no pynvml needed)."""

    def __init__(self, lib_path, uuid=None, index=0):
        self.lib = ctypes.CDLL(lib_path or "libnvidia-ml.so.1")
        rc = self.lib.nvmlInit_v2()
        if rc != 0:
            raise RuntimeError("nvmlInit_v2 returned %d" % rc)
        self.dev = ctypes.c_void_p()
        self.how = None
        if uuid:
            if self.lib.nvmlDeviceGetHandleByUUID(uuid.encode(), ctypes.byref(self.dev)) == 0:
                self.how = "uuid"
        if self.how is None:
            rc = self.lib.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(index), ctypes.byref(self.dev))
            if rc != 0:
                raise RuntimeError("nvmlDeviceGetHandleByIndex_v2(%d) returned %d" % (index, rc))
            self.how = "index %d" % index
        buf = ctypes.create_string_buffer(96)
        self.uuid = buf.value.decode() if self.lib.nvmlDeviceGetUUID(self.dev, buf, 96) == 0 else None
        self.name = buf.value.decode() if self.lib.nvmlDeviceGetName(self.dev, buf, 96) == 0 else None
        self.instant_ok = self.power_instant_mw() is not None

    def energy_mj(self):
        v = ctypes.c_ulonglong()
        return v.value if self.lib.nvmlDeviceGetTotalEnergyConsumption(self.dev, ctypes.byref(v)) == 0 else None

    def power_mw(self):
        v = ctypes.c_uint()
        return v.value if self.lib.nvmlDeviceGetPowerUsage(self.dev, ctypes.byref(v)) == 0 else None

    def power_instant_mw(self):
        f = FieldValue()
        f.fieldId = NVML_FIELD_POWER_INSTANT
        if self.lib.nvmlDeviceGetFieldValues(self.dev, 1, ctypes.byref(f)) != 0 or f.nvmlReturn != 0:
            return None
        return f.value & 0xFFFFFFFF  # unsigned int member of the union

    def read_energy(self):
        """(CLOCK_MONOTONIC ns at the read's midpoint, mJ)."""
        t0 = time.monotonic_ns()
        e = self.energy_mj()
        t1 = time.monotonic_ns()
        return {"t_ns": (t0 + t1) // 2, "mj": e}


class NvmlSampler(threading.Thread):
    """Samples the counter and the power every interval, on its own clock."""

    def __init__(self, nvml, interval_ms):
        super().__init__(daemon=True)
        self.nvml, self.interval = nvml, interval_ms / 1000.0
        self.samples, self.stop = [], threading.Event()

    def run(self):
        while not self.stop.is_set():
            t = time.monotonic_ns()
            s = {"t_ns": t, "mj": self.nvml.energy_mj(), "power_mw": self.nvml.power_mw()}
            if self.nvml.instant_ok:
                s["instant_mw"] = self.nvml.power_instant_mw()
            self.samples.append(s)
            self.stop.wait(self.interval)


class StepRunner:
    """Runs a Python step body inside the native step function."""

    def __init__(self, marker_path):
        self.lib = ctypes.CDLL(marker_path)
        self.proto = ctypes.CFUNCTYPE(ctypes.c_int)
        self.native = self.lib.gpu_check_train_step
        self.native.argtypes = [self.proto]
        self.native.restype = ctypes.c_int
        self.body, self.error = None, None
        self.callback = self.proto(self._call)  # kept alive for the whole run

    def _call(self):
        try:
            self.body()
            return 0
        except BaseException as e:  # an exception cannot cross the C frame
            self.error = e
            return 1

    def run(self, body):
        self.body, self.error = body, None
        t0 = time.monotonic_ns()
        rc = self.native(self.callback)
        t1 = time.monotonic_ns()
        if self.error is not None:
            raise self.error
        if rc != 0:
            raise RuntimeError("gpu_check_train_step returned %d" % rc)
        return t0, t1


class TorchWorkload:
    def __init__(self, args):
        import torch

        self.torch = torch
        self.cuda = args.device.startswith("cuda")
        if self.cuda and not torch.cuda.is_available():
            raise SystemExit("loop: torch.cuda.is_available() is False")
        dev = torch.device(args.device)
        torch.manual_seed(0)
        layers = []
        for i in range(args.layers):
            layers.append(torch.nn.Linear(args.hidden, args.hidden))
            if i + 1 < args.layers:
                layers.append(torch.nn.ReLU())
        self.model = torch.nn.Sequential(*layers).to(dev)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-4, momentum=0.9)
        self.dev = dev
        # The input comes from the host every step: one host→device copy of known size.
        self.x_host = torch.randn(args.batch, args.hidden)
        self.x_bytes = self.x_host.numel() * self.x_host.element_size()
        self.x = self.x_host.to(dev)
        self.cpu_ns = 0
        self.y = torch.randn(args.batch, args.hidden, device=dev)
        self.loss_fn = torch.nn.MSELoss()
        self.loss = None
        self.sync_ns = (0, 0)
        props = torch.cuda.get_device_properties(dev) if self.cuda else None
        self.info = {
            "torch": torch.__version__,
            "torch_cuda": torch.version.cuda,
            "device": args.device,
            "device_name": props.name if props else "cpu",
            "device_uuid": self._uuid(props),
        }

    @staticmethod
    def _uuid(props):
        u = getattr(props, "uuid", None) if props is not None else None
        if u is None:
            return None
        s = str(u)
        return s if s.startswith(("GPU-", "MIG-")) else "GPU-" + s

    def train_step(self):
        """The step: its input to the device, forward, loss, backward, optimizer,
        then wait for the GPU."""
        c0 = time.thread_time_ns()
        self.opt.zero_grad(set_to_none=True)
        x = self.x_host.to(self.dev) if self.cuda else self.x
        out = self.model(x)
        self.loss = self.loss_fn(out, self.y)
        self.loss.backward()
        self.opt.step()
        s0 = time.monotonic_ns()
        if self.cuda:
            self.torch.cuda.synchronize()
        self.sync_ns = (s0, time.monotonic_ns())
        self.cpu_ns = time.thread_time_ns() - c0

    def profiled(self, runner, trace_path):
        """One step under torch.profiler (CUPTI on a CUDA device)."""
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        with profile(activities=acts) as prof:
            t = runner.run(self.train_step)
        prof.export_chrome_trace(trace_path)
        return t

    def final_loss(self):
        return float(self.loss.item()) if self.loss is not None else None


class StandinWorkload:
    """The stand-in driver's launches: named kernels from the step thread and
    from a worker thread; the 'CUPTI' traces are written from what it did."""

    KERNELS = [
        ("_Z11fake_kernelPfi", "fake_kernel(float*, int)"),
        ("_Z6reduceILi256EEvPKfPf", "void reduce<256>(float const*, float*)"),
        ("_ZN2at6native13fill_kernel_3IfEEvPT_S2_i", "void at::native::fill_kernel_3<float>(float*, float, int)"),
        ("plain_c_kernel", "plain_c_kernel"),
    ]

    def __init__(self, args):
        self.cu = ctypes.CDLL("libcuda.so.1")  # found through LD_LIBRARY_PATH, as frameworks do
        if self.cu.cuInit(0) != 0:
            raise SystemExit("loop: stand-in cuInit failed")
        self.funcs = []
        for mangled, demangled in self.KERNELS:
            f = ctypes.c_void_p()
            if self.cu.cuModuleGetFunction(ctypes.byref(f), ctypes.c_void_p(1), mangled.encode()) != 0:
                raise SystemExit("loop: stand-in cuModuleGetFunction failed")
            self.funcs.append((f, demangled))
        launch = self.cu.cuLaunchKernel
        launch.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
        launch.restype = ctypes.c_int
        self.launch = launch
        self.main_launches, self.worker_launches = args.standin_launches, args.standin_worker_launches
        self.cupti_extra = args.standin_cupti_extra
        self.sync_ns = (0, 0)
        self.record = None
        self.info = {"torch": None, "device": "standin", "device_name": "stand-in", "device_uuid": None}

    def _launch_n(self, n, offset):
        tid = threading.get_native_id()
        for i in range(n):
            f, name = self.funcs[(i + offset) % len(self.funcs)]
            t = time.monotonic_ns()
            if self.launch(f, 1, 1, 1, 32, 1, 1, 0, None, None, None) != 0:
                raise RuntimeError("stand-in cuLaunchKernel failed")
            if self.record is not None:
                self.record.append((t, tid, name))

    def train_step(self):
        worker = threading.Thread(target=self._launch_n, args=(self.worker_launches, 1))
        worker.start()
        self._launch_n(self.main_launches, 0)
        worker.join()
        self.cu.cuCtxSynchronize.restype = ctypes.c_int
        s0 = time.monotonic_ns()
        self.cu.cuCtxSynchronize()
        self.sync_ns = (s0, time.monotonic_ns())

    def profiled(self, runner, trace_path):
        self.record = []
        t = runner.run(self.train_step)
        events = []
        for k, (ts, tid, name) in enumerate(self.record):
            us = ts / 1000.0
            events.append({"ph": "X", "cat": "cuda_driver", "name": "cuLaunchKernel", "pid": os.getpid(),
                           "tid": tid, "ts": us, "dur": 1, "args": {"correlation": k}})
            events.append({"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": 7,
                           "ts": us + 5, "dur": 1, "args": {"correlation": k}})
        for k in range(self.cupti_extra):
            events.append({"ph": "X", "cat": "kernel", "name": "unseen_kernel_%d" % k, "pid": 0, "tid": 7,
                           "ts": t[1] / 1000.0, "dur": 1, "args": {"correlation": -1 - k}})
        self.record = None
        with open(trace_path, "w") as f:
            json.dump({"traceEvents": events}, f)
        return t

    def final_loss(self):
        return None


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=["torch", "standin"], default="torch")
    p.add_argument("--device", default="cuda", help="torch device (cuda, cuda:1, cpu)")
    p.add_argument("--marker", required=True, help="path of libgpucheck_step.so")
    p.add_argument("--out", required=True, help="ground-truth JSON file")
    p.add_argument("--trace-dir", required=True, help="where CUPTI traces go")
    p.add_argument("--nvml-lib", default=None)
    p.add_argument("--no-nvml", action="store_true")
    p.add_argument("--nvml-interval-ms", type=float, default=50)
    p.add_argument("--steps", type=int, default=100, help="steps in all")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--cupti-steps", type=int, default=5, help="steps compared with CUPTI (0: none)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--batch", type=int, default=8192)
    p.add_argument("--standin-launches", type=int, default=30)
    p.add_argument("--standin-worker-launches", type=int, default=10)
    p.add_argument("--standin-cupti-extra", type=int, default=0,
                   help="kernels the stand-in's CUPTI trace adds per step: proves the check can fail")
    args = p.parse_args()

    cupti_first = args.warmup + 1 if args.cupti_steps > 0 else args.warmup  # +1: CUPTI's start-up step
    steady_first = cupti_first + args.cupti_steps
    if args.steps <= steady_first + 1:
        raise SystemExit("loop: --steps must exceed warm-up + CUPTI steps by 2 or more")
    os.makedirs(args.trace_dir, exist_ok=True)

    started = time.monotonic_ns()
    work = TorchWorkload(args) if args.backend == "torch" else StandinWorkload(args)
    runner = StepRunner(args.marker)
    nvml, sampler, nvml_error = None, None, None
    if not args.no_nvml:
        try:
            nvml = Nvml(args.nvml_lib, uuid=work.info.get("device_uuid"))
            sampler = NvmlSampler(nvml, args.nvml_interval_ms)
            sampler.start()
        except (OSError, RuntimeError, AttributeError) as e:
            nvml_error = str(e)

    steps, energy_reads = [], {}
    tid = threading.get_native_id()
    for i in range(args.steps):
        if i == steady_first and nvml is not None:
            energy_reads["steady_start"] = nvml.read_energy()
        kind = "warmup" if i < args.warmup else "steady" if i >= steady_first else "cupti"
        trace = None
        if kind == "warmup" or kind == "steady":
            t0, t1 = runner.run(work.train_step)
        else:
            if i == args.warmup:
                kind = "cupti-warmup"
            trace = os.path.join(args.trace_dir, "step_%d.json" % i)
            t0, t1 = work.profiled(runner, trace)
        s0, s1 = work.sync_ns
        steps.append({"step": i, "kind": kind, "tid": tid, "start_ns": t0, "end_ns": t1,
                      "sync_start_ns": s0, "sync_end_ns": s1, "trace": trace,
                      "cpu_ns": getattr(work, "cpu_ns", None),
                      "h2d_bytes": getattr(work, "x_bytes", 0) if getattr(work, "cuda", False) else 0})
    if nvml is not None:
        energy_reads["steady_end"] = nvml.read_energy()
    if sampler is not None:
        time.sleep(2 * args.nvml_interval_ms / 1000.0)  # one more counter update after the last step
        sampler.stop.set()
        sampler.join()

    truth = {
        "version": 1,
        "pid": os.getpid(),
        "python": sys.version.split()[0],
        "backend": args.backend,
        "workload": {"layers": args.layers, "hidden": args.hidden, "batch": args.batch},
        "info": work.info,
        "started_ns": started,
        "ended_ns": time.monotonic_ns(),
        "final_loss": work.final_loss(),
        "steps": steps,
        "nvml": None if nvml is None else {
            "uuid": nvml.uuid, "name": nvml.name, "matched_by": nvml.how,
            "reads": energy_reads, "samples": sampler.samples if sampler else [],
            "interval_ms": args.nvml_interval_ms,
        },
        "nvml_error": nvml_error,
    }
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(truth, f)
    os.replace(tmp, args.out)


if __name__ == "__main__":
    main()
