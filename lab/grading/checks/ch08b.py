"""Chapter 08b, checkpoints and failures. The shards a rank reads when resharding are checked against
`lab.calc.reliability.reads_for` (the regions DCP's load planner reads); the checkpoint interval against Young's
formula and the waste in `lab.calc.reliability`; the diverging rank against a simulated hang; the straggler against
`lab.distributed.health.find_straggler`'s rule on simulated per-rank step times (`reference_straggler`, kept here
so that grading imports no torch; a test holds the two equal); goodput with and without hot spares against
`lab.calc.reliability.restart_goodput` and `hot_spare_goodput`.

Layouts are random (tp degrees that do not divide each other, rows at save and columns at load, dp replicas);
MTBFs, save times and GPU counts span five orders of magnitude, and the `--checkpoint-every` cases put Young's
interval on either side of the nearest whole step. The collective logs come from a simulation: ranks of a dp × tp
mesh run the same program of collectives (sequence numbers counted per group, as NCCL and Flight Recorder count
them) until one rank stops, or calls another op, and every rank that waits on it blocks; each rank's ring buffer
keeps only its newest entries. The check confirms with its own analysis that the simulation names the rank it
broke before asking the student.
"""

from __future__ import annotations

import math
import random
import statistics

from lab.calc.reliability import (
    Restart,
    hot_spare_goodput,
    job_mtbf,
    reads_for,
    restart_goodput,
    shard_box,
    waste,
    young_interval,
)
from lab.grading.checks import CheckFailed, Mistake, exercise, expect_equal, expect_number, explain
from lab.grading.sandbox import CallError


def ask(fn, call: str, expected: str, *args):
    """`fn(*args)`, a function of the student's cell: a call that raised fails the check, saying what was due."""
    try:
        return fn(*args)
    except CallError as error:
        raise explain(error, call, expected) from None


# --- 08b.reshard_reads ----------------------------------------------------------------------------------------------

RESHARD = exercise("08b.reshard_reads", entry=("shards_to_read", "run_shards_to_read"))


def expected_reads(shape: list[int], save: dict, load: dict, rank: int) -> list[dict]:
    """What `rank` of the load layout reads: from the file of the lowest saved rank holding each overlapping box
    (dp coordinate 0: rank t of the save layout holds box t), the region in full-tensor coordinates."""
    saved = [shard_box(shape, save["dim"], save["tp"], t) for t in range(save["tp"])]
    wanted = shard_box(shape, load["dim"], load["tp"], rank % load["tp"])
    return [{"writer": t, "read": [list(offsets), list(sizes)]} for t, (offsets, sizes) in reads_for(saved, wanted)]


def _plain(value):
    """Tuples as lists, the way JSON brings an answer back."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def random_shape(rng: random.Random, *degrees: int) -> list[int]:
    """A 2-D weight whose both dimensions every degree divides, not much more."""
    unit = math.lcm(*degrees)
    return [unit * rng.randrange(1, 4), unit * rng.randrange(1, 4)]


def _expect_reads(student, shape: list[int], save: dict, load: dict, ranks: list[int]) -> None:
    call = f"run_shards_to_read({shape}, save={save}, load={load}, ranks={ranks})"
    got = ask(student.run_shards_to_read, call, "the slices each rank reads", shape, save, load, ranks)
    if not isinstance(got, dict) or not isinstance(got.get("reads"), list) or len(got["reads"]) != len(ranks):
        raise CheckFailed(f"{call} returned {got!r:.200}, expected the driver's dict with one list per rank")
    for rank, reads in zip(ranks, got["reads"], strict=True):
        expected = expected_reads(shape, save, load, rank)
        if _plain(reads) != expected:
            raise CheckFailed(f"{call}: rank {rank} returned {_plain(reads)!r:.300}, expected {expected}")


@RESHARD.check(points=1, hint="two slices overlap when each starts before the other ends: a slice that ends exactly "
                              "where another starts shares no element and must not be read")
def same_dimension_other_degree(student, rng):
    """the same dimension cut at another degree: the saved slices a rank's slice overlaps, none it only touches"""
    for save_tp, load_tp in ((2, 4), (4, 2), (rng.choice([2, 3]), rng.choice([3, 4])), (rng.choice([3, 4]), 6)):
        dim = rng.randrange(2)
        save, load = {"dp": 1, "tp": save_tp, "dim": dim}, {"dp": 1, "tp": load_tp, "dim": dim}
        _expect_reads(student, random_shape(rng, save_tp, load_tp), save, load, list(range(load_tp)))


@RESHARD.check(points=1, hint="a slice of rows and a slice of columns cross in a rectangle: the rows of the one, the "
                              "columns of the other; intersect each dimension separately")
def rows_to_columns(student, rng):
    """saved cut along rows, loaded cut along columns (and back): the rectangles where the slices cross"""
    for save_dim in (0, 1):
        save_tp, load_tp = rng.choice([2, 3, 4]), rng.choice([2, 3, 4, 8])
        save, load = {"dp": 1, "tp": save_tp, "dim": save_dim}, {"dp": 1, "tp": load_tp, "dim": 1 - save_dim}
        _expect_reads(student, random_shape(rng, save_tp, load_tp), save, load, list(range(load_tp)))


@RESHARD.check(points=1, hint="tp varies fastest in the rank numbering; the dp replicas of a slice wrote it once, "
                              "from the first of them")
def dp_replicas_written_once(student, rng):
    """dp replicas: a rank holds slice rank % tp, read from the lowest saved rank that held each slice"""
    for _ in range(3):
        save = {"dp": rng.choice([2, 3, 4]), "tp": rng.choice([1, 2, 3, 4]), "dim": rng.randrange(2)}
        load = {"dp": rng.choice([2, 3]), "tp": rng.choice([2, 4, 6]), "dim": rng.randrange(2)}
        world = load["dp"] * load["tp"]
        ranks = sorted(rng.sample(range(load["tp"], world), min(4, world - load["tp"])))  # dp coordinates > 0
        _expect_reads(student, random_shape(rng, save["tp"], load["tp"]), save, load, ranks)


@RESHARD.check(points=1, hidden=True, hint="nothing may depend on the tensor being small")
def llama3_70b_ffn(student, rng):
    """Llama 3 70B's FFN weight (28,672 x 8,192): tp8 column-parallel to tp4, and to tp8 row-parallel"""
    shape = [28672, 8192]
    for load in ({"dp": 2, "tp": 4, "dim": 0}, {"dp": 1, "tp": 8, "dim": 1}):
        _expect_reads(student, shape, {"dp": 4, "tp": 8, "dim": 0}, load, sorted(rng.sample(range(load["dp"] *
                                                                                               load["tp"]), 3)))


# --- 08b.checkpoint_interval ----------------------------------------------------------------------------------------

INTERVAL = exercise("08b.checkpoint_interval", entry=("checkpoint_interval", "expected_waste", "checkpoint_every"))


def random_run(rng: random.Random) -> tuple[float, int, float]:
    """(seconds a save blocks, GPUs, a GPU's MTBF in seconds): async saves to slow synchronous ones, 8 to 100k GPUs,
    GPUs failing every year to every ten."""
    save_s = 10 ** rng.uniform(-1.5, 2.5)
    gpus = rng.choice([8, 64, 512, 2048, 16384, 98304]) * rng.choice([1, 3])
    return save_s, gpus, rng.uniform(1, 10) * 365 * 86400


@INTERVAL.check(points=1, hint="any of the N GPUs stops a synchronous job, so the job fails more often than one GPU; "
                               "Young's interval balances saving against redoing")
def young_interval_of_a_cluster(student, rng):
    """Young's interval sqrt(2·C·M), with the job's MTBF M = the GPU's MTBF / the number of GPUs"""
    for _ in range(5):
        save_s, gpus, gpu_mtbf_s = random_run(rng)
        expected = young_interval(save_s, job_mtbf(gpus, gpu_mtbf_s))
        mistakes = (Mistake(1 / math.sqrt(2), "1/sqrt(2)", "check Young's interval's constant: a failure loses half "
                                                           "an interval on average"),
                    Mistake(math.sqrt(gpus), "sqrt(gpus)", "the job fails N times as often as one GPU: divide the "
                                                           "GPU's MTBF by the number of GPUs"))
        call = f"checkpoint_interval(save_s={save_s!r}, gpus={gpus}, gpu_mtbf_s={gpu_mtbf_s!r})"
        got = ask(student.checkpoint_interval, call, f"{expected:.6g} s", save_s, gpus, gpu_mtbf_s)
        expect_number(got, expected, call, tol=1e-6, mistakes=mistakes)


@INTERVAL.check(points=1, hint="the waste has two parts: time spent saving, and work redone after a failure (which "
                               "strikes on average half-way through an interval)")
def waste_at_an_interval(student, rng):
    """the expected waste C/τ + τ/(2M) at intervals around, below and above the optimum"""
    for factor in (1.0, rng.uniform(0.05, 0.5), rng.uniform(2, 20)):
        save_s, gpus, gpu_mtbf_s = random_run(rng)
        mtbf_s = job_mtbf(gpus, gpu_mtbf_s)
        interval_s = factor * young_interval(save_s, mtbf_s)
        expected = waste(interval_s, save_s, mtbf_s)
        call = f"expected_waste(interval_s={interval_s!r}, save_s={save_s!r}, gpus={gpus}, gpu_mtbf_s={gpu_mtbf_s!r})"
        got = ask(student.expected_waste, call, f"{expected:.6g}", interval_s, save_s, gpus, gpu_mtbf_s)
        expect_number(got, expected, call, tol=1e-6,
                      mistakes=(Mistake(2.0, "2", "a failure strikes on average half-way through an interval: "
                                                 "τ/(2M) of the work is redone, not τ/M"),))


def _every_case(rng: random.Random, ceil_wins: bool) -> tuple[float, float, int, float]:
    """(step_s, save_s, gpus, gpu_mtbf_s) whose best whole number of steps is the ceiling (or the floor) of Young's
    interval over the step, not the nearest one."""
    while True:
        save_s, gpus, gpu_mtbf_s = random_run(rng)
        tau = young_interval(save_s, job_mtbf(gpus, gpu_mtbf_s))
        k = rng.randrange(1, 40)
        # τ*/step = k + f. The waste, w*·(x + 1/x)/2 at x = τ/τ*, rises slower above τ* than below: the ceiling
        # wins from f = sqrt(k(k+1)) − k (0.41 to 0.5) on, so a nearest-step rounding misses f just under 1/2
        f = rng.uniform(0.4, 0.5) if ceil_wins else rng.uniform(0.1, 0.35)
        step_s = tau / (k + f)
        mtbf_s = job_mtbf(gpus, gpu_mtbf_s)
        lo, hi = waste(k * step_s, save_s, mtbf_s), waste((k + 1) * step_s, save_s, mtbf_s)
        if (hi < lo) == ceil_wins and abs(hi - lo) > 1e-9 * lo:
            return step_s, save_s, gpus, gpu_mtbf_s


@INTERVAL.check(points=1, hint="the best whole number of steps is the floor or the ceiling of τ*/step — whichever "
                               "wastes less (the waste is not symmetric around τ*), and never fewer than 1")
def every_whole_steps(student, rng):
    """--checkpoint-every N: the whole number of steps with the least waste, the floor or ceiling of τ*/step, >= 1"""
    cases = [_every_case(rng, True), _every_case(rng, False)]
    save_s, gpus, gpu_mtbf_s = random_run(rng)
    cases.append((3 * young_interval(save_s, job_mtbf(gpus, gpu_mtbf_s)), save_s, gpus, gpu_mtbf_s))  # τ* < a step
    for step_s, save_s, gpus, gpu_mtbf_s in cases:
        mtbf_s = job_mtbf(gpus, gpu_mtbf_s)
        expected = min(range(1, math.ceil(young_interval(save_s, mtbf_s) / step_s) + 2),
                       key=lambda n: waste(n * step_s, save_s, mtbf_s))
        call = f"checkpoint_every(step_s={step_s!r}, save_s={save_s!r}, gpus={gpus}, gpu_mtbf_s={gpu_mtbf_s!r})"
        expect_equal(ask(student.checkpoint_every, call, str(expected), step_s, save_s, gpus, gpu_mtbf_s), expected,
                     call)


@INTERVAL.check(points=1, hidden=True, hint="the published log: 419 failures in 54 days on 16,384 GPUs")
def llama3_405b_interval(student, rng):
    """Llama 3 405B's log (419 interruptions in 54 days on 16,384 H100s): the interval for a 1 to 100 s save"""
    gpu_mtbf_s = 54 * 86400 * 16384 / 419
    save_s = rng.uniform(1, 100)
    expected = young_interval(save_s, job_mtbf(16384, gpu_mtbf_s))
    call = f"checkpoint_interval(save_s={save_s!r}, gpus=16384, gpu_mtbf_s={gpu_mtbf_s!r})"
    expect_number(ask(student.checkpoint_interval, call, f"{expected:.6g} s", save_s, 16384, gpu_mtbf_s), expected,
                  call, tol=1e-6)


# --- 08b.diverging_rank ---------------------------------------------------------------------------------------------

DIVERGING = exercise("08b.diverging_rank", entry=("diverging_rank",))

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")


def mesh_groups(dp: int, tp: int) -> dict[str, list[int]]:
    """The tp groups ("tp0", ...: consecutive ranks) and dp groups ("dp0", ...: every tp-th rank) of a dp x tp mesh,
    or one "world" group when there is only one axis."""
    if dp == 1 or tp == 1:
        return {"world": list(range(dp * tp))}
    return {**{f"tp{d}": list(range(d * tp, (d + 1) * tp)) for d in range(dp)},
            **{f"dp{t}": list(range(t, dp * tp, tp)) for t in range(tp)}}


def simulate_hang(dp: int, tp: int, program: list[tuple[str, str]], culprit: int, at: int, kind: str,
                  keep: int) -> list[list[dict]]:
    """Every rank runs `program` ((axis, op) pairs, axis "tp", "dp" or "world") over and over; rank `culprit`
    stops before its `at`-th collective ("hang") or calls another op there ("mismatch"). A collective completes
    when every rank of its group has entered it with the same op; a rank waits in the first one that does not.
    Returns each rank's newest `keep` entries, oldest first."""
    groups = mesh_groups(dp, tp)
    world = dp * tp

    def group_of(rank: int, axis: str) -> str:
        if axis == "world" or "world" in groups:
            return "world"
        return f"tp{rank // tp}" if axis == "tp" else f"dp{rank % tp}"

    logs: list[list[dict]] = [[] for _ in range(world)]
    position, seq = [0] * world, [dict.fromkeys(groups, 0) for _ in range(world)]
    total = at + 2 * len(program)
    progress = True
    while progress:
        progress = False
        for rank in range(world):  # enter the next collective, unless waiting in one or stopped
            waiting = logs[rank] and logs[rank][-1]["state"] == "started"
            if waiting or position[rank] >= total or (rank == culprit and kind == "hang" and position[rank] == at):
                continue
            axis, op = program[position[rank] % len(program)]
            if rank == culprit and kind == "mismatch" and position[rank] == at:
                op = next(o for o in OPS if o != op)
            name = group_of(rank, axis)
            logs[rank].append({"seq": seq[rank][name], "group": name, "ranks": groups[name], "op": op,
                               "state": "started"})
            seq[rank][name] += 1
            progress = True
        for name, members in groups.items():  # complete every collective its whole group has entered alike
            last = [logs[m][-1] if logs[m] else None for m in members]
            if all(e is not None and e["state"] == "started" and e["group"] == name for e in last) and \
                    len({(e["seq"], e["op"]) for e in last}) == 1:
                for m, e in zip(members, last, strict=True):
                    e["state"] = "completed"
                    position[m] += 1
                progress = True
    return [log[-keep:] for log in logs]


def reference_diagnose(logs: list[list[dict]]) -> dict:
    """The rank the others wait for: the odd one out at a collective its whole group entered (a mismatch), else the
    rank that someone waits for and that waits for no one; with its newest entry."""
    last = [log[-1] for log in logs]

    def at(rank: int, entry: dict) -> bool:
        return last[rank]["group"] == entry["group"] and last[rank]["seq"] == entry["seq"]

    for entry in (e for e in last if e["state"] == "started"):
        ops = {m: last[m]["op"] for m in entry["ranks"] if at(m, entry)}
        if len(ops) == len(entry["ranks"]) and len(set(ops.values())) > 1:
            odd = [m for m, op in ops.items() if list(ops.values()).count(op) == 1]
            if len(odd) == 1:
                return {"rank": odd[0], **{k: last[odd[0]][k] for k in ("group", "seq", "op")}}
    waits = {r: {m for m in e["ranks"] if not at(m, e)} if e["state"] == "started" else set()
             for r, e in enumerate(last)}
    found = [r for r in range(len(logs)) if not waits[r] and any(r in w for w in waits.values())]
    if len(found) != 1:
        raise ValueError(f"no single rank that the others wait for: {found}")
    return {"rank": found[0], **{k: last[found[0]][k] for k in ("group", "seq", "op")}}


def random_program(rng: random.Random, axes: tuple[str, ...], length: int) -> list[tuple[str, str]]:
    """A training step's collectives: tp ones often (every layer), dp ones rarely (gradients)."""
    weights = [4 if a == "tp" else 1 for a in axes]
    return [(rng.choices(axes, weights)[0], rng.choice(OPS[:3])) for _ in range(length)]


def hang_case(rng: random.Random, dp: int, tp: int, kind: str) -> tuple[list[list[dict]], dict]:
    """A simulated hang whose broken rank is not rank 0 and, with several groups, not the rank with the lowest newest
    sequence number; every other rank waits in a collective. Its logs and the expected answer."""
    axes = ("world",) if dp == 1 or tp == 1 else ("tp", "dp")
    for _ in range(200):
        program = random_program(rng, axes, rng.randrange(4, 9))
        culprit = rng.randrange(1, dp * tp)
        at = rng.randrange(len(program) + 3, 3 * len(program))
        logs = simulate_hang(dp, tp, program, culprit, at, kind, keep=rng.randrange(5, 9))
        last = [log[-1] for log in logs]
        if kind == "mismatch" and len(mesh_groups(dp, tp)[last[culprit]["group"]]) < 3:
            continue  # two ranks that disagree: neither is the odd one out
        lowest = min(range(dp * tp), key=lambda r: (last[r]["seq"], r))
        if (axes != ("world",) and lowest == culprit) or \
                not all(e["state"] == "started" for r, e in enumerate(last) if r != culprit):
            continue  # with several groups, the lowest sequence number must not give the answer away
        expected = {"rank": culprit, **{k: last[culprit][k] for k in ("group", "seq", "op")}}
        assert reference_diagnose(logs) == expected, (expected, logs)
        return logs, expected
    raise RuntimeError(f"no hang case for dp={dp} tp={tp} {kind} in 200 draws")


def _expect_diagnosis(student, logs: list[list[dict]], expected: dict, what: str) -> None:
    call = f"diverging_rank(<{len(logs)} ranks' logs: {what}>)"
    got = ask(student.diverging_rank, call, str(expected), logs)
    if not isinstance(got, dict) or {k: got.get(k) for k in expected} != expected:
        newest = "; ".join(f"rank {r}: {log[-1]['op']} #{log[-1]['seq']} on {log[-1]['group']} {log[-1]['state']}"
                           for r, log in enumerate(logs))
        raise CheckFailed(f"{call} returned {got!r:.200}, expected {expected} (newest entries — {newest})")


@DIVERGING.check(points=1, hint="compare sequence numbers, not positions in the buffer (it keeps only the newest "
                                "entries): the others wait in collective #s, the rank you want never entered it")
def one_group_one_rank_stopped(student, rng):
    """one group: the rank that never joined the collective the others wait in"""
    for world in (rng.choice([3, 4]), rng.choice([6, 8])):
        logs, expected = hang_case(rng, world, 1, "hang")
        _expect_diagnosis(student, logs, expected, f"{world} data-parallel ranks, one stopped")


@DIVERGING.check(points=1, hint="at the same sequence number every rank of a group must call the same op: the one "
                                "whose op differs from the others' is the one to name")
def one_rank_calls_another_op(student, rng):
    """a mismatch: the rank whose op differs from the rest of its group at the same sequence number"""
    for world in (rng.choice([3, 4]), rng.choice([5, 8])):
        logs, expected = hang_case(rng, world, 1, "mismatch")
        _expect_diagnosis(student, logs, expected, f"{world} data-parallel ranks, one calls another op")


@DIVERGING.check(points=1, hint="sequence numbers count per group: compare a rank with its own group only. A rank "
                                "waiting for a rank that waits too is not the cause: follow the waits to the rank "
                                "that waits for no one, or that called another op")
def several_groups(student, rng):
    """dp x tp: sequence numbers per group, and waits that spread from group to group"""
    for dp, tp, kind in ((2, rng.choice([2, 3]), "hang"), (rng.choice([2, 3]), 4, "hang"), (2, 4, "mismatch"),
                         (rng.choice([2, 3]), 3, "mismatch")):
        logs, expected = hang_case(rng, dp, tp, kind)
        broken = "stopped" if kind == "hang" else "calls another op"
        _expect_diagnosis(student, logs, expected, f"dp{dp} x tp{tp}, one rank {broken}")


# --- 08b.find_straggler ---------------------------------------------------------------------------------------------

STRAGGLER = exercise("08b.find_straggler", entry=("find_straggler",))


def reference_straggler(compute_s: list[list[float]], step_s: list[list[float]], threshold_s: float) -> dict | None:
    """`lab.distributed.health.find_straggler`'s rule, on every step given: per rank, the median over steps of its
    compute time minus the median of the other ranks' that step; the largest, if above `threshold_s`, with the
    fraction of the median synchronous step (the slowest rank's step time) it costs."""
    ranks = len(compute_s[0])
    excess = [statistics.median(row[r] - statistics.median(row[:r] + row[r + 1:]) for row in compute_s)
              for r in range(ranks)]
    slowest = max(range(ranks), key=excess.__getitem__)
    if excess[slowest] <= threshold_s:
        return None
    return {"rank": slowest, "excess_s": excess[slowest],
            "cost": excess[slowest] / statistics.median(max(row) for row in step_s)}


def timed_run(rng: random.Random, ranks: int, steps: int, slow: int | None, delay_s: float,
              spikes: int = 0) -> tuple[list[list[float]], list[list[float]]]:
    """Per-step, per-rank (compute, step) seconds of a synchronous run: each rank computes for its own base time
    plus noise (rank `slow` `delay_s` more), `spikes` single steps on random ranks are 0.1-0.3 s slower (the OS took
    the core away once), and every rank leaves the all-reduce when the slowest arrives, rank 0 a little later (it
    writes the log)."""
    base = [rng.uniform(0.02, 0.04) for _ in range(ranks)]
    compute = [[b + rng.gauss(0, 0.0005) + (delay_s if r == slow else 0.0) for r, b in enumerate(base)]
               for _ in range(steps)]
    for _ in range(spikes):
        compute[rng.randrange(steps)][rng.randrange(ranks)] += rng.uniform(0.1, 0.3)
    step = []
    for row in compute:
        end = max(row) + rng.uniform(0.004, 0.006)  # the gradient all-reduce, once the last rank arrives
        step.append([end + (0.02 if r == 0 else 0.0) + rng.uniform(0, 0.0005) for r in range(ranks)])
    return compute, step


def _expect_straggler(student, compute: list[list[float]], step: list[list[float]], threshold_s: float,
                      what: str) -> None:
    call = f"find_straggler(<{len(compute)} steps x {len(compute[0])} ranks: {what}>, threshold_s={threshold_s:.4f})"
    expected = reference_straggler(compute, step, threshold_s)
    got = ask(student.find_straggler, call, str(expected), compute, step, threshold_s)
    if expected is None:
        if got is not None:
            raise CheckFailed(f"{call} returned {got!r:.200}, expected None: no rank is slower step after step")
        return
    if not isinstance(got, dict) or got.get("rank") != expected["rank"]:
        raise CheckFailed(f"{call} returned {got!r:.200}, expected rank {expected['rank']} ({expected})")
    for key in ("excess_s", "cost"):
        expect_number(got.get(key), expected[key], f"{call}[{key!r}]", tol=1e-6)


@STRAGGLER.check(points=1, hint="compare each rank with the median of the *other* ranks that step (with two ranks, a "
                                "median that includes the rank itself halves its excess); the cost is the excess over "
                                "the synchronous step, which lasts as long as its slowest rank")
def clear_straggler(student, rng):
    """a clear straggler among 2 to 8 ranks: its rank, its excess per step, and the fraction of a step it costs"""
    for ranks in (2, rng.randrange(3, 6), rng.randrange(6, 9)):
        delay = rng.uniform(0.01, 0.08)
        slow = rng.randrange(ranks)
        compute, step = timed_run(rng, ranks, rng.randrange(5, 12), slow, delay)
        _expect_straggler(student, compute, step, delay / 3, f"rank {slow} {delay * 1e3:.0f} ms slower")


@STRAGGLER.check(points=1, hint="one slow step is the OS taking a core away, not a straggler: take the median over the "
                                "steps, not the mean, and name no one when the largest excess is under the threshold")
def one_slow_step_is_noise(student, rng):
    """one slow step is noise: ranks descheduled once in a run are no straggler, and do not hide the real one"""
    ranks = rng.randrange(3, 7)
    compute, step = timed_run(rng, ranks, rng.randrange(7, 12), None, 0.0, spikes=2)
    _expect_straggler(student, compute, step, 0.01, "no straggler, two slow steps")
    slow = rng.randrange(ranks)
    compute, step = timed_run(rng, ranks, rng.randrange(7, 12), slow, 0.02, spikes=2)
    _expect_straggler(student, compute, step, 0.01, f"rank {slow} 20 ms slower, two slow steps elsewhere")


@STRAGGLER.check(points=1, hint="every rank leaves the all-reduce together, so step times are (nearly) equal and say "
                                "nothing about who is slow; the compute time before the all-reduce does")
def compute_not_step_time(student, rng):
    """compute time, not step time: the ranks leave the all-reduce together, rank 0 a little later"""
    ranks = rng.randrange(3, 7)
    slow = rng.randrange(1, ranks)
    compute, step = timed_run(rng, ranks, rng.randrange(5, 10), slow, 0.015)
    _expect_straggler(student, compute, step, 0.005, f"rank {slow} 15 ms slower, rank 0 logs after each step")


# --- 08b.goodput ----------------------------------------------------------------------------------------------------

GOODPUT = exercise("08b.goodput", entry=("goodput", "hot_spare_goodput", "most_spares"))


def goodput_run(rng: random.Random) -> dict:
    """A job from 1,024 to 131,072 GPUs at GPU MTBFs of 2 to 10 years, saving at Young's interval (times 0.5 to 2)
    for 1 to 60 s, restarting in 3 to 20 minutes of which 60 to 90 % is rescheduling, swapping a spare in 20 s to
    3 minutes; redrawn until plain restarts keep more than 30 % of the time."""
    while True:
        gpus = rng.choice([1024, 4096, 16384, 32768, 131072]) * rng.choice([1, 3]) // 2
        gpu_mtbf_s = rng.uniform(2, 10) * 365 * 86400
        save_s = rng.uniform(1, 60)
        interval_s = young_interval(save_s, job_mtbf(gpus, gpu_mtbf_s)) * rng.uniform(0.5, 2)
        restart_s = rng.uniform(180, 1200)
        run = {"gpus": gpus, "gpu_mtbf_s": gpu_mtbf_s, "interval_s": interval_s, "save_s": save_s,
               "restart_s": restart_s, "reschedule_s": restart_s * rng.uniform(0.6, 0.9),
               "swap_s": rng.uniform(20, 180)}
        if reference_goodput(run) > 0.3:
            return run


def reference_goodput(run: dict, spare_gpus: int | None = None) -> float:
    """Without spares (`spare_gpus` None): `restart_goodput`. With them: `hot_spare_goodput`, the spares one node of
    `spare_gpus` GPUs, never out for repair (repair_s = 0), so that every failure swaps."""
    load_s = run["restart_s"] - run["reschedule_s"]  # the rest of the restart: load and warm-up alike
    restart = Restart(run["reschedule_s"], load_s, 0.0)
    if spare_gpus is None:
        return restart_goodput(run["gpus"], run["gpu_mtbf_s"], run["save_s"], restart, run["interval_s"])
    return hot_spare_goodput(run["gpus"], run["gpu_mtbf_s"], run["save_s"], restart, run["swap_s"],
                             1 if spare_gpus else 0, 0.0, max(spare_gpus, 1), run["interval_s"])


def reference_most_spares(run: dict) -> int:
    """The most spare GPUs for which hot spares keep at least plain restarts' goodput: G·(g_swap/g − 1), floored,
    where g_swap is the goodput when every restart swaps instead of rescheduling, before the charge G/(G + S)."""
    return max(0, math.floor(_break_even(run)))


def _break_even(run: dict) -> float:
    """gpus·(g_swap/g_restart − 1): the spare GPUs at which hot spares keep exactly what plain restarts keep."""
    swapped = {**run, "restart_s": run["restart_s"] - run["reschedule_s"] + run["swap_s"],
               "reschedule_s": run["swap_s"]}
    return run["gpus"] * (reference_goodput(swapped) / reference_goodput(run) - 1)


def _args(run: dict, *names: str) -> tuple:
    return tuple(run[name] for name in names)


BASE = ("gpus", "gpu_mtbf_s", "interval_s", "save_s", "restart_s")
SPARE = ("gpu_mtbf_s", "interval_s", "save_s", "restart_s", "reschedule_s", "swap_s")
MOST = ("gpus", *SPARE)


def _call(run: dict, names: tuple[str, ...], function: str, spare_gpus: int | None = None) -> tuple[str, tuple]:
    args = _args(run, *names) if spare_gpus is None else (run["gpus"], spare_gpus, *_args(run, *names))
    keys = names if spare_gpus is None else ("gpus", "spare_gpus", *names)
    return f"{function}({', '.join(f'{k}={v!r}' for k, v in zip(keys, args, strict=True))})", args


@GOODPUT.check(points=1, hint="a failure costs the restart and the work since the last save, half an interval on "
                              "average; the saves slow the rest down: divide by 1 + C/τ")
def goodput_of_a_restart(student, rng):
    """goodput restarting from a checkpoint: (1 − (R + τ/2)/M) / (1 + C/τ), with M the job's MTBF"""
    for _ in range(4):
        run = goodput_run(rng)
        expected = reference_goodput(run)
        call, args = _call(run, BASE, "goodput")
        expect_number(ask(student.goodput, call, f"{expected:.6g}", *args), expected, call, tol=1e-7)


@GOODPUT.check(points=1, hint="a spare replaces only the rescheduling part of the restart; its GPUs do not train, so "
                              "charge them: the kept share of all the GPUs paid for is × gpus / (gpus + spare_gpus); "
                              "idle spares do not fail")
def hot_spares_swap_and_cost(student, rng):
    """hot spares: the restart's rescheduling swapped for swap_s, goodput charged gpus / (gpus + spare_gpus)"""
    for _ in range(4):
        run = goodput_run(rng)
        spare_gpus = 8 * rng.randrange(1, 65)
        expected = reference_goodput(run, spare_gpus)
        call, args = _call(run, SPARE, "hot_spare_goodput", spare_gpus)
        expect_number(ask(student.hot_spare_goodput, call, f"{expected:.6g}", *args), expected, call, tol=1e-7,
                      mistakes=(Mistake((run["gpus"] + spare_gpus) / run["gpus"], "(gpus + spare_gpus) / gpus",
                                        "the spares' GPUs are paid for and do not train"),))


def _spares_case(rng: random.Random, fraction: str) -> dict:
    """A run whose break-even number of spares, gpus·(g_swap/g_restart − 1), has a fractional part above a half, or
    below it with at least one spare worth having, or anything: rounding to the nearest, or up, misses one of them."""
    while True:
        run = goodput_run(rng)
        x = _break_even(run)
        part = x - math.floor(x)
        if fraction == "any" or (fraction == "above a half" and 0.55 < part < 0.95 and x > 0) or (
                fraction == "below a half" and 0.05 < part < 0.45 and x > 1):
            return run


@GOODPUT.check(points=1, hint="hot spares keep at least plain restarts' goodput while gpus / (gpus + S) ≥ g_restart / "
                              "g_swap: solve for S and take the whole number at or below it (0 if spares never pay)")
def most_spares_worth_it(student, rng):
    """the most spare GPUs still worth having: the whole number at or below gpus·(g_swap/g_restart − 1)"""
    for kind in ("above a half", "below a half", "any", "any"):
        run = _spares_case(rng, kind)
        expected = reference_most_spares(run)
        call, args = _call(run, MOST, "most_spares")
        expect_equal(ask(student.most_spares, call, str(expected), *args), expected, call)


@GOODPUT.check(points=1, hidden=True, hint="without failures nothing is lost but the saves, and spares only cost")
def no_failures(student, rng):
    """GPUs that never fail: goodput τ/(τ + C), and no spare is worth its GPUs"""
    run = {**goodput_run(rng), "gpu_mtbf_s": 1e30}
    expected = run["interval_s"] / (run["interval_s"] + run["save_s"])
    call, args = _call(run, BASE, "goodput")
    expect_number(ask(student.goodput, call, f"{expected:.6g}", *args), expected, call, tol=1e-7)
    call, args = _call(run, MOST, "most_spares")
    expect_equal(ask(student.most_spares, call, "0", *args), 0, call)
