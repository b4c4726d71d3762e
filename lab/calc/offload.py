"""ZeRO-Offload: the optimizer moved to the CPU — what moves, what it costs per step, when it pays.

ZeRO-Offload (Ren et al., "ZeRO-Offload: Democratizing Billion-Scale Model Training", USENIX ATC 2021) splits
mixed-precision Adam's state between the two memories by where each piece is used:

  GPU: the 16-bit parameters (2Ψ bytes), used by every forward and backward;
  CPU: the fp32 master weights, Adam's momentum and variance (12Ψ) and the fp32 gradients (4Ψ): 16Ψ, which is
       DeepSpeed's `estimate_zero2_model_states_mem_needs` with offload (GPU 2Ψ, CPU 16Ψ times a 1.5 buffer factor).

Each step the 16-bit gradients go down over PCIe as the backward produces them (2Ψ bytes), the CPU runs Adam over
the fp32 state, and the updated 16-bit parameters come back up (2Ψ): 4Ψ bytes per step (the paper's schedule, §4.1),
the least any split that keeps the forward and backward on the GPU can move (§3.3). With data parallelism each of dp
GPUs offloads only its ZeRO-2 partition: 4Ψ/dp over its own PCIe link, 16Ψ/dp of CPU memory.

The cost is time: PCIe (64 GB/s per direction for Gen5 x16, 32 for Gen4) is ~50x slower than HBM, and a CPU's Adam
is bound by its memory bandwidth (it reads and writes the fp32 master, momentum and variance and reads the
gradient: `ADAM_BYTES_PER_PARAM`). The paper hides the CPU's work behind the GPU's next step (a one-step delayed
update, §5.2); then offloading is free when the GPU computes at least as long as PCIe and the CPU take. Both sides
scale with Ψ, so Ψ cancels and the condition is a number of tokens per GPU per step, as for ZeRO-3's all-gathers.
Offload pays when the model does not fit otherwise (a 13B model on one 32 GB V100, the paper's headline) and the
step has enough tokens to hide the traffic.
"""

from __future__ import annotations

from dataclasses import dataclass

GPU_BYTES_PER_PARAM = 2  # bf16/fp16 parameters stay on the GPU
CPU_BYTES_PER_PARAM = 16  # fp32 master, momentum, variance and gradient
PCIE_BYTES_PER_PARAM = 4  # 16-bit gradients down, 16-bit parameters up
ADAM_BYTES_PER_PARAM = 30  # read master, m, v, fp32 grad (16), write master, m, v (12), write the 16-bit copy (2)
PCIE = {"gen3": 16e9, "gen4": 32e9, "gen5": 64e9}  # x16 link, bytes/s per direction (PCI-SIG specifications)
CPU_MEMORY_BANDWIDTH = 2e11  # bytes/s: an assumption, a two-socket server's DRAM; measure yours (STREAM)


@dataclass(frozen=True)
class OffloadStep:
    """One training step of one GPU with ZeRO-Offload (seconds, bytes)."""

    gpu_bytes: float  # model states left on the GPU
    cpu_bytes: float  # model states on the CPU, this GPU's share
    pcie_bytes: float  # moved over this GPU's PCIe link per step
    pcie_s: float
    cpu_step_s: float
    compute_s: float  # forward and backward on the GPU

    @property
    def exposed_s(self) -> float:
        """What the GPU waits for per step when the CPU's update overlaps its next step (delayed update)."""
        return max(0.0, self.pcie_s + self.cpu_step_s - self.compute_s)

    @property
    def step_s(self) -> float:
        return self.compute_s + self.exposed_s


def _positive(**values: float) -> None:
    for name, value in values.items():
        if not value > 0:
            raise ValueError(f"{name}={value!r} must be > 0")


def offload_step(params: float, tokens: float, peak_flops: float, *, dp: int = 1, mfu: float = 0.4,
                 pcie_bandwidth: float = PCIE["gen5"], cpu_bandwidth: float = CPU_MEMORY_BANDWIDTH) -> OffloadStep:
    """ZeRO-Offload's memory and time for `params` parameters, `tokens` tokens per GPU per step, on dp GPUs
    (ZeRO-2 partitions: each GPU offloads 1/dp of the optimizer). The GPU computes 6·Ψ·tokens FLOPs at
    `mfu` of `peak_flops`; PCIe moves 4Ψ/dp bytes; the CPU streams ADAM_BYTES_PER_PARAM·Ψ/dp bytes of Adam state."""
    _positive(params=params, tokens=tokens, peak_flops=peak_flops, dp=dp, mfu=mfu, pcie_bandwidth=pcie_bandwidth,
              cpu_bandwidth=cpu_bandwidth)
    if mfu > 1:
        raise ValueError(f"mfu={mfu!r} must be in (0, 1]")
    share = params / dp
    return OffloadStep(gpu_bytes=GPU_BYTES_PER_PARAM * params, cpu_bytes=CPU_BYTES_PER_PARAM * share,
                       pcie_bytes=PCIE_BYTES_PER_PARAM * share, pcie_s=PCIE_BYTES_PER_PARAM * share / pcie_bandwidth,
                       cpu_step_s=ADAM_BYTES_PER_PARAM * share / cpu_bandwidth,
                       compute_s=6 * params * tokens / (mfu * peak_flops))


def offload_hide_tokens(peak_flops: float, *, dp: int = 1, mfu: float = 0.4, pcie_bandwidth: float = PCIE["gen5"],
                        cpu_bandwidth: float = CPU_MEMORY_BANDWIDTH) -> float:
    """Tokens per GPU per step above which the offloaded traffic and CPU step hide behind the GPU's compute:
    6Ψ·T/(mfu·C) = (4/pcie + 30/cpu_bw)·Ψ/dp  ⇒  T = (4/pcie + 30/cpu_bw)·mfu·C / (6·dp). Ψ cancels."""
    _positive(peak_flops=peak_flops, dp=dp, mfu=mfu, pcie_bandwidth=pcie_bandwidth, cpu_bandwidth=cpu_bandwidth)
    per_param_s = PCIE_BYTES_PER_PARAM / pcie_bandwidth + ADAM_BYTES_PER_PARAM / cpu_bandwidth
    return per_param_s * mfu * peak_flops / (6 * dp)
