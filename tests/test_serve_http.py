"""`python -m lab serve --port N` (issue 39): OpenAI's API over lab's engine, checked with the `openai` client.

One server runs in a thread of this process for the whole module (so the tests can look at its engine: what ran
batched, what was aborted, which blocks are free), on the tiny model; one test starts the real CLI in a
subprocess. Each server is stopped in `finally`.

Planted bugs that turned a test red: neighbouring streams' tokens swapped in `AsyncEngine._route`; `data: [DONE]`
left out of a stream; the abort of a disconnected client's sequence skipped; the disconnect watcher of a plain
(unstreamed) request removed; unknown fields ignored; the error body's `message` renamed.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch

from lab.config import load_config
from lab.inference.engine import EngineConfig, LLMEngine
from lab.inference.sampling import SamplingParams
from lab.serve import load_model

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")
server_module = pytest.importorskip("lab.inference.server")  # needs starlette: the `serve` extra

REPO = Path(__file__).resolve().parents[1]
CONFIG = str(REPO / "configs" / "tiny.toml")
ENGINE = EngineConfig(num_blocks=96, block_size=8, max_num_seqs=8, max_num_batched_tokens=128)
PROMPTS = ["Hello", "The cat", "ZeRO-3 shards", "ring all-reduce"]


def offline(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """The offline engine's greedy tokens for these prompts: what the server must send back."""
    model, _ = load_model(load_config(CONFIG, []), None, torch.device("cpu"))
    return LLMEngine(model, ENGINE).generate(prompts, SamplingParams(max_tokens=max_tokens))


def until(condition, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.fixture(scope="module")
def server() -> Iterator[SimpleNamespace]:
    config = load_config(CONFIG, [])
    model, config = load_model(config, None, torch.device("cpu"))
    served = server_module.Served(config.model.name, config.model.vocab_size, config.model.max_seq_len)
    app = server_module.build_app(LLMEngine(model, ENGINE), served)
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    try:
        assert until(lambda: uv.started), "the server did not start"
        port = uv.servers[0].sockets[0].getsockname()[1]
        url = f"http://127.0.0.1:{port}/v1"
        yield SimpleNamespace(url=url, address=("127.0.0.1", port), core=app.state.engine, name=config.model.name,
                              client=openai.OpenAI(base_url=url, api_key="-", max_retries=0, timeout=10))
    finally:
        uv.should_exit = True
        thread.join(timeout=10)


def test_greedy_completions_equal_the_offline_engine(server):
    text, ids = server_module.encode(PROMPTS[0], 256), [5, 17, 200, 3]
    messages = [{"role": "user", "content": "hi"}]
    chat = server_module.encode(server_module.chat_prompt(messages), 256)
    want = offline([text, ids, chat], max_tokens=6)
    got = [server.client.completions.create(model=server.name, prompt=p, max_tokens=6, temperature=0)
           for p in (PROMPTS[0], ids)]
    reply = server.client.chat.completions.create(model=server.name, messages=messages, max_tokens=6, temperature=0)
    assert [c.choices[0].token_ids for c in got] == want[:2]
    assert reply.choices[0].token_ids == want[2]
    assert got[0].choices[0].text == server_module.Detokenizer()(want[0], final=True)
    assert reply.choices[0].message.content == server_module.Detokenizer()(want[2], final=True)
    assert got[0].usage.prompt_tokens == len(text) and got[0].choices[0].finish_reason == "length"


def test_four_concurrent_streams_are_batched_and_each_gets_its_own_tokens(server):
    prompts = [server_module.encode(p, 256) for p in PROMPTS]
    want = offline(prompts, max_tokens=12)
    client = openai.AsyncOpenAI(base_url=server.url, api_key="-", max_retries=0, timeout=10)

    async def one(prompt: str) -> tuple[list[int], str, list]:
        stream = await client.completions.create(model=server.name, prompt=prompt, max_tokens=12, temperature=0,
                                                 stream=True)
        chunks = [chunk async for chunk in stream]
        tokens = [t for c in chunks for t in c.choices[0].token_ids]
        return tokens, "".join(c.choices[0].text for c in chunks), [c.choices[0].finish_reason for c in chunks]

    async def all_four() -> list:
        return await asyncio.gather(*(one(p) for p in PROMPTS))

    steps_before = len(server.core.engine.timeline)
    results = asyncio.run(all_four())
    assert [tokens for tokens, _, _ in results] == want
    assert [text for _, text, _ in results] == [server_module.Detokenizer()(w, final=True) for w in want]
    assert all(reasons[-1] == "length" and set(reasons[:-1]) <= {None} for _, _, reasons in results)
    batch = max(len(record.ran) for record in server.core.engine.timeline[steps_before:])
    assert batch >= 2, "the four connections' requests never shared a step"


def test_a_stream_is_server_sent_events_ending_in_done(server):
    body = {"model": server.name, "prompt": [1, 2, 3], "max_tokens": 3, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{server.url}/completions", json=body, timeout=10) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    assert '"usage"' in events[-2] and '"completion_tokens": 3' in events[-2]


@pytest.mark.parametrize("body, param", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -5}, "max_tokens"),
    ({"max_tokens": 250, "prompt": "x" * 10}, "max_tokens"),  # 10 + 250 tokens > max_seq_len 256
    ({"frequency_penalty": 0.5}, "frequency_penalty"),  # unknown here: refused, not ignored
    ({"max_tokens": "8"}, "max_tokens"),  # wrong type
    ({"prompt": [1, 2, 999]}, "prompt"),  # not a token of the vocabulary
])
def test_a_bad_request_is_a_400_with_openais_error_body(server, body, param):
    request = {"model": server.name, "prompt": "hi", "max_tokens": 4} | body
    response = httpx.post(f"{server.url}/completions", json=request, timeout=10)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]


def test_the_openai_client_raises_bad_request_and_not_found(server):
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        server.client.completions.create(model=server.name, prompt="hi", max_tokens=-1)
    with pytest.raises(openai.BadRequestError, match="unknown field"):
        server.client.chat.completions.create(model=server.name, messages=[{"role": "user", "content": "hi"}],
                                              extra_body={"tools_please": True})
    with pytest.raises(openai.NotFoundError):
        server.client.completions.create(model="gpt-4o", prompt="hi")


def test_models_lists_the_served_model(server):
    assert [m.id for m in server.client.models.list().data] == [server.name]


def test_a_client_that_disconnects_frees_its_sequence(server):
    """A stream closed after its first chunk, and a plain request whose client times out: both aborted, nothing
    left running, every KV block back in the pool."""
    core, blocks = server.core, server.core.engine.block_manager
    aborted, steps_before = core.aborted, len(core.engine.timeline)
    stream = server.client.completions.create(model=server.name, prompt="abc", max_tokens=250, stream=True)
    next(iter(stream))
    stream.close()
    assert until(lambda: core.aborted == aborted + 1 and not core.engine.has_unfinished())
    body = b'{"prompt": "abc", "max_tokens": 250}'
    with socket.create_connection(server.address) as s:  # a plain request, its client gone once it runs
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        assert until(core.engine.has_unfinished)
    assert until(lambda: core.aborted == aborted + 2 and not core.engine.has_unfinished())
    assert blocks.num_free_blocks == blocks.num_blocks
    assert core.engine.sequences == {}  # the server forgets what it served
    computed: dict[int, int] = {}
    for record in core.engine.timeline[steps_before:]:
        for seq_id, n in record.ran:
            computed[seq_id] = computed.get(seq_id, 0) + n
    assert len(computed) == 2 and max(computed.values()) < 3 + 249, "a request ran to its end after its client left"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_cli_serves_on_the_port_it_is_given():
    port = _free_port()
    process = subprocess.Popen([sys.executable, "-m", "lab", "serve", "--config", CONFIG, "--port", str(port)],
                               cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        def up() -> bool:
            assert process.poll() is None, process.stderr.read().decode()
            try:
                return httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=1).status_code == 200
            except httpx.TransportError:
                return False

        assert until(up, timeout_s=60)
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                           timeout=10).json()
        assert len(reply["choices"][0]["token_ids"]) == 2
    finally:
        process.terminate()
        process.wait(timeout=10)
