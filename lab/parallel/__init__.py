"""Parallelisms applied to `lab.model`, each written from `torch.distributed` primitives."""
