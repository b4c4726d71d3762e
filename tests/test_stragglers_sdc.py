"""The failures that do not crash (lab.distributed.health, lab.faults' straggler and bitflip kinds): a slow rank is
named with its cost, and a flipped bit in one data-parallel replica is caught on that rank and that parameter.
The real-rank runs are `python -m lab.train`'s `main` on the tiny model for a few steps (ranks forked here)."""

import json

import pytest
import torch

from lab.distributed.health import Mismatch, checksum, compare_checksums, find_straggler, rank_excess
from lab.faults import InjectedFailure, flip_bit
from lab.train import main

DELAY_MS = 300  # large against the tiny model's ~20 ms of compute, so that load on the machine cannot hide it
TINY = ["--config", "configs/tiny.toml", "--quiet"]
PARAM = "layers.1.attn.wq.weight"


def _times(log) -> tuple[list[list[float]], list[list[float]]]:
    entries = [json.loads(line) for line in open(log)]
    return [e["rank_compute_s"] for e in entries], [e["rank_step_s"] for e in entries]


@pytest.mark.parametrize("spec, message", [
    ("rank=1,kind=straggler", "kind='straggler' needs delay_ms=D > 0"),
    ("rank=1,step=2,delay_ms=5", "delay_ms= belongs to kind=straggler, not kind=raise"),
    ("rank=1,kind=straggler,delay_ms=5,bit=3", "bit= belongs to kind=bitflip, not kind=straggler"),
    ("rank=1,step=2,kind=bitflip,bit=-1", "bit=-1 must be an integer >= 0"),
    ("rank=1,step=2,kind=bitflip,colour=red", "'colour=red' is not rank=R, step=S or kind=K"),
])
def test_a_bad_straggler_or_bitflip_spec_is_one_line(spec, message):
    with pytest.raises(ValueError, match=message) as err:
        InjectedFailure.parse(spec)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("args, message", [
    (["--nproc", "1", "--sdc-check", "1"], "--sdc-check=1 compares data-parallel replicas: it needs dp x cp >= 2"),
    (["--nproc", "2", "--sdc-check", "-2"], "--sdc-check=-2 must be an integer >= 0"),
    (["--nproc", "2", "--zero", "3", "--sdc-check", "2"], "--sdc-check=2 with zero=3: its replicas are not whole"),
])
def test_bad_sdc_flags_are_one_line_before_any_rank_starts(capsys, args, message):
    assert main([*TINY, "--steps", "2", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_a_straggler_is_slow_from_its_step_on():
    assert InjectedFailure.parse("rank=1,kind=straggler,delay_ms=50") == InjectedFailure(1, 1, "straggler", 50.0)
    assert InjectedFailure.parse("rank=0,step=3,kind=bitflip,param=w,bit=7") == InjectedFailure(0, 3, "bitflip",
                                                                                                  param="w", bit=7)


def test_the_bit_checksum_catches_a_low_mantissa_flip_that_a_float_sum_misses():
    """The reason the checksum sums bits: one ulp of one element is below the rounding of a float sum."""
    clean = torch.randn(4096, generator=torch.Generator().manual_seed(0))
    corrupt = clean.clone()
    flip_bit(corrupt, 17, 0)
    assert not torch.equal(clean, corrupt)
    assert clean.sum().item() == corrupt.sum().item()  # the plausible wrong checksum: blind to this flip
    assert checksum(clean) != checksum(corrupt)
    change = abs(checksum(corrupt) - checksum(clean))
    assert change & (change - 1) == 0  # exactly ±2^k: element 17's bit 0 is bit 32 of its 64-bit word
    for bit in (0, 9, 22, 23, 30, 31):  # mantissa, exponent and sign bits; bf16, and a tail shorter than a word
        for tensor in (clean, clean.bfloat16(), clean[1:8], clean.bfloat16()[3:6]):
            if bit < tensor.element_size() * 8:
                flipped = tensor.clone()
                flip_bit(flipped, 2, bit)
                assert checksum(flipped) != checksum(tensor), (bit, tensor.dtype)


def test_replicas_name_the_odd_rank_only_when_a_majority_says_which():
    names = ["a", "b"]
    assert compare_checksums(names, [[1, 2], [1, 2], [1, 2]], [0, 1, 2]) == []
    assert compare_checksums(names, [[1, 2], [1, 9], [1, 2]], [4, 5, 6]) == [Mismatch("b", (5,), True)]
    assert compare_checksums(names, [[1, 2], [3, 2]], [0, 1]) == [Mismatch("a", (0, 1), False)]


def test_find_straggler_reads_compute_not_step_time():
    """Every rank's step time is the same (they leave the all-reduce together); only compute shows who is slow.
    The first step is left out, and a single slow step (the OS descheduling a rank) makes no straggler."""
    compute = [[0.9, 0.9, 0.9]] + [[0.02, 0.06, 0.02]] * 5
    step = [[1.0] * 3] + [[0.08] * 3] * 5
    found = find_straggler(compute, step)
    assert found is not None and found.rank == 1 and found.excess_s == pytest.approx(0.04)
    assert found.describe().startswith("rank 1 is the straggler: +40 ms/step")
    assert "(50% of a 80 ms step)" in found.describe()
    assert rank_excess(compute[1:])[1] == pytest.approx(0.04)
    noisy = [[0.02, 0.02]] * 5 + [[0.02, 0.5]]
    assert find_straggler(noisy, [[0.03, 0.03]] * 6) is None
    assert find_straggler([[0.02]] * 4, [[0.03]] * 4) is None  # one rank: no one waits for it


def test_the_injected_straggler_is_named_and_a_healthy_run_names_no_one(tmp_path, capfd, one_thread):
    """Rank 1 sleeps DELAY_MS per step: the summary names it and the ms it costs every step; on the same run
    without it, no rank is anywhere near that excess (the threshold is the injected delay, not absolute times)."""
    slow, healthy = tmp_path / "slow.jsonl", tmp_path / "healthy.jsonl"
    base = [*TINY, "--steps", "5", "--nproc", "2"]
    assert main([*base, "--log-json", str(slow), "--inject-failure",
                 f"rank=1,kind=straggler,delay_ms={DELAY_MS}"]) == 0
    out = capfd.readouterr().out
    assert "rank 1 is the straggler: +" in out and "wait for it in the gradient all-reduce" in out, out
    found = find_straggler(*_times(slow))
    assert found is not None and found.rank == 1
    assert 0.5 * DELAY_MS < found.excess_s * 1e3 < 2 * DELAY_MS
    assert main([*base, "--log-json", str(healthy)]) == 0
    compute, step = _times(healthy)
    assert len(compute) == 5 and all(len(row) == 2 for row in compute + step)
    assert find_straggler(compute, step, floor_s=DELAY_MS / 2e3) is None
    assert max(rank_excess(compute[1:])) < DELAY_MS / 2e3


def test_a_flipped_bit_is_caught_on_its_rank_and_parameter(tmp_path, capfd, one_thread):
    """dp=3 (a majority can say which replica is corrupt): rank 1 flips the lowest mantissa bit of one weight after
    step 3's update; --sdc-check 1 stops the run at step 3 with one line naming rank 1 and the weight. Without the
    flip, the same check passes every step."""
    base = [*TINY, "--steps", "4", "--nproc", "3", "--set", "train.global_batch=6", "--sdc-check", "1"]
    log = tmp_path / "log.jsonl"
    assert main([*base, "--log-json", str(log), "--inject-failure", f"rank=1,step=3,kind=bitflip,param={PARAM}"]) == 1
    err = capfd.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert errors == [f"python -m lab.train: error: step 3: rank 1 differs from the other replicas in {PARAM}: "
                      "silent data corruption, stopped before it spreads; resume from the last checkpoint (the "
                      "check ran every 1 step(s))"], err
    assert [json.loads(line)["step"] for line in open(log)] == [1, 2]
    assert main(base) == 0
