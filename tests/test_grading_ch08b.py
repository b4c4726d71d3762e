"""Chapter 08b's checks: the solutions pass with any secret, the released stubs score nothing, and every
plausible-but-wrong answer (mutant) fails the checks named for it.

The shards to read are compared with `lab.calc.reliability.reads_for`, the interval and its waste with Young's
formula in `lab.calc.reliability`, the diverging rank with the rank a simulated hang broke. A mutant is the solution
cell with one classic mistake — slices that only touch counted as overlapping, a slice read whole, the writer taken
from the loading rank's dp replica, the slice index read as if dp varied fastest; the interval without its factor
2, the job's MTBF not divided by the GPUs, the whole interval redone after a failure, Young's interval rounded down,
rounded to the nearest step or allowed below one step; the first waiting rank named instead of the one it waits
for, sequence numbers compared across groups, the majority of a mismatched group named, a mismatch not looked for;
goodput losing a whole interval per failure or subtracting the saves, spares not charged, idle spares failing, a spare
replacing the whole restart, the break-even number of spares rounded to the nearest or up —
and only the checks that must catch it are run, to keep this file fast.
"""

from __future__ import annotations

import random

import pytest
from grading_support import Chapter, chapter_tests

from lab.grading.checks import ch08b

EXERCISES = ("08b.reshard_reads", "08b.checkpoint_interval", "08b.diverging_rank", "08b.find_straggler",
             "08b.goodput")

SAME_DIM = "the same dimension cut at another degree: the saved slices a rank's slice overlaps, none it only touches"
ROWS_COLS = "saved cut along rows, loaded cut along columns (and back): the rectangles where the slices cross"
REPLICAS = "dp replicas: a rank holds slice rank % tp, read from the lowest saved rank that held each slice"
FFN = "Llama 3 70B's FFN weight (28,672 x 8,192): tp8 column-parallel to tp4, and to tp8 row-parallel"
YOUNG = "Young's interval sqrt(2·C·M), with the job's MTBF M = the GPU's MTBF / the number of GPUs"
WASTE = "the expected waste C/τ + τ/(2M) at intervals around, below and above the optimum"
EVERY = "--checkpoint-every N: the whole number of steps with the least waste, the floor or ceiling of τ*/step, >= 1"
LLAMA = "Llama 3 405B's log (419 interruptions in 54 days on 16,384 H100s): the interval for a 1 to 100 s save"
STOPPED = "one group: the rank that never joined the collective the others wait in"
MISMATCH = "a mismatch: the rank whose op differs from the rest of its group at the same sequence number"
GROUPS = "dp x tp: sequence numbers per group, and waits that spread from group to group"
CLEAR = "a clear straggler among 2 to 8 ranks: its rank, its excess per step, and the fraction of a step it costs"
NOISE = "one slow step is noise: ranks descheduled once in a run are no straggler, and do not hide the real one"
COMPUTE = "compute time, not step time: the ranks leave the all-reduce together, rank 0 a little later"
GOODPUT = "goodput restarting from a checkpoint: (1 − (R + τ/2)/M) / (1 + C/τ), with M the job's MTBF"
SPARES = "hot spares: the restart's rescheduling swapped for swap_s, goodput charged gpus / (gpus + spare_gpus)"
MOST = "the most spare GPUs still worth having: the whole number at or below gpus·(g_swap/g_restart − 1)"
NO_FAILURES = "GPUs that never fail: goodput τ/(τ + C), and no spare is worth its GPUs"

EVERY_LINE = "    options = {max(1, math.floor(steps)), max(1, math.ceil(steps))}"
FLOOR = "max(0, math.floor(gpus * (swapped / plain - 1)))"
LAST_LINE = "    return answer(next(r for r in sorted(waited_for) if not waits[r]))"

MUTANTS = {  # name: (exercise, [(old, new) in the solution cell], checks that must fail)
    "touching_slices_overlap": (
        "08b.reshard_reads", [("if any(h <= low for low, h", "if any(h < low for low, h")], {SAME_DIM, FFN}),
    "saved_slice_read_whole": (
        "08b.reshard_reads", [('reads.append({"writer": t, "read": region})',
                              'reads.append({"writer": t, "read": slice_box(shape, save["dim"], save["tp"], t)})')],
        {SAME_DIM, ROWS_COLS}),
    "slices_are_always_rows": (  # the cut dimension ignored: every slice a range of rows
        "08b.reshard_reads", [("offsets = [index * size if d == dim else 0 for d in range(len(shape))]",
                              "offsets = [index * shape[0] // parts, 0]"),
                             ("sizes = [size if d == dim else n for d, n in enumerate(shape)]",
                              "sizes = [shape[0] // parts, shape[1]]")], {ROWS_COLS}),
    "writer_is_the_loading_ranks_replica": (
        "08b.reshard_reads", [('reads.append({"writer": t, "read": region})',
                              'reads.append({"writer": rank // load["tp"] * save["tp"] + t, "read": region})')],
        {REPLICAS}),
    "slice_index_as_if_dp_were_fastest": (
        "08b.reshard_reads", [('rank % load["tp"])', 'rank // load["dp"])')], {REPLICAS}),
    "interval_without_the_factor_2": (
        "08b.checkpoint_interval", [("math.sqrt(2 * save_s * job_mtbf_s(gpus, gpu_mtbf_s))",
                                    "math.sqrt(save_s * job_mtbf_s(gpus, gpu_mtbf_s))")], {YOUNG, LLAMA}),
    "mtbf_not_divided_by_the_gpus": (
        "08b.checkpoint_interval", [("return gpu_mtbf_s / gpus", "return gpu_mtbf_s")], {YOUNG, WASTE, LLAMA}),
    "whole_interval_redone": (
        "08b.checkpoint_interval", [("interval_s / (2 * job_mtbf_s(gpus, gpu_mtbf_s))",
                                    "interval_s / job_mtbf_s(gpus, gpu_mtbf_s)")], {WASTE}),
    "every_rounded_down": ("08b.checkpoint_interval", [(EVERY_LINE, "    return max(1, math.floor(steps))")], {EVERY}),
    "every_rounded_to_nearest": ("08b.checkpoint_interval", [(EVERY_LINE, "    return max(1, round(steps))")],
                                 {EVERY}),
    "every_below_one_step": (
        "08b.checkpoint_interval", [(EVERY_LINE, "    options = {math.floor(steps), math.ceil(steps)}")], {EVERY}),
    "first_waiting_rank_named": (
        "08b.diverging_rank", [(LAST_LINE, '    return answer(next(r for r, e in enumerate(last) if e["state"] == '
                                          '"started"))')], {STOPPED, GROUPS}),
    "sequence_numbers_compared_across_groups": (
        "08b.diverging_rank", [(LAST_LINE, '    return answer(min(range(len(logs)), key=lambda r: last[r]["seq"]))')],
        {GROUPS}),
    "majority_of_a_mismatch_named": (
        "08b.diverging_rank", [('.count(entry["op"]) == 1:', '.count(entry["op"]) > 1:')], {MISMATCH, GROUPS}),
    "mismatch_not_looked_for": (
        "08b.diverging_rank", [("            return answer(rank)  # the whole", "            pass  # the whole")],
        {MISMATCH}),
    "mean_over_steps": (
        "08b.find_straggler", [("excess.append(statistics.median(behind))", "excess.append(statistics.mean(behind))")],
        {NOISE}),
    "median_includes_the_rank_itself": (
        "08b.find_straggler", [("statistics.median(row[:r] + row[r + 1:])", "statistics.median(row)")], {CLEAR}),
    "step_time_read_for_compute": (
        "08b.find_straggler", [("for row in compute_s]", "for row in step_s]")], {CLEAR, COMPUTE}),
    "cost_over_the_compute_time": (
        "08b.find_straggler", [("max(row) for row in step_s)", "max(row) for row in compute_s)")], {CLEAR}),
    "no_threshold": (
        "08b.find_straggler", [("if excess[slowest] <= threshold_s:", "if excess[slowest] <= 0:")], {NOISE}),
    "whole_interval_lost_per_failure": (
        "08b.goodput", [("lost = restart_s + interval_s / 2", "lost = restart_s + interval_s")], {GOODPUT, SPARES}),
    "saves_subtracted_not_divided": (
        "08b.goodput", [("/ (1 + save_s / interval_s)", "* (1 - save_s / interval_s)")],
        {GOODPUT, SPARES, NO_FAILURES}),
    "spares_not_charged": (
        "08b.goodput", [("* gpus / (gpus + spare_gpus)  # spares", "  # spares")], {SPARES}),
    "idle_spares_fail_too": (
        "08b.goodput", [("return goodput(gpus, gpu_mtbf_s, interval_s, save_s, swapped)",
                         "return goodput(gpus + spare_gpus, gpu_mtbf_s, interval_s, save_s, swapped)")], {SPARES}),
    "spare_replaces_the_whole_restart": (
        "08b.goodput", [("swapped = restart_s - reschedule_s + swap_s", "swapped = swap_s")], {SPARES, MOST}),
    "most_spares_rounded_to_nearest": (
        "08b.goodput", [(FLOOR, "max(0, round(gpus * (swapped / plain - 1)))")], {MOST}),
    "most_spares_rounded_up": (
        "08b.goodput", [(FLOOR, "max(0, math.ceil(gpus * (swapped / plain - 1)))")], {MOST}),
}
CHAPTER = Chapter("08b_checkpoints_and_failures.ipynb", EXERCISES, MUTANTS, said=("returned", "raised"))


globals().update(chapter_tests(CHAPTER))


@pytest.mark.parametrize("seed", range(3))
def test_simulated_hangs_break_the_rank_they_say(seed):
    """The simulation behind 08b.diverging_rank: every rank but the broken one ends waiting in a collective, the
    broken one is the rank the analysis names, and the ring buffers keep only their newest entries."""
    rng = random.Random(seed)
    for dp, tp, kind in ((4, 1, "hang"), (5, 1, "mismatch"), (2, 2, "hang"), (3, 4, "mismatch"), (2, 3, "hang")):
        logs, expected = ch08b.hang_case(rng, dp, tp, kind)
        last = [log[-1] for log in logs]
        assert all(e["state"] == "started" for r, e in enumerate(last) if r != expected["rank"])
        assert last[expected["rank"]]["state"] == ("completed" if kind == "hang" else "started")
        assert all(len(log) <= 8 for log in logs) and any(log[0]["seq"] > 0 for log in logs)  # newest entries only
        assert ch08b.reference_diagnose(logs) == expected


@pytest.mark.parametrize("seed", range(3))
def test_the_straggler_reference_is_lab_distributed_health(seed):
    """ch08b keeps its own copy of the rule so that grading imports no torch: it must stay find_straggler's."""
    from lab.distributed.health import find_straggler

    rng = random.Random(seed)
    for ranks, slow, delay, spikes in ((2, 1, 0.03, 0), (5, 3, 0.02, 2), (4, None, 0.0, 2)):
        compute, step = ch08b.timed_run(rng, ranks, 8, slow, delay, spikes)
        expected = ch08b.reference_straggler(compute, step, 0.01)
        # lab's skips the first step and takes a floor: give it a first step to skip and the same threshold
        found = find_straggler([compute[0], *compute], [step[0], *step], fraction=0.0, floor_s=0.01)
        assert (found is None) == (expected is None)
        if found is not None:
            assert (found.rank, found.excess_s, found.step_s) == pytest.approx(
                (expected["rank"], expected["excess_s"], expected["excess_s"] / expected["cost"]))
