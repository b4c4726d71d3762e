"""A flight recorder for collectives: which rank was in which collective when a run hung.

Most hangs in distributed training are desyncs: one rank calls a different collective than the
others (an `all_gather` where they call `all_reduce`), or does not call it at all (it is stuck in a loop,
or took another branch). Every rank then waits for the others and the run stops without a word, until a
timeout says only "timed out". What the timeout does not say is *where the ranks parted*. So each rank keeps
a ring buffer of its recent collectives, and after a hang the buffers are read side by side:

    rank 3 is in all_gather #41 on tp group; ranks 0–2 are in all_reduce #41 on tp group
    rank 1 is not in a collective (its last: all_reduce #40 on dp group); ranks 0, 2, 3 are in all_reduce #41
    on dp group

Each entry holds a sequence number counted per process group (the 41st collective this rank issued on that
group: every member must issue the same 41st), the op, the group (named by `Mesh`: tp, dp, pp, cp, ep, ...;
"world" for the default group), shapes and dtype, and a state: "entered" while the call runs, "finished"
once it returned, "failed" if it raised (a collective that timed out). A rank blocked inside #41 therefore
reads as "is in all_reduce #41". Point-to-point ops are counted per direction of a pair of ranks (rank 0's
send #3 to rank 1 matches rank 1's recv #3 from rank 0; rank 1's sends to rank 0 are counted apart).
`diagnose(buffers)` finds, per group, the first sequence number at which the members differ, and says who
is where; it is a pure function of the buffers.

How it records. `lab` calls collectives as `dist.all_reduce(...)`, looking the function up on
`torch.distributed` at call time, so `start()` replaces those functions with recording wrappers (as
`count_collectives` does for counting). Collectives that torch issues internally (DDP's reducer, FSDP2,
DTensor, functional collectives) are not seen. An async op (`async_op=True`, isend/irecv) is marked finished
when its future completes, where the backend gives one (gloo does for collectives, not for isend/irecv: those
stay "issued"). The wrapper costs 5-10 us per call (measured against a no-op on a 2-core CPU shared with other
jobs, where a 1-float gloo all_reduce took 100-800 us): noise next to collectives that move megabytes.

Where the buffer lives. A rank stuck in a collective is blocked in C++: a Python signal handler would not
run until the call returns, and a watcher thread would need the rank's cooperation. So the ring is an
mmap'd file (`rank<R>.flight`, fixed-size records) that the rank writes into: the launcher reads it with
no help from the rank, while it hangs, after it was SIGKILLed, or after the whole job died.

Progress. The header also holds a counter the rank bumps whenever it makes progress: each collective that
finishes, and each call of `heartbeat()` (lab.train calls it once a step). `lab.distributed.run` reads it
(`progress`) to tell a hung rank from a slow one: a rank whose counter stands still for `hang_timeout_s` is hung,
however long the run has lasted before.

Use. `lab.distributed.run` records always, and its RankTimeout / RankError message carries the diagnosis
line. By hand, in a notebook or a script, with any launcher:

    from lab.distributed import flight
    flight.start("/tmp/flight")         # in every rank, before its first collective
    ...                                 # train; the run hangs and is killed
    print(flight.report("/tmp/flight")) # anywhere afterwards: the diagnosis and each rank's last entries

Under torchrun, run `LAB_FLIGHT_DIR=/shared/flight torchrun ...` with `flight.start_from_env()` at the top
of the script (it does nothing when the variable is not set); after a hang, `python -m lab.distributed.flight
/shared/flight` prints the report (on several nodes, copy every node's files into one directory first).

On NCCL a collective returns as soon as its kernel is queued on the GPU, so "finished" here means "queued":
the desync (a different op, or a missing rank, at the same sequence number) is still found, but only
torch's own Flight Recorder knows what completed on the GPU. Turn it on with
`TORCH_NCCL_TRACE_BUFFER_SIZE=2000 TORCH_NCCL_DUMP_ON_TIMEOUT=1 TORCH_FR_DUMP_TEMP_FILE=/tmp/fr/nccl_trace_rank_`
(make /tmp/fr first; torch 2.13 also reads the buffer size as TORCH_FR_BUFFER_SIZE, its newer name); after
a timeout, every rank dumps its trace there, and
`python -m torch.distributed.flight_recorder.fr_trace /tmp/fr -p nccl_trace_rank_` (also installed as
`torchfrtrace`) reports the first mismatched collective; add `-j` to print each rank's entries.
"""

from __future__ import annotations

import functools
import inspect
import mmap
import os
import struct
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from lab.distributed.comm import PAYLOAD_ARGUMENT, _P2POp

ENV_DIR = "LAB_FLIGHT_DIR"
NCCL_HINT = ("on NCCL, torch's Flight Recorder also knows what completed on the GPU: run with "
             "TORCH_NCCL_TRACE_BUFFER_SIZE=2000 TORCH_NCCL_DUMP_ON_TIMEOUT=1 "
             "TORCH_FR_DUMP_TEMP_FILE=/tmp/fr/nccl_trace_rank_ (mkdir /tmp/fr first), then read the dumps with "
             "python -m torch.distributed.flight_recorder.fr_trace /tmp/fr -p nccl_trace_rank_ [-j]")
STATES = ("entered", "finished", "failed", "issued")  # issued: async, and the backend gives no completion
_FINISHED, _FAILED, _ISSUED = 1, 2, 3  # their codes in the file
OPS = tuple(PAYLOAD_ARGUMENT)
_P2P = ("send", "recv", "isend", "irecv")
_SENDS = (OPS.index("send"), OPS.index("isend"))
_SAME_SHAPE = ("all_reduce", "broadcast", "reduce")  # ops whose tensor must be the same on every member

# The file: a header, a table of the groups seen, then `capacity` fixed-size records used as a ring.
_MAGIC = b"LABFLT01"
_HEADER = struct.Struct("<8siiiiQ16s")  # magic, rank, world size, capacity, groups, records written, backend
_WORLD_AT, _GROUPS_N_AT, _COUNT_AT, _BACKEND_AT = 12, 20, 24, 32  # offsets of header fields written later
_PROGRESS = struct.Struct("<Q")  # after the header: how often the rank made progress (`heartbeat`)
_PROGRESS_AT = _HEADER.size
_GROUP = struct.Struct("<16s32s208s")  # torch's group id, description (tp, dp, ...), ranks as start:stop:step runs
_MAX_GROUPS = 256
_GROUPS_AT = 4096
# seq, start, end, group slot, op, state, peer (-1: none), dtype, dims, tensors in a list (0: one tensor), shape
_RECORD = struct.Struct("<qddhBBiBBH6q12x")
_END_AT, _STATE_AT = 16, 27  # offsets of `end` and `state` in a record
_MAX_DIMS, _NO_DIMS = 6, (0,) * 6
_DTYPES = ("", "float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool",
           "complex64", "float8_e4m3fn", "float8_e5m2", "other")  # the dtype's code is its index; "": no tensor
_DTYPE_CODES = {getattr(torch, name): code for code, name in enumerate(_DTYPES) if name and hasattr(torch, name)}
_RING_AT = _GROUPS_AT + _MAX_GROUPS * _GROUP.size


@dataclass(frozen=True)
class Entry:
    """One collective as a rank issued it: its `seq`-th on `group` (`ranks` are the group's global ranks).

    `state` is one of STATES; `peer` is the other rank of a point-to-point op (None for collectives);
    `start`/`end` are wall-clock times (time.time()); `group_id` is torch's id of the group, which tells
    apart two groups with the same name and ranks (empty in hand-made entries: name and ranks are the key).
    """

    seq: int
    op: str
    group: str
    ranks: tuple[int, ...]
    state: str = "finished"
    shapes: str = ""
    dtype: str = ""
    peer: int | None = None
    start: float = 0.0
    end: float = 0.0
    group_id: str = ""


# --- recording (the rank side) -------------------------------------------------------------------------

def _runs(ranks: list[int]) -> str:
    """[0, 1, 2, 3, 8, 10] -> "0:4:1,8:12:2": a group's ranks as arithmetic runs, so that big groups fit."""
    runs, i = [], 0
    while i < len(ranks):
        step = ranks[i + 1] - ranks[i] if i + 1 < len(ranks) else 1
        j = i + 1
        while j < len(ranks) and ranks[j] - ranks[j - 1] == step:
            j += 1
        runs.append(f"{ranks[i]}:{ranks[j - 1] + step}:{step}")
        i = j
    return ",".join(runs)


def _unruns(text: str) -> tuple[int, ...]:
    return tuple(r for run in text.split(",") if run for r in range(*map(int, run.split(":"))))


def _payload(value) -> tuple[int, ...]:
    """The record's dtype code, dims, tensors in the list (0: a tensor, not a list) and shape, of the tensor a
    rank hands over (of a list, the first one's). Numbers, not text: formatting a shape costs microseconds."""
    count = 0
    if isinstance(value, (list, tuple)):
        count, value = len(value), value[0] if value else None
    if not isinstance(value, torch.Tensor):
        return (0, 0, count, *_NO_DIMS)
    shape = value.shape
    return (_DTYPE_CODES.get(value.dtype, len(_DTYPES) - 1), len(shape), count, *shape[:_MAX_DIMS],
            *_NO_DIMS[len(shape):])


def _shape_text(ndim: int, count: int, dims: tuple[int, ...]) -> str:
    shape = str(list(dims[:ndim])) if ndim <= _MAX_DIMS else str(list(dims))[:-1] + ", ...]"
    return f"{count}x{shape}" if count else shape


class _Recorder:
    """Writes this rank's entries into its mmap'd file; one per process, made by `start`."""

    def __init__(self, path: Path, rank: int, capacity: int) -> None:
        self.path, self.capacity, self.count, self.progress = path, capacity, 0, 0
        with open(path, "wb") as file:
            file.truncate(_RING_AT + capacity * _RECORD.size)
        self.file = open(path, "r+b")
        self.mm = mmap.mmap(self.file.fileno(), 0)
        _HEADER.pack_into(self.mm, 0, _MAGIC, rank, 0, capacity, 0, 0, b"")
        self.slots: dict = {}  # process group -> its slot in the group table
        self.seqs: dict = {}  # slot, or (slot, is a send, peer) for point-to-point -> last sequence number

    def slot(self, group) -> int:
        group = dist.group.WORLD if group is None else group
        slot = self.slots.get(group)
        if slot is None:
            slot = self.slots[group] = len(self.slots)
            if slot < _MAX_GROUPS:
                self.describe(group, slot)
        return slot

    def describe(self, group, slot: int) -> None:
        """Write a group into the table: torch's id for it, its name, its global ranks."""
        world = group is dist.group.WORLD
        desc = getattr(group, "group_desc", "")
        name = "world" if world else "" if desc in ("undefined", "") else desc
        _GROUP.pack_into(self.mm, _GROUPS_AT + slot * _GROUP.size, group.group_name.encode()[:16],
                         name.encode()[:32], _runs(dist.get_process_group_ranks(group)).encode()[:208])
        struct.pack_into("<i", self.mm, _GROUPS_N_AT, slot + 1)
        if world:
            struct.pack_into("<i", self.mm, _WORLD_AT, dist.get_world_size())
            struct.pack_into("<16s", self.mm, _BACKEND_AT, dist.get_backend().encode()[:16])

    def enter(self, op: int, group, peer: int | None, payload) -> int:
        """Write a new entry ("entered") for op `OPS[op]`; returns its place in the ring, for `end`."""
        slot = self.slot(group)
        key = slot if peer is None else (slot, op in _SENDS, peer)
        seq = self.seqs[key] = self.seqs.get(key, 0) + 1
        index = self.count % self.capacity
        _RECORD.pack_into(self.mm, _RING_AT + index * _RECORD.size, seq, time.time(), 0.0, min(slot, _MAX_GROUPS),
                          op, 0, -1 if peer is None else peer, *_payload(payload))
        self.count += 1
        struct.pack_into("<Q", self.mm, _COUNT_AT, self.count)  # after the record: a kill never shows half of one
        return index

    def end(self, index: int, state: int) -> None:
        offset = _RING_AT + index * _RECORD.size
        struct.pack_into("<d", self.mm, offset + _END_AT, time.time())
        self.mm[offset + _STATE_AT] = state
        if state == _FINISHED:
            self.beat()

    def beat(self) -> None:
        """Count one more piece of progress. Async ops finish on a backend thread: an increment lost to a race
        still changes the counter, which is all the reader looks at."""
        self.progress += 1
        _PROGRESS.pack_into(self.mm, _PROGRESS_AT, self.progress)

    def watch(self, index: int, work) -> None:
        """Mark an async op finished (or failed) when its future completes, if the backend gives one."""
        try:
            future = work.get_future()
        except RuntimeError:  # e.g. gloo's isend/irecv: completion stays unknown
            self.end(index, _ISSUED)
            return
        future.then(functools.partial(self._finished, index))

    def _finished(self, index: int, future) -> None:
        try:
            future.value()
        except Exception:  # the op failed (e.g. timed out)
            self.end(index, _FAILED)
        else:
            self.end(index, _FINISHED)


_recorder: _Recorder | None = None
_saved: dict[str, Callable] = {}
# op -> its parameter names, to map positional arguments to names cheaply (inspect's bind costs ~10 us)
_PARAMETERS = {op: tuple(inspect.signature(getattr(dist, op)).parameters) for op in OPS if hasattr(dist, op)}


def _argument(op: str, name: str) -> Callable:
    """A getter for argument `name` of `dist.<op>`, given either way (positionally or by keyword); None if absent.
    Cheaper than binding the signature (inspect's bind costs ~10 us, a dict of all arguments ~2 us)."""
    parameters = _PARAMETERS[op]
    if name not in parameters:
        return lambda args, kwargs: None
    at = parameters.index(name)
    return lambda args, kwargs: args[at] if len(args) > at else kwargs.get(name)


def _recording(op: str, original: Callable) -> Callable:
    code, p2p, waits = OPS.index(op), op in _P2P, op in ("isend", "irecv")
    group, async_op = _argument(op, "group"), _argument(op, "async_op")
    payload = _argument(op, PAYLOAD_ARGUMENT[op] or "")
    end = "dst" if "send" in op else "src"
    peer, group_peer = _argument(op, end), _argument(op, f"group_{end}")

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        recorder = _recorder
        if recorder is None or not dist.is_initialized():  # torch says what is wrong with the call
            return original(*args, **kwargs)
        on = group(args, kwargs)
        other = None
        if p2p:  # the global rank at the other end: `dst`/`src`, or `group_dst`/`group_src` within the group
            other = peer(args, kwargs)
            if other is None:
                local = group_peer(args, kwargs)
                other = local if on is None or local is None else dist.get_global_rank(on, local)
        index = recorder.enter(code, on, other, payload(args, kwargs))
        try:
            result = original(*args, **kwargs)
        except BaseException:
            recorder.end(index, _FAILED)
            raise
        if result is not None and (waits or async_op(args, kwargs)):
            recorder.watch(index, result)
        else:
            recorder.end(index, _FINISHED)
        return result

    return wrapper


def _recording_batch(original: Callable) -> Callable:
    @functools.wraps(original)
    def wrapper(p2p_op_list):
        recorder = _recorder
        if recorder is None or not dist.is_initialized():
            return original(p2p_op_list)
        indices = [recorder.enter(OPS.index(p2p.op.__name__), p2p.group, p2p.peer, p2p.tensor) for p2p in p2p_op_list]
        try:
            works = original(p2p_op_list)
        except BaseException:
            for index in indices:
                recorder.end(index, _FAILED)
            raise
        for n, index in enumerate(indices):  # NCCL gives one work for the whole batch, gloo one per op
            if len(works) == len(indices):
                recorder.watch(index, works[n])
            else:
                recorder.end(index, _ISSUED)
        return works

    return wrapper


def start(directory: str | os.PathLike, rank: int | None = None, capacity: int = 1024) -> Path:
    """Record this process's collectives into `directory/rank<R>.flight` (a ring of the last `capacity`).

    `rank` defaults to $RANK (set by torchrun and lab's launcher). Call it before the first collective, in
    every rank; calling it again starts a fresh file. Returns the file's path."""
    global _recorder
    rank = int(os.environ.get("RANK", 0)) if rank is None else rank
    if not isinstance(capacity, int) or capacity < 1:
        raise ValueError(f"capacity={capacity!r} must be an integer >= 1")
    stop()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    _recorder = _Recorder(file_path(directory, rank), rank, capacity)
    for op in _PARAMETERS:
        _saved[op] = getattr(dist, op)
        setattr(dist, op, _recording(op, _saved[op]))
    _saved["batch_isend_irecv"], _saved["P2POp"] = dist.batch_isend_irecv, dist.P2POp
    dist.batch_isend_irecv, dist.P2POp = _recording_batch(dist.batch_isend_irecv), _P2POp
    return _recorder.path


def file_path(directory: str | os.PathLike, rank: int) -> Path:
    """Where rank `rank` records into, under `directory`."""
    return Path(directory) / f"rank{rank}.flight"


def heartbeat() -> None:
    """Tell whoever watches this rank (`lab.distributed.run`) that it made progress: call it where work that
    issues no collective finishes a piece (lab.train: every step). Does nothing when this rank does not record."""
    if _recorder is not None:
        _recorder.beat()


def start_from_env() -> Path | None:
    """`start($LAB_FLIGHT_DIR)` if that variable is set (the torchrun path); else do nothing and return None."""
    return start(os.environ[ENV_DIR]) if os.environ.get(ENV_DIR) else None


def stop() -> None:
    """Stop recording and put torch.distributed's functions back (the file stays, for `read`)."""
    global _recorder
    for name, original in _saved.items():
        setattr(dist, name, original)
    _saved.clear()
    if _recorder is not None:
        _recorder.mm.close()
        _recorder.file.close()
        _recorder = None


# --- reading and diagnosing (the launcher side) ---------------------------------------------------------

def read_file(path: str | os.PathLike) -> tuple[int, list[Entry], str]:
    """(rank, its retained entries oldest first, backend) from one rank's file."""
    data = Path(path).read_bytes()
    magic, rank, _, capacity, n_groups, count, backend = _HEADER.unpack_from(data)
    if magic != _MAGIC:
        raise ValueError(f"{path} is not a flight-recorder file (it starts with {magic!r})")
    groups = []
    for slot in range(min(n_groups, _MAX_GROUPS)):
        group_id, name, runs = (field.rstrip(b"\0").decode() for field in _GROUP.unpack_from(
            data, _GROUPS_AT + slot * _GROUP.size))
        ranks = _unruns(runs)
        groups.append((group_id, name or f"group {list(ranks)}", ranks))
    entries = []
    for n in range(max(0, count - capacity), count):
        seq, t0, t1, slot, op, state, peer, dtype, ndim, tensors, *dims = _RECORD.unpack_from(
            data, _RING_AT + (n % capacity) * _RECORD.size)
        group_id, name, ranks = groups[slot] if slot < len(groups) else ("", "an unrecorded group", ())
        shapes = _shape_text(ndim, tensors, tuple(dims)) if dtype else ""
        entries.append(Entry(seq, OPS[op], name, ranks, STATES[state], shapes, _DTYPES[dtype],
                             None if peer < 0 else peer, t0, t1, group_id))
    return rank, entries, backend.rstrip(b"\0").decode()


def progress(path: str | os.PathLike) -> int | None:
    """A rank's progress counter (see `heartbeat`), read from its file with no help from the rank; None while
    the file is not written yet (the rank is starting)."""
    try:
        with open(path, "rb") as file:
            head = file.read(_PROGRESS_AT + _PROGRESS.size)
    except FileNotFoundError:
        return None
    return _PROGRESS.unpack_from(head, _PROGRESS_AT)[0] if len(head) == _PROGRESS_AT + _PROGRESS.size else None


def read_all(directory: str | os.PathLike) -> tuple[dict[int, list[Entry]], bool]:
    """Every rank's entries from the rank<R>.flight files in `directory`, by rank, and whether any rank ran on
    NCCL (where torch's own Flight Recorder knows more: `NCCL_HINT`)."""
    read_back = [read_file(path) for path in sorted(Path(directory).glob("rank*.flight"))]
    return {rank: entries for rank, entries, _ in read_back}, any(backend == "nccl" for *_, backend in read_back)


def read(directory: str | os.PathLike) -> dict[int, list[Entry]]:
    """Every rank's entries from the rank<R>.flight files in `directory`, by rank."""
    return read_all(directory)[0]


def _ranks_text(ranks: Iterable[int]) -> str:
    """[3] -> "rank 3"; [0, 1, 2] -> "ranks 0–2"; [0, 2, 3] -> "ranks 0, 2, 3"."""
    ranks = sorted(ranks)
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}–{ranks[-1]}"
    return "ranks " + ", ".join(map(str, ranks))


def _where(entry: Entry) -> str:
    """"all_reduce #41 on tp group", "send #3 to rank 1 on pp group"."""
    group = entry.group if entry.group in ("world",) or entry.group.startswith("group ") else f"{entry.group} group"
    if entry.peer is not None:
        return f"{entry.op} #{entry.seq} {'to' if 'send' in entry.op else 'from'} rank {entry.peer} on {group}"
    return f"{entry.op} #{entry.seq} on {group}"


_VERB = {"entered": ("is in", "are in"), "finished": ("finished", "finished"), "failed": ("failed in", "failed in"),
         "issued": ("issued", "issued")}


def _position(entries: list[Entry]) -> str:
    """Where a rank is now: inside its last call, or outside any collective (and what it did last)."""
    if not entries:
        return "has not issued a collective"
    last = entries[-1]
    if last.state in ("entered", "failed"):
        return f"{_VERB[last.state][0]} {_where(last)}"
    return f"is not in a collective (its last: {_where(last)})"


def _stream(entry: Entry, rank: int) -> tuple[tuple, tuple[int, ...]]:
    """(key, members) of the sequence an entry belongs to, whose n-th entries must match on every member: a
    group's collectives, or one direction of a pair's point-to-point ops (rank 0's sends to rank 1 and rank 1's
    receives from rank 0 pair up in order; the other direction is independent of them)."""
    group = (entry.group_id or entry.group, entry.ranks)
    if entry.peer is None:
        return group, entry.ranks
    pair = (rank, entry.peer) if "send" in entry.op else (entry.peer, rank)
    return (group, pair), pair


def _signature(entry: Entry) -> tuple:
    """What must be equal on every member at one sequence number: the op, and the shape and dtype where every
    member hands over the same tensor (all_reduce, broadcast, reduce; a send and its recv)."""
    if entry.peer is not None:
        return ("send/recv", entry.shapes, entry.dtype)
    return (entry.op, entry.shapes, entry.dtype) if entry.op in _SAME_SHAPE else (entry.op,)


def _divergences(buffers: dict[int, list[Entry]]) -> list[tuple[float, str, list[int]]]:
    """(when, one line, the odd ranks out) for every sequence whose members part ways, at the first number where
    they do. The odd ones out are the ranks without the entry, else the smallest party (none on a tie)."""
    streams: dict[tuple, dict[int, dict[int, Entry]]] = {}  # stream -> rank -> seq -> entry
    members: dict[tuple, tuple[int, ...]] = {}
    for rank, entries in buffers.items():
        for entry in entries:
            key, members[key] = _stream(entry, rank)
            streams.setdefault(key, {}).setdefault(rank, {})[entry.seq] = entry
    found = []
    for key, by_rank in streams.items():
        judged = [r for r in members[key] or by_rank if r in buffers]  # a rank that left no file cannot be judged
        first = max(min(seqs) for seqs in by_rank.values())  # the oldest number every buffer still holds
        for seq in range(first, max(max(seqs) for seqs in by_rank.values()) + 1):
            here = {r: by_rank.get(r, {}).get(seq) for r in judged}
            when = min((entry.start for entry in here.values() if entry is not None), default=None)
            if when is None:  # a gap in hand-made buffers
                continue
            # A rank without this entry is behind, unless its ring starts later: the entry may have scrolled out
            here = {r: e for r, e in here.items() if e is not None or not (buffers[r] and buffers[r][0].start > when)}
            kinds: dict[tuple, list[int]] = {}
            for r, entry in here.items():
                if entry is not None:
                    kinds.setdefault(_signature(entry), []).append(r)
            if None in here.values() or len(kinds) > 1:
                parties = sorted(kinds.values(), key=len)
                odd = [r for r, e in here.items() if e is None] or (
                    parties[0] if len(parties[0]) < len(parties[1]) else [])
                found.append((when, _describe(here, kinds, buffers), odd))
                break
    return sorted(found)


def _describe(here: dict[int, Entry | None], kinds: dict[tuple, list[int]], buffers: dict[int, list[Entry]]) -> str:
    """"rank 3 is in all_gather #41 on tp group; ranks 0–2 are in all_reduce #41 on tp group": the ranks without
    this entry first (where they are instead), then the ranks with it, the smallest party first."""
    parts = [f"rank {r} {_position(buffers[r])}" for r, entry in here.items() if entry is None]
    shapes_differ = len(kinds) > 1 and len({signature[0] for signature in kinds}) == 1  # same op, other tensors
    for ranks in sorted(kinds.values(), key=lambda ranks: (len(ranks), ranks)):
        by_state: dict[str, list[int]] = {}
        for r in ranks:
            by_state.setdefault(here[r].state, []).append(r)
        for state, same in by_state.items():
            entry = here[same[0]]
            detail = f" ({entry.dtype} {entry.shapes})" if shapes_differ else ""
            parts.append(f"{_ranks_text(same)} {_VERB[state][len(same) > 1]} {_where(entry)}{detail}")
    return "; ".join(parts)


def diagnose(buffers: dict[int, list[Entry]]) -> str:
    """Say where the ranks' collectives diverged, one line per group that diverged (earliest first), e.g.
    "rank 3 is in all_gather #41 on tp group; ranks 0–2 are in all_reduce #41 on tp group"; or, when every
    group agrees, where each rank is. `buffers` maps each rank to its entries, oldest first (as `read` gives)."""
    if not any(buffers.values()):
        return "no collectives were recorded"
    lines = [line for _, line, _ in _divergences(buffers)]
    if lines:
        return "\n".join(lines)
    where = "; ".join(f"{_ranks_text([r])} {_position(buffers[r])}" for r in sorted(buffers))
    return f"the ranks' collectives agree (no rank issued a different one, none is missing one): {where}"


def culprits(buffers: dict[int, list[Entry]]) -> list[int]:
    """The ranks the first divergence points at: those missing from the collective the others are in, or the
    fewer ranks that called a different one (rank 3 of "rank 3 is in all_gather #41; ranks 0–2 are in
    all_reduce #41"). Empty when the ranks agree, or when two equal parties disagree."""
    found = _divergences(buffers)
    return found[0][2] if found else []


def tail(buffers: dict[int, list[Entry]], n: int = 3) -> str:
    """Each rank's last `n` entries, one per line: the evidence behind `diagnose`."""
    lines = []
    for rank in sorted(buffers):
        lines.append(f"rank {rank}'s last collectives:" if buffers[rank] else f"rank {rank}: none recorded")
        lines += [f"  {_where(e)}: {e.state} {e.dtype} {e.shapes}".rstrip() for e in buffers[rank][-n:]]
    return "\n".join(lines)


def report(directory: str | os.PathLike, n: int = 3) -> str:
    """The diagnosis from the files in `directory`, each rank's last `n` entries, and on NCCL the pointer to
    torch's Flight Recorder."""
    buffers, nccl = read_all(directory)
    if not buffers:
        return f"no flight-recorder files (rank<R>.flight) in {directory}"
    text = f"{diagnose(buffers)}\n{tail(buffers, n)}"
    return f"{text}\n{NCCL_HINT}" if nccl else text


def main(argv: list[str] | None = None) -> None:
    """`python -m lab.distributed.flight DIR [N]`: print the report from DIR (N entries per rank, default 3)."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) not in (1, 2):
        raise SystemExit("usage: python -m lab.distributed.flight DIR [entries per rank]")
    print(report(argv[0], int(argv[1]) if len(argv) == 2 else 3))


if __name__ == "__main__":
    main()
