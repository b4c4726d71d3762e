"""Continuous batching: every step, decide which sequences run and how many of their tokens.

Static batching runs a batch until its longest request is done, so short requests idle in the batch and new
ones wait outside it. Continuous (iteration-level) batching, from Orca (Yu et al., OSDI 2022), decides the batch
again at every step: a finished sequence leaves at once and a waiting one takes its place. What limits a step is
a *token budget* (`max_num_batched_tokens`, the tokens one forward pass may process) and `max_num_seqs` (the
sequences in flight), as in vLLM V1, which has no separate prefill and decode phases, only a budget:

1. Running sequences first, in the order they were admitted: each takes what it still has to compute (1 token
   for a decode, the rest of its prompt for a prefill in progress), cut to the budget left when chunked prefill
   is on. A sequence that needs a new block and finds none preempts the most recently admitted running sequence
   (itself, if it is the last one): its blocks are freed, `num_computed_tokens` goes back to 0 and it goes to the
   FRONT of the waiting queue. Its generated tokens are kept: when it is admitted again, prompt and generated
   tokens are prefilled together (preemption by recompute; with prefix caching, its own committed blocks are
   likely still cached, so the recompute is cheap).
2. Then waiting sequences in arrival order (FCFS), while the budget, `max_num_seqs` and the free blocks allow.
   The head of the queue is never skipped for a smaller request behind it: that would starve long prompts.

Chunked prefill (Sarathi, Agrawal et al. 2023) cuts a long prompt into budget-sized pieces over several steps,
so a 10,000-token prompt does not stall every running decode for one long step: decodes are scheduled first and
the prompt gets what is left. Without it a prompt runs whole or waits, and `add` refuses a prompt that no step
could ever hold. A preempted sequence's recompute is always split: it may by now be longer than any step.

`update` is the other half of a step: it advances each sequence by its chunk, appends the sampled token to those
whose chunk reached their last token, publishes newly full blocks to the prefix cache, and retires finished
sequences. `abort` takes a sequence out wherever it is (a server's client disconnected), freeing its blocks.
"""

from __future__ import annotations

from collections import deque

from lab.inference.block_manager import BlockManager
from lab.inference.sequence import Sequence, SequenceStatus


class Scheduler:
    """Continuous batching over a `BlockManager`, under a token budget and a cap on sequences in flight."""

    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        chunked_prefill: bool = True,
    ) -> None:
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={max_num_seqs} must be >= 1")
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens={max_num_batched_tokens} must be >= max_num_seqs={max_num_seqs}, "
                "so that every running sequence can decode its token in each step"
            )
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunked_prefill = chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in order of admission: the last one is preempted first

    def add(self, seq: Sequence) -> None:
        """Queue a new request. Refuses one that could never run, rather than letting it wait forever."""
        if seq.status is not SequenceStatus.WAITING or seq.num_computed_tokens or seq.block_table:
            raise ValueError(f"sequence {seq.seq_id} is {seq.status.name} with state; add only new sequences")
        if not self.chunked_prefill and seq.num_tokens > self.max_num_batched_tokens:
            raise ValueError(
                f"prompt of {seq.num_tokens} tokens (sequence {seq.seq_id}) exceeds max_num_batched_tokens="
                f"{self.max_num_batched_tokens}; without chunked prefill a prompt must fit in one step"
            )
        # The most K/V it will ever hold: prompt + max_tokens - 1 (the last sampled token is never run).
        most_slots = seq.num_prompt_tokens + seq.params.max_tokens - 1
        bm = self.block_manager
        if bm.blocks_needed(most_slots) > bm.num_blocks:
            raise ValueError(
                f"sequence {seq.seq_id} may need {most_slots} token slots ({bm.blocks_needed(most_slots)} blocks of "
                f"{bm.block_size}) but the cache has only {bm.num_blocks} blocks"
            )
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, seq: Sequence) -> None:
        """Cancel an unfinished sequence between steps: out of the queue or the running list, its blocks freed (full
        ones stay in the prefix cache, as after a normal finish). Aborting a finished sequence changes nothing."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.block_manager.free(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        else:
            return
        seq.status = SequenceStatus.ABORTED

    def _chunk(self, seq: Sequence, remaining: int, budget_left: int) -> int:
        """How many of the sequence's `remaining` tokens run this step (0: it waits for a roomier step)."""
        if remaining <= budget_left:
            return remaining
        if self.chunked_prefill or seq.preemptions:
            return budget_left
        return 0

    def _preempt(self, seq: Sequence) -> None:
        """Preemption by recompute: drop the sequence's K/V, keep its tokens, and queue it first in line."""
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.preemptions += 1
        self.waiting.appendleft(seq)

    def _reserve(self, seq: Sequence, n: int) -> bool:
        """Get the slots for a running sequence's next n tokens, preempting from the back of the running list
        until they fit. False when the sequence itself had to go (it was the last one left to preempt)."""
        while not self.block_manager.ensure_slots(seq, n):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def schedule(self) -> list[tuple[Sequence, int]]:
        """The sequences that run this step and how many new tokens each, in batch order."""
        scheduled: list[tuple[Sequence, int]] = []
        budget = self.max_num_batched_tokens

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = self._chunk(seq, seq.num_tokens - seq.num_computed_tokens, budget)
            if n == 0 or not self._reserve(seq, n):
                break
            scheduled.append((seq, n))
            budget -= n
            i += 1

        # A sequence preempted just now is at the head of the queue and needs at least the blocks it gave up, one
        # of which went to the sequence that preempted it: it cannot come straight back in this step, and FCFS
        # keeps everyone behind it waiting too, so a preemption is never undone within a step.
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            cached = self.block_manager.num_cached_tokens(seq)
            n = self._chunk(seq, seq.num_tokens - cached, budget)
            if n == 0 or not self.block_manager.allocate(seq):
                break  # FCFS: nobody overtakes the head of the queue
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append((seq, n))
            budget -= n
        return scheduled

    def update(self, scheduled: list[tuple[Sequence, int]], sampled: dict[int, int]) -> list[Sequence]:
        """Apply a step's results; return the sequences that finished in it. `sampled[seq_id]` is needed for
        exactly the sequences whose chunk reached the end of their tokens (the others ran part of a prefill)."""
        finished = []
        for seq, n in scheduled:
            seq.num_computed_tokens += n
            got_token = seq.num_computed_tokens == seq.num_tokens
            if got_token:
                seq.append(sampled[seq.seq_id])
            self.block_manager.commit(seq)
            if got_token and seq.should_stop():
                seq.status = SequenceStatus.FINISHED
                self.running.remove(seq)
                self.block_manager.free(seq)
                finished.append(seq)
        return finished
