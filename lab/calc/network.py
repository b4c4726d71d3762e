"""Interconnects: how fast bytes move between accelerators, inside a node and across nodes.

Bandwidths are per GPU and per direction (what one rank can push while it also receives), in bytes/s;
latencies are the fixed cost of one message, alpha. Vendors quote NVLink bidirectionally (900 GB/s for
H100 = 450 GB/s each way) and InfiniBand in bits (400 Gb/s = 50 GB/s): divide before comparing.
Latencies are order-of-magnitude figures for a small NCCL message, not vendor specs.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Link:
    name: str
    bandwidth: float  # bytes/s per GPU per direction
    latency: float  # seconds per message (alpha)
    source: str


@dataclass(frozen=True)
class System:
    """A cluster design: a fast link inside each node of `gpus_per_node`, a slower one between nodes."""

    name: str
    intra: Link
    inter: Link
    gpus_per_node: int


LINKS = {
    "nvlink3": Link("NVLink 3 (A100)", 300e9, 3e-6, "NVIDIA A100 datasheet: 600 GB/s bidirectional"),
    "nvlink4": Link("NVLink 4 (H100/H200)", 450e9, 3e-6, "NVIDIA H100 datasheet: 900 GB/s bidirectional"),
    "nvlink5": Link("NVLink 5 (B200)", 900e9, 3e-6, "NVIDIA B200 datasheet: 1.8 TB/s bidirectional"),
    "ib-hdr200": Link("InfiniBand HDR, 200 Gb/s per GPU", 25e9, 5e-6, "200 Gb/s = 25 GB/s per direction"),
    "ib-ndr400": Link("InfiniBand NDR, 400 Gb/s per GPU", 50e9, 5e-6,
                      "400 Gb/s = 50 GB/s; TorchTitan's H100 hosts (400 Gb/s per GPU RDMA)"),
    "ib-xdr800": Link("InfiniBand XDR, 800 Gb/s per GPU", 100e9, 5e-6, "800 Gb/s = 100 GB/s per direction"),
    "tpu-v5p-ici": Link("TPU v5p ICI, one axis", 4.5e10, 1e-6,
                        "How to Scale Your Model ch. 2: 9e10 B/s bidirectional per axis, ~1 us per hop"),
    "gloo-loopback": Link("gloo over loopback, 2-core CPU", 1.0e9, 5e-4,
                          "measured by benchmarks/collectives.py on the course's CI machine (alpha-beta fit)"),
}

SYSTEMS = {
    "a100": System("DGX A100", LINKS["nvlink3"], LINKS["ib-hdr200"], 8),
    "h100": System("DGX H100", LINKS["nvlink4"], LINKS["ib-ndr400"], 8),
    "h200": System("DGX H200", LINKS["nvlink4"], LINKS["ib-ndr400"], 8),
    "b200": System("DGX B200", LINKS["nvlink5"], LINKS["ib-xdr800"], 8),
    "cpu": System("laptop CPU ranks (gloo)", LINKS["gloo-loopback"], LINKS["gloo-loopback"], 64),
}
