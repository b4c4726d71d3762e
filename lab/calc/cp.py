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

The layout rules live here too, torch-free, so that the executor (`lab.parallel.cp`,
`lab.parallel.ring_attention`), the ring-attention widget and the checks share one description: which global
chunks a rank holds (`chunk_ids`: contiguous, or zig-zag's r and 2·cp−1−r), how a query chunk meets a key
chunk under a causal mask (`block_kind`: full, diagonal or skipped) and the query-key pairs each rank scores
(`attention_work`, and per ring step `step_work`, striped attention's token-by-token layout included).

What the variants move and hold per layer and rank — the ring's cp − 1 K/V blocks (`ring_bytes`), Ulysses'
all-to-alls of q, k, v and the output (`ulysses_bytes`, at most n_heads/tp ranks: `ulysses_max_cp`), the
all-gather variant's whole-sequence K/V (`allgather_kv_bytes`) — and how attention's FLOPs grow against the
layer's matmuls with the context (`attention_core_flops`, `attention_share`, `attention_matches_mlp`) are the
chapter's worked problems. Torch-free, like the rest of `lab.calc`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from lab.calc.hardware import get_accelerator
from lab.calc.network import LINKS
from lab.config import ModelConfig
from lab.layout import heads_per_rank, kv_heads_per_rank, tokens_per_rank

LAYOUTS = ("contiguous", "zigzag")
FULL, DIAGONAL, SKIP = "full", "diagonal", "skip"  # kind of a (query chunk, key chunk) block under a causal mask


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} must be one of {', '.join(map(repr, LAYOUTS))}")


def num_chunks(cp: int, layout: str) -> int:
    """How many equal chunks the sequence is cut into: cp (contiguous) or 2·cp (zig-zag)."""
    _check_layout(layout)
    return cp if layout == "contiguous" else 2 * cp


def chunk_ids(rank: int, cp: int, layout: str) -> list[int]:
    """The global chunks rank `rank` holds, in the order it lays them out: [r] or [r, 2·cp-1-r]."""
    if not 0 <= rank < cp:
        raise ValueError(f"rank={rank} must be in [0, {cp})")
    return [rank] if num_chunks(cp, layout) == cp else [rank, 2 * cp - 1 - rank]


def check_sequence(seq_len: int, cp: int, layout: str) -> None:
    """One clear error when the sequence cannot be cut into this layout's equal chunks."""
    n = num_chunks(cp, layout)
    if seq_len % n:
        rule = f"2*cp = {n}" if layout == "zigzag" else f"cp = {n}"
        raise ValueError(f"seq_len={seq_len} must be divisible by {rule} for the {layout} layout")


def block_kind(q_chunk: int, k_chunk: int, causal: bool) -> str:
    """How query chunk `q_chunk` attends to key chunk `k_chunk` (global chunk indices)."""
    if not causal or k_chunk < q_chunk:
        return FULL
    return DIAGONAL if k_chunk == q_chunk else SKIP


def block_work(kind: str, q_len: int, k_len: int) -> int:
    """Query-key pairs a block scores: the useful work that load balancing is about."""
    return {FULL: q_len * k_len, DIAGONAL: q_len * (q_len + 1) // 2, SKIP: 0}[kind]


def attention_work(seq_len: int, cp: int, layout: str, causal: bool = True) -> list[int]:
    """Query-key pairs each rank scores in ring attention (the schedule's work, without running it)."""
    check_sequence(seq_len, cp, layout)
    chunk = seq_len // num_chunks(cp, layout)
    every = [c for r in range(cp) for c in chunk_ids(r, cp, layout)]
    return [sum(block_work(block_kind(q, k, causal), chunk, chunk) for q in chunk_ids(r, cp, layout) for k in every)
            for r in range(cp)]


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
    return heads_per_rank(cfg.n_heads, tp), kv_heads_per_rank(cfg.n_kv_heads, tp)


def kv_block_bytes(mbs: int, tokens: int, kv_heads: int, head_dim: int, dtype_bytes: int = 2) -> int:
    """Bytes of one K/V block: K and V (the 2) of `tokens` tokens, `kv_heads` heads of `head_dim` each."""
    return 2 * mbs * tokens * kv_heads * head_dim * dtype_bytes


def ring_step(cfg: ModelConfig, seq: int, cp: int, mbs: int = 1, *, tp: int = 1, gpu: str = "h100",
              link: str = "nvlink4", dtype_bytes: int = 2, efficiency: float = 1.0, causal: bool = True) -> RingStep:
    """Time of one ring-attention step on one rank: the attention it computes and the K/V it sends.
    `efficiency` scales the GPU's peak (e.g. 0.5 for a kernel at 50% of peak)."""
    for name, value in (("seq", seq), ("cp", cp), ("mbs", mbs), ("tp", tp), ("dtype_bytes", dtype_bytes)):
        _check(name, value)
    c, d = tokens_per_rank(seq, cp), cfg.head_dim
    if not 0 < efficiency <= 1:
        raise ValueError(f"efficiency={efficiency!r} must be in (0, 1]")
    heads, kv_heads = _heads(cfg, tp)
    flops = 4 * mbs * c * c * heads * d * (0.5 if causal else 1.0)
    kv_bytes = kv_block_bytes(mbs, c, kv_heads, d, dtype_bytes)
    wire = _link(link)
    return RingStep(c, flops, kv_bytes, flops / (get_accelerator(gpu).peak_flops() * efficiency),
                    wire.latency + kv_bytes / wire.bandwidth)


def tokens_to_hide_ring(cfg: ModelConfig, *, tp: int = 1, gpu: str = "h100", link: str = "nvlink4",
                        dtype_bytes: int = 2, efficiency: float = 1.0) -> float:
    """c* = G·β·F / (H·W): the tokens per rank above which a causal ring step hides its transfer
    (link latency neglected)."""
    heads, kv_heads = _heads(cfg, tp)
    return hide_tokens(heads, kv_heads, dtype_bytes, get_accelerator(gpu).peak_flops() * efficiency,
                       _link(link).bandwidth)


def hide_tokens(heads: int, kv_heads: int, dtype_bytes: float, flops: float, bandwidth: float) -> float:
    """c* = G·β·F / (H·W) from the raw numbers: heads and KV heads on the rank, bytes per element, achieved
    FLOP/s and link bytes/s (one direction)."""
    return kv_heads * dtype_bytes * flops / (heads * bandwidth)


# --- ring vs Ulysses vs all-gather: what each moves and holds, per layer and rank (forward) -----------------------
# s = seq/cp tokens per rank, b sequences, H query heads and G KV heads of size d on the rank, β bytes per element.

def ring_bytes(seq: int, cp: int, kv_heads: int, head_dim: int, dtype_bytes: int = 2, mbs: int = 1) -> int:
    """Bytes one rank sends in one layer's ring attention: cp − 1 K/V blocks of s tokens."""
    return (cp - 1) * kv_block_bytes(mbs, tokens_per_rank(seq, cp), kv_heads, head_dim, dtype_bytes)


def ulysses_bytes(seq: int, cp: int, heads: int, kv_heads: int, head_dim: int, dtype_bytes: int = 2,
                  mbs: int = 1) -> float:
    """Bytes one rank sends in one layer's Ulysses attention: all-to-alls of q, k, v in and of the output back,
    each rank keeping 1/cp of every tensor it holds: (cp−1)/cp · b·s·(2H + 2G)·d·β."""
    return (cp - 1) / cp * mbs * tokens_per_rank(seq, cp) * (2 * heads + 2 * kv_heads) * head_dim * dtype_bytes


def ulysses_max_cp(n_heads: int, tp: int = 1) -> int:
    """Ulysses splits the heads over the cp ranks: cp must divide the tp rank's n_heads/tp heads, at most that."""
    return heads_per_rank(n_heads, tp)


def allgather_kv_bytes(seq: int, kv_heads: int, head_dim: int, dtype_bytes: int = 2, mbs: int = 1) -> int:
    """K and V of the whole sequence, which the all-gather variant (Llama 3) holds on every rank for one layer."""
    return kv_block_bytes(mbs, seq, kv_heads, head_dim, dtype_bytes)


# --- attention's FLOPs against the rest of the layer ---------------------------------------------------------------

def attention_core_flops(seq: int, n_heads: int, head_dim: int, mbs: int = 1, causal: bool = True) -> float:
    """Forward FLOPs of one layer's q·kᵀ and p·v over a sequence: 4·b·s²·H·d, half of it under a causal mask
    (the blocks a causal kernel or ring skips)."""
    return 4 * mbs * seq * seq * n_heads * head_dim * (0.5 if causal else 1.0)


def layer_matmul_flops(seq: int, d_model: int, n_heads: int, n_kv_heads: int, head_dim: int, d_ff: int,
                       mbs: int = 1) -> float:
    """Forward FLOPs of one layer's weight matmuls (q, k, v, o projections and a SwiGLU MLP): 2 per weight and
    token."""
    attention = d_model * (2 * n_heads + 2 * n_kv_heads) * head_dim
    return 2 * mbs * seq * (attention + 3 * d_model * d_ff)


def attention_share(seq: int, d_model: int, n_heads: int, n_kv_heads: int, head_dim: int, d_ff: int) -> float:
    """The fraction of a layer's forward FLOPs spent in the causal attention core at context `seq`."""
    core = attention_core_flops(seq, n_heads, head_dim)
    return core / (core + layer_matmul_flops(seq, d_model, n_heads, n_kv_heads, head_dim, d_ff))


def attention_matches_mlp(d_model: int, n_heads: int, head_dim: int, d_ff: int) -> float:
    """The context at which the causal attention core costs as many FLOPs per token as the SwiGLU MLP:
    2·s·H·d = 6·h·d_ff, s = 3·h·d_ff / (H·d) (= 3·d_ff when H·d = h)."""
    return 3 * d_model * d_ff / (n_heads * head_dim)


# --- striped attention (Brandon et al., 2023): token t on rank t mod cp ---------------------------------------------

def striped_chunks(seq_len: int, cp: int) -> list[list[int]]:
    """Every rank's chunks when the sequence is dealt out one token at a time: rank r holds tokens r, r+cp, ...
    (chunks of one token, so `lab.parallel.ring_attention` runs it as any other layout)."""
    if seq_len % cp:
        raise ValueError(f"seq_len={seq_len} must be divisible by cp = {cp} for the striped layout")
    return [list(range(r, seq_len, cp)) for r in range(cp)]


def step_work(seq_len: int, cp: int, layout: str) -> list[list[int]]:
    """Query-key pairs rank r scores at ring step i (it holds rank (r − i) mod cp's keys), causal: [step][rank],
    for "contiguous", "zigzag" or "striped". A step lasts as long as its busiest rank."""
    if layout not in (*LAYOUTS, "striped"):
        raise ValueError(f"layout={layout!r} must be one of {', '.join(map(repr, (*LAYOUTS, 'striped')))}")
    if layout == "striped":
        striped_chunks(seq_len, cp)
        t = seq_len // cp  # query j·cp + r sees key j'·cp + src when j' < j, or j' = j and src <= r:
        return [[t * (t - 1) // 2 + (t if (r - i) % cp <= r else 0) for r in range(cp)]  # a triangle, +diagonal
                for i in range(cp)]
    check_sequence(seq_len, cp, layout)
    held = [chunk_ids(r, cp, layout) for r in range(cp)]
    size = seq_len // num_chunks(cp, layout)
    return [[sum(block_work(block_kind(q, k, True), size, size) for q in held[r] for k in held[(r - i) % cp])
             for r in range(cp)] for i in range(cp)]
