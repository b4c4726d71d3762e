"""Context parallelism on paper: does a ring step's attention hide the K/V block it passes on?

At every ring step a rank computes attention of its c = seq/cp queries to one block of c keys while the
next block travels. For one micro-batch of b sequences, with H query heads and G KV heads of size d on the
rank (both /tp under tensor parallelism) and β bytes per element:

    compute = 4·b·c²·H·d FLOPs for a full block (q·kᵀ and p·v), half of it on average under a causal mask
    comm    = 2·b·c·G·d·β bytes (K and V)

Compute grows as c², communication as c, so the ring hides its transfers once the chunk is long enough.
Setting causal compute time = transfer time, 2·b·c²·H·d / F = 2·b·c·G·d·β / W, gives

    c* = G·β·F / (H·W)        (F: achieved FLOP/s, W: link bytes/s per direction)

For Llama-3-8B (32 heads, 8 KV heads) in bf16 on H100s at peak: 8·2·989e12 / (32·450e9) ≈ 1.1k tokens per
rank over NVLink, ≈ 9.9k over one 400 Gb/s InfiniBand NIC. One NIC, not a node's eight: a ring step is
point-to-point, every rank waits for the slowest hop, and the hop that crosses between nodes leaves from one
GPU through its own NIC (unlike a multi-rail ring collective, `lab.calc.comms`). Fewer KV heads (GQA) make
the ring cheaper.
Torch-free, like the rest of `lab.calc`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from lab.calc.hardware import get_accelerator
from lab.calc.network import LINKS
from lab.config import ModelConfig


@dataclass(frozen=True)
class RingStep:
    tokens_per_rank: int  # c = seq / cp
    flops: float  # attention FLOPs of one step (causal: the average, half a block)
    kv_bytes: int  # the K/V block passed on
    compute_s: float
    comm_s: float

    @property
    def hidden(self) -> bool:
        """True when the transfer finishes before the step's attention does."""
        return self.comm_s <= self.compute_s

    def as_dict(self) -> dict:
        return {**asdict(self), "hidden": self.hidden}


def _check(name: str, value: int, minimum: int = 1) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an integer >= {minimum}")


def _link(link: str):
    if link not in LINKS:
        raise ValueError(f"link={link!r} must be one of {', '.join(LINKS)}")
    return LINKS[link]


def _heads(cfg: ModelConfig, tp: int) -> tuple[int, int]:
    if cfg.n_heads % tp:
        raise ValueError(f"tp={tp} must divide n_heads={cfg.n_heads}")
    return cfg.n_heads // tp, max(1, cfg.n_kv_heads // tp)


def ring_step(cfg: ModelConfig, seq: int, cp: int, mbs: int = 1, *, tp: int = 1, gpu: str = "h100",
              link: str = "nvlink4", dtype_bytes: int = 2, efficiency: float = 1.0, causal: bool = True) -> RingStep:
    """Time of one ring-attention step on one rank: the attention it computes and the K/V it sends.
    `efficiency` scales the GPU's peak (e.g. 0.5 for a kernel at 50% of peak)."""
    for name, value in (("seq", seq), ("cp", cp), ("mbs", mbs), ("tp", tp), ("dtype_bytes", dtype_bytes)):
        _check(name, value)
    if seq % cp:
        raise ValueError(f"cp={cp} must divide seq={seq}")
    if not 0 < efficiency <= 1:
        raise ValueError(f"efficiency={efficiency!r} must be in (0, 1]")
    heads, kv_heads = _heads(cfg, tp)
    c, d = seq // cp, cfg.head_dim
    flops = 4 * mbs * c * c * heads * d * (0.5 if causal else 1.0)
    kv_bytes = 2 * mbs * c * kv_heads * d * dtype_bytes
    wire = _link(link)
    return RingStep(c, flops, kv_bytes, flops / (get_accelerator(gpu).peak_flops() * efficiency),
                    wire.latency + kv_bytes / wire.bandwidth)


def tokens_to_hide_ring(cfg: ModelConfig, *, tp: int = 1, gpu: str = "h100", link: str = "nvlink4",
                        dtype_bytes: int = 2, efficiency: float = 1.0) -> float:
    """c* = G·β·F / (H·W): the tokens per rank above which a causal ring step hides its transfer
    (link latency neglected)."""
    heads, kv_heads = _heads(cfg, tp)
    achieved = get_accelerator(gpu).peak_flops() * efficiency
    return kv_heads * dtype_bytes * achieved / (heads * _link(link).bandwidth)
