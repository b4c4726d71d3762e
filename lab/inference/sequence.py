"""A request as the serving engine tracks it: its tokens, how many of them have K/V in the paged cache, its blocks.

The one number that drives everything is `num_computed_tokens`: the tokens [0, num_computed_tokens) have their
keys and values in the cache, the rest still have to go through the model. A prefill, a chunk of a prefill, a
decode and the recompute after a preemption are all the same operation seen this way: run the tokens
[num_computed_tokens, num_computed_tokens + n) and advance the count by n. When the count reaches the end of
`token_ids`, the model's last logits give the next token, which is appended, and the sequence is one token
behind again (the new token's K/V are computed by the next step). So a decode is a chunk of length 1, and the
scheduler never needs to know which "phase" a sequence is in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, auto

from lab.inference.sampling import SamplingParams


class SequenceStatus(Enum):
    """WAITING: queued, holds no blocks (new, or preempted). RUNNING: admitted, holds blocks, scheduled every step
    the budget allows. FINISHED: done; its blocks are released (full ones stay in the prefix cache). ABORTED:
    cancelled before it finished (its client went away); its blocks are released the same way."""

    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()
    ABORTED = auto()


@dataclass
class Sequence:
    """One request. `token_ids` holds the prompt followed by the generated tokens; the first
    `num_prompt_tokens` of them are the prompt. `block_table[i]` is the physical block holding positions
    [i * block_size, (i + 1) * block_size). `num_cached_prompt_tokens` (prompt tokens whose K/V came from the
    prefix cache at the latest admission) and `preemptions` are statistics only."""

    seq_id: int
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    num_cached_prompt_tokens: int = 0
    preemptions: int = 0

    def __post_init__(self) -> None:
        self.token_ids = list(self.token_ids)  # our own copy: appending must not change the caller's prompt list
        if not 1 <= self.num_prompt_tokens <= len(self.token_ids):
            raise ValueError(
                f"num_prompt_tokens={self.num_prompt_tokens} must be in [1, {len(self.token_ids)}] "
                "(a request needs a non-empty prompt, and the prompt is a prefix of token_ids)"
            )

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def generated(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append(self, token_id: int) -> None:
        """Add a sampled token. Its K/V are not computed yet: that is the next step's single-token chunk."""
        self.token_ids.append(token_id)

    def should_stop(self) -> bool:
        """Whether the last appended token ends the request: `max_tokens` reached, or a stop token (kept in the
        output, as vLLM keeps it)."""
        if self.num_generated >= self.params.max_tokens:
            return True
        return self.num_generated > 0 and self.last_token in self.params.stop_token_ids
