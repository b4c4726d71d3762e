"""The memory timeline: activations rise in forward and drain in backward; Adam's states appear at step 1."""

from pathlib import Path

import nbformat
import torch
from nbclient import NotebookClient

from lab.config import PRESETS
from lab.measure.memory_timeline import language_model_step, memory_timeline
from lab.model import build_model, materialize


def test_timeline_shows_the_phases_of_a_training_step():
    model = materialize(build_model(PRESETS["tiny"]), seed=0)
    optimizer = torch.optim.AdamW(model.parameters())
    tokens = torch.randint(0, 256, (4, 32))
    timeline = memory_timeline(language_model_step(model, optimizer, tokens, tokens), steps=2)
    assert [(s, p) for s, p, _, _ in timeline.phases] == [
        (1, "forward"), (1, "backward"), (1, "optimizer"), (2, "forward"), (2, "backward"), (2, "optimizer")]
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    cats = timeline.bytes_by_category
    assert max(cats["optimizer_state"]) >= 2 * param_bytes  # Adam's exp_avg and exp_avg_sq
    assert max(cats["gradient"]) >= param_bytes
    # activations peak at the end of forward, far above what is left when the step ends
    end_of_forward = next(e for s, p, _, e in timeline.phases if (s, p) == (1, "forward"))
    at = max(i for i, t in enumerate(timeline.times_ms) if t <= end_of_forward)
    assert cats["activation"][at] > 10 * cats["activation"][-1]
    # the first step has no optimizer state yet while its activations peak: later steps peak higher
    assert timeline.peak(2) > timeline.peak(1)



_CELL = """
import os, torch
from lab.config import PRESETS
from lab.model import build_model, materialize
from lab.measure.memory_timeline import language_model_step, memory_timeline
model = materialize(build_model(PRESETS["tiny"]), seed=0)
tokens = torch.randint(0, 256, (2, 16))
step = language_model_step(model, torch.optim.AdamW(model.parameters()), tokens, tokens)
def noisy_step():
    step()
    os.write(2, b"a native warning\\n")
memory_timeline(noisy_step, steps=1)
print("timeline done")
"""


def test_profiler_markers_do_not_reach_the_notebook(jupyter_env, monkeypatch):
    """Kineto writes "USDT: ... profiler_start" to descriptor 2, which the kernel shows under the cell (chapter
    01's first demo did). In a fresh kernel, as a learner's: the markers are gone, other native output stays."""
    for name, value in jupyter_env.items():
        monkeypatch.setenv(name, value)
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(_CELL)])
    NotebookClient(nb, kernel_name="python3", timeout=120, startup_timeout=60,
                   resources={"metadata": {"path": str(Path(__file__).parents[1])}}).execute()
    streams = {}
    for output in nb.cells[0].outputs:
        assert output.output_type == "stream", output
        streams[output.name] = streams.get(output.name, "") + output.text
    assert streams.get("stdout") == "timeline done\n"
    for marker in ("USDT", "profiler_start", "profiler_stop", "STAGE:"):
        assert marker not in streams.get("stderr", ""), streams
    assert "a native warning" in streams.get("stderr", "")
