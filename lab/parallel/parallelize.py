"""Every parallelism on one mesh: `parallelize` builds this rank's part of the model and what steps it.

TorchTitan's order, applied to each pipeline stage (one stage when pp = 1), on the `meta` device:

  1. pipeline split  keep the stage's layers (`lab.parallel.pp.cut_to_stage`); interleaved: several chunks
  2. TP (+SP)        split attention heads, FFN width and vocabulary over tp (`lab.parallel.tp`)
  3. CP              swap every attention core for ring or Ulysses attention (`lab.parallel.cp`)
  4. EP              keep this rank's experts, route through the all-to-all (`lab.parallel.ep`)
  5. recompute       activation checkpointing (`lab.model.set_recompute`)
  6. materialise     allocate only what is left and fill it with its slice of the single-process values
  7. precision       cast to the compute dtype; FP8 GEMMs into the blocks' linears (`lab.precision.scheme`)
  8. compile         `torch.compile` each block's forward, as rewritten by 1-7 (`lab.parallel.compile`)
  9. DP / ZeRO       the engine that averages gradients over dp x cp (experts over ep_dp), or shards them, summing
                     in `reduce_dtype`; fp32 master weights of what this rank updates (`lab.precision.master`)

Each step that shards a parameter records its `Placement`; once the layout is known, `replicas` says how many
ranks hold each value, so that gradient reduction, clipping (and checkpoints) read one description. The model
itself (`lab.model`) knows nothing of any of it.

    par = parallelize(config.model, mesh, config.parallel, device, seed, seq_len, precision=scheme)
    optimizer = adamw(par.parameters(), lr, weight_decay)   # the fp32 masters under bf16/fp16
    inputs, targets = par.batch(*data.next_batch())
    loss, moe = par.forward_backward(inputs, targets)       # the pipeline's schedule, or gradient accumulation
    par.finish_gradients()
    loss = par.mean_loss(loss)
    ... clip, optimizer.step() ...
    par.after_step()
    par.zero_grad()
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from lab.calc.schedules import make_schedule
from lab.config import ModelConfig, ParallelConfig
from lab.data import shard_rows
from lab.distributed import Mesh
from lab.loss import LossFn, cross_entropy, model_loss, router_loss
from lab.model import MoE, Transformer, build_model, init_tensor, set_recompute
from lab.parallel.compile import apply_compile, graph_breaks
from lab.parallel.cp import apply_context_parallel, layout_of, sequence_positions, shard_sequence
from lab.parallel.dp import DataParallel, NaiveDP, storage_bytes
from lab.parallel.ep import ExpertDataParallel, apply_expert_parallel
from lab.parallel.placement import placement_of, set_replicas, sum_partial_gradients
from lab.parallel.pp import Boundary, Pipeline, cut_to_stage
from lab.parallel.tp import apply_tensor_parallel, vocab_parallel_cross_entropy
from lab.parallel.zero import make_data_parallel
from lab.precision.master import MasterWeights
from lab.precision.scheme import PrecisionScheme, cast_model, convert_to_fp8, precision_scheme


@torch.no_grad()
def materialize_local(model: Transformer, device: str | torch.device, seed: int) -> Transformer:
    """Allocate a (sharded) `meta` model on `device`: each parameter is its placement's piece of the full value
    `init_tensor` draws by name, so every layout starts from the single-process weights. Only one full tensor
    exists at a time, and only while its piece is cut from it. On `meta` (a dry run) nothing is allocated."""
    if torch.device(device).type == "meta":
        return model
    placements = {name: placement_of(param) for name, param in model.named_parameters()}
    model.to_empty(device=device)  # new Parameter objects: the placements are put back below
    model.tie_weights()
    for name, param in model.named_parameters():
        spot = placements[name]
        param.copy_(spot.local(init_tensor(name, spot.full_shape(tuple(param.shape)), model.cfg, seed)))
        param.placement = spot
    return model


@dataclass
class LocalBatch:
    """This rank's part of a global batch: its rows (dp) and its chunks of the sequence (cp), with the global
    positions of those tokens for RoPE. The one thing the training loop asks about the data layout."""

    dp_rank: int
    dp: int
    cp_rank: int
    cp: int
    cp_layout: str
    device: torch.device
    seq_len: int

    @property
    def positions(self) -> torch.Tensor:
        return sequence_positions(self.seq_len, self.cp_rank, self.cp, self.cp_layout).to(self.device)

    def __call__(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets = (shard_rows(t, self.dp_rank, self.dp) for t in (inputs, targets))
        if self.cp > 1:
            inputs, targets = (shard_sequence(t, self.cp_rank, self.cp, self.cp_layout) for t in (inputs, targets))
        return inputs.to(self.device), targets.to(self.device)


class MoEStats:
    """The router's losses and what the MoE layers report over one step: assignments per expert, dropped ones,
    the balancing loss (mean over layers, micro-batches and ranks). It lives with the layout because its sum over
    ranks must know which of them routed the same tokens."""

    def __init__(self, cfg: ModelConfig, tp: int) -> None:
        self.cfg, self.tp = cfg, tp
        self.reset()

    def reset(self) -> None:
        self.load = torch.zeros(self.cfg.n_experts, dtype=torch.double)
        self.layer_load = torch.zeros(self.cfg.n_layers, self.cfg.n_experts, dtype=torch.double)  # row: a block
        self.dropped = self.aux = self.layer_forwards = 0.0

    def router_loss(self, module: nn.Module) -> torch.Tensor:
        """After `module`'s forward (the model, or a pipeline stage's chunk): its MoE layers' weighted balancing
        and z losses (`lab.loss.router_loss`), to add to what is backpropagated; their load is recorded."""
        for m in (m for m in module.modules() if isinstance(m, MoE)):
            self.load += m.load.cpu().double()
            self.layer_load[m.layer] += m.load.cpu().double()
            self.dropped += m.dropped
            self.aux += m.aux_loss.item()
            self.layer_forwards += 1
        return router_loss(module, self.cfg)

    def summary(self) -> dict:
        """The step's record, summed over every rank: expert_load (assignments per expert), its max/mean
        load_imbalance (1 when balanced), expert_load_per_layer, dropped_tokens, aux_loss (1 when balanced)."""
        totals = torch.cat([self.layer_load.flatten(), self.load,
                            torch.tensor([self.dropped, self.aux, self.layer_forwards])])
        if dist.is_initialized():  # every rank routed its own tokens through its own layers...
            dist.all_reduce(totals)
            totals[:-2] /= self.tp  # ...except the TP ranks of one group, which route the same ones
        per_layer, load = totals[:self.layer_load.numel()].view_as(self.layer_load), totals[self.layer_load.numel():-3]
        return {"expert_load": [round(n) for n in load.tolist()], "load_imbalance": (load.max() / load.mean()).item(),
                "expert_load_per_layer": {str(i): [round(n) for n in row.tolist()] for i, row in enumerate(per_layer)
                                          if self.cfg.is_moe_layer(i)},
                "dropped_tokens": round(totals[-3].item()), "aux_loss": (totals[-2] / totals[-1]).item()}


@dataclass
class Parallelized:
    """What `parallelize` gives a rank: its part of the model, the pipeline driving it (None when pp = 1), the
    data-parallel engine, the master weights the optimizer updates, the loss function on whole logits, how to cut
    its batch, (a mixture of experts) the router's record, and whether training takes the model's own chunked loss
    (`chunked_loss`: `lab.loss.chunked_cross_entropy`, never the whole micro-batch's fp32 logits) instead of
    `loss_fn` on its logits. A training loop needs only its methods."""

    model: nn.Module
    pipeline: Pipeline | None
    engine: DataParallel
    loss_fn: LossFn
    batch: LocalBatch
    mesh: Mesh | None
    masters: MasterWeights
    precision: PrecisionScheme
    micro_batches: int = 1  # per optimizer step: gradient accumulation's, or the pipeline schedule's
    moe: MoEStats | None = None
    chunked_loss: bool = False

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor, grad_scale: float = 1.0
                         ) -> tuple[torch.Tensor, dict | None]:
        """One optimizer step's forwards and backwards over this rank's batch (from `batch`): the pipeline's
        schedule, or the micro-batches in turn. What is backpropagated is the loss (plus an MoE model's weighted
        router losses) times `grad_scale`, fp16's loss scale. Returns this rank's mean cross-entropy (zero on a
        pipeline stage without the loss; `mean_loss` gathers it) and, for a mixture of experts, the step's
        `MoEStats.summary` over all ranks (else None)."""
        if self.moe is not None:
            self.moe.reset()
        if self.pipeline is not None:
            with self.engine.no_sync():  # the schedule's backwards accumulate; gradients are reduced after
                loss = self.pipeline.step(inputs, targets, self.batch.positions, grad_scale)
            loss = torch.zeros((), device=inputs.device) if loss is None else loss
        else:
            loss = self._accumulate_gradients(inputs, targets, grad_scale)
        return loss, self.moe.summary() if self.moe is not None else None

    def _accumulate_gradients(self, inputs: torch.Tensor, targets: torch.Tensor, grad_scale: float) -> torch.Tensor:
        """Forward and backward of every micro-batch in turn (gradient accumulation); the mean cross-entropy."""
        loss = torch.zeros((), device=inputs.device)
        positions = self.batch.positions
        pairs = list(zip(inputs.chunk(self.micro_batches), targets.chunk(self.micro_batches), strict=True))
        scale = grad_scale / self.micro_batches  # what each micro-batch's backward starts from
        for i, (micro_in, micro_tgt) in enumerate(pairs):
            # no gradient communication until the last micro-batch's backward
            with self.engine.backward_context(last_micro_batch=i == len(pairs) - 1):
                micro_loss = model_loss(self.model, micro_in, positions, micro_tgt,
                                        None if self.chunked_loss else self.loss_fn, scale)
                objective = micro_loss + (self.moe.router_loss(self.model) if self.moe is not None else 0.0)
                (objective * scale).backward()
            loss += micro_loss.detach() / self.micro_batches
        return loss

    def parameters(self) -> list[torch.Tensor]:
        """The tensors this rank's optimizer updates: its whole parameters, TP shards or ZeRO pieces — or, under
        bf16/fp16, their fp32 master copies."""
        return self.masters.master_params

    def finish_gradients(self) -> None:
        """After the step's last backward: average over the data-parallel ranks (in `reduce_dtype`), hand the
        sums to the fp32 masters, then sum what is partial over TP (norms under SP, copied KV heads). Every rank
        then holds the single-process gradient of the values it updates."""
        self.engine.finish()
        self.masters.grads_to_master()
        if self.mesh is not None and self.mesh.tp > 1:
            sum_partial_gradients(self.parameters(), self.mesh.tp_group)

    def after_step(self) -> None:
        """After the optimizer step: round the masters into the model's weights, then let the engine spread the
        update (ZeRO-1/2 all-gather the shards)."""
        self.masters.master_to_model()
        self.engine.after_step()

    def zero_grad(self) -> None:
        self.engine.zero_grad()
        self.masters.zero_grad()

    def resident_bytes(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        """Bytes this rank holds right now as parameters, gradients and optimizer states, measured on the live
        tensors; fp32 master weights count with the optimizer's states (ZeRO's K = 12: master, m, v), their
        gradients with the gradients (no bytes when they are the engine's fp32 sums themselves)."""
        tensors = self.engine.resident_tensors(optimizer)
        if self.precision.policy.needs_master_weights:
            tensors["optimizer"] += self.masters.master_params
            tensors["grads"] += [master.grad for master in self.masters.master_params]
        return {kind: storage_bytes(group) for kind, group in tensors.items()}

    def mean_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The batch's loss on every rank: from the last pipeline stage, averaged over dp x cp."""
        if self.mesh is None:
            return loss
        if self.pipeline is not None:
            dist.all_reduce(loss, group=self.mesh.pp_group)  # zero except on the last stage
        if self.mesh.dp * self.mesh.cp > 1:
            dist.all_reduce(loss, group=self.mesh.dp_cp_group)
            loss /= self.mesh.dp * self.mesh.cp
        return loss


def build_mesh(parallel: ParallelConfig) -> Mesh | None:
    """The mesh of `parallel`'s degrees (every rank must build it, in the same order), or None in one process."""
    if not dist.is_initialized():
        return None
    return Mesh(dp=parallel.dp, pp=parallel.pp, cp=parallel.cp, tp=parallel.tp, ep=parallel.ep)


def build_stage(cfg: ModelConfig, mesh: Mesh | None, parallel: ParallelConfig, virtual_stage: int,
                virtual_stages: int) -> Transformer:
    """Steps 1-5 for one stage, on `meta`: nothing is allocated yet."""
    model = build_model(cfg)
    if virtual_stages > 1:
        cut_to_stage(model, virtual_stage, virtual_stages, parallel.pp_layers)
    if parallel.tp > 1:
        apply_tensor_parallel(model, mesh.tp_group, sequence_parallel=parallel.sp)
    if parallel.cp > 1:
        apply_context_parallel(model, mesh.cp_group, parallel.cp_impl)
    if parallel.ep > 1:
        apply_expert_parallel(model, mesh.ep_group)
    set_recompute(model, parallel.recompute)
    return model


def _record_replicas(model: nn.Module, parallel: ParallelConfig) -> None:
    """How many ranks of the world hold each value: its TP copies times its data-parallel copies (dp x cp, or
    the ep_dp ranks for an expert). Pipeline stages hold different layers: no copies across pp."""
    for param in model.parameters():
        spot = placement_of(param)
        tp_copies = spot.replicas or 1  # set by TP: 1 for a split piece, tp/n_kv for copied KV heads, tp if whole
        data_copies = parallel.dp * parallel.cp // (parallel.ep if spot.expert else 1)
        set_replicas([param], tp_copies * data_copies)


def _engine(model: nn.Module, mesh: Mesh | None, parallel: ParallelConfig, reduce_dtype: torch.dtype
            ) -> DataParallel:
    if mesh is None:
        return NaiveDP(model, None, reduce_dtype)
    if parallel.ep > 1:
        return ExpertDataParallel(model, mesh.dp_cp_group, mesh.ep_dp_group, reduce_dtype)
    if parallel.pp > 1 and not parallel.zero:
        # A pipeline's backwards are spread over its schedule: gradients are averaged once it is done.
        return NaiveDP(model, mesh.dp_cp_group, reduce_dtype)
    return make_data_parallel(model, mesh.dp_cp_group, zero=parallel.zero, dp_mode=parallel.dp_mode,
                              bucket_mb=parallel.bucket_mb, reduce_dtype=reduce_dtype,
                              fp8_all_gather=parallel.fp8_all_gather)


def initial_values(engine: DataParallel, fp32: dict[nn.Parameter, torch.Tensor]) -> list[torch.Tensor]:
    """For each tensor the engine's optimizer updates, the fp32 value it was rounded from: its parameter's in
    `fp32`, or for a ZeRO piece the slice `flat_range` of its full parameter's, flattened (`engine.parameter_of`)."""
    values = []
    for tensor in engine.parameters():
        param = engine.parameter_of(tensor)
        if param is tensor:
            values.append(fp32[tensor])
        else:
            start, end = tensor.flat_range
            values.append(fp32[param].reshape(-1)[start:end])
    return values


def parallelize(cfg: ModelConfig, mesh: Mesh | None, parallel: ParallelConfig, device: torch.device,
                seed: int, seq_len: int, loss: LossFn = cross_entropy,
                precision: PrecisionScheme | None = None, compile: str | None = None,
                whole_logits: bool = False) -> Parallelized:
    """This rank's part of the model with every parallelism of `parallel` applied (None mesh: one process).
    `loss` is the loss on whole logits (a fused kernel may replace torch's); tensor parallelism, whose logits
    are split along the vocabulary, uses the vocabulary-parallel cross-entropy instead. With lab's own
    `cross_entropy` and tp = 1, training (gradient accumulation and the pipeline's last stage) computes it chunk by
    chunk from the final hidden states instead (`chunked_loss`): the same loss within rounding, without the
    micro-batch's fp32 logits (4.2 GB for llama3-1b's 8192 tokens). FP8 leaves the output layer in the compute
    dtype (`convert_to_fp8` converts the blocks' linears only), so FP8 runs take the chunked path too, and fp16 runs,
    whose loss scale the chunked loss is told (it forms its gradients in the forward, before they are cast down).
    `precision` (default fp32) says what the model computes in; the weights are the fp32 single-process values,
    rounded, and their fp32 masters those values themselves. `compile` names a `torch.compile` backend for each
    block (None: eager): after the blocks are final, before the engine, whose ZeRO-3 hooks then run around each
    compiled forward, outside it."""
    precision = precision or precision_scheme("fp32")
    policy = precision.policy
    schedule = None
    if parallel.pp > 1:
        schedule = make_schedule(parallel.pp_schedule, parallel.pp, parallel.grad_accum, parallel.pp_virtual_stages)
        stages = [build_stage(cfg, mesh, parallel, schedule.virtual_stage(mesh.pp_rank, c), schedule.virtual_stages)
                  for c in range(schedule.chunks)]
    else:
        stages = [build_stage(cfg, mesh, parallel, 0, 1)]
    for stage in stages:
        materialize_local(stage, device, seed)
    # the fp32 values, kept (not copied) across the cast for the masters to start from: FSDP2's contract
    fp32 = {p: p.data for stage in stages for p in stage.parameters()} if policy.needs_master_weights else {}
    for stage in stages:
        cast_model(stage, policy)
        if precision.fp8 is not None:
            convert_to_fp8(stage, precision.fp8)
    model = nn.ModuleList(stages) if schedule is not None else stages[0]
    if compile is not None:
        apply_compile(model, compile, fullgraph=graph_breaks(cfg, parallel) is None)
    _record_replicas(model, parallel)
    loss_on_whole_logits = loss
    if parallel.tp > 1:
        def loss_on_whole_logits(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            return vocab_parallel_cross_entropy(logits, targets, mesh.tp_group)
    loss_fn = loss_on_whole_logits
    if policy.output_dtype is not None:  # the log-sum-exp over the vocabulary, in fp32
        def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            return loss_on_whole_logits(logits.to(policy.output_dtype), targets)
    # Not a Triton kernel's fused loss, and not split logits. `whole_logits` asks for torch's loss on them anyway
    # (`--loss whole`: FSDP2's fp32-output recipe, bit for bit).
    chunked = parallel.tp == 1 and loss is cross_entropy and not whole_logits
    moe = MoEStats(cfg, parallel.tp) if cfg.is_moe else None
    pipeline = None
    if schedule is not None:
        boundary = Boundary(cfg.d_model, parallel.tp if parallel.sp else 1, next(model.parameters()).dtype)
        pipeline = Pipeline(stages, schedule, mesh.pp_group, None if chunked else loss_fn, boundary=boundary,
                            extra_loss=moe.router_loss if moe is not None else None)  # each stage's MoE layers
    engine = _engine(model, mesh, parallel, policy.reduce_dtype)  # after the pipeline: ZeRO's hooks see its calls
    masters = MasterWeights(engine.parameters(), policy, initial_values(engine, fp32) if fp32 else None)
    coords = (mesh.dp_rank, mesh.dp, mesh.cp_rank, mesh.cp) if mesh is not None else (0, 1, 0, 1)
    batch = LocalBatch(*coords, layout_of(parallel.cp_impl), device, seq_len)
    return Parallelized(model, pipeline, engine, loss_fn, batch, mesh, masters, precision, parallel.grad_accum, moe,
                        chunked)
