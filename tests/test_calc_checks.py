"""One rule, one message: every calculator that takes a count refuses 0, a fraction and a bool in the same line."""

import pytest

from lab.calc import bubble, flops, inference, roofline, search
from lab.config import PRESETS
from lab.layout import check_count
from lab.measure import launch


@pytest.mark.parametrize("bad", [0, -3, 2.0, True, "4", None])
def test_check_count_refuses_all_but_positive_integers(bad):
    with pytest.raises(ValueError, match=rf"^n={bad!r} must be an integer >= 1$"):
        check_count("n", bad)


def test_check_count_takes_positive_integers():
    for good in (1, 7, 1 << 40):
        check_count("n", good)


CALLS = {  # each public entry point, called with one count set to `bad`
    "roofline.softmax_fusion": (lambda bad: roofline.softmax_fusion(rows=bad, cols=8), "rows"),
    "inference.decode_step": (lambda bad: inference.decode_step("llama3-1b", "h100", batch=bad, context=128), "batch"),
    "flops.training_flops": (lambda bad: flops.training_flops(PRESETS["tiny"], seq=bad), "seq"),
    "bubble.min_microbatches": (lambda bad: bubble.min_microbatches(pp=bad, target=0.1), "pp"),
    "search.search": (lambda bad: search.search("llama3-1b", gpus=bad), "gpus"),
    "launch.per_op_s": (lambda bad: launch.per_op_s(64, n_ops=bad), "n_ops"),
}


@pytest.mark.parametrize("name", CALLS)
def test_every_calculator_says_the_same_line(name):
    call, argument = CALLS[name]
    with pytest.raises(ValueError, match=rf"^{argument}=True must be an integer >= 1$"):
        call(True)
