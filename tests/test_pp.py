"""Pipeline parallelism on real ranks: every schedule gives the single-process loss and gradients; AFAB holds
m micro-batches, 1F1B at most p - r; the zero-bubble W pass computes autograd's weight gradients; torch's
own `torch.distributed.pipelining` schedules agree."""

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lab.calc.bubble import simulate
from lab.calc.memory import estimate_memory
from lab.calc.schedules import make_schedule, rank_layers, virtual_stage_of
from lab.config import PRESETS, ParallelConfig
from lab.distributed import count_collectives, run
from lab.model import build_model, materialize
from lab.parallel.pp import Pipeline, build_chunk, weight_gradients

CFG = dataclasses.replace(PRESETS["tiny"], n_layers=4, vocab_size=96, d_ff=80)
BATCH, SEQ = 12, 16


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, CFG.vocab_size, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    return tokens[:, :-1], tokens[:, 1:]


def _reference() -> tuple[float, dict[str, torch.Tensor]]:
    inputs, targets = _batch()
    model = materialize(build_model(CFG), seed=1)
    loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


def _pipeline(name: str, microbatches: int, chunks: int, own_loss: bool = False):
    rank, pp = dist.get_rank(), dist.get_world_size()
    schedule = make_schedule(name, pp, microbatches, chunks)
    stages = [schedule.virtual_stage(rank, c) for c in range(chunks)]
    modules = [build_chunk(CFG, stage, schedule.virtual_stages, seed=1) for stage in stages]
    pipeline = Pipeline(modules, schedule, None, **({"loss_fn": None} if own_loss else {}))
    with count_collectives() as counts:
        loss = pipeline.step(*_batch())
    grads = {n: p.grad for module in modules for n, p in module.named_parameters()}
    return (None if loss is None else loss.item()), grads, pipeline.peak_in_flight, counts.calls["isend"]


CASES = [("afab", 2, 4, 1), ("1f1b", 2, 3, 1), ("1f1b", 2, 1, 1), ("1f1b", 4, 2, 1), ("1f1b", 4, 6, 1),
         ("afab", 4, 12, 1), ("interleaved", 2, 4, 2), ("interleaved", 2, 2, 2), ("interleaved", 2, 6, 2),
         ("zb-h1", 2, 3, 1), ("zb-h1", 4, 4, 1), ("zb-h1", 4, 6, 1)]


@pytest.mark.parametrize("name, pp, microbatches, chunks", CASES)
def test_every_schedule_equals_one_process(name, pp, microbatches, chunks):
    """m = p, m < p, m > p and not a multiple of p, and (1f1b, pp 2, m 1) the naive pipeline; each parameter
    lives on exactly one rank."""
    ref_loss, ref_grads = _reference()
    results = run(_pipeline, pp, name, microbatches, chunks)
    losses = [loss for loss, *_ in results if loss is not None]
    assert len(losses) == 1 and losses[0] == pytest.approx(ref_loss, rel=1e-6)
    seen = {}
    for _, grads, _, _ in results:
        assert not set(grads) & set(seen), "a parameter on two ranks"
        seen.update(grads)
    assert set(seen) == set(ref_grads)
    for name_, grad in seen.items():
        torch.testing.assert_close(grad, ref_grads[name_], rtol=1e-5, atol=1e-6, msg=lambda m, n=name_: f"{n}: {m}")
    # one activation forward and one gradient back per micro-batch and boundary between virtual stages
    sends = sum(count for *_, count in results)
    assert sends == 2 * microbatches * (pp * chunks - 1)


@pytest.mark.parametrize("name, pp, microbatches, chunks", [("1f1b", 2, 3, 1), ("interleaved", 2, 4, 2),
                                                           ("zb-h1", 2, 3, 1)])
def test_the_last_stages_chunked_loss_equals_one_process(name, pp, microbatches, chunks):
    """`loss_fn=None`, what `parallelize` passes at tp = 1: the last stage's own chunked cross-entropy, which never
    calls the output layer — under zero-bubble its weight's gradient, computed in the loss's forward, is asked for
    in B and accumulated in W — gives the whole-logits single-process loss and gradients."""
    ref_loss, ref_grads = _reference()
    results = run(_pipeline, pp, name, microbatches, chunks, True)
    assert [loss for loss, *_ in results if loss is not None] == [pytest.approx(ref_loss, rel=1e-6)]
    seen = {n: g for _, grads, _, _ in results for n, g in grads.items()}
    assert set(seen) == set(ref_grads)
    for name_, grad in seen.items():
        torch.testing.assert_close(grad, ref_grads[name_], rtol=1e-5, atol=1e-6, msg=lambda m, n=name_: f"{n}: {m}")


@pytest.mark.parametrize("pp, microbatches", [(2, 6), (4, 12), (4, 2)])
def test_afab_holds_every_micro_batch_and_one_f_one_b_at_most_p_minus_r(pp, microbatches):
    """Measured by the pipeline: activations stashed between a forward and its backward, per rank."""
    afab = [peak for *_, peak, _ in run(_pipeline, pp, "afab", microbatches, 1)]
    one_f_one_b = [peak for *_, peak, _ in run(_pipeline, pp, "1f1b", microbatches, 1)]
    assert afab == [microbatches] * pp
    assert one_f_one_b == [min(microbatches, pp - r) for r in range(pp)]
    assert one_f_one_b == simulate(make_schedule("1f1b", pp, microbatches)).peak_activations
    # ZB-H1 holds a micro-batch until its W: the simulator counts the same
    zb = [peak for *_, peak, _ in run(_pipeline, pp, "zb-h1", microbatches, 1)]
    assert zb == simulate(make_schedule("zb-h1", pp, microbatches)).peak_activations


def test_deferred_weight_gradients_equal_autograds():
    """The W pass of zero-bubble schedules (from each module's input and output gradient) reproduces what
    autograd's backward accumulates into .grad, for every kind of weighted module in lab.model."""
    torch.manual_seed(0)
    modules = [torch.nn.Linear(6, 5), materialize(build_model(CFG), seed=1).layers["0"].attn_norm,
               torch.nn.Embedding(11, 6)]
    inputs = [torch.randn(3, 4, 6), torch.randn(3, 4, CFG.d_model), torch.randint(0, 11, (3, 4))]
    for module, x in zip(modules, inputs, strict=True):
        out = module(x)
        grad_out = torch.randn_like(out)
        out.backward(grad_out)
        expected = {n: p.grad.clone() for n, p in module.named_parameters()}
        module.zero_grad(set_to_none=True)
        weight_gradients(module, x, grad_out)
        for n, p in module.named_parameters():
            torch.testing.assert_close(p.grad, expected[n], msg=lambda m, n=n, mod=module: f"{mod}.{n}: {m}")


def _timed(name: str, microbatches: int, delay: float):
    rank, pp = dist.get_rank(), dist.get_world_size()
    schedule = make_schedule(name, pp, microbatches)
    pipeline = Pipeline([build_chunk(CFG, rank, pp, seed=1)], schedule, None,
                        op_delay={"F": delay, "B": 2 * delay, "W": delay})
    pipeline.step(*_batch())
    return [(str(t.op), t.reached, t.start, t.end) for t in pipeline.timings]


def test_ops_are_timed_in_schedule_order():
    timings = run(_timed, 2, "1f1b", 4, 0.0)
    for rank, spans in enumerate(timings):
        assert [op for op, *_ in spans] == [str(op) for op in make_schedule("1f1b", 2, 4).ops[rank]]
        assert all(reached <= start <= end for _, reached, start, end in spans)
        assert all(a[3] <= b[1] for a, b in zip(spans, spans[1:], strict=False))


def test_chunks_hold_the_layers_the_memory_model_counts():
    """Megatron's round-robin (chunk c of rank r is virtual stage c·pp + r), as built and as costed."""
    cfg = dataclasses.replace(CFG, n_layers=8)
    assert rank_layers(8, 2, 2) == [[0, 1, 4, 5], [2, 3, 6, 7]]
    for pp, chunks in ((2, 1), (2, 2), (4, 2)):
        built = [[int(name) for c in range(chunks) for name in
                  build_chunk(cfg, virtual_stage_of(rank, c, pp), pp * chunks, device="meta").layers]
                 for rank in range(pp)]
        assert built == rank_layers(8, pp, chunks)


def test_bad_layouts_are_one_clear_line():
    with pytest.raises(ValueError, match=r"pp\*chunks = 3 must divide n_layers=4"):
        build_chunk(CFG, 0, 3)
    with pytest.raises(ValueError, match=r"virtual_stage=4 must be in \[0, 4\)"):
        build_chunk(CFG, 4, 4)
    with pytest.raises(ValueError, match="ties its embedding and output weights"):
        build_chunk(PRESETS["smollm-135m"], 0, 2, device="meta")


def _torch_pipelining(name: str, microbatches: int):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    rank, pp = dist.get_rank(), dist.get_world_size()
    chunks = 2 if name == "interleaved" else 1
    modules = [build_chunk(CFG, rank + c * pp, pp * chunks, seed=1) for c in range(chunks)]
    stages = [PipelineStage(m, rank + c * pp, pp * chunks, torch.device("cpu")) for c, m in enumerate(modules)]
    schedule_class = {"afab": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B}[name]
    schedule = schedule_class(stages if chunks > 1 else stages[0], n_microbatches=microbatches,
                              loss_fn=lambda out, target: F.cross_entropy(out.flatten(0, 1), target.flatten()))
    inputs, targets = _batch()
    losses: list[torch.Tensor] = []
    schedule.step(*((inputs,) if rank == 0 else ()), **({"target": targets, "losses": losses} if rank == pp - 1
                                                         else {}))
    grads = {n: p.grad for m in modules for n, p in m.named_parameters()}
    return (sum(loss.item() for loss in losses) / microbatches if losses else None), grads


@pytest.mark.parametrize("name", ["afab", "1f1b", "interleaved"])
def test_torch_pipelining_gives_the_same_loss_and_gradients(name):
    """ScheduleGPipe / Schedule1F1B / ScheduleInterleaved1F1B on the same chunks (torch scales the gradients
    by 1/m, as lab does through the loss)."""
    ours = run(_pipeline, 2, name, 4, 2 if name == "interleaved" else 1)
    theirs = run(_torch_pipelining, 2, name, 4)
    assert [r[0] for r in ours if r[0] is not None] == pytest.approx([r[0] for r in theirs if r[0] is not None])
    for (_, our_grads, *_), (_, their_grads) in zip(ours, theirs, strict=True):
        for n, grad in our_grads.items():
            torch.testing.assert_close(grad, their_grads[n], rtol=1e-5, atol=1e-6)


class _ChunkPeaks(Pipeline):
    """The executor, also recording how many micro-batches each of its chunks holds at most: chunk 0 of rank
    0 holds the embedding's activations, the last chunk of the last rank the output layer's and the logits."""

    def step(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        self.chunk_peaks = [0] * len(self.chunks)
        return super().step(tokens, targets)

    def _forward(self, op) -> None:
        super()._forward(op)
        held = sum(1 for _, chunk in self._stash if chunk == op.chunk)
        self.chunk_peaks[op.chunk] = max(self.chunk_peaks[op.chunk], held)


def _in_flight(name: str, microbatches: int, chunks: int) -> tuple[int, list[int]]:
    rank, pp = dist.get_rank(), dist.get_world_size()
    schedule = make_schedule(name, pp, microbatches, chunks)
    modules = [build_chunk(CFG, schedule.virtual_stage(rank, c), schedule.virtual_stages, seed=1)
               for c in range(chunks)]
    pipeline = _ChunkPeaks(modules, schedule, None)
    pipeline.step(*_batch())
    return pipeline.peak_in_flight, pipeline.chunk_peaks


@pytest.mark.parametrize("name, pp, microbatches, chunks", [
    ("afab", 2, 6, 1), ("afab", 4, 12, 1), ("1f1b", 4, 12, 1), ("1f1b", 4, 2, 1), ("zb-h1", 4, 12, 1),
    ("interleaved", 2, 4, 2), ("interleaved", 2, 6, 2)])
def test_memory_calculator_holds_what_the_executor_holds(name, pp, microbatches, chunks):
    """lab.calc.memory's activation terms per stage — the layers, the embedding (first stage) and the logits
    (last stage) — are one micro-batch's worth times the micro-batches the executor really keeps: AFAB keeps
    all m micro-batches' logits, not one; interleaving keeps more embeddings than min(m, p); ZB-H1 keeps a
    micro-batch, logits included, until its W."""
    measured = run(_in_flight, pp, name, microbatches, chunks)
    mbs = BATCH // microbatches
    one = estimate_memory(CFG, SEQ, mbs, ParallelConfig(grad_accum=microbatches)).activations_breakdown
    parallel = ParallelConfig(pp=pp, grad_accum=microbatches, pp_schedule=name, pp_virtual_stages=chunks)
    for stage, (total, per_chunk) in enumerate(measured):
        got = estimate_memory(CFG, SEQ, mbs, parallel, stage=stage).activations_breakdown
        assert got["layers"] == pytest.approx(one["layers"] / pp * total / chunks), f"stage {stage} layers"
        assert got["embedding"] == (one["embedding"] * per_chunk[0] if stage == 0 else 0), f"stage {stage}"
        assert got["logits"] == (one["logits"] * per_chunk[-1] if stage == pp - 1 else 0), f"stage {stage}"
