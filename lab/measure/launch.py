"""What happens around a kernel: the fixed cost of launching an op, measured on this CPU, and which ops it bounds.

Every op eager PyTorch runs pays a toll before it touches a byte: the Python call, the dispatcher choosing a kernel,
the output's allocation and, on a GPU, the driver enqueueing the launch. On a big tensor the toll disappears under
the memory traffic; on a small one it is all there is, and time per op stops falling as the tensor shrinks. That
floor turns the roofline into three terms, time(op) ≈ max(launch floor, bytes / bandwidth, flops / peak):

* `per_op_s`, `chain_vs_one`, `launch_sweep`, `launch_floor`: a chain of tiny elementwise ops against one op over
  the same bytes, and time per op as the tensor shrinks (the floor);
* `python_share`: the same ops called one by one from Python and dispatched from C++ by one `torch._foreach_add`
  (the multi-tensor apply that fused optimizers use): what the interpreter adds to each op;
* `Machine`, `op_time`, `fusion_saving`, `this_cpu`: the roofline with a floor, and what fusing a chain into one
  launch saves (torch.compile's fusion and a CUDA graph's single launch both remove launches);
* `profile_step`: torch.profiler over one step, the ops by self time and the Python time between them;
* `read_kernel_trace`: a recorded GPU trace (Chrome JSON from torch.profiler, read by `trace_events`) as kernel
  times and the gaps between kernels, the signature of a launch-bound step (`kernel_time` sorts the same kernels
  by what they do).
"""

from __future__ import annotations

import gzip
import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from lab.calc.roofline import Op
from lab.layout import check_count
from lab.measure.cpu import best_seconds, copy_bandwidth, matmul_flops, one_thread


def per_op_s(numel: int, n_ops: int = 200, repeats: int = 5) -> float:
    """Seconds per op of a chain of `n_ops` eager adds on a tensor of `numel` fp32 elements, each op reading the
    previous op's output and allocating its own, as an unfused elementwise chain does."""
    check_count("numel", numel)
    check_count("n_ops", n_ops)
    x = torch.ones(numel)

    def chain() -> torch.Tensor:
        y = x
        for _ in range(n_ops):
            y = y.add(1.0)
        return y

    with one_thread():
        return best_seconds(chain, repeats) / n_ops


def chain_vs_one(numel: int = 64, n_ops: int = 200, repeats: int = 5) -> tuple[float, float]:
    """(seconds for a chain of `n_ops` adds over `numel` elements each, seconds for one add over all
    `numel * n_ops` elements): the same bytes read and written, `n_ops` launches against one."""
    chain = per_op_s(numel, n_ops, repeats) * n_ops
    x = torch.ones(numel * n_ops)
    with one_thread():
        return chain, best_seconds(lambda: x.add(1.0), repeats)


def launch_floor(sweep: Sequence[tuple[int, float]]) -> float:
    """The floor of a `launch_sweep`: its least time per op (the small sizes all sit on it, up to noise)."""
    return min(seconds for _, seconds in sweep)


def launch_sweep(sizes: Sequence[int] = (1, 64, 1024, 16384, 262144), n_ops: int = 50,
                 repeats: int = 5) -> list[tuple[int, float]]:
    """(bytes one op moves, seconds per op) as the fp32 tensor grows: flat at the launch floor while the op is
    small, then rising with bytes / bandwidth."""
    return [(8 * numel, per_op_s(numel, n_ops, repeats)) for numel in sizes]  # 4 bytes read + 4 written


def python_share(numel: int = 16, n_ops: int = 200, repeats: int = 5) -> tuple[float, float]:
    """(seconds per add called from Python, seconds per add dispatched from C++ by one `torch._foreach_add` over
    `n_ops` tensors): both pay the dispatcher, the allocation and the kernel; the difference is the interpreter."""
    check_count("numel", numel)
    check_count("n_ops", n_ops)
    tensors = [torch.ones(numel) for _ in range(n_ops)]

    def one_by_one() -> list[torch.Tensor]:
        return [t.add(1.0) for t in tensors]

    with one_thread():
        return (best_seconds(one_by_one, repeats) / n_ops,
                best_seconds(lambda: torch._foreach_add(tensors, 1.0), repeats) / n_ops)


@dataclass(frozen=True)
class Machine:
    """What an op costs at least on one device: a fixed launch floor, then its bytes and FLOPs at the peaks."""

    name: str
    launch_s: float  # the floor: time per op of the smallest op (dispatch + launch)
    bandwidth: float  # bytes/s
    peak_flops: float  # FLOP/s

    def __post_init__(self) -> None:
        for field in ("launch_s", "bandwidth", "peak_flops"):
            value = getattr(self, field)
            if not value > 0:
                raise ValueError(f"Machine {field}={value!r} must be > 0")


def op_time(nbytes: float, flops: float, machine: Machine) -> tuple[float, str]:
    """(least seconds one kernel takes, what bounds it: "launch", "memory" or "compute"). The three overlap — a
    GPU launches the next kernel while this one runs, and moves bytes while it computes — so the time is the
    largest of them, not their sum."""
    times = {"launch": machine.launch_s, "memory": nbytes / machine.bandwidth, "compute": flops / machine.peak_flops}
    bound = max(times, key=times.__getitem__)
    return times[bound], bound


def block_bounds(ops: Sequence[Op], machine: Machine) -> list[tuple[str, float, str]]:
    """(name, seconds, bound) of each op of a block (`lab.calc.roofline.llama_block_ops`) on `machine`."""
    return [(op.name, *op_time(op.bytes_moved, op.flops, machine)) for op in ops]


def fusion_saving(chain: Sequence[tuple[float, float]], fused: tuple[float, float], machine: Machine) -> float:
    """Seconds saved by running `chain` — (bytes, flops) of each op, one launch each — as one kernel that moves
    `fused`'s bytes and does its FLOPs: the launches beyond the first, and the intermediates' round trips."""
    eager = sum(op_time(nbytes, flops, machine)[0] for nbytes, flops in chain)
    return eager - op_time(*fused, machine)[0]


def this_cpu(launch_s: float) -> Machine:
    """This CPU on one thread: the launch floor measured by `launch_floor`, the copy bandwidth and a 256³ fp32
    matmul's FLOP/s from `lab.measure.cpu`."""
    return Machine("this CPU, 1 thread", launch_s, copy_bandwidth(), matmul_flops(256, 256, 256, repeats=10))


@dataclass(frozen=True)
class StepProfile:
    """One step under torch.profiler: its wall time, the time spent inside torch (the outermost events' CPU time:
    ops called from Python, and autograd's nodes in backward) and the ops with the most self time (name, calls,
    seconds)."""

    wall_s: float
    in_ops_s: float
    top: list[tuple[str, int, float]]
    unprofiled_s: float  # the same step without the profiler (best of 3): the difference is the profiler's own cost

    @property
    def between_ops_s(self) -> float:
        """Wall time outside every torch op: Python between the calls, and the profiler's own bookkeeping."""
        return self.wall_s - self.in_ops_s


def profile_step(step: Callable[[], object], top: int = 8) -> StepProfile:
    """Run `step` once under the profiler, after timing it unprofiled (the best of 3, after a warm-up). The events
    and `key_averages()` are those of `torch.profiler.profile(activities=[ProfilerActivity.CPU])`; its CPU-only path
    without Kineto is used because Kineto takes seconds to start in a fresh process (3.5 s on 2 busy cores), and CPU
    ops need none of it."""
    unprofiled = best_seconds(step, 3)
    with torch.autograd.profiler.profile(use_kineto=False) as prof:
        start = time.perf_counter()
        step()
        wall = time.perf_counter() - start
    events = prof.function_events
    in_ops = sum(e.cpu_time_total for e in events if e.cpu_parent is None) / 1e6  # autograd's nodes in backward
    by_self = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return StepProfile(wall, in_ops, [(e.key, e.count, e.self_cpu_time_total / 1e6) for e in by_self], unprofiled)


@dataclass(frozen=True)
class KernelTrace:
    """A recorded GPU trace read as its kernels: how many, how long, and how long the GPU sat between them."""

    kernels: int
    median_kernel_s: float
    busy_s: float  # the kernels' durations, summed
    span_s: float  # first kernel's start to last kernel's end
    median_gap_s: float  # idle time between one kernel's end and the next one's start
    median_launch_s: float  # host time of one launch call (cudaLaunchKernel and its kin)
    launches: int

    @property
    def idle(self) -> float:
        """Share of the span the GPU ran no kernel: large when the host cannot launch fast enough."""
        return 1 - self.busy_s / self.span_s


def trace_events(path: str | Path) -> list[dict]:
    """The events of a Chrome trace written by torch.profiler (`.json` or `.json.gz`): kernels have cat "kernel"."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def read_kernel_trace(path: str | Path) -> KernelTrace:
    """Read a Chrome trace written by torch.profiler (`.json` or `.json.gz`) with CUDA activity. The kernels of all
    streams are taken in start order, so with several streams a gap is a gap on the device, not on one stream."""
    events = trace_events(path)
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    if len(kernels) < 2:
        raise ValueError(f"{path} holds {len(kernels)} kernel events, expected at least 2 (a trace with CUDA activity)")
    launches = [e["dur"] for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "LaunchKernel" in e["name"]]
    end = 0.0
    gaps = []
    for e in kernels:
        if end:
            gaps.append(max(0.0, e["ts"] - end))
        end = max(end, e["ts"] + e["dur"])
    us = 1e-6  # the trace's times are microseconds
    return KernelTrace(len(kernels), statistics.median(e["dur"] for e in kernels) * us,
                       sum(e["dur"] for e in kernels) * us, (end - kernels[0]["ts"]) * us, statistics.median(gaps) * us,
                       statistics.median(launches) * us if launches else float("nan"), len(launches))
