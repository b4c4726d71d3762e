"""The capacity explorer: synthetic tokens routed through a real MoE router, and what the capacity drops.

A mixture-of-experts layer sends each token to the top_k of n_experts experts its router scores highest.
With a capacity factor c, an expert takes at most C = ⌈c·T·top_k/n_experts⌉ of the T·top_k assignments of a
batch of T tokens, first come first served; the rest are dropped, and a token whose every assignment was
dropped passes the layer on its residual alone. c = 0 is the no-drop mode (DeepSeek-V3, dropless MoE).

The routing is `lab.model.MoE`'s own: the widget builds one from a `ModelConfig` (the tiny-moe preset with
the chosen n_experts, top_k, capacity factor and gating), gives its router seeded random weights plus a
preference for low-numbered experts of strength `skew` (expert e's logit gets −skew·log(1 + e), so with
softmax gating its share falls like (1 + e)^−skew: 0 is balanced, 1 Zipf-like), and runs its forward on T
seeded random tokens. The bars are the assignments each expert was chosen for, kept (`MoE.load`) and dropped;
the dashed line is the capacity C; the summary gives the dropped assignments (`MoE.dropped`), the tokens
left with no expert at all and the load-balancing loss (`MoE.aux_loss`, 1 when balanced). A combination
the model rejects (top_k > n_experts) shows its one-line error instead of the chart.

Torch and `lab.model` are imported on first use, so `import lab.widgets.moe` stays instant. `draw_dispatch`
and `draw_load_history` draw the chapter's other pictures (an expert-parallel dispatch, load over training).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import ipywidgets as widgets

from lab.config import MOE_GATINGS, PRESETS
from lab.layout import expert_capacity, experts_per_rank
from lab.widgets.base import Explorer, note, show_figure, slider

MAX_EXPERTS, MAX_TOP_K, MIN_TOKENS, MAX_TOKENS = 64, 8, 8, 8192
MAX_CAPACITY, MAX_SKEW = 2.0, 3.0
KEPT, DROPPED = "#1565c0", "#e53935"


@dataclass(frozen=True)
class Routing:
    """One batch routed by `MoE`: per-expert counts of assignments (token, slot) and what the capacity did."""

    tokens: int
    n_experts: int
    top_k: int
    capacity_factor: float
    skew: float
    gating: str
    wanted: list[int]  # assignments each expert was chosen for, before the capacity
    load: list[int]  # those it kept: MoE.load
    dropped: int  # MoE.dropped
    capacity: int | None  # C = ceil(c·T·top_k/n_experts); None without a capacity factor
    tokens_without_expert: int  # tokens whose top_k assignments were all dropped: residual only
    aux_loss: float  # MoE.aux_loss: n_experts·Σ f_e·P_e, 1 when balanced
    z_loss: float  # MoE.z_loss

    @property
    def assignments(self) -> int:
        return self.tokens * self.top_k

    @property
    def dropped_fraction(self) -> float:
        return self.dropped / self.assignments

    @property
    def mean_load(self) -> float:
        return self.assignments / self.n_experts

    @property
    def imbalance(self) -> float:
        """The busiest expert's wanted assignments over the mean (1 when balanced)."""
        return max(self.wanted) / self.mean_load


def _check_int(name: str, value: int, low: int, high: int) -> None:
    if not (isinstance(value, int) and not isinstance(value, bool) and low <= value <= high):
        raise ValueError(f"{name}={value!r} must be an integer from {low} to {high}")


def _check_float(name: str, value: float, low: float, high: float, what: str = "") -> None:
    if not (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and low <= value <= high):
        raise ValueError(f"{name}={value!r} must be a number from {low:g} to {high:g}{what}")


def route_tokens(tokens: int = 1024, n_experts: int = 8, top_k: int = 2, capacity_factor: float = 1.25,
                 skew: float = 0.5, gating: str = "softmax", seed: int = 0) -> Routing:
    """Route `tokens` seeded random tokens through a `lab.model.MoE` whose router prefers expert e by
    −skew·log(1 + e) on top of seeded random weights; the same seed gives the same tokens and router
    whatever the capacity factor, so moving it changes only what is dropped."""
    import torch

    from lab.model import MoE

    _check_int("tokens", tokens, 1, MAX_TOKENS)
    _check_int("n_experts", n_experts, 1, MAX_EXPERTS)
    _check_float("skew", skew, 0.0, MAX_SKEW)
    cfg = dataclasses.replace(PRESETS["tiny-moe"], n_experts=n_experts, top_k=top_k, moe_gating=gating,
                              capacity_factor=capacity_factor, d_ff_expert=1, n_shared_experts=0)  # validates
    d = cfg.d_model
    with torch.random.fork_rng(devices=[]):  # the experts' default init must not move the caller's RNG
        moe = MoE(cfg)
    preference = -skew * torch.log1p(torch.arange(n_experts, dtype=torch.float32))
    random = torch.randn(n_experts, d - 1, generator=torch.Generator().manual_seed(seed))
    random = random / random.norm(dim=1, keepdim=True)  # unit rows: every expert's logit is N(0, 1) per token
    weight = torch.cat([preference[:, None], random], dim=1)  # feature 0 of every token is 1: a per-expert bias
    x = torch.randn(tokens, d, generator=torch.Generator().manual_seed(seed + 1))
    x[:, 0] = 1.0
    with torch.no_grad():
        moe.router.weight.copy_(weight)
        moe(x)  # records load, dropped, aux_loss and z_loss, as in training
        _, chosen = moe.route(x)
        keep = moe.capacity_mask(chosen)
    return Routing(
        tokens=tokens, n_experts=n_experts, top_k=top_k, capacity_factor=capacity_factor, skew=skew, gating=gating,
        wanted=torch.bincount(chosen.flatten(), minlength=n_experts).tolist(), load=moe.load.tolist(),
        dropped=moe.dropped,
        capacity=expert_capacity(tokens, top_k, n_experts, capacity_factor) if capacity_factor else None,
        tokens_without_expert=int((~keep).all(dim=1).sum()), aux_loss=moe.aux_loss.item(),
        z_loss=moe.z_loss.item())


def draw_routing(routing: Routing, ax=None):
    """Assignments per expert: kept in blue, dropped stacked above in hatched red; the capacity dashed."""
    import matplotlib.pyplot as plt

    ax = ax or plt.subplots(figsize=(7.5, 3.2))[1]
    experts = range(routing.n_experts)
    dropped = [w - k for w, k in zip(routing.wanted, routing.load, strict=True)]
    ax.bar(experts, routing.load, color=KEPT, label="kept")
    ax.bar(experts, dropped, bottom=routing.load, color="white", hatch="////", label="dropped",
           edgecolor=[DROPPED if d else "none" for d in dropped])
    ax.axhline(routing.mean_load, color="grey", linestyle=":", linewidth=1,
               label=f"mean T·k/E = {routing.mean_load:,.4g}")
    if routing.capacity is not None:
        ax.axhline(routing.capacity, color="black", linestyle="--", linewidth=1.2,
                   label=f"capacity C = {routing.capacity:,}")
    ax.set_xlabel("expert")
    ax.set_ylabel("assignments (token, slot)")
    if routing.n_experts <= 16:
        ax.set_xticks(list(experts))
    ax.set_xlim(-0.6, routing.n_experts - 0.4)
    ax.legend(fontsize=8, loc="upper right")
    ax.set_title(f"T = {routing.tokens:,} tokens, top-{routing.top_k} of {routing.n_experts} ({routing.gating}), "
                 f"c = {routing.capacity_factor:g}, skew {routing.skew:g}\ndropped {routing.dropped:,} "
                 f"({routing.dropped_fraction:.1%}), aux loss {routing.aux_loss:.3f}", fontsize=10)
    return ax


class CapacityExplorer(Explorer):
    """Controls on the left, assignments per expert on the right. `update()` reroutes and redraws; tests
    read `routing`, `figure`, `summary.value` and `error.value`."""

    def __init__(self, capacity_factor: float = 1.25, top_k: int = 2, n_experts: int = 8, tokens: int = 1024,
                 skew: float = 0.5, gating: str = "softmax") -> None:
        _check_float("capacity_factor", capacity_factor, 0.0, MAX_CAPACITY, " (0: no token dropped)")
        _check_int("top_k", top_k, 1, MAX_TOP_K)
        _check_int("n_experts", n_experts, 1, MAX_EXPERTS)
        _check_int("tokens", tokens, MIN_TOKENS, MAX_TOKENS)
        _check_float("skew", skew, 0.0, MAX_SKEW)
        if gating not in MOE_GATINGS:
            raise ValueError(f"gating={gating!r} must be one of {', '.join(map(repr, MOE_GATINGS))}")
        super().__init__({
            "capacity_factor": slider(widgets.FloatSlider, capacity_factor, 0.0, MAX_CAPACITY, 0.05,
                                      "capacity factor"),
            "top_k": slider(widgets.IntSlider, top_k, 1, MAX_TOP_K, 1, "top_k"),
            "n_experts": slider(widgets.IntSlider, n_experts, 1, MAX_EXPERTS, 1, "n_experts"),
            "tokens": slider(widgets.IntSlider, tokens, MIN_TOKENS, MAX_TOKENS, MIN_TOKENS, "tokens T"),
            "skew": slider(widgets.FloatSlider, skew, 0.0, MAX_SKEW, 0.1, "router skew"),
            "gating": widgets.ToggleButtons(options=list(MOE_GATINGS), value=gating, description="gating",
                                            style={"button_width": "80px"}),
        })
        self.routing: Routing | None = None
        self.figure = None
        explained = note("capacity factor 0: no capacity, nothing dropped. Router skew: expert e's logit is lowered "
                         "by skew·log(1 + e), so low-numbered experts are popular (0: balanced).")
        self.children = self.beside([*self.controls.values(), explained], width="360px")
        self.update()

    def update(self) -> None:
        v = self.values()
        try:
            routing = route_tokens(v["tokens"], v["n_experts"], v["top_k"], v["capacity_factor"], v["skew"],
                                   v["gating"])
        except ValueError as err:
            self.routing = self.figure = None
            self.show_error(str(err))
            return
        self.routing = routing
        self.error.value = ""
        self._draw()
        self._summarise()

    def _summarise(self) -> None:
        r = self.routing
        if r.capacity is None:
            capacity = "No capacity factor: every expert takes all it is sent"
        else:
            capacity = (f"Capacity C = ⌈{r.capacity_factor:g}·{r.tokens:,}·{r.top_k}/{r.n_experts}⌉ = "
                        f"{r.capacity:,} assignments per expert")
        self.summary.value = (
            f'<p class="lab-moe-dropped"><b>dropped {r.dropped:,} of {r.assignments:,} assignments '
            f"({r.dropped_fraction:.1%})</b>; {r.tokens_without_expert:,} of {r.tokens:,} tokens lost all "
            f"{r.top_k} experts (residual only).</p>"
            f'<p class="lab-moe-load">{capacity}. The busiest expert was chosen {max(r.wanted):,} times, '
            f"{r.imbalance:.2f}× the mean {r.mean_load:,.4g}; aux loss (Switch, 1 = balanced) "
            f"{r.aux_loss:.4f}, z-loss {r.z_loss:.3g}.</p>")

    def _draw(self) -> None:
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7.5, 3.4))
        draw_routing(self.routing, ax)
        fig.tight_layout()
        self.figure = fig
        show_figure(self.plot, fig)


def moe_explorer(capacity_factor: float = 1.25, top_k: int = 2, n_experts: int = 8, tokens: int = 1024,
                 skew: float = 0.5, gating: str = "softmax") -> CapacityExplorer:
    """The chapter 07 widget: tokens per expert under a router's skew, and what a capacity factor drops."""
    return CapacityExplorer(capacity_factor=capacity_factor, top_k=top_k, n_experts=n_experts, tokens=tokens,
                            skew=skew, gating=gating)


capacity_explorer = moe_explorer


def draw_dispatch(rows: list[list[int]], ax=None):
    """An expert-parallel dispatch: rows[s][e] = rows rank s sends to expert e, the experts split evenly over
    the ranks (rank j owns a contiguous block). Each rank's send split sizes are printed at the right of its
    row; what each rank receives, below its block of experts."""
    import matplotlib.pyplot as plt

    ep, n_experts = len(rows), len(rows[0])
    local = experts_per_rank(n_experts, ep)
    ax = ax or plt.subplots(figsize=(1.0 + 0.55 * n_experts + 1.6, 0.5 * ep + 1.6))[1]
    ax.imshow(rows, cmap="Blues", aspect="auto", vmin=0, vmax=max(max(r) for r in rows) * 1.4 or 1)
    for s, row in enumerate(rows):
        for e, count in enumerate(row):
            ax.text(e, s, str(count), ha="center", va="center", fontsize=8)
        splits = [sum(row[j * local:(j + 1) * local]) for j in range(ep)]
        ax.text(n_experts - 0.3, s, f"send {splits}", va="center", fontsize=8)
    for j in range(ep):
        if j:
            ax.axvline(j * local - 0.5, color="black", linewidth=1.5)
        received = sum(rows[s][e] for s in range(ep) for e in range(j * local, (j + 1) * local))
        ax.text((j + 0.5) * local - 0.5, -0.6, f"rank {j} receives {received}", ha="center", va="bottom",
                fontsize=8)
    ax.set_xticks(range(n_experts), [f"e{e}" for e in range(n_experts)], fontsize=8)
    ax.set_yticks(range(ep), [f"rank {s}" for s in range(ep)], fontsize=8)
    ax.set_xlabel(f"expert (rank j owns experts {local}j … {local}j+{local - 1})")
    ax.set_title("rows each rank sends to each expert", fontsize=10, loc="left", pad=16)
    return ax


def draw_load_history(loads: list[list[int]], ax=None, title: str = ""):
    """Assignments per expert at every training step (one line per expert), and the mean."""
    import matplotlib.pyplot as plt

    ax = ax or plt.subplots(figsize=(6, 3))[1]
    steps = range(1, len(loads) + 1)
    for e in range(len(loads[0])):
        ax.plot(steps, [load[e] for load in loads], linewidth=1, label=f"e{e}")
    ax.plot(steps, [sum(load) / len(load) for load in loads], "k--", linewidth=1.5, label="mean")
    ax.set(xlabel="step", ylabel="assignments per expert", title=title)
    return ax
