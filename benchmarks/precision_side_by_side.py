"""lab's mixed precision beside torch's FSDP2 MixedPrecisionPolicy and torchao's float8 training: the same run.

    python benchmarks/precision_side_by_side.py                      # tiny model, 2 layers, 2 gloo ranks, 10 steps
    python benchmarks/precision_side_by_side.py --steps 20 --set model.n_layers=4 --json out.json
    pip install -e ".[torchao]"      # torchao 0.18.0 (in make's ".[all]"); its wheel brings no torch of its own

One run — the config's model, `lab.data.SyntheticTokens` batches cut by rows over the dp ranks, the weights
`lab.model` draws by name from the seed, lab.train's AdamW (`lab.parallel.optim.adamw`), its warm-up plus cosine
schedule (`lab.trainer.lr_factor`) and its clipping by the global norm (`clip_grad_norm`) — trained by lab and by
the production stack:

  bf16            `lab.train --precision bf16` (bf16 weights, fp32 masters owned by the optimizer, gradients
                  summed in fp32, fp32 logits) against torch's `fully_shard` on each block and on the root with
                  `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`, `output_dtype=fp32` on the root:
                  FSDP2 keeps fp32 shards as the masters, casts them to bf16 when it all-gathers, and casts the
                  bf16 gradients to fp32 before it reduce-scatters them.
  fp8-tensorwise  `lab.train --precision fp8-tensorwise` (bf16, and the linears inside the blocks through
                  `lab.precision.fp8_linear.FP8Matmul`) against the same FSDP2 run whose block linears torchao's
                  `convert_to_float8_training` swapped for `Float8Linear` with its tensorwise recipe (TorchTitan's
                  float8 layout: the output layer stays in bf16, as lab's does).
  fp8-tilewise    lab's DeepSeek-V3 tiles have a torchao counterpart, `torchao.prototype.blockwise_fp8_training`,
                  which does not run on a CPU: the row gives torchao's own refusal.

Both keep the fp32 initial values w0 as the masters (lab's `MasterWeights` takes them from before the cast to
bf16, FSDP2's contract). Masters started from the bf16-rounded copy instead would give the same weights at step
1 and round differently from the first update on (round(w0 + Δ) against round(round(w0) + Δ): a weight in four
lands one bf16 step apart); `torch_worker(rounded_masters=True)` plants that, and the tests see it.

What still differs between the two sides, and what it does to the loss:

- FSDP2 casts every floating input of a wrapped module to param_dtype (`cast_forward_inputs`): each block's RoPE
  cos/sin are rounded to bf16 — as lab's model now rounds them itself (RoPE in the compute dtype, its tables cast
  once per forward), so FSDP2's default and cast_forward_inputs=False give the same numbers here.
- lab.train's default loss is chunked (`lab.loss.chunked_cross_entropy`), which forms the output layer's bf16
  gradients in another order than autograd on whole logits; lab's side runs `--loss whole`, the reference's recipe.
- Gradient accumulation is left out: FSDP2 without gradient sync accumulates unsharded gradients in bf16 before
  its fp32 reduction, lab sums micro-batches in fp32.

Seen on a 2-core CPU (torch 2.13, torchao 0.18, tiny model with 2 layers, 2 ranks, 10 steps): both references give
bit-identical losses and gradient norms at every step (max |diff| 0) — lab's bf16 step is FSDP2's, and lab's FP8
GEMMs (torch._scaled_mm on the CPU) are torchao's. With masters from the bf16-rounded copy (lab's before issue 33),
max |diff| was 2.5e-4 (bf16) and 1.9e-3 (fp8): bf16 rounding noise, which FP8 amplifies.

A reference that is missing (torchao not installed) or refuses to run is a row that says why, never a crash.
With --json, the rows become records with the torch and torchao versions and the config.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from lab.config import Config, read_config  # noqa: E402
from lab.data import SyntheticTokens, shard_rows  # noqa: E402
from lab.distributed import run  # noqa: E402
from lab.loss import cross_entropy  # noqa: E402
from lab.model import build_model, materialize  # noqa: E402
from lab.parallel.optim import adamw, clip_grad_norm  # noqa: E402
from lab.parallel.placement import set_replicas  # noqa: E402
from lab.precision.scheme import KEEP_IN_HIGH_PRECISION  # noqa: E402
from lab.train import run as lab_train  # noqa: E402
from lab.trainer import lr_factor  # noqa: E402

DEFAULT_CONFIG = ROOT / "configs" / "tiny.toml"
DEFAULT_SETS = ("model.n_layers=2",)
REFERENCES = {"bf16": "torch FSDP2 MixedPrecisionPolicy(param bf16, reduce fp32), fp32 logits",
              "fp8-tensorwise": "torchao Float8Linear (tensorwise) on that FSDP2 run",
              "fp8-tilewise": "torchao.prototype.blockwise_fp8_training (1x128, 128x128)"}
TORCHAO_HINT = "pip install -e \".[torchao]\" (torchao==0.18.0)"


def build_config(config_path: str | Path = DEFAULT_CONFIG, sets: Sequence[str] = DEFAULT_SETS,
                 steps: int | None = None, nproc: int = 2) -> Config:
    """The run both sides train: the config file with `sets` applied, `nproc` data-parallel ranks on the CPU.
    Plain data parallelism without gradient accumulation only: the layout FSDP2 alone reproduces."""
    if not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"nproc={nproc!r} must be an integer >= 1")
    data = read_config(str(config_path), list(sets))
    parallel, train = data.setdefault("parallel", {}), data.setdefault("train", {})
    others = {k: v for k, v in parallel.items()
              if k in ("tp", "pp", "cp", "ep", "grad_accum", "zero") and v not in (0, 1)}
    if others:
        raise ValueError(f"parallel {others}: this benchmark compares plain data parallelism (dp only, grad_accum 1, "
                         "zero 0) with FSDP2")
    parallel["dp"] = nproc
    train["device"] = "cpu"
    if steps is not None:
        train["steps"] = steps
    return Config.from_dict(data)


# --- torch's side: FSDP2 with a MixedPrecisionPolicy, optionally torchao's float8 linears ---------------------

def torchao_missing() -> str | None:
    """None when torchao's float8 training imports (here, so that forked ranks inherit it); else why not."""
    try:
        import torchao.float8  # noqa: F401
    except ImportError as err:
        return f"torchao is not installed ({_first_line(err)}): {TORCHAO_HINT}"
    except Exception as err:  # a torchao built for another torch can fail in other ways
        return f"torchao does not import here: {_first_line(err)}"
    return None


def torchao_version() -> str | None:
    try:
        import torchao
    except Exception:
        return None
    return getattr(torchao, "__version__", "unknown")


def _fp8_linear(fqn: str) -> bool:
    """The linears FP8 converts, on both sides (`lab.precision.scheme.convert_to_fp8`'s rule): those inside the
    transformer blocks except the kept ones; not the output layer."""
    return fqn.startswith("layers.") and fqn.rsplit(".", 1)[-1] not in KEEP_IN_HIGH_PRECISION


def torch_worker(config: Config, fp8: bool = False, rounded_masters: bool = False,
                 reduce_dtype: torch.dtype = torch.float32, fp32_logits: bool = True,
                 cast_block_inputs: bool = False) -> list[dict]:
    """One rank of the reference run: FSDP2 with MixedPrecisionPolicy(bf16, `reduce_dtype`) on each block
    (`cast_block_inputs`: FSDP2's cast_forward_inputs) and on the root (its output cast to fp32 when
    `fp32_logits`), the block linears as torchao's tensorwise Float8Linear when `fp8`; the masters start at the
    fp32 initial weights, or (a bug to plant) at their bf16-rounded copy when `rounded_masters`. The loop is
    lab.train's: the same batches, initial weights, optimizer, schedule and clipping. Returns per step the loss
    (mean over ranks) and the gradient norm right after reduction, before clipping."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg, train = config.model, config.train
    model = materialize(build_model(cfg), "cpu", seed=train.seed)  # lab's initial weights, drawn by name
    if rounded_masters:
        with torch.no_grad():
            for param in model.parameters():
                param.copy_(param.bfloat16().float())
    if fp8:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("tensorwise"),
                                   module_filter_fn=lambda module, fqn: _fp8_linear(fqn))
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    block_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype,
                                        cast_forward_inputs=cast_block_inputs)
    for block in model.layers.values():
        fully_shard(block, mesh=mesh, mp_policy=block_policy)
    fully_shard(model, mesh=mesh, mp_policy=MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype, output_dtype=torch.float32 if fp32_logits else None))
    params = list(model.parameters())  # DTensor shards of the fp32 masters
    set_replicas(params, 1)  # each value on one rank: what lab's clip_grad_norm reads
    optimizer = adamw(params, train.lr, train.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, config))
    data = SyntheticTokens(cfg.vocab_size, train.seq_len, train.global_batch, train.seed, train.data_branching)
    logs = []
    for step in range(train.steps):
        inputs, targets = (shard_rows(t, rank, world) for t in data.next_batch())
        loss = cross_entropy(model(inputs), targets)
        loss.backward()  # FSDP2's reduce-scatters are done when it returns
        norm = clip_grad_norm(params, train.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        mean = loss.detach().float()
        dist.all_reduce(mean)
        logs.append({"step": step + 1, "loss": mean.item() / world, "grad_norm": norm.item()})
    return logs


def run_torch(config: Config, **options) -> list[dict]:
    """`torch_worker(config, **options)` on the config's dp ranks (fork-launched gloo ranks); rank 0's log."""
    timeout = max(120.0, 10.0 * config.train.steps)
    return run(torch_worker, config.parallel.dp, config, timeout_s=timeout, **options)[0]


def run_lab(config: Config, precision: str) -> list[dict]:
    """lab.train on the config's ranks with --precision `precision` and --loss whole: the reference takes the loss
    on FSDP2's fp32 logits of the whole micro-batch, and what is compared is the precision recipe (lab's chunked
    loss, its default, forms the bf16 gradients of the output layer in another order: 8e-5 apart by step 3)."""
    data = config.to_dict()
    config = Config.from_dict({**data, "train": {**data["train"], "precision": precision, "loss": "whole"}})
    return [{"step": s.step, "loss": s.loss, "grad_norm": s.grad_norm}
            for s in lab_train(config, config.parallel.world_size, verbose=False)]


def torchao_tilewise_refusal(config: Config) -> str:
    """Why torchao's tile-wise FP8 training (DeepSeek-V3's 1x128 activation tiles, 128x128 weight blocks) is not
    compared: torchao's own refusal of a 128x128 linear on this machine (it asserts a Hopper GPU), and whether
    the model's block linears have the multiples of 128 it asserts as well."""
    missing = torchao_missing()
    if missing is not None:
        return missing
    try:
        from torchao.prototype.blockwise_fp8_training.linear import Float8BlockwiseLinear

        Float8BlockwiseLinear.from_float(torch.nn.Linear(128, 128, bias=False))
        refusal = None
    except Exception as err:  # AssertionError on a CPU; ImportError where the prototype has moved
        refusal = _first_line(err)
    cfg = config.model
    widths = sorted({cfg.d_model, cfg.d_ff, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim})
    narrow = (f"; it also needs in and out features divisible by 128, and this model's are {widths}"
              if any(w % 128 for w in widths) else "")
    if refusal is None:
        return f"torchao's Float8BlockwiseLinear accepts this machine{narrow}; lab has no comparison for it yet"
    return f"torchao.prototype.blockwise_fp8_training refuses on this machine: {refusal}{narrow}"


def _first_line(err: BaseException) -> str:
    text = str(err).splitlines()[0] if str(err) else ""
    return f"{type(err).__name__}: {text}"[:200]


# --- the comparison -------------------------------------------------------------------------------------------

def compare(precision: str, lab: list[dict], reference: list[dict]) -> dict:
    """One row: both runs' losses per step and their |difference|, the max of it, the final losses' relative gap,
    and the relative difference of the step-1 gradient norms (after reduction, before the first update)."""
    if [r["step"] for r in lab] != [r["step"] for r in reference]:
        raise ValueError(f"{precision}: lab logged steps {[r['step'] for r in lab]}, the reference "
                         f"{[r['step'] for r in reference]}")
    steps = [{"step": a["step"], "lab_loss": a["loss"], "ref_loss": b["loss"], "abs_diff": abs(a["loss"] - b["loss"]),
              "lab_grad_norm": a["grad_norm"], "ref_grad_norm": b["grad_norm"]}
             for a, b in zip(lab, reference, strict=True)]
    first, last = steps[0], steps[-1]
    return {"precision": precision, "reference": REFERENCES[precision], "status": "ok",
            "steps": steps, "max_abs_diff": max(s["abs_diff"] for s in steps),
            "final_rel_gap": (last["lab_loss"] - last["ref_loss"]) / last["ref_loss"],
            "step1_grad_norm_rel_diff": abs(first["lab_grad_norm"] - first["ref_grad_norm"]) / first["ref_grad_norm"]}


def not_run(precision: str, reason: str) -> dict:
    return {"precision": precision, "reference": REFERENCES[precision], "status": f"not run: {reason}"}


def precision_rows(config: Config, precision: str, lab: Callable = run_lab,
                   reference: Callable = run_torch) -> list[dict]:
    """lab.train at `precision` against its reference, one row. The fp8 reference needs torchao: without it, or
    when it fails on this machine, the row says why."""
    fp8 = precision == "fp8-tensorwise"
    if fp8 and (missing := torchao_missing()) is not None:
        return [not_run(precision, missing)]
    try:
        ref = reference(config, fp8=fp8)
    except Exception as err:  # RankError carrying the rank's traceback: the reference refused this machine
        if not fp8:
            raise
        return [not_run(precision, f"torchao's float8 training failed here: {_first_line(err)}")]
    return [compare(precision, lab(config, precision), ref)]


def rows(config: Config) -> list[dict]:
    return [*precision_rows(config, "bf16"), *precision_rows(config, "fp8-tensorwise"),
            not_run("fp8-tilewise", torchao_tilewise_refusal(config))]


def print_table(found: list[dict]) -> None:
    for precision in dict.fromkeys(r["precision"] for r in found):
        ran = [r for r in found if r["precision"] == precision and r["status"] == "ok"]
        if not ran:
            continue
        print(f"{precision}: lab.train --precision {precision} against {ran[0]['reference']}")
        print(f"{'step':>4}{'lab':>11}" + "".join(f" | {'reference':>19}{'|diff|':>9}" for r in ran))
        for i, step in enumerate(ran[0]["steps"]):
            print(f"{step['step']:>4}{step['lab_loss']:>11.6f}" +
                  "".join(f" | {r['steps'][i]['ref_loss']:>19.6f}{r['steps'][i]['abs_diff']:>9.1e}" for r in ran))
        print()
    print(f"{'precision':<16}{'max |diff|':>11}{'final gap':>11}{'step-1 norm':>12}  reference")
    for r in found:
        if r["status"] != "ok":
            print(f"{r['precision']:<16}{'-':>11}{'-':>11}{'-':>12}  {r['reference']}\n    {r['status']}")
            continue
        print(f"{r['precision']:<16}{r['max_abs_diff']:>11.1e}{100 * r['final_rel_gap']:>10.4f}%"
              f"{r['step1_grad_norm_rel_diff']:>12.1e}  {r['reference']}")
    print("|diff|: lab's loss against the reference's; final gap: lab's final loss relative to the reference's; "
          "step-1 norm: relative difference of the gradient norms after reduction, before any update")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    parser.add_argument("--set", action="append", default=list(DEFAULT_SETS), metavar="SECTION.FIELD=VALUE",
                        help=f"override a config field, as lab.train's --set (applied first: {' '.join(DEFAULT_SETS)})")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--nproc", type=int, default=2, help="data-parallel ranks (gloo, fork-launched)")
    parser.add_argument("--json", type=Path, default=None, help="write the records here")
    args = parser.parse_args(argv)
    try:
        config = build_config(args.config, args.set, args.steps, args.nproc)
    except ValueError as err:
        parser.error(str(err))
    env = {"device": f"CPU ({platform.processor() or platform.machine()})", "torch": torch.__version__,
           "torchao": torchao_version(), "python": platform.python_version()}
    m, t = config.model, config.train
    print(f"{env['device']}: torch {env['torch']}, torchao {env['torchao']}; {m.name} model ({m.n_layers} layers, "
          f"d_model {m.d_model}), {config.parallel.dp} ranks, {t.steps} steps of {t.global_batch} x {t.seq_len} "
          "tokens\n")
    found = rows(config)
    print_table(found)
    if args.json:
        args.json.write_text(json.dumps({**env, "config": config.to_dict(), "rows": found}, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
