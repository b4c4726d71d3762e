"""Inference for `lab.model` (chapter 11): the KV cache, sampling, and a small serving engine, all on a CPU.

Pure bookkeeping is kept apart from the code that runs the model, as nano-vllm and vLLM keep it, so that each is
tested alone:

    sampling        SamplingParams and sample(): greedy, temperature, top-k, top-p, seeded per request
    kv_cache        a contiguous KV cache behind the model's `cache` seam; generate() for one batch of prompts
    sequence        a request as the engine tracks it: its tokens, how many have their K/V cached, its blocks
    block_manager   paged KV bookkeeping: fixed-size blocks, block tables, reference counts, prefix caching
    scheduler       continuous batching under a token budget, chunked prefill, preemption by recompute
    model_runner    the paged K/V tensors and the step that runs a scheduled batch through the model
    engine          LLMEngine: requests in, tokens out, one scheduled step at a time
    async_engine    AsyncEngine: one engine stepped for many connections, tokens routed back, aborts on disconnect
    server          the OpenAI-compatible HTTP routes over it (`python -m lab serve --port N`; needs starlette)
    latency         TTFT, TPOT and end-to-end latency under Poisson arrivals: percentiles, SLO attainment, goodput

Expert-parallel decode needs ranks, so it lives with the parallelisms: `lab.parallel.ep_decode`.
"""
