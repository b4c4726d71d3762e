"""Accelerators: peak dense FLOP/s, memory and HBM bandwidth, each with where the number comes from.

Peaks are *dense* (no 2:4 sparsity): NVIDIA's datasheets print the sparse figure first, twice the dense one
(H100 SXM: "1,979 TFLOPS" bf16 is 989 dense). Memory is what the datasheet calls "80GB" and nvidia-smi
reports in MiB: the capacity of the HBM stacks, so it is stored in GiB (2^30 bytes). Bandwidths are bytes/s.

The ratio peak FLOP/s / HBM bandwidth is the *critical arithmetic intensity* of a chip: a kernel doing fewer
FLOPs per byte it moves is memory-bound (How to Scale Your Model, ch. 1: ~240 for TPU v5e, ~300 for H100).
"""

from __future__ import annotations

from dataclasses import dataclass

GiB = 2**30


@dataclass(frozen=True)
class Accelerator:
    name: str
    bf16_flops: float  # dense FLOP/s
    fp8_flops: float | None  # dense FLOP/s; None where the chip has no fp8 matmul unit
    int8_ops: float | None
    memory_bytes: int
    hbm_bandwidth: float  # bytes/s
    source: str

    def peak_flops(self, dtype: str = "bf16") -> float:
        peaks = {"bf16": self.bf16_flops, "fp8": self.fp8_flops, "int8": self.int8_ops}
        if dtype not in peaks or peaks[dtype] is None:
            valid = [k for k, v in peaks.items() if v is not None]
            raise ValueError(f"dtype={dtype!r} has no peak on {self.name}; valid: {', '.join(valid)}")
        return peaks[dtype]

    def critical_intensity(self, dtype: str = "bf16") -> float:
        """FLOPs per HBM byte above which a kernel is compute-bound."""
        return self.peak_flops(dtype) / self.hbm_bandwidth


HARDWARE: dict[str, Accelerator] = {
    "h100": Accelerator(
        "NVIDIA H100 SXM", 989.4e12, 1978.9e12, 1978.9e12, 80 * GiB, 3.35e12,
        "NVIDIA H100 datasheet (SXM: 1,979 TFLOPS bf16 and 3,958 fp8 with sparsity, 80GB HBM3 at 3.35 TB/s); "
        "How to Scale Your Model ch. 1 uses 9.89e14 and 3.35e12"),
    "h200": Accelerator(
        "NVIDIA H200 SXM", 989.4e12, 1978.9e12, 1978.9e12, 141 * GiB, 4.8e12,
        "NVIDIA H200 datasheet (same compute as H100 SXM; 141GB HBM3e at 4.8 TB/s)"),
    "a100": Accelerator(
        "NVIDIA A100 80GB SXM", 312e12, None, 624e12, 80 * GiB, 2.039e12,
        "NVIDIA A100 datasheet (312 TFLOPS bf16 dense, 624 TOPS int8, no fp8; 80GB HBM2e at 2,039 GB/s)"),
    "b200": Accelerator(
        "NVIDIA B200", 2.25e15, 4.5e15, 4.5e15, 192 * GiB, 8e12,
        "NVIDIA Blackwell/DGX B200 datasheet (4.5 PFLOPS bf16 and 9 PFLOPS fp8 with sparsity per GPU; 192GB "
        "HBM3e at 8 TB/s)"),
    "tpu-v5e": Accelerator(
        "Google TPU v5e", 1.97e14, None, 3.94e14, 16 * GiB, 8.1e11,
        "How to Scale Your Model ch. 2 chip table (1.97e14 bf16, 3.94e14 int8, 16 GB HBM at 8.1e11 B/s)"),
    "tpu-v5p": Accelerator(
        "Google TPU v5p", 4.59e14, None, 9.18e14, 96 * GiB, 2.8e12,
        "How to Scale Your Model ch. 2 chip table (4.59e14 bf16, 9.18e14 int8, 96 GB HBM at 2.8e12 B/s)"),
}


def get_accelerator(name: str) -> Accelerator:
    if name not in HARDWARE:
        raise ValueError(f"gpu={name!r} must be one of {', '.join(HARDWARE)}")
    return HARDWARE[name]


def device_accelerator(device_name: str) -> Accelerator | None:
    """The entry for a `torch.cuda.get_device_name()` string ("NVIDIA H100 80GB HBM3" is h100), or None when the
    table has none. PCIe cards (H100 PCIe: 2 TB/s, 756 TFLOP/s) are not the SXM parts the table holds: None."""
    if "PCIE" in device_name.upper():
        return None
    return next((chip for key, chip in HARDWARE.items()
                 if not key.startswith("tpu") and key.upper() in device_name.upper()), None)
