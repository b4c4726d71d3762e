"""LLMEngine: requests in, tokens out, one scheduled step at a time (nano-vllm's and vLLM's loop).

    engine = LLMEngine(model, EngineConfig(num_blocks=64, block_size=16))
    outputs = engine.generate([prompt_a, prompt_b], SamplingParams(max_tokens=32))

Each `step()`: the scheduler picks which sequences run and how many tokens each (continuous batching: a request
joins as soon as a slot and blocks are free, and leaves the step it finishes), the model runner runs those tokens
over the paged cache, each sequence that reached the end of its known tokens samples one (with its own seeded
generator, so that its tokens do not depend on its batch-mates), and the scheduler books the result. `timeline`
records what each step ran, for the chapter's picture of continuous batching.

A server (`lab.inference.server`) adds two calls, made between steps: `abort(seq_id)` when a client goes away,
and `pop(seq_id)` once a request's tokens are delivered, so that a long-running engine does not keep every
request it ever served.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from lab.inference.block_manager import BlockManager
from lab.inference.model_runner import ModelRunner
from lab.inference.sampling import SamplingParams, sample
from lab.inference.scheduler import Scheduler
from lab.inference.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class EngineConfig:
    """The engine's budgets: `num_blocks` blocks of `block_size` tokens of KV cache; at most `max_num_seqs`
    sequences and `max_num_batched_tokens` tokens a step; prompts split over steps (`chunked_prefill`); full
    blocks shared between requests with the same prefix (`enable_prefix_caching`); the paged attention of a pure
    decode step in torch (gather) or the Triton kernel of chapter 09."""

    num_blocks: int = 256
    block_size: int = 16
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    attention: str = "torch"


@dataclass
class StepRecord:
    """What one step ran: (seq_id, new tokens) per sequence, its wall time, and the sequences that finished."""

    ran: list[tuple[int, int]]
    seconds: float
    finished: list[int] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.ran)


class LLMEngine:
    def __init__(self, model: nn.Module, config: EngineConfig | None = None) -> None:
        self.config = config = config or EngineConfig()
        self.block_manager = BlockManager(config.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.chunked_prefill)
        self.runner = ModelRunner(model, self.block_manager, config.attention)
        self.sequences: dict[int, Sequence] = {}
        self.generators: dict[int, torch.Generator | None] = {}
        self.timeline: list[StepRecord] = []
        self._ids = itertools.count()

    def add_request(self, prompt: list[int], params: SamplingParams) -> int:
        """Queue a request; returns its seq_id."""
        if not prompt:
            raise ValueError("a prompt needs at least one token")
        seq = Sequence(next(self._ids), list(prompt), len(prompt), params)
        self.scheduler.add(seq)  # raises on a prompt the budgets can never run
        self.sequences[seq.seq_id] = seq
        self.generators[seq.seq_id] = params.generator(self.runner.device)
        return seq.seq_id

    def step(self) -> list[Sequence]:
        """Run one scheduled step; return the sequences that finished in it."""
        start = time.perf_counter()
        scheduled = self.scheduler.schedule()
        if not scheduled and self.scheduler.has_unfinished():
            raise RuntimeError("no sequence could be scheduled: the KV cache cannot hold even one request "
                               f"({self.config.num_blocks} blocks of {self.config.block_size} tokens)")
        logits = self.runner.run(scheduled)
        sampled = {sid: sample(row, self.sequences[sid].params, self.generators[sid]) for sid, row in logits.items()}
        finished = self.scheduler.update(scheduled, sampled)
        self.timeline.append(StepRecord([(seq.seq_id, n) for seq, n in scheduled], time.perf_counter() - start,
                                        [seq.seq_id for seq in finished]))
        return finished

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def abort(self, seq_id: int) -> None:
        """Cancel a request between steps: it stops being scheduled and its KV blocks go back to the pool."""
        self.scheduler.abort(self.sequences[seq_id])

    def pop(self, seq_id: int) -> Sequence:
        """Forget a finished or aborted request (its record and generator) and return it."""
        seq = self.sequences[seq_id]
        if seq.status not in (SequenceStatus.FINISHED, SequenceStatus.ABORTED):
            raise ValueError(f"sequence {seq_id} is {seq.status.name}: abort it before popping it")
        del self.generators[seq_id]
        return self.sequences.pop(seq_id)

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
        """Run every prompt to completion; the generated tokens of each, in the prompts' order."""
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"{len(per_prompt)} SamplingParams for {len(prompts)} prompts")
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, per_prompt, strict=True)]
        while self.has_unfinished():
            self.step()
        return [self.sequences[i].generated for i in ids]
