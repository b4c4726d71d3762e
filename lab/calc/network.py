"""Interconnects: how fast bytes move between accelerators, inside a node and across nodes.

Bandwidths are per direction (what a sender can push while it also receives), in bytes/s; latencies are the
fixed cost of one message, alpha. Vendors quote NVLink bidirectionally (900 GB/s for H100 = 450 GB/s each
way) and InfiniBand in bits (400 Gb/s = 50 GB/s): divide before comparing. The bandwidths and NIC counts
are vendor specs (the `source` of each entry); the latencies are order-of-magnitude figures for a small NCCL
message, not vendor specs.

A node's scale-out bandwidth is that of all its NICs together. A DGX H100 has eight 400 Gb/s ConnectX-7
NICs for the compute fabric, one beside each GPU (a *rail*): 8 x 50 GB/s = 400 GB/s per node and direction.
How much of it one collective can use depends on its pattern: `lab.calc.comms` explains.

A `Fabric` describes the switches between nodes where they are not one non-blocking network: pods with full
bisection bandwidth inside, joined by a layer that carries a fraction of what the pods' NICs inject (the
oversubscription). `SYSTEMS["llama3-roce"]` is the cluster Llama 3 405B trained on, as its paper describes it.

`PLAYBOOK_BUSBW` holds the one set of measured inter-node numbers the course compares the model with.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Link:
    name: str
    bandwidth: float  # bytes/s per direction: one GPU's NVLink, one NIC
    latency: float  # seconds per message (alpha)
    source: str


@dataclass(frozen=True)
class Fabric:
    """The switches between nodes: pods of `pod_gpus` GPUs with full bisection bandwidth inside (any GPU can send
    to any other at its NIC's rate, all at once), joined by a layer whose links carry 1/`oversubscription` of
    what the pods' NICs can inject."""

    pod_gpus: int
    oversubscription: float
    source: str


@dataclass(frozen=True)
class System:
    """A cluster design: `gpus_per_node` GPUs joined by a fast link (`intra`, per GPU), and `nics_per_node`
    network cards (`nic`, each) between nodes; `fabric` the switches between the nodes, where described (None:
    a non-blocking network of any size)."""

    name: str
    intra: Link
    nic: Link
    gpus_per_node: int
    nics_per_node: int
    source: str
    fabric: Fabric | None = None

    @property
    def node_bandwidth(self) -> float:
        """Bytes/s per direction that all NICs of a node carry together."""
        return self.nics_per_node * self.nic.bandwidth


LINKS = {
    "nvlink3": Link("NVLink 3 (A100)", 300e9, 3e-6, "NVIDIA A100 datasheet: 600 GB/s bidirectional"),
    "nvlink4": Link("NVLink 4 (H100/H200)", 450e9, 3e-6, "NVIDIA H100 datasheet: 900 GB/s bidirectional"),
    "nvlink5": Link("NVLink 5 (B200)", 900e9, 3e-6, "NVIDIA B200 datasheet: 1.8 TB/s bidirectional"),
    "ib-hdr200": Link("InfiniBand HDR NIC, 200 Gb/s", 25e9, 5e-6, "200 Gb/s = 25 GB/s per direction"),
    "ib-ndr400": Link("InfiniBand NDR NIC, 400 Gb/s", 50e9, 5e-6,
                      "400 Gb/s = 50 GB/s; TorchTitan's H100 hosts (400 Gb/s per GPU RDMA)"),
    "ib-xdr800": Link("InfiniBand XDR NIC, 800 Gb/s", 100e9, 5e-6, "800 Gb/s = 100 GB/s per direction"),
    "roce-400": Link("RoCE NIC, 400 Gb/s, Meta's Llama 3 fabric", 50e9, 10e-6,
                     "The Llama 3 Herd of Models, §3.3.1, Network: 400 Gbps between GPUs; latency: §3.3.3, "
                     "Collective Communication: PP and DP cross \"a multi-hop network, with latency up to tens of "
                     "microseconds\" (an assumption: 10 us, spread 5-20 us; a ring's hops mostly stay in a pod)"),
    "tpu-v5p-ici": Link("TPU v5p ICI, one axis", 4.5e10, 1e-6,
                        "How to Scale Your Model ch. 2: 9e10 B/s bidirectional per axis, ~1 us per hop"),
    "gloo-loopback": Link("gloo over loopback, 2-core CPU", 1.0e9, 5e-4,
                          "measured by benchmarks/collectives.py on the course's CI machine (alpha-beta fit)"),
}

SYSTEMS = {
    "a100": System("DGX A100", LINKS["nvlink3"], LINKS["ib-hdr200"], 8, 8,
                   "NVIDIA DGX A100 datasheet: 8x single-port ConnectX-6 VPI, 200 Gb/s HDR InfiniBand"),
    "h100": System("DGX H100", LINKS["nvlink4"], LINKS["ib-ndr400"], 8, 8,
                   "NVIDIA DGX BasePOD reference architecture: four OSFP ports serving eight single-port "
                   "ConnectX-7 VPI, up to 400 Gb/s InfiniBand (the compute fabric)"),
    "h200": System("DGX H200", LINKS["nvlink4"], LINKS["ib-ndr400"], 8, 8,
                   "NVIDIA DGX BasePOD reference architecture: as DGX H100, eight 400 Gb/s ConnectX-7"),
    "b200": System("DGX B200", LINKS["nvlink5"], LINKS["ib-ndr400"], 8, 8,
                   "NVIDIA DGX BasePOD reference architecture: 4x OSFP ports serving 8x single-port "
                   "ConnectX-7 VPI, up to 400 Gb/s InfiniBand"),
    # Llama 3 405B's cluster (the paper's §3.3.1, "Network", and §3.3.2): Grand Teton hosts of 8 H100 on NVLink,
    # one 400 Gb/s RoCE NIC per GPU, a three-layer Clos: 16 GPUs a rack, 192 racks a pod of 3,072 GPUs with
    # full bisection bandwidth, 8 pods (24K GPUs) joined at 1:7; NCCLX spreads each pair's traffic over 16 flows
    # that E-ECMP balances over the paths, and places DP outermost, "network-aware"
    "llama3-roce": System("Meta's 24K-GPU RoCE cluster (Llama 3 405B)", LINKS["nvlink4"], LINKS["roce-400"], 8, 8,
                          "The Llama 3 Herd of Models, §3.3.1, Training Infrastructure (Compute: Grand Teton, 8 "
                          "GPUs on NVLink a server; Network: RoCE, 400 Gbps between GPUs)",
                          Fabric(3072, 7.0, "The Llama 3 Herd of Models, §3.3.1, Network topology: pods of "
                                            "3,072 GPUs with full bisection bandwidth, 1:7 oversubscription at the "
                                            "aggregation layer between the 8 pods")),
    "cpu": System("laptop CPU ranks (gloo)", LINKS["gloo-loopback"], LINKS["gloo-loopback"], 64, 1,
                  "one machine: every rank shares the loopback"),
}

PLAYBOOK_BUSBW = {
    "source": "The Ultra-Scale Playbook, \"Pipeline Parallelism\", figure pp_comm_bandwidth: median nccl-tests bus "
              "bandwidth of 256 MB collectives on H100 nodes of 8 GPUs, in GB/s (256 MB taken as 2^28 bytes)",
    "message_bytes": 2**28,
    "nodes": (1, 2, 4, 8, 16, 32, 64),
    "all_reduce": (436.0, 361.7, 160.1, 99.6, 84.7, 64.9, 32.9),
    "all_gather": (249.8, 184.6, 119.0, 69.0, 55.0, 28.0, 11.0),
    "reduce_scatter": (249.7, 181.6, 115.8, 68.6, 54.5, 27.9, 11.1),
}
