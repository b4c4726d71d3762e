"""The training objective, beside the model: what a step minimises, the same for every layout.

What belongs here: losses computed from the model's outputs and its layers' own records, on whole tensors — the
language-model cross-entropy on whole logits, and a mixture of experts' router losses with their weights. What
does not: a loss that needs a process group (the vocabulary-parallel cross-entropy lives with TP in
`lab.parallel.tp`), and a kernel that computes one of these faster (`lab.kernels.cross_entropy` has
`cross_entropy`'s signature and is passed in its place).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from lab.config import ModelConfig
from lab.model import moe_losses

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean next-token loss of logits (B, T, vocab): the last pipeline stage's loss, and one process's."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def router_loss(module: nn.Module, cfg: ModelConfig) -> torch.Tensor:
    """The load-balancing and z losses of `module`'s MoE layers after its forward (the model, or a pipeline
    stage's chunk), with the weights `cfg` gives them: what is added to the cross-entropy before backward."""
    aux, z = moe_losses(module)
    return cfg.aux_loss_coef * aux + cfg.z_loss_coef * z
