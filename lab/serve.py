"""`python -m lab serve`: a batch of requests through `lab.inference`'s engine, offline, with the serving numbers;
or, with `--port`, an OpenAI-compatible HTTP server over the same engine.

    python -m lab serve --config configs/tiny.toml --requests 32
    python -m lab train --config configs/tiny.toml --steps 200 --checkpoint-dir ckpt
    python -m lab serve --checkpoint ckpt --requests 32 --max-tokens 64 --json serve.json
    python -m lab serve --checkpoint ckpt --requests 8 --tp 2        # tensor-parallel decode on 2 local ranks

The prompts are drawn from the training stream (`lab.data.SyntheticTokens` of the config), so a model trained
by `python -m lab train` continues them the way the stream does, and the report says how often: the share of
generated tokens that are one of the stream's possible successors of the token before (1 for a model that learnt
the stream, about branching/vocab for noise). Every request arrives at time 0; the report gives throughput,
time to first token and request latency percentiles, the steps' composition, the prefix-cache hits, and — for
the decode steps — the fraction of the memory roofline reached (bytes of weights and KV cache read per step over
the step time and the device's bandwidth: `lab.calc.hardware` on a GPU, a measured copy bandwidth on a CPU).

The engine sees the model through the cache seam only. Tensor parallelism is applied here, from outside: the
blocks split by `lab.parallel.tp` exactly as in training, the vocabulary-parallel logits gathered before
sampling; every rank runs the same engine on the same requests and samples the same tokens.

The HTTP server (`lab.inference.server`, Starlette under uvicorn: `pip install -e ".[serve]"`):

    python -m lab serve --config configs/tiny.toml --port 8000     # 127.0.0.1 only; --host 0.0.0.0 opens it
    curl -N localhost:8000/v1/completions -H 'Content-Type: application/json' \
         -d '{"model": "tiny", "prompt": "Hello", "max_tokens": 8, "temperature": 0, "stream": true}'

It speaks OpenAI's API — `POST /v1/completions`, `POST /v1/chat/completions` (a plain `role: content` template),
`GET /v1/models` (the model is named by its config: `tiny` here), streaming as server-sent events ending in
`data: [DONE]` — so the `openai` client works against it (`OpenAI(base_url="http://127.0.0.1:8000/v1",
api_key="-")`). Text is bytes (UTF-8, one token per byte; a prompt may also be a list of token ids) and each
choice carries its `token_ids`. Requests from every connection are batched by the one engine (continuous
batching across clients); a client that disconnects has its sequence aborted and its KV blocks freed; a bad
request is a 400 with OpenAI's JSON error. The engine flags (--block-size, --num-blocks, ...) and
--config/--checkpoint apply; sampling comes from each request, and --tp is offline only.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch import nn

from lab import distributed as lab_dist
from lab.calc.hardware import device_accelerator
from lab.checkpoint import LAB_FILE, newest, to_single_file
from lab.config import Config, ParallelConfig, check_supported, load_config
from lab.data import SyntheticTokens
from lab.distributed.launch import HANG_TIMEOUT_S
from lab.inference.engine import EngineConfig, LLMEngine
from lab.inference.sampling import SamplingParams
from lab.measure.cpu import copy_bandwidth
from lab.model import Transformer, build_model, materialize
from lab.outputs import check_output_file


@dataclass
class ServeReport:
    requests: int
    generated_tokens: int
    seconds: float
    tokens_per_s: float
    ttft_ms: dict[str, float]  # time to first token: p50, p90, p99
    latency_ms: dict[str, float]  # request latency (arrival at 0 to its last token)
    steps: int
    prefill_tokens: int
    decode_tokens: int
    prefix_hit_tokens: int
    preemptions: int
    follows_stream: float  # share of generated tokens that are a possible successor of the token before
    decode_roofline_fraction: float | None  # median over pure decode steps
    bandwidth_bytes_per_s: float | None

    def text(self) -> str:
        pct = " / ".join(f"{v:.1f}" for v in self.ttft_ms.values())
        lat = " / ".join(f"{v:.1f}" for v in self.latency_ms.values())
        roof = ("-" if self.decode_roofline_fraction is None else
                f"{100 * self.decode_roofline_fraction:.1f}% of {self.bandwidth_bytes_per_s / 1e9:.1f} GB/s")
        return "\n".join([
            f"served {self.requests} requests, {self.generated_tokens} tokens in {self.seconds:.2f} s: "
            f"{self.tokens_per_s:,.0f} tokens/s",
            f"  time to first token p50 / p90 / p99: {pct} ms;  latency p50 / p90 / p99: {lat} ms",
            f"  {self.steps} steps: {self.prefill_tokens} prefill tokens ({self.prefix_hit_tokens} more from the "
            f"prefix cache), {self.decode_tokens} decode tokens, {self.preemptions} preemptions",
            f"  decode steps at {roof} (memory roofline: weights + KV read once a step)",
            f"  generated tokens that follow the training stream: {100 * self.follows_stream:.1f}%"])


def _percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {f"p{q}": 1e3 * ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))] for q in (50, 90, 99)}


def load_model(config: Config, checkpoint: str | None, device: torch.device) -> tuple[Transformer, Config]:
    """The model to serve: the weights of a `lab.train` checkpoint (and the config it was trained with), or the
    config's initial weights."""
    if checkpoint is not None:
        path = newest(checkpoint)[0] or checkpoint
        state, config = to_single_file(path)
        model = build_model(config.model).to_empty(device=device)
        model.tie_weights()
        model.load_state_dict(state)
        return model, config
    return materialize(build_model(config.model), seed=config.train.seed).to(device), config


def make_prompts(config: Config, requests: int, prompt_len: tuple[int, int], seed: int) -> list[list[int]]:
    """`requests` prompts of lengths drawn in [lo, hi], each a stretch of the training stream."""
    lo, hi = prompt_len
    data = SyntheticTokens(config.model.vocab_size, hi, requests, seed=config.train.seed,
                           branching=config.train.data_branching)
    rows = data.batch(10_000 + seed)[0]
    lengths = torch.randint(lo, hi + 1, (requests,), generator=torch.Generator().manual_seed(seed)).tolist()
    return [rows[i, :n].tolist() for i, n in enumerate(lengths)]


class GatheredLogits(nn.Module):
    """A tensor-parallel model whose vocabulary-parallel logits are all-gathered: what sampling needs."""

    def __init__(self, model: nn.Module, group: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.model, self.group = model, group

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        local = self.model(tokens, positions, cache).contiguous()
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(parts, local, group=self.group)
        return torch.cat(parts, dim=-1)


def tensor_parallel(model: Transformer, group: dist.ProcessGroup | None) -> nn.Module:
    """This rank's TP shard of a materialised model (chapter 04's layers), logits gathered."""
    from lab.parallel.tp import apply_tensor_parallel

    return GatheredLogits(apply_tensor_parallel(model, group), group)


def serve(config: Config, engine_config: EngineConfig, params: SamplingParams, requests: int,
          prompt_len: tuple[int, int], checkpoint: str | None = None, tp: int = 1,
          hang_timeout_s: float | None = HANG_TIMEOUT_S, time_limit_s: float | None = None) -> tuple[ServeReport, list]:
    """Serve `requests` prompts (on `tp` local ranks when tp > 1); the report and each request's tokens. The ranks
    are stopped when one makes no progress (every decode step all-gathers logits) for `hang_timeout_s`, and after
    `time_limit_s` only if given: a long batch that progresses is not a hang."""
    if tp > 1:
        results = lab_dist.run(_serve_rank, tp, config, engine_config, params, requests, prompt_len, checkpoint,
                               timeout_s=time_limit_s, hang_timeout_s=hang_timeout_s)
        return results[0]
    return _serve_rank(config, engine_config, params, requests, prompt_len, checkpoint)


def _serve_rank(config: Config, engine_config: EngineConfig, params: SamplingParams, requests: int,
                prompt_len: tuple[int, int], checkpoint: str | None) -> tuple[ServeReport, list]:
    device = torch.device("cuda", 0) if torch.cuda.is_available() and config.train.device != "cpu" else \
        torch.device("cpu")
    model, config = load_model(config, checkpoint, device)
    served = tensor_parallel(model, None) if dist.is_initialized() else model
    weight_bytes = sum(p.numel() * p.element_size() for p in served.parameters())  # this rank's shard under TP
    engine = LLMEngine(served, engine_config)
    prompts = make_prompts(config, requests, prompt_len, seed=params.seed or 0)
    start = time.perf_counter()
    ids = [engine.add_request(p, params) for p in prompts]
    first, done = {}, {}
    while engine.has_unfinished():
        finished = engine.step()
        now = time.perf_counter() - start
        for sid in ids:
            if sid not in first and engine.sequences[sid].num_generated:
                first[sid] = now
        done.update({seq.seq_id: now for seq in finished})
    seconds = time.perf_counter() - start
    outputs = [engine.sequences[i].generated for i in ids]
    data = SyntheticTokens(config.model.vocab_size, 2, 1, seed=config.train.seed, branching=config.train.data_branching)
    follows = [follows_stream(data, engine.sequences[i].token_ids, engine.sequences[i].num_prompt_tokens) for i in ids]
    bandwidth = _bandwidth(device)
    kv_per_token = sum(t[0, 0].numel() * t.element_size() for t in (*engine.runner.cache.keys.values(),
                                                                       *engine.runner.cache.values.values()))
    fractions = []
    for record in engine.timeline:
        if record.ran and all(n == 1 for _, n in record.ran) and bandwidth:
            context = sum(len(engine.sequences[sid].token_ids) for sid, _ in record.ran)  # an upper bound
            fractions.append((weight_bytes + kv_per_token * context) / record.seconds / bandwidth)
    tokens = sum(len(o) for o in outputs)
    prefill = sum(n for r in engine.timeline for _, n in r.ran if n > 1)
    report = ServeReport(
        requests, tokens, seconds, tokens / seconds, _percentiles(list(first.values())),
        _percentiles(list(done.values())), len(engine.timeline), prefill,
        sum(r.tokens for r in engine.timeline) - prefill, engine.block_manager.prefix_hits,
        sum(engine.sequences[i].preemptions for i in ids), statistics.fmean(follows),
        statistics.median(fractions) if fractions else None, bandwidth)
    return report, outputs


def follows_stream(data: SyntheticTokens, token_ids: list[int], num_prompt_tokens: int) -> float:
    """The share of a sequence's generated tokens that the stream allows after the token before them."""
    tokens = torch.tensor(token_ids)
    before, after = tokens[num_prompt_tokens - 1:-1], tokens[num_prompt_tokens:]
    return (data.successors(before) == after[:, None]).any(dim=1).double().mean().item()


def _bandwidth(device: torch.device) -> float | None:
    if device.type == "cuda":
        chip = device_accelerator(torch.cuda.get_device_name(device))
        return chip.hbm_bandwidth if chip is not None else None
    return copy_bandwidth()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m lab serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=None, help="TOML run config (default: the tiny model)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    p.add_argument("--checkpoint", help="serve the weights of a lab.train checkpoint (DIR or DIR/step-N)")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prompt-len", type=int, nargs=2, default=(8, 48), metavar=("MIN", "MAX"))
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=256)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-batched-tokens", type=int, default=256)
    p.add_argument("--no-chunked-prefill", action="store_true")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--attention", choices=("torch", "triton"), default="torch",
                   help="paged attention of decode steps: torch's gather, or chapter 09's Triton kernel")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (local gloo ranks on a CPU)")
    p.add_argument("--hang-timeout", type=float, default=HANG_TIMEOUT_S, metavar="SECONDS",
                   help="with --tp: stop when a rank makes no progress for this long (default: %(default)g s)")
    p.add_argument("--time-limit", type=float, metavar="SECONDS",
                   help="with --tp: stop after this long, progressing or not (default: no limit)")
    p.add_argument("--json", metavar="PATH", help="write the report as JSON")
    p.add_argument("--port", type=int, help="serve OpenAI's HTTP API on this port instead of an offline batch")
    p.add_argument("--host", default="127.0.0.1", help="with --port: the address to listen on (default: loopback)")
    return p


def serve_http(config: Config, engine_config: EngineConfig, checkpoint: str | None, host: str, port: int) -> None:
    """Serve the model over HTTP until interrupted: one engine, the OpenAI routes of `lab.inference.server`."""
    import uvicorn

    from lab.inference.server import Served, build_app

    device = torch.device("cuda", 0) if torch.cuda.is_available() and config.train.device != "cpu" else \
        torch.device("cpu")
    model, config = load_model(config, checkpoint, device)
    served = Served(config.model.name, config.model.vocab_size, config.model.max_seq_len)
    uvicorn.run(build_app(LLMEngine(model, engine_config), served), host=host, port=port)


def served_config(config: Config, checkpoint: str | None) -> Config:
    """The config of the model that will be served: the checkpoint's own (as `load_model` uses it), else `config`.
    A missing or incomplete checkpoint is one ValueError line here, before any weight is read."""
    if checkpoint is None:
        return config
    if not os.path.isdir(checkpoint):
        raise ValueError(f"--checkpoint {checkpoint}: no such directory (give a lab train --checkpoint-dir, or one "
                         f"of its step-N directories)")
    path = newest(checkpoint)[0] or checkpoint
    if not all(os.path.exists(os.path.join(path, name)) for name in (".metadata", LAB_FILE)):
        raise ValueError(f"--checkpoint {checkpoint}: no complete lab train checkpoint there (a step-N directory "
                         f"holding .metadata and {LAB_FILE})")
    with open(os.path.join(path, LAB_FILE)) as file:
        return Config.from_dict(json.load(file)["config"])


def check_request(config: Config, tp: int, prompt_len: tuple[int, int], max_tokens: int) -> None:
    """Refuse, in one line, what the served model cannot do: a tensor-parallel layout lab train would refuse (the
    rules' one home is lab.config), or sequences longer than its max_seq_len."""
    layout = dataclasses.replace(config, parallel=ParallelConfig(tp=tp))
    layout.validate()
    check_supported(layout)
    longest = prompt_len[1] + max_tokens
    if longest > config.model.max_seq_len:
        raise ValueError(f"--prompt-len MAX={prompt_len[1]} + --max-tokens={max_tokens} = {longest} tokens must be "
                         f"<= the model's max_seq_len={config.model.max_seq_len}")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config, args.set)
        if args.requests < 1:
            raise ValueError(f"--requests={args.requests} must be >= 1")
        lo, hi = args.prompt_len
        if not 1 <= lo <= hi:
            raise ValueError(f"--prompt-len {lo} {hi}: need 1 <= MIN <= MAX")
        if args.tp < 1:
            raise ValueError(f"--tp={args.tp} must be >= 1")
        for flag, value in (("--hang-timeout", args.hang_timeout), ("--time-limit", args.time_limit)):
            if value is not None and not value > 0:
                raise ValueError(f"{flag}={value!r} must be a number of seconds > 0 (inf: no limit)")
        engine_config = EngineConfig(args.num_blocks, args.block_size, args.max_num_seqs, args.max_batched_tokens,
                                     not args.no_chunked_prefill, not args.no_prefix_caching, args.attention)
        if args.port is not None:
            if args.tp != 1:
                raise ValueError(f"--tp={args.tp} with --port: the HTTP server runs one rank (--tp is offline only)")
            if not 0 <= args.port <= 65535:
                raise ValueError(f"--port={args.port} must be in [0, 65535]")
            served_config(config, args.checkpoint)  # a bad --checkpoint is one line, before the model loads
            serve_http(config, engine_config, args.checkpoint, args.host, args.port)
            return 0
        params = SamplingParams(args.max_tokens, args.temperature, args.top_k, args.top_p, args.seed)
        check_request(served_config(config, args.checkpoint), args.tp, (lo, hi), args.max_tokens)
        if args.json:
            check_output_file(args.json, "--json")
        report, _ = serve(config, engine_config, params, args.requests, (lo, hi), args.checkpoint, args.tp,
                          args.hang_timeout, args.time_limit)
    except ValueError as err:
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        return 2
    except lab_dist.RankError as err:  # which rank failed or hangs, and where: lab.distributed.run's report
        print(f"{parser.prog}: {err}", file=sys.stderr)
        return 1
    print(report.text())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(asdict(report), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
