"""The layout rules, once: which degrees fit which model and batch, and the numbers that follow from them.

A rule such as "tp must divide n_kv_heads or be a multiple of it" used to be written out in config, the TP
code, two calculators and a widget, and copies drift. Here each rule is one function on plain integers, with the
one-line message (the bad value, what is allowed) that `lab.config` validation, `lab.parallel`, `lab.calc`, the
widgets and the JAX track all show. What belongs here: divisibility rules of the five degrees against the model,
the batch and the sequence; how the layers split over pipeline stages; the numbers they fix (KV heads per rank,
experts per rank, an expert's capacity, micro-batch size); the defaults a layout resolves (interleaved chunks, dp
from the world size); the mesh's axis order and strides; `describe`, the one-line summary of a layout; and
`check_count`, the rule that a degree, batch or length is a whole number >= 1.
Costs (bytes, seconds) live in `lab.calc`.

Torch-free and free of lab imports, so that `lab.config` can call it without a cycle and a browser kernel can run it.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lab.config import ParallelConfig

AXES = ("dp", "pp", "cp", "tp")  # the world is arange(world).view(dp, pp, cp, tp): tp innermost, in a node
INTERLEAVED_CHUNKS = 2  # layer chunks per pipeline rank when the interleaved schedule names none
# Tokens per chunk of the chunked cross-entropy (`lab.loss.chunked_cross_entropy`), whose memory `lab.calc.memory`
# counts: for llama3-1b's 128,256-entry vocabulary 0.5 GB of fp32 logits a chunk, not 4.2 GB for 8192 tokens
CHUNK_TOKENS = 1024


def require(ok: bool, message: str) -> None:
    """Raise ValueError(message) unless `ok`: every rule's one line."""
    if not ok:
        raise ValueError(message)


def check_count(name: str, value: object, minimum: int = 1) -> None:
    """Refuse anything but an integer >= `minimum` (a bool is not a count, though Python calls it an int): the
    one line every degree, batch, length and count of the config, the calculators and the measurements shows."""
    require(isinstance(value, int) and not isinstance(value, bool) and value >= minimum,
            f"{name}={value!r} must be an integer >= {minimum}")


# Tensor parallelism: heads, KV heads, FFN width and vocabulary split over tp ranks (lab.parallel.tp).

def tp_problem(tp: int, n_heads: int, n_kv_heads: int | None, d_ff: int, vocab_size: int | None = None,
               of: str = "") -> str | None:
    """Why tp ranks cannot split this model, or None. `n_kv_heads=None` for attention without KV heads (MLA);
    `vocab_size=None` for a layer alone (the TP widget); `of` names the model in the message ("of llama3-8b").
    KV heads split when tp divides them, and are replicated (one per rank) when tp is a multiple of them."""
    where = f" of {of}" if of else ""
    if n_heads % tp:
        return f"tp={tp} must divide n_heads={n_heads}{where}"
    if n_kv_heads is not None and n_kv_heads % tp and tp % n_kv_heads:
        return f"tp={tp} must divide n_kv_heads={n_kv_heads}{where} or be a multiple of it"
    for name, size in (("d_ff", d_ff), ("vocab_size", vocab_size)):
        if size is not None and size % tp:
            return f"tp={tp} must divide {name}={size}{where}"
    return None


def check_tp(tp: int, n_heads: int, n_kv_heads: int | None, d_ff: int, vocab_size: int | None = None) -> None:
    """Raise `tp_problem`'s message, if any."""
    problem = tp_problem(tp, n_heads, n_kv_heads, d_ff, vocab_size)
    require(problem is None, problem or "")


def heads_per_rank(n_heads: int, tp: int) -> int:
    """Query heads a tensor-parallel rank holds."""
    require(n_heads % tp == 0, f"tp={tp} must divide n_heads={n_heads}")
    return n_heads // tp


def kv_heads_per_rank(n_kv_heads: int, tp: int) -> int:
    """KV heads a tensor-parallel rank holds: n_kv/tp when tp divides them, else one (replicated tp/n_kv times)."""
    require(n_kv_heads % tp == 0 or tp % n_kv_heads == 0,
            f"tp={tp} must divide n_kv_heads={n_kv_heads} or be a multiple of it")
    return max(n_kv_heads // tp, 1)


def kv_heads_replicated(n_kv_heads: int, tp: int) -> bool:
    """Whether each rank keeps a whole KV head (tp > n_kv_heads) rather than a split of them."""
    return kv_heads_per_rank(n_kv_heads, tp) * tp > n_kv_heads


# Expert parallelism: the experts split over ep ranks carved out of dp x cp (lab.parallel.ep).

def experts_per_rank(n_experts: int, ep: int) -> int:
    """Routed experts an expert-parallel rank holds."""
    require(n_experts % ep == 0, f"ep={ep} must divide n_experts={n_experts}")
    return n_experts // ep


def check_ep_ranks(ep: int, dp: int, cp: int) -> None:
    """Expert parallelism reuses the dp x cp ranks (TorchTitan's way), so ep must divide them."""
    require((dp * cp) % ep == 0, f"ep={ep} must divide dp*cp = {dp}*{cp} = {dp * cp}")


def expert_capacity(tokens: int, top_k: int, n_experts: int, capacity_factor: float) -> int:
    """GShard's capacity C = ceil(c·tokens·top_k/n_experts): the assignments one expert takes from `tokens`
    tokens (a balanced router's share, times c). Computed as c·(tokens·top_k) so every caller rounds alike."""
    return math.ceil(capacity_factor * (tokens * top_k) / n_experts)


# Pipeline parallelism: layers dealt to pp ranks in chunks (virtual stages), equally or as a split says.

def pp_chunks(schedule: str, chunks: int = 0) -> int:
    """The chunks per pipeline rank a schedule runs: those given (> 0), else 2 for interleaved, else 1."""
    return chunks if chunks else INTERLEAVED_CHUNKS if schedule == "interleaved" else 1


PP_SPLITS = ("even", "llama3")  # the named rules of `stage_layers`; counts such as "7,8,8,7" are the third kind


def stage_layers(n_layers: int, virtual_stages: int, split: str = "even") -> list[int]:
    """The layer count of each virtual stage, in pipeline order (stage s runs the next counts[s] layers).

    "even": every stage the same share, n_layers / virtual_stages. "llama3": the first and the last stage one
    layer fewer than the others, [k-1, k, ..., k, k-1], because they also run the embedding and the output layer
    and the loss (Llama 3 405B's 126 layers over 16 stages: 7, 8 x 14, 7; "The Llama 3 Herd of Models", §3.3.2).
    Or the counts themselves, "7,8,8,7": one per virtual stage, each >= 1, adding up to n_layers."""
    if split == "even":
        require(n_layers % virtual_stages == 0, f"pp*chunks = {virtual_stages} must divide n_layers={n_layers}")
        return [n_layers // virtual_stages] * virtual_stages
    if split == "llama3":
        if virtual_stages == 1:
            return [n_layers]
        k, rest = divmod(n_layers + 2, virtual_stages)  # S·k - 2 layers: two stages lighter by one
        require(rest == 0 and k >= 2, f"pp_layers='llama3' cannot split n_layers={n_layers} over {virtual_stages} "
                                      f"virtual stages: it needs n_layers + 2 = {n_layers + 2} to be a multiple of "
                                      f"{virtual_stages} (k layers a stage, k - 1 on the first and the last, k >= 2)")
        return [k - 1] + [k] * (virtual_stages - 2) + [k - 1]
    counts = split_counts(split, virtual_stages)
    require(sum(counts) == n_layers, f"pp_layers={split!r} adds up to {sum(counts)} layers; n_layers={n_layers}")
    return counts


def split_counts(split: str, virtual_stages: int) -> list[int]:
    """The counts of an explicit split "7,8,8,7", checked for what needs no model: one integer >= 1 per stage."""
    require(isinstance(split, str), f"pp_layers={split!r} must be a string: 'even', 'llama3' or counts like '3,5'")
    words = split.split(",")
    require(all(w.strip().isdigit() and int(w) >= 1 for w in words),
            f"pp_layers={split!r} must be 'even', 'llama3' or comma-separated layer counts >= 1, one per virtual "
            f"stage (e.g. '3,5')")
    require(len(words) == virtual_stages, f"pp_layers={split!r} gives {len(words)} stage(s); the layout has "
                                          f"pp*pp_virtual_stages = {virtual_stages} virtual stages")
    return [int(w) for w in words]


def check_stages(n_layers: int, pp: int, chunks: int, split: str = "even") -> None:
    """The pp·chunks virtual stages share the layers as `split` says (`stage_layers`): by default equally."""
    stages = pp * chunks
    require(split != "even" or n_layers % stages == 0,
            f"pp*pp_virtual_stages = {pp}*{chunks} = {stages} must divide n_layers={n_layers}")
    stage_layers(n_layers, stages, split)


def check_schedule(pp: int, chunks: int, schedule: str, micro_batches: int) -> None:
    """Several chunks per rank only for the interleaved schedule, whose micro-batches go round in groups of pp."""
    if pp == 1:
        return
    if schedule == "interleaved":
        require(chunks >= 2, f"pp_virtual_stages={chunks} must be >= 2 for pp_schedule='interleaved' (1 is plain 1f1b)")
        require(micro_batches % pp == 0, f"grad_accum={micro_batches} (the micro-batches) must be a multiple of "
                                         f"pp={pp} for pp_schedule='interleaved'")
    else:
        require(chunks == 1, f"pp_virtual_stages={chunks}: only pp_schedule='interleaved' runs several chunks per rank")


# Context and sequence parallelism, and the batch.

def tokens_per_rank(seq: int, cp: int) -> int:
    """Tokens of one sequence a context-parallel rank holds (contiguous chunks; `check_sequence` for a layout)."""
    require(seq % cp == 0, f"cp={cp} must divide seq={seq}")
    return seq // cp


def check_sequence(seq_len: int, cp: int, cp_impl: str, tp: int, sp: bool, name: str = "seq_len") -> None:
    """The sequence splits into cp chunks (2·cp for zig-zag, when there is a cp > 1 to split over), and each
    context-parallel rank's tokens into tp pieces under sequence parallelism. `name`: the caller's word for it."""
    zigzag = cp_impl == "zigzag" and cp > 1
    chunks = 2 * cp if zigzag else cp
    require(seq_len % chunks == 0, f"{name}={seq_len} must be divisible by "
                                   + (f"2*cp = {chunks} for cp_impl='zigzag'" if zigzag else f"cp={chunks}"))
    local = seq_len // cp
    require(tp == 1 or not sp or local % tp == 0,
            f"tp={tp} must divide {name}={seq_len} with sp=True" if cp == 1
            else f"tp={tp} must divide {name}/cp = {local} with sp=True")


def check_ulysses(n_heads: int, tp: int, cp: int) -> None:
    """Ulysses' all-to-all gives each context-parallel rank whole heads of its tensor-parallel rank's share."""
    require((n_heads // tp) % cp == 0, f"cp={cp} must divide the heads per tensor-parallel rank, n_heads/tp = "
                                       f"{n_heads}/{tp} = {n_heads // tp}, for cp_impl='ulysses'")


def micro_batch(global_batch: int, dp: int, grad_accum: int) -> int:
    """Sequences per micro-batch: the global batch split over dp ranks, then into grad_accum micro-batches."""
    shards = dp * grad_accum
    require(global_batch % shards == 0,
            f"dp*grad_accum = {dp}*{grad_accum} = {shards} must divide global_batch={global_batch}")
    return global_batch // shards


# The mesh: how the degrees lay the ranks out.

def check_mesh(world_size: int, dp: int, pp: int, cp: int, tp: int, ep: int = 1) -> None:
    """The degrees are integers >= 1 whose product is the world, and ep fits in dp x cp."""
    for name, value in zip(AXES + ("ep",), (dp, pp, cp, tp, ep), strict=True):
        require(isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                f"{name}={value!r} must be an integer >= 1")
    require(dp * pp * cp * tp == world_size,
            f"dp*pp*cp*tp = {dp}*{pp}*{cp}*{tp} = {dp * pp * cp * tp} must equal world_size={world_size}")
    check_ep_ranks(ep, dp, cp)


def strides(dp: int, pp: int, cp: int, tp: int) -> dict[str, int]:
    """How far apart, in global ranks, two neighbours along each axis are (tp innermost): rank =
    Σ coord·stride. A group along an axis spans stride x size consecutive ranks; TP's sits inside a node."""
    return {"dp": pp * cp * tp, "pp": cp * tp, "cp": tp, "tp": 1}


def infer_dp(world_size: int, parallel: dict) -> int | None:
    """The data-parallel degree that `world_size` launched ranks imply: the ranks that tp x cp x pp leave.

    One rule for both launchers (`--nproc N` and torchrun), applied when the command line does not name dp.
    `parallel` is the [parallel] section as requested (file, then overrides), before defaults and validation.
    None when the degrees are not valid integers or do not divide world_size: the layout check then says why."""
    others = 1
    for name in ("tp", "cp", "pp"):
        value = parallel.get(name, 1)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            return None
        others *= value
    return world_size // others if world_size % others == 0 else None


def describe(parallel: ParallelConfig, grad_accum: bool = False) -> str:
    """One line for logs and reports, e.g. "dp=8, tp=8, pp=4, zero=1, sp, pp_schedule=1f1b": the degrees that
    are not 1 (ZeRO's stage when not 0), then the switches that go with them; "one rank" for none. A run's summary
    also says how many micro-batches a step took (`grad_accum=True`: "dp=2, pp=2, grad_accum=4, ...")."""
    p = parallel
    names = ("dp", "tp", "cp", "pp", "ep") + (("grad_accum",) if grad_accum else ())
    degrees = [f"{k}={getattr(p, k)}" for k in names if getattr(p, k) != 1]
    return ", ".join(degrees + ([f"zero={p.zero}"] if p.zero else []) + (["fp8_all_gather"] if p.fp8_all_gather else [])
                     + (["sp"] if p.sp else [])
                     + ([f"cp_impl={p.cp_impl}"] if p.cp > 1 else [])
                     + ([f"pp_schedule={p.pp_schedule}"] if p.pp > 1 else [])
                     + ([f"pp_chunks={p.pp_virtual_stages}"] if p.pp_virtual_stages > 1 else [])
                     + ([f"pp_layers={p.pp_layers}"] if p.pp > 1 and p.pp_layers != "even" else [])) or "one rank"
