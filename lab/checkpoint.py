"""Distributed checkpoints with `torch.distributed.checkpoint` (DCP): atomic, exactly resumable, reshardable.

What a checkpoint holds does not depend on the layout that wrote it. Each value is saved under its
single-process name as the FULL logical tensor, of which every rank writes only its piece:

    model.{name}                 the parameter                     (a TP shard is a box of the full tensor)
    optim.{name}.exp_avg         AdamW's first moment, same box
    optim.{name}.exp_avg_sq      AdamW's second moment, same box
    optim.{name}.step            AdamW's step count (a scalar)
    scheduler, data, meta        the LR scheduler's and the data stream's state dicts, the step and the layout
    scaler                       fp16 only: the dynamic loss scale and its growth count
    rng.rank{r}                  each rank's CPU random state (restored only when the world size is the same)

A rank describes its piece as a box — offsets and sizes within the full tensor — read off the parameter's
`Placement`, and a small planner pair (`_BoxSavePlanner`, `_BoxLoadPlanner`, over DCP's default planners) hands
DCP those boxes. DCP then does the rest: replicas (the same box on several ranks: dp copies, KV heads copied
over TP, experts over ep_dp) are written once (`dedup_save_plans`), and a load at another layout reads, for each
box a rank now holds, the overlapping parts of the saved boxes (`create_read_items_for_chunk_list`).

ZeRO's pieces are ranges of a flat buffer holding a whole block's parameters: a range that cuts a matrix mid-row
is no box, so it cannot be a DCP chunk. ZeRO saves instead through its gathered units: one all-gather over dp per
unit turns the shards (parameters, exp_avg, exp_avg_sq) back into each parameter's TP piece, which is a box; at
load each rank reads those boxes and keeps its shard. This costs one unit's full buffer at a time while saving
(the whole TP-local model's state while loading), and the dp ranks then write identical boxes, deduplicated.

Atomicity: a save writes into `DIR/.tmp-step-N`, DCP's `.metadata` last, and once every rank is done rank 0
renames it to `DIR/step-N` — one `rename`, so a checkpoint is visible only when complete. A kill during a save
leaves a `.tmp-*` directory that resume ignores (it says so) and the next save of that step replaces.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorProperties,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from lab.distributed import all_gather_single
from lab.parallel.placement import placement_of
from lab.parallel.zero import Zero
from lab.precision.loss_scale import DynamicLossScaler

STEP_DIR = re.compile(r"^step-(\d+)$")
TMP_PREFIX = ".tmp-"
LAB_FILE = "lab.json"  # step, layout and config, for `inspect`/`convert` (written before the rename)
ADAM_STATES = ("exp_avg", "exp_avg_sq")

Box = tuple[tuple[int, ...], torch.Size]  # (offsets in the full tensor, full size)


@dataclass
class CheckpointOptions:
    """The checkpoint flags of `python -m lab.train`."""

    dir: str
    every: int = 0  # save after every `every` steps (0: only at the end)
    keep: int = 0  # keep the newest `keep` checkpoints (0: all)
    resume: bool = False
    asynchronous: bool = False  # write in the background; a checkpoint appears when the next save starts

    def __post_init__(self) -> None:
        for name in ("every", "keep"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{'checkpoint-every' if name == 'every' else name}={getattr(self, name)} "
                                 f"must be >= 0")


# --- DCP planners: each rank's tensors are boxes of full tensors --------------------------------------------


class _BoxSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, told where each local tensor lies in its full tensor (`boxes`)."""

    def __init__(self, boxes: dict[str, Box]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.boxes = boxes

    def create_local_plan(self) -> SavePlan:
        items = []
        for fqn, obj in self.state_dict.items():
            if not isinstance(obj, torch.Tensor):
                items.append(WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO))
                continue
            offsets, size = self.boxes.get(fqn, ((0,) * obj.dim(), obj.size()))
            offsets = torch.Size(offsets)
            items.append(WriteItem(
                index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=offsets, sizes=obj.size()),
                                            properties=TensorProperties.create_from_tensor(obj), size=size)))
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> object:
        return self.state_dict[index.fqn]


class _BoxLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner reading, for each local tensor, the parts of the saved boxes it overlaps."""

    def __init__(self, boxes: dict[str, Box]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.boxes = boxes

    def create_local_plan(self) -> LoadPlan:
        requests: list[ReadItem] = []
        saved = self.metadata.state_dict_metadata
        for fqn, obj in self.state_dict.items():
            if fqn not in saved:
                raise ValueError(f"the checkpoint holds no {fqn!r} (a different model?)")
            if not isinstance(obj, torch.Tensor):
                index = MetadataIndex(fqn)
                requests.append(ReadItem(type=LoadItemType.BYTE_IO, dest_index=index, dest_offsets=torch.Size((0,)),
                                         storage_index=index, storage_offsets=torch.Size((0,)),
                                         lengths=torch.Size((0,))))
                continue
            offsets, size = self.boxes.get(fqn, ((0,) * obj.dim(), obj.size()))
            md = saved[fqn]
            if not isinstance(md, TensorStorageMetadata) or tuple(md.size) != tuple(size):
                found = tuple(md.size) if isinstance(md, TensorStorageMetadata) else "an object"
                raise ValueError(f"{fqn}: the checkpoint holds {found}, this model needs {tuple(size)}")
            chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=obj.size())
            requests += create_read_items_for_chunk_list(fqn, md, [chunk])
        return LoadPlan(requests)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.state_dict[index.fqn]


# --- a rank's state as named boxes ----------------------------------------------------------------------------


def named_parameters(par) -> list[tuple[str, nn.Parameter]]:
    """(single-process name, parameter) for what this rank holds: a pipeline rank's chunks are a ModuleList of
    stages, each keeping the single-process names."""
    stages = list(par.model) if par.pipeline is not None else [par.model]
    return [(name, param) for stage in stages for name, param in stage.named_parameters()]


def _box(param: torch.Tensor) -> Box:
    """Where this rank's piece of `param` lies in the full tensor, from its placement."""
    spot = placement_of(param)
    offsets = [0] * param.dim()
    if spot.tp_dim is not None:
        offsets[spot.tp_dim] = spot.tp_index * param.shape[spot.tp_dim]
    return tuple(offsets), torch.Size(spot.full_shape(tuple(param.shape)))


def _keys(name: str) -> dict[str, str]:
    return {"param": f"model.{name}", **{s: f"optim.{name}.{s}" for s in ADAM_STATES}, "step": f"optim.{name}.step"}


def _rank_state(par, optimizer: torch.optim.Optimizer, loading: bool
                ) -> tuple[dict[str, torch.Tensor], dict[str, Box], Callable[[], None]]:
    """This rank's tensors by checkpoint key, their boxes, and (when `loading`) what puts the loaded values in
    place. Saving reads the live tensors (ZeRO: gathered per unit); loading fills buffers of the same boxes."""
    if isinstance(par.engine, Zero):
        return _zero_state(par, optimizer, loading)
    tensors, boxes, fills = {}, {}, []
    for name, param in named_parameters(par):
        keys, box = _keys(name), _box(param)
        master = par.masters.master(param)  # the fp32 weight under bf16/fp16 (the parameter itself under fp32)
        tensors[keys["param"]] = master.data  # loaded in place
        state = optimizer.state.get(master)
        if loading:
            state = {s: torch.zeros_like(master.data) for s in ADAM_STATES}
            state["step"] = torch.zeros((), dtype=torch.float32)
            fills.append((master, state))
        if state:
            tensors.update({keys[s]: state[s] for s in (*ADAM_STATES, "step")})
        for s in ("param", *ADAM_STATES):
            boxes[keys[s]] = box

    def apply() -> None:
        for master, state in fills:
            optimizer.state[master] = state
        par.masters.master_to_model()  # the loaded fp32 weights, rounded into a bf16/fp16 model

    return tensors, boxes, apply


def _zero_pieces(engine: Zero) -> list[tuple]:
    """(unit, parameter, piece, lo, hi) with piece = unit.shard[lo:hi], in the order the engine built them."""
    flat = [(unit, lo, hi, param) for unit in engine.units for lo, hi, param in _piece_ranges(unit)]
    return [(unit, param, piece, lo, hi) for (unit, lo, hi, param), piece in zip(flat, engine.parameters(),
                                                                                  strict=True)]


def _piece_ranges(unit) -> list[tuple[int, int, nn.Parameter]]:
    end = unit.start + unit.shard_numel
    ranges = []
    for param, offset in unit.offsets.items():
        lo, hi = max(offset, unit.start) - unit.start, min(offset + param.numel(), end) - unit.start
        if lo < hi:
            ranges.append((lo, hi, param))
    return ranges


@torch.no_grad()
def _zero_state(par, optimizer: torch.optim.Optimizer, loading: bool):
    engine: Zero = par.engine
    names = {engine.full_of.get(param, param): name for name, param in named_parameters(par)}  # ZeRO-3: pieces
    pieces = _zero_pieces(engine)
    tensors, boxes, flats = {}, {}, []
    steps: dict[nn.Parameter, torch.Tensor] = {}
    dtype = par.masters.master_params[0].dtype  # of the weights saved (fp32 masters of a bf16 model) and moments
    for unit in engine.units:
        full_numel, kinds = unit.full.numel(), ("param", *ADAM_STATES)
        full = {kind: torch.zeros(full_numel, dtype=dtype, device=unit.shard.device) for kind in kinds}
        if not loading:  # gather the shards of the parameters and of the optimizer's moments
            shards = {kind: torch.zeros_like(unit.shard, dtype=dtype) for kind in kinds}
            for owner, param, piece, lo, hi in pieces:
                if owner is not unit:
                    continue
                master = par.masters.master(piece)
                shards["param"][lo:hi] = master
                if state := optimizer.state.get(master):
                    for s in ADAM_STATES:
                        shards[s][lo:hi] = state[s]
                    steps[param] = state["step"]
            for kind in kinds:
                all_gather_single(full[kind], shards[kind], group=engine.group)
        flats.append((unit, full))
        for param, offset in unit.offsets.items():
            keys, box = _keys(names[param]), _box(param)
            for kind in kinds:
                tensors[keys[kind]] = full[kind][offset:offset + param.numel()].view(param.shape)
                boxes[keys[kind]] = box
            if loading:
                steps[param] = tensors[keys["step"]] = torch.zeros((), dtype=torch.float32)
            elif param in steps:
                tensors[keys["step"]] = steps[param]

    @torch.no_grad()
    def apply() -> None:
        for unit, full in flats:
            unit.shard.copy_(full["param"][unit.start:unit.start + unit.shard_numel])
            if engine.stage < 3:
                unit.full.copy_(full["param"])
        fulls = {id(unit): full for unit, full in flats}
        for unit, param, piece, lo, hi in pieces:  # each piece keeps its range of the unit's weights and moments
            full, start, master = fulls[id(unit)], unit.start, par.masters.master(piece)
            master.copy_(full["param"][start + lo:start + hi])  # a bf16 model's fp32 masters (under fp32: piece)
            optimizer.state[master] = {"step": steps[param].clone(),
                                       **{s: full[s][start + lo:start + hi].clone() for s in ADAM_STATES}}

    return tensors, boxes, apply


# --- save, find, load ----------------------------------------------------------------------------------------


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    """DCP warns whenever it runs without a process group, even when asked to (`no_dist`): a single process is
    a layout like any other here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def layout_of(parallel) -> dict:
    return {k: getattr(parallel, k) for k in ("dp", "tp", "cp", "pp", "ep", "zero", "pp_virtual_stages")}


@dataclass
class PendingSave:
    """A save whose files are being written (in the background when asynchronous): visible once `finish`ed."""

    tmp: str
    final: str
    lab_info: dict
    future: object | None = None  # DCP's future for an asynchronous save


def start_save(directory: str, step: int, par, optimizer: torch.optim.Optimizer, scheduler, data, config,
               async_group: dist.ProcessGroup | None = None, asynchronous: bool = False,
               scaler: DynamicLossScaler | None = None) -> PendingSave:
    """Write the run's state after `step` steps into `directory/.tmp-step-N`. Asynchronous: DCP copies the state
    to CPU memory (the part that blocks training) and a background thread writes it, over `async_group` (its own
    gloo group, so that its collectives never interleave with training's)."""
    final = os.path.join(directory, f"step-{step:08d}")
    tmp = os.path.join(directory, f"{TMP_PREFIX}step-{step:08d}")
    if _rank() == 0:
        os.makedirs(directory, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # a save of this step that was killed
        os.makedirs(tmp)
    _barrier()
    tensors, boxes, _ = _rank_state(par, optimizer, loading=False)
    world = dist.get_world_size() if dist.is_initialized() else 1
    meta = {"step": step, "layout": layout_of(config.parallel), "world": world}
    state = {**tensors, "scheduler": scheduler.state_dict(), "data": data.state_dict(), "meta": meta,
             f"rng.rank{_rank()}": torch.get_rng_state()}
    if scaler is not None and scaler.enabled:
        state["scaler"] = scaler.state_dict()
    pending = PendingSave(tmp, final, {**meta, "config": config.to_dict()})
    # the writer named, not found from a path: DCP would import fsspec to probe it (~0.3 s per process)
    options = {"storage_writer": dcp.FileSystemWriter(tmp), "planner": _BoxSavePlanner(boxes),
               "no_dist": not dist.is_initialized()}
    with _quiet_single_process():
        if asynchronous:
            pending.future = dcp.async_save(state, process_group=async_group, **options)
        else:
            dcp.save(state, **options)
    return pending


def finish_save(pending: PendingSave) -> str:
    """Wait for the files, then make the checkpoint visible with one rename (rank 0); return its path."""
    if pending.future is not None:
        pending.future.result()
    _barrier()  # every rank's files and the metadata are written
    if _rank() == 0:
        with open(os.path.join(pending.tmp, LAB_FILE), "w") as f:
            json.dump(pending.lab_info, f, indent=1)
        shutil.rmtree(pending.final, ignore_errors=True)
        os.rename(pending.tmp, pending.final)  # the checkpoint appears, complete
    _barrier()
    return pending.final


def save(directory: str, step: int, par, optimizer: torch.optim.Optimizer, scheduler, data, config,
         scaler: DynamicLossScaler | None = None) -> str:
    """Save the run's state after `step` steps as `directory/step-N` (atomically); return its path."""
    return finish_save(start_save(directory, step, par, optimizer, scheduler, data, config, scaler=scaler))


def prune(directory: str, keep: int) -> None:
    """Delete all but the newest `keep` checkpoints (renamed away first, so that a kill mid-delete never leaves a
    half-deleted checkpoint looking complete), and what a prune that was killed left half-deleted."""
    if keep <= 0 or _rank() != 0:
        return
    deleted = TMP_PREFIX + "deleted-"
    for path in complete_checkpoints(directory)[:-keep]:
        os.rename(path, os.path.join(directory, deleted + os.path.basename(path)))
    for name in os.listdir(directory):
        if name.startswith(deleted):
            shutil.rmtree(os.path.join(directory, name))


def complete_checkpoints(directory: str) -> list[str]:
    """The complete checkpoints in `directory`, oldest first (a `.tmp-*` directory is an unfinished save)."""
    if not os.path.isdir(directory):
        return []
    found = [(int(m.group(1)), name) for name in os.listdir(directory) if (m := STEP_DIR.match(name))]
    return [os.path.join(directory, name) for _, name in sorted(found)
            if os.path.exists(os.path.join(directory, name, ".metadata"))]


def newest(directory: str) -> tuple[str | None, str]:
    """The newest complete checkpoint (or None) and one line saying what resume will do."""
    done = complete_checkpoints(directory)
    unfinished = sorted(n for n in os.listdir(directory) if n.startswith(TMP_PREFIX + "step-")) \
        if os.path.isdir(directory) else []
    if not done:
        note = f"no complete checkpoint in {directory}: starting from step 0"
    else:
        note = f"resuming from {done[-1]}"
    if unfinished:
        note += f" (ignoring {', '.join(unfinished)}: a save that did not finish)"
    return (done[-1] if done else None), note


def load(path: str, par, optimizer: torch.optim.Optimizer, scheduler, data, config,
         scaler: DynamicLossScaler | None = None) -> dict:
    """Load a checkpoint saved at any layout (and any precision: the weights are saved in fp32 unless the run
    was all bf16/fp16) into this rank's part of the run; return its `meta`. An fp16 run resumed from a checkpoint
    of another precision starts its loss scale afresh."""
    tensors, boxes, apply = _rank_state(par, optimizer, loading=True)
    saved = _read_metadata(path).state_dict_metadata
    if not any(k.startswith("optim.") for k in saved):
        # saved before the first optimizer step: AdamW's zero moments and step 0, as a fresh optimizer has
        tensors = {k: v for k, v in tensors.items() if not k.startswith("optim.")}
    state = {**tensors, "scheduler": None, "data": None, "meta": None}
    with_scaler = scaler is not None and scaler.enabled and any(k.startswith("scaler") for k in saved)
    if with_scaler:
        state["scaler"] = None
    with open(os.path.join(path, LAB_FILE)) as f:
        saved_world = json.load(f)["world"]
    world = dist.get_world_size() if dist.is_initialized() else 1
    rng_key = f"rng.rank{_rank()}"
    if saved_world == world:
        state[rng_key] = torch.get_rng_state()
    with _quiet_single_process():
        dcp.load(state, storage_reader=dcp.FileSystemReader(path), planner=_BoxLoadPlanner(boxes),
                 no_dist=not dist.is_initialized())
    apply()
    scheduler.load_state_dict(state["scheduler"])
    for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr(), strict=True):
        group["lr"] = lr
    data.load_state_dict(state["data"])
    if with_scaler:
        scaler.load_state_dict(state["scaler"])
    if rng_key in state:
        torch.set_rng_state(state[rng_key])
    return state["meta"]


def resume_note(meta: dict, config) -> str | None:
    """One line when the layout changed: what resharding keeps exact and what it does not."""
    now = layout_of(config.parallel)
    if meta["layout"] == now:
        return None
    changed = ", ".join(f"{k} {meta['layout'][k]}->{now[k]}" for k in now if meta["layout"].get(k) != now[k])
    note = f"resharded ({changed}): model and optimizer state are exact"
    if meta["layout"]["dp"] != now["dp"]:
        note += ("; the data stream continues at the same global batch, but each dp rank now reads other rows "
                 "of it")
    return note


class Checkpointer:
    """The training loop's two hooks: `resume` before the first step, `after_step` after each."""

    def __init__(self, options: CheckpointOptions, config, scaler: DynamicLossScaler | None = None) -> None:
        self.options, self.config, self.scaler = options, config, scaler
        self.pending: PendingSave | None = None
        # an asynchronous save's collectives run beside training's: they get their own group (made by every rank)
        self.group = dist.new_group(backend="gloo") if options.asynchronous and dist.is_initialized() else None

    def resume(self, par, optimizer, scheduler, data) -> int:
        """Load the newest complete checkpoint if asked to; return the step to continue from."""
        if not self.options.resume:
            return 0
        path, note = newest(self.options.dir)
        step = 0
        if path is not None:
            meta = load(path, par, optimizer, scheduler, data, self.config, self.scaler)
            step = meta["step"]
            if (reshard := resume_note(meta, self.config)) is not None:
                note += f"; {reshard}"
        if _rank() == 0:
            print(f"checkpoint: {note}", flush=True)
        return step

    def after_step(self, step: int, par, optimizer, scheduler, data) -> None:
        """Save every `every` steps and after the last one (which waits for its files)."""
        every, last = self.options.every, step == self.config.train.steps
        if not ((every and step % every == 0) or last):
            return
        self._finish_pending()
        self.pending = start_save(self.options.dir, step, par, optimizer, scheduler, data, self.config,
                                  self.group, self.options.asynchronous, self.scaler)
        if last or not self.options.asynchronous:
            self._finish_pending()

    def _finish_pending(self) -> None:
        if self.pending is not None:
            finish_save(self.pending)
            self.pending = None
            prune(self.options.dir, self.options.keep)


# --- python -m lab checkpoint inspect | convert ---------------------------------------------------------------


def _read_metadata(path: str):
    if not os.path.exists(os.path.join(path, ".metadata")):
        raise ValueError(f"{path} is not a complete checkpoint (no .metadata); complete ones: "
                         f"{', '.join(complete_checkpoints(path)) or 'none'}")
    return dcp.FileSystemReader(path).read_metadata()


def inspect(path: str) -> str:
    """What a checkpoint holds: its step, the layout that wrote it, each tensor's full shape, dtype and bytes."""
    metadata = _read_metadata(path)
    with open(os.path.join(path, LAB_FILE)) as f:
        info = json.load(f)
    layout = ", ".join(f"{k}={v}" for k, v in info["layout"].items())
    lines = [f"{path}: step {info['step']}, saved by {info['world']} rank(s) [{layout}], "
             f"model {info['config']['model']['name']}"]
    total = 0
    for fqn, md in sorted(metadata.state_dict_metadata.items()):
        if isinstance(md, TensorStorageMetadata):
            nbytes = md.size.numel() * md.properties.dtype.itemsize
            total += nbytes
            lines.append(f"  {fqn:<44} {str(tuple(md.size)):<16} {str(md.properties.dtype):<14} {nbytes:>12,} B "
                         f"({len(md.chunks)} chunk(s))")
        else:
            lines.append(f"  {fqn:<44} (object)")
    on_disk = sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path))
    lines.append(f"tensors: {total:,} bytes ({total / 1e9:.3f} GB); files on disk: {on_disk:,} bytes")
    return "\n".join(lines)


def read_full(path: str, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint whose key starts with `prefix`, whole, in this process (no process group):
    what any layout's ranks saved, gathered."""
    metadata = _read_metadata(path)
    full = {fqn: torch.empty(md.size, dtype=md.properties.dtype) for fqn, md in metadata.state_dict_metadata.items()
            if fqn.startswith(prefix) and isinstance(md, TensorStorageMetadata)}
    with _quiet_single_process():
        dcp.load(full, storage_reader=dcp.FileSystemReader(path), planner=_BoxLoadPlanner({}), no_dist=True)
    return full


def to_single_file(path: str) -> tuple[dict[str, torch.Tensor], object]:
    """The model's plain `state_dict` (every key `build_model(cfg).state_dict()` has) and the run's config."""
    from lab.config import Config
    from lab.model import build_model

    with open(os.path.join(path, LAB_FILE)) as f:
        config = Config.from_dict(json.load(f)["config"])
    saved = read_full(path, "model.")
    with torch.device("meta"):
        model = build_model(config.model)
    names = {id(param): name for name, param in model.named_parameters()}  # a tied weight has one name
    params = dict(model.named_parameters(remove_duplicate=False))
    state = {}
    for key in model.state_dict():
        source = names[id(params[key])] if key in params else key
        state[key] = saved[f"model.{source}"]
    return state, config


def main(argv: list[str] | None = None) -> int:
    from lab import hf  # which imports this module

    p = argparse.ArgumentParser(prog="python -m lab checkpoint", description="look into and convert DCP checkpoints")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("inspect", help="step, layout, tensors and bytes of a checkpoint").add_argument("dir")
    convert = sub.add_parser("convert", help="write a plain torch state_dict (load it into lab.model.build_model), "
                                             "or Hugging Face weights (lab.hf)")
    convert.add_argument("dir")
    target = convert.add_mutually_exclusive_group(required=True)
    target.add_argument("--to-single-file", metavar="OUT")
    hf.add_arguments(convert, target)
    args = p.parse_args(argv)
    path = args.dir
    if not os.path.exists(os.path.join(path, ".metadata")) and complete_checkpoints(path):
        path = complete_checkpoints(path)[-1]  # a checkpoint directory: its newest checkpoint
    try:
        if args.command == "inspect":
            print(inspect(path))
        elif args.to_single_file is None:
            print(hf.convert(args, path))
        else:
            state, _ = to_single_file(path)
            torch.save(state, args.to_single_file)
            print(f"wrote {len(state)} tensors of {path} to {args.to_single_file}")
    except (ValueError, OSError) as err:
        print(f"python -m lab checkpoint: error: {err}", file=sys.stderr)
        return 2
    return 0

