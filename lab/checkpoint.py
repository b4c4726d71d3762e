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

A rank describes its piece as a box — offsets and sizes within the full tensor — read off its engine's boxes and
the parameter's `Placement`, and a small planner pair (`_BoxSavePlanner`, `_BoxLoadPlanner`, over DCP's default
planners) hands DCP those boxes. DCP then does the rest: replicas (the same box on several ranks: dp copies, KV
heads copied over TP, experts over ep_dp) are written once (`dedup_save_plans`), and a load at another layout
reads, for each box a rank now holds, the overlapping parts of the saved boxes (`create_read_items_for_chunk_list`).

Which boxes a rank holds of each parameter is its data-parallel engine's to say (`DataParallel.state_boxes`,
`load_boxes`): a plain engine holds whole parameters; ZeRO, whose flat pieces cut matrices mid-row, gathers its
units and holds whole parameters too while saving or loading. This module knows DCP and placements only: an
engine of another kind needs no change here.

Atomicity: a save writes into `DIR/.tmp-step-N`, DCP's `.metadata` last, and once every rank is done rank 0
renames it to `DIR/step-N` — one `rename`, so a checkpoint is visible only when complete. A kill during a save
leaves a `.tmp-*` directory that resume ignores (it says so) and the next save of that step replaces.

Integrity: every file is hashed (sha256) as DCP writes it — in the async save's background thread when
asynchronous, so no file is read twice — and `lab.json`, written last, lists each file's size and hash. Resume
and `inspect` check them: a missing, truncated or flipped file names itself, and resume goes back to the newest
intact checkpoint, saying which one it skipped and why. When step folders exist but none is intact, `--resume`
refuses (a silent restart from step 0 would throw the run away) unless `--fresh` says to start over.

What a resume may change: the layout (resharded exactly), the length and learning rate of the run (the lr
schedule is recomputed from the new values), the global batch (the data stream goes on from the saved step with
batches of the new size) and the other training knobs (weight decay, clipping, kernels, device, reduce dtype).
It refuses another model (any model field but its name), another precision or another data stream (seed,
sequence length, branching): that is another experiment, which belongs in another directory.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import hashlib
import json
import os
import pickle
import re
import shutil
import sys
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystem
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

from lab.parallel.dp import WEIGHT
from lab.parallel.placement import placement_of
from lab.precision.loss_scale import DynamicLossScaler

STEP_DIR = re.compile(r"^step-(\d+)$")
TMP_PREFIX = ".tmp-"
LAB_FILE = "lab.json"  # step, layout, config and each file's size and sha256 (written last, before the rename)
ADAM_STATES = ("exp_avg", "exp_avg_sq")
# what a resume refuses to change: another model, precision or data stream is another experiment
MUST_MATCH = ("model.", "train.precision", "train.seq_len", "train.seed", "train.data_branching")
SCHEDULE = ("train.steps", "train.lr", "train.warmup_steps")  # the lr schedule is a function of these

Box = tuple[tuple[int, ...], torch.Size]  # (offsets in the full tensor, full size)


@dataclass
class CheckpointOptions:
    """The checkpoint flags of `python -m lab.train`."""

    dir: str
    every: int = 0  # save after every `every` steps (0: only at the end)
    keep: int = 0  # keep the newest `keep` checkpoints (0: all)
    resume: bool = False
    asynchronous: bool = False  # write in the background; a checkpoint appears when the next save starts
    fresh: bool = False  # with resume: start from step 0 when no checkpoint in `dir` is intact, instead of refusing

    def __post_init__(self) -> None:
        for name in ("every", "keep"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{'checkpoint-every' if name == 'every' else name}={getattr(self, name)} "
                                 f"must be >= 0")
        if self.fresh and not self.resume:
            raise ValueError("--fresh goes with --resume (it lets a resume that finds no intact checkpoint start "
                             "from step 0); without --resume a run starts from step 0 anyway")


class CheckpointError(ValueError):
    """A checkpoint that cannot be saved, trusted or resumed, said in one line that names the file and the newest
    checkpoint still good. A ValueError: `python -m lab.train` and `python -m lab checkpoint` print it as their
    one error line and exit 2, as for any bad input."""


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


def _box(param: torch.Tensor, offsets: tuple[int, ...]) -> Box:
    """Where the box of `param` starting at `offsets` lies in the full tensor: `param` is this rank's piece of it,
    located by its placement."""
    spot = placement_of(param)
    offsets = list(offsets)
    if spot.tp_dim is not None:
        offsets[spot.tp_dim] += spot.tp_index * param.shape[spot.tp_dim]
    return tuple(offsets), torch.Size(spot.full_shape(tuple(param.shape)))


def _key(name: str, kind: str) -> str:
    return f"model.{name}" if kind == WEIGHT else f"optim.{name}.{kind}"


def _rank_state(par, optimizer: torch.optim.Optimizer, loading: bool
                ) -> tuple[dict[str, torch.Tensor], dict[str, Box], Callable[[], None]]:
    """This rank's tensors by checkpoint key, their boxes, and (when `loading`) what puts the loaded values in
    place. The engine says which boxes of which parameters it holds (`state_boxes`, `load_boxes`), given, for each
    tensor the optimizer updates, its weight (the fp32 master under bf16/fp16) and AdamW's states."""
    engine = par.engine
    masters = [par.masters.master(tensor) for tensor in engine.parameters()]
    if loading:  # loaded in place into the weights, into fresh tensors for the states
        values = [{WEIGHT: master.data, **{s: torch.zeros_like(master.data) for s in ADAM_STATES},
                   "step": torch.zeros((), dtype=torch.float32)} for master in masters]
        boxes, put_back = engine.load_boxes(values)
    else:
        values = [{WEIGHT: master.data, **{s: state[s] for s in (*ADAM_STATES, "step")}}
                  if (state := optimizer.state.get(master)) else {WEIGHT: master.data} for master in masters]
        boxes, put_back = engine.state_boxes(values), None
    names = {engine.parameter_of(param): name for name, param in named_parameters(par)}
    tensors, where = {}, {}
    for box in boxes:
        for kind, value in box.values.items():
            key = _key(names[box.param], kind)
            tensors[key] = value
            if value.dim():  # a 0-dim value (the step count) is one number: its own box
                where[key] = _box(box.param, box.offsets)

    def apply() -> None:
        put_back()
        for master, held in zip(masters, values, strict=True):
            optimizer.state[master] = {s: held[s] for s in (*ADAM_STATES, "step")}
        par.masters.master_to_model()  # the loaded fp32 weights, rounded into a bf16/fp16 model

    return tensors, where, apply


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


class _HashedFile:
    """A file DCP is writing, hashed as its bytes go by (DCP writes each file front to back, never seeking): the
    checksum costs no second read. A write that fails names the file (a full disk's OSError names none)."""

    def __init__(self, file, path: str) -> None:
        self.file, self.path, self.sha, self.size = file, path, hashlib.sha256(), 0

    def write(self, data) -> int:
        try:
            written = self.file.write(data)
        except OSError as err:
            err.filename = err.filename or self.path
            raise
        self.sha.update(data)
        self.size += memoryview(data).nbytes
        return written

    def __getattr__(self, name: str):  # tell, flush, fileno, close: the file's own
        return getattr(self.file, name)


class _HashingFileSystem(FileSystem):
    """DCP's local file system, recording the size and sha256 of each file written, by its final name."""

    def __init__(self) -> None:
        super().__init__()
        self.sums: dict[str, dict] = {}

    @contextlib.contextmanager
    def create_stream(self, path, mode: str) -> Iterator:
        with super().create_stream(path, mode) as stream:
            if "w" not in mode:
                yield stream
                return
            hashed = _HashedFile(stream, str(path))
            yield hashed
        name = os.path.basename(path).removesuffix(".tmp")  # DCP writes `.metadata.tmp`, then renames it
        self.sums[name] = {"bytes": hashed.size, "sha256": hashed.sha.hexdigest()}


def _writer(path: str) -> dcp.FileSystemWriter:
    writer = dcp.FileSystemWriter(path)
    writer.fs = _HashingFileSystem()
    return writer


@dataclass
class PendingSave:
    """A save whose files are being written (in the background when asynchronous): visible once `finish`ed."""

    tmp: str
    final: str
    lab_info: dict
    future: object | None = None  # DCP's future for an asynchronous save
    sums: dict[str, dict] = field(default_factory=dict)  # this rank's files: size and sha256, filled as written


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
    # the writer named, not found from a path: DCP would import fsspec to probe it (~0.3 s per process)
    writer = _writer(tmp)
    pending = PendingSave(tmp, final, {**meta, "config": config.to_dict()}, sums=writer.fs.sums)
    options = {"storage_writer": writer, "planner": _BoxSavePlanner(boxes), "no_dist": not dist.is_initialized()}
    with _quiet_single_process(), _save_failures(pending):
        if asynchronous:
            pending.future = dcp.async_save(state, process_group=async_group, **options)
        else:
            dcp.save(state, **options)
    return pending


def finish_save(pending: PendingSave) -> str:
    """Wait for the files, then (rank 0) write `lab.json` with every rank's file sizes and hashes and make the
    checkpoint visible with one rename; return its path."""
    if pending.future is not None:
        with _save_failures(pending):
            pending.future.result()
    sums = [pending.sums]
    if dist.is_initialized():  # also the barrier: every rank's files and the metadata are written
        sums = [None] * dist.get_world_size()
        dist.all_gather_object(sums, pending.sums)
    if _rank() == 0:
        files = {name: sum_ for rank_sums in sums for name, sum_ in rank_sums.items()}
        with _save_failures(pending), open(os.path.join(pending.tmp, LAB_FILE), "w") as f:
            json.dump({**pending.lab_info, "files": dict(sorted(files.items()))}, f, indent=1)
        shutil.rmtree(pending.final, ignore_errors=True)
        os.rename(pending.tmp, pending.final)  # the checkpoint appears, complete
    _barrier()
    return pending.final


@contextlib.contextmanager
def _save_failures(pending: PendingSave) -> Iterator[None]:
    """A save that fails (a full disk, a lost mount) as one line: the cause, the file, the partial save removed
    and the previous checkpoint, which the save never touched. DCP's own error is a CheckpointException (a
    BaseException) whose headline lists only the ranks."""
    try:
        yield
    except (CheckpointException, OSError) as err:
        cause = _cause(err)
        # every failing rank removes it: the first one to fail may be the only one to get this far (the launcher
        # stops the others), and its line says the partial save is gone
        shutil.rmtree(pending.tmp, ignore_errors=True)
        directory = os.path.dirname(pending.final)
        done = complete_checkpoints(directory)
        kept = (f"the newest complete checkpoint, {os.path.basename(done[-1])}, is untouched" if done else
                "no earlier checkpoint exists")
        raise CheckpointError(f"could not save step {pending.lab_info['step']} to {directory}: {cause}; the "
                              f"partial save {os.path.basename(pending.tmp)} was removed and {kept}") from None


def _cause(err: BaseException) -> str:
    """The first rank's underlying error, in a few words: an OSError's message and file, else its type and text."""
    failures = sorted(err.failures.items()) if isinstance(err, CheckpointException) else [(_rank(), (err, None))]
    for rank, (exc, _) in failures:
        if isinstance(exc, OSError):
            where = f" writing {os.path.basename(exc.filename)}" if exc.filename else ""
            return f"{exc.strerror or exc} (errno {errno.errorcode.get(exc.errno, exc.errno)}{where} on rank {rank})"
    rank, (exc, _) = failures[0]
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''} (rank {rank})"


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
    return [path for path in _step_dirs(directory) if os.path.exists(os.path.join(path, ".metadata"))]


def newest(directory: str) -> tuple[str | None, str]:
    """The newest intact checkpoint (or None) and one line saying what resume will do: which newer ones it skips
    and why, and which unfinished saves it ignores."""
    path, skipped = _newest_intact_and_skipped(directory)
    return path, _resume_line(directory, path, skipped)


def _resume_line(directory: str, path: str | None, skipped: list[tuple[str, str]], moved: str = "") -> str:
    unfinished = sorted(n for n in os.listdir(directory) if n.startswith(TMP_PREFIX + "step-")) \
        if os.path.isdir(directory) else []
    note = (f"resuming from {path}" if path else
            f"no {'intact' if skipped else 'complete'} checkpoint in {directory}: starting from step 0")
    if skipped:
        note += f" (skipping {_skipped_words(skipped)}{moved})"
    if unfinished:
        note += f" (ignoring {', '.join(unfinished)}: a save that did not finish)"
    return note


def _newest_intact_and_skipped(directory: str) -> tuple[str | None, list[tuple[str, str]]]:
    """The newest intact checkpoint (or None), and the newer damaged ones with why each is."""
    skipped = []
    for candidate in reversed(_step_dirs(directory)):
        if (why := _damage(candidate)) is None:
            return candidate, skipped
        skipped.append((candidate, why))
    return None, skipped


def _skipped_words(skipped: list[tuple[str, str]]) -> str:
    return "; ".join(f"{os.path.basename(path)}: {why}" for path, why in skipped)


def _step_dirs(directory: str) -> list[str]:
    """Every `step-N` folder in `directory`, oldest first, complete or not (a rename made each: only damage, or a
    hand, can have left one incomplete)."""
    if not os.path.isdir(directory):
        return []
    found = sorted((int(m.group(1)), name) for name in os.listdir(directory) if (m := STEP_DIR.match(name)))
    return [os.path.join(directory, name) for _, name in found]


_INTACT: dict[str, tuple] = {}  # checkpoint -> the sizes and mtimes of its files when they were last verified


def _damage(path: str) -> str | None:
    """Why the checkpoint at `path` cannot be trusted, in a few words naming the file, or None when each file its
    `lab.json` lists has the size and sha256 it had when written. The files are hashed in threads (hashlib
    releases the GIL); a checkpoint verified before, unchanged since, is not read again (ranks forked after the
    launcher's check inherit its verdicts)."""
    try:
        files = _lab_info(path).get("files")
    except CheckpointError as err:
        return str(err)
    if files is None:  # written before lab recorded checksums: nothing to check against
        return None if os.path.exists(os.path.join(path, ".metadata")) else ".metadata is missing"
    if not files:
        return f"{LAB_FILE} lists no files"
    stats = {}
    for name, want in files.items():
        try:
            stats[name] = os.stat(os.path.join(path, name))
        except FileNotFoundError:
            return f"{name} is missing"
        if stats[name].st_size != want["bytes"]:
            return f"{name} has {stats[name].st_size:,} bytes, {want['bytes']:,} were written"
    signature = tuple((name, st.st_size, st.st_mtime_ns) for name, st in sorted(stats.items()))
    if _INTACT.get(path) == signature:
        return None
    with ThreadPoolExecutor(max_workers=min(8, len(files) or 1)) as pool:
        digests = dict(zip(files, pool.map(_sha256, [os.path.join(path, name) for name in files]), strict=True))
    for name, want in files.items():
        if digests[name] != want["sha256"]:
            return f"{name} is corrupt: its sha256 differs from the one recorded when it was written"
    _INTACT[path] = signature
    return None


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _lab_info(path: str) -> dict:
    """The checkpoint's `lab.json`, or a CheckpointError saying, in a few words, what is wrong with it."""
    try:
        with open(os.path.join(path, LAB_FILE)) as f:
            info = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{LAB_FILE} is missing (the manifest a save writes last)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{LAB_FILE} is not valid JSON ({err})") from None
    if not isinstance(info, dict) or not {"step", "layout", "world", "config"} <= info.keys():
        raise CheckpointError(f"{LAB_FILE} lacks step, layout, world or config")
    return info


def resume_from(directory: str, config, fresh: bool = False, move_damaged: bool = True) -> tuple[str | None, str]:
    """The checkpoint `--resume` loads and the line that says so. Refuses (CheckpointError) when step folders
    exist but none is intact, unless `fresh` (a run resubmitted with `--resume` would otherwise throw its work
    away without a word), and when the checkpoint is another experiment's (`compatibility`). Damaged checkpoints
    it skips are moved aside to `.damaged-step-N`: left in place, `--keep` would count them as the newest and
    delete the good ones, and the next resume would skip them again (`move_damaged=False`: a check only)."""
    path, skipped = _newest_intact_and_skipped(directory)
    if path is None and skipped and not fresh:
        raise CheckpointError(f"no intact checkpoint in {directory} to resume from ({_skipped_words(skipped)}); "
                              f"pass --fresh to start from step 0 anyway, or restore a good copy")
    compatible = compatibility(path, config) if path is not None else ""
    for damaged, _ in skipped if move_damaged else []:
        aside = os.path.join(directory, ".damaged-" + os.path.basename(damaged))
        shutil.rmtree(aside, ignore_errors=True)
        os.rename(damaged, aside)
    moved = f"; moved aside to .damaged-step-*{' (--fresh)' if path is None else ''}" if move_damaged and skipped \
        else ""
    return path, _resume_line(directory, path, skipped, moved) + compatible


def check_resume(options: CheckpointOptions | None, config) -> None:
    """What `--resume` will refuse, refused before any rank starts (one line, exit 2, not a rank's traceback)."""
    if options is not None and options.resume:
        resume_from(options.dir, config, options.fresh, move_damaged=False)  # rank 0 moves them, and says so


def _leaves(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        out.update(_leaves(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return out


def compatibility(path: str, config) -> str:
    """What this run changes from the checkpoint's run, with its consequence ("" when nothing: the layout is
    `resume_note`'s); a CheckpointError naming each differing field and tensor when it is another model,
    precision or data stream."""
    info = _lab_info(path)  # intact: `newest` checked it
    saved, now, step = _leaves(info["config"]), _leaves(config.to_dict()), info["step"]
    changed = {k: (saved[k], now[k]) for k in now if k in saved and saved[k] != now[k] and k != "model.name"}
    refused = [k for k in changed if k.startswith(MUST_MATCH)]
    if refused:
        fields = ", ".join(f"{k} {changed[k][0]}->{changed[k][1]}" for k in refused)
        raise CheckpointError(f"{path} is another experiment's: this run changes {fields}{_tensor_diff(path, config)}"
                              f"; a resume may change only the layout, steps, lr schedule, global batch and "
                              f"training knobs (weight decay, clipping, kernels): point --checkpoint-dir at a new "
                              f"directory for a new experiment")
    allowed = [k for k in changed if not k.startswith("parallel.") or k.removeprefix("parallel.")
               not in layout_of(config.parallel)]
    if not allowed:
        return ""
    schedule = [k for k in allowed if k in SCHEDULE]
    parts = [", ".join(f"{k} {changed[k][0]}->{changed[k][1]}" for k in schedule)
             + f" (the lr schedule is recomputed from them: from step {step + 1} the lr follows the new one)"
             ] if schedule else []
    if "train.global_batch" in allowed:
        parts.append(f"train.global_batch {changed['train.global_batch'][0]}->{changed['train.global_batch'][1]} "
                     f"(from step {step + 1} each step reads {changed['train.global_batch'][1]} sequences, not the "
                     f"ones the saved run would have read; the lr is not rescaled)")
    parts += [f"{k} {changed[k][0]}->{changed[k][1]}" for k in allowed
              if k not in SCHEDULE and k != "train.global_batch"]
    return f"; this run changes {', '.join(parts)}"


def _tensor_diff(path: str, config) -> str:
    """The model tensors only the checkpoint has, only this model needs, or of another shape: a count and the
    first one of each."""
    from lab.model import build_model

    with torch.device("meta"):
        model = build_model(config.model)
    need = {f"model.{name}": tuple(p.shape) for name, p in model.named_parameters()}
    have = {k: tuple(md.size) for k, md in _read_metadata(path).state_dict_metadata.items()
            if k.startswith("model.") and isinstance(md, TensorStorageMetadata)}
    parts = []
    for what, keys in (("only in the checkpoint", sorted(have.keys() - need.keys())),
                       ("missing from it", sorted(need.keys() - have.keys())),
                       ("of another shape", sorted(k for k in need.keys() & have.keys() if need[k] != have[k]))):
        if keys:
            shape = f" {have[keys[0]]} vs {need[keys[0]]}" if what == "of another shape" else ""
            parts.append(f"{len(keys)} tensor(s) {what} (first: {keys[0]}{shape})")
    return f" ({'; '.join(parts)})" if parts else ""


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
    try:
        saved_world = _lab_info(path)["world"]
    except CheckpointError as err:
        raise CheckpointError(f"{path}: {err}") from None
    world = dist.get_world_size() if dist.is_initialized() else 1
    rng_key = f"rng.rank{_rank()}"
    if saved_world == world:
        state[rng_key] = torch.get_rng_state()
    with _quiet_single_process():
        try:
            dcp.load(state, storage_reader=dcp.FileSystemReader(path), planner=_BoxLoadPlanner(boxes),
                     no_dist=not dist.is_initialized())
        except CheckpointException as err:  # a file changed after it was verified, or a model that does not fit
            raise CheckpointError(f"could not load {path}: {_cause(err)}") from None
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
        note += "; each dp rank now reads other rows of each global batch"
    return note


def _decided_by_rank_0(decide: Callable[[], tuple]) -> tuple:
    """What rank 0 decides, given to every rank (each rank reading and hashing the same files would multiply the
    I/O by the world size); rank 0's CheckpointError is raised on every rank."""
    result: list = [None]
    if _rank() == 0:
        try:
            result = [decide()]
        except CheckpointError as err:
            result = [err]
    if dist.is_initialized():
        dist.broadcast_object_list(result, src=0)
    if isinstance(result[0], CheckpointError):
        raise result[0]
    return result[0]


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
        path, note = _decided_by_rank_0(lambda: resume_from(self.options.dir, self.config, self.options.fresh))
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
        raise CheckpointError(f"{path} is not a complete checkpoint (no .metadata); {_newest_intact(path)}")
    try:
        return dcp.FileSystemReader(path).read_metadata()
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, IndexError, ValueError) as err:
        raise CheckpointError(f"{path}: .metadata is unreadable ({type(err).__name__}: {err}); "
                              f"{_newest_intact(path)}") from None


def _newest_intact(path: str) -> str:
    """The newest intact checkpoint beside `path` (or in it, when it is a directory of checkpoints), as words."""
    others = [p for p in _step_dirs(path) or _step_dirs(os.path.dirname(os.path.abspath(path)))
              if os.path.abspath(p) != os.path.abspath(path)]
    good = next((p for p in reversed(others) if _damage(p) is None), None)
    return f"the newest intact checkpoint is {good}" if good else "no intact checkpoint is left beside it"


def inspect(path: str) -> str:
    """What a checkpoint holds: its step, the layout that wrote it, each tensor's full shape, dtype and bytes,
    and whether its files are intact (a CheckpointError naming the damaged file and the step when not)."""
    if not os.path.exists(os.path.join(path, LAB_FILE)):
        _read_metadata(path)  # neither it nor .metadata: "not a complete checkpoint"
    try:
        info = _lab_info(path)
    except CheckpointError as err:
        raise CheckpointError(f"{path}: {err}; {_newest_intact(path)}") from None
    if (why := _damage(path)) is not None:
        raise CheckpointError(f"{path} (step {info['step']}) is damaged: {why}; {_newest_intact(path)}")
    metadata = _read_metadata(path)
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
    files = info.get("files")
    verified = (f"{len(files)} files intact (size and sha256 as written)" if files is not None else
                "not verified (saved before lab recorded checksums)")
    lines.append(f"tensors: {total:,} bytes ({total / 1e9:.3f} GB); files on disk: {on_disk:,} bytes, {verified}")
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
    if not any(os.path.exists(os.path.join(path, name)) for name in (".metadata", LAB_FILE)) and _step_dirs(path):
        path = _step_dirs(path)[-1]  # a checkpoint directory: its newest checkpoint (intact or not: say which)
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

