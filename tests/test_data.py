"""The synthetic stream: deterministic, resumable, shardable, and its loss floor is real."""

import math

import pytest
import torch

from lab.data import SyntheticTokens, shard_rows


def test_deterministic_and_resumable():
    a = SyntheticTokens(256, 32, 8, seed=1)
    first = [a.next_batch() for _ in range(3)]
    b = SyntheticTokens(256, 32, 8, seed=1)
    b.load_state_dict({"step": 2, "seed": 1})
    assert torch.equal(b.next_batch()[0], first[2][0])
    assert a.state_dict() == {"step": 3, "seed": 1}
    assert not torch.equal(SyntheticTokens(256, 32, 8, seed=2).next_batch()[0], first[0][0])
    with pytest.raises(ValueError, match="does not match"):
        b.load_state_dict({"step": 0, "seed": 5})


def test_targets_are_inputs_shifted():
    inputs, targets = SyntheticTokens(64, 16, 4).next_batch()
    assert inputs.shape == targets.shape == (4, 16)
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    assert int(inputs.max()) < 64 and int(inputs.min()) >= 0


def test_loss_floor_is_the_empirical_conditional_entropy():
    stream = SyntheticTokens(32, 256, 64, seed=0, branching=4)
    inputs, targets = stream.next_batch()
    counts = torch.zeros(32, 32)
    counts.index_put_((inputs.flatten(), targets.flatten()), torch.ones(inputs.numel()), accumulate=True)
    probs = counts / counts.sum(1, keepdim=True)
    entropy = -(counts * torch.where(probs > 0, probs.log(), 0)).sum() / counts.sum()
    assert abs(entropy.item() - stream.loss_floor) < 0.02
    assert (counts > 0).sum(1).max() == 4  # exactly `branching` successors per token
    assert stream.loss_floor < math.log(32)


def test_shards_tile_the_global_batch():
    inputs, _ = SyntheticTokens(64, 8, 8).next_batch()
    assert torch.equal(torch.cat([shard_rows(inputs, r, 4) for r in range(4)]), inputs)
    with pytest.raises(ValueError, match="world=3 must divide the global batch of 8 rows"):
        shard_rows(inputs, 0, 3)


@pytest.mark.parametrize("kwargs, message", [
    (dict(vocab_size=1, seq_len=8, global_batch=2), "vocab_size=1 must be an integer >= 2"),
    (dict(vocab_size=8, seq_len=0, global_batch=2), "seq_len=0 must be an integer >= 1"),
    (dict(vocab_size=8, seq_len=8, global_batch=2, branching=9), "branching=9 must be <= vocab_size=8"),
])
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SyntheticTokens(**kwargs)
