"""An OpenAI-compatible HTTP server over `LLMEngine`: what `python -m lab serve --port N` runs.

What belongs here: the HTTP side of serving (routes, request checks, OpenAI's JSON and server-sent events) and
the text <-> token mapping of a model without a tokenizer. Stepping the engine for every connection is
`lab.inference.async_engine`'s; scheduling, the KV cache and sampling stay in the engine's modules.

Routes (OpenAI's API, the subset a course model can honour):

    GET  /v1/models             the one model served
    POST /v1/completions        prompt -> text; `"stream": true` sends server-sent events
    POST /v1/chat/completions   messages -> the assistant's reply, through the plain chat template below

Continuous batching across connections: every route hands its request to one `AsyncEngine`
(`lab.inference.async_engine`), whose single loop task steps the engine for all connections and routes each
request's new tokens back to it. A connection that closes (a streamed one cancelled by Starlette, a plain one
noticed by a watcher) aborts its sequence, and its KV blocks go back to the pool.

Tokens and text. The course's models have no tokenizer, so text is bytes: a prompt string is UTF-8 encoded and
each byte is one token id (the tiny model's vocabulary is 256; a byte outside a smaller vocabulary is a 400),
and generated token ids are bytes decoded as UTF-8 (incrementally, so a character split across two streamed
chunks arrives whole; invalid bytes become U+FFFD, as a random model makes plenty). A prompt may also be a
list of token ids, as OpenAI's API allows, and every choice carries the exact `token_ids` it generated (an
extension, like vLLM's `return_token_ids`), since text with U+FFFD in it cannot be turned back into tokens.

The chat template is plain text: each message as `"{role}: {content}\\n"`, then `"assistant: "` for the model
to continue (roles: system, user, assistant).

Bad requests are answered 400 with OpenAI's error body, `{"error": {"message", "type": "invalid_request_error",
"param", "code"}}`: an unknown field (no silent ignoring), a wrong type, `max_tokens` < 1, a prompt whose tokens
plus `max_tokens` exceed the model's `max_seq_len`, or one the KV cache can never hold. A wrong model name is 404.
Sampling: `temperature`, `top_p`, `seed` and vLLM's `top_k`; one choice per request (`n` = 1); generation ends
at `max_tokens` (`finish_reason` "length"), there are no stop strings.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import itertools
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from lab.inference.async_engine import AsyncEngine
from lab.inference.engine import LLMEngine
from lab.inference.sampling import SamplingParams

CHAT_ROLES = ("system", "user", "assistant")


class BadRequest(ValueError):
    """A request the server refuses; `param` names the field, `status` is the HTTP status."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param, self.status = param, status


def error_response(err: BadRequest) -> JSONResponse:
    """OpenAI's error body, which its clients turn into `BadRequestError` / `NotFoundError` with the message."""
    code = "model_not_found" if err.status == 404 else None
    body = {"error": {"message": str(err), "type": "invalid_request_error", "param": err.param, "code": code}}
    return JSONResponse(body, status_code=err.status)


# -- text <-> tokens -------------------------------------------------------------------------------------------


def encode(text: str, vocab_size: int) -> list[int]:
    """A prompt string's token ids: its UTF-8 bytes."""
    ids = list(text.encode("utf-8"))
    if ids and max(ids) >= vocab_size:
        raise BadRequest(f"the prompt's UTF-8 byte {max(ids)} is not a token of this model's vocabulary of "
                         f"{vocab_size}: send token ids instead", "prompt")
    return ids


def chat_prompt(messages: list[dict[str, str]]) -> str:
    """The plain chat template: one `role: content` line per message, then the assistant's turn to speak."""
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "


class Detokenizer:
    """Generated token ids -> text, one streamed chunk at a time: bytes decoded as UTF-8, holding back the first
    bytes of a character until its last one arrives."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def __call__(self, tokens: list[int], final: bool = False) -> str:
        # An id past the bytes (a model with a larger vocabulary) becomes 0xFF, never valid UTF-8: one U+FFFD.
        return self._decoder.decode(bytes(t if t < 256 else 0xFF for t in tokens), final=final)


# -- requests --------------------------------------------------------------------------------------------------

# Every field the server reads, with its JSON types; any other field is a 400 rather than silently ignored.
SAMPLING_FIELDS = {"model": (str,), "max_tokens": (int,), "temperature": (int, float), "top_p": (int, float),
                   "top_k": (int,), "seed": (int,), "n": (int,), "stream": (bool,), "stream_options": (dict,),
                   "user": (str,)}
COMPLETION_FIELDS = {**SAMPLING_FIELDS, "prompt": (str, list)}
CHAT_FIELDS = {**SAMPLING_FIELDS, "messages": (list,)}


@dataclass
class Served:
    """What the routes need to know about the model: its name and the limits a request is checked against."""

    name: str
    vocab_size: int
    max_seq_len: int
    created: int = field(default_factory=lambda: int(time.time()))


def check_fields(body: object, allowed: dict[str, tuple[type, ...]], required: str) -> dict:
    """The request's fields, each of an allowed JSON type (null: not given); 400 for anything else."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    for name, value in body.items():
        if name not in allowed:
            raise BadRequest(f"unknown field {name!r}; this server accepts {', '.join(sorted(allowed))}", name)
        types = allowed[name]
        if value is not None and (not isinstance(value, types) or (isinstance(value, bool) and bool not in types)):
            raise BadRequest(f"{name}={value!r} must be of JSON type {' or '.join(t.__name__ for t in types)}", name)
    if body.get(required) is None:
        raise BadRequest(f"the field {required!r} is required", required)
    return {name: value for name, value in body.items() if value is not None}


def sampling_params(body: dict, served: Served, prompt_len: int) -> SamplingParams:
    """The request's SamplingParams, after the checks OpenAI's API makes (max_tokens, context length, n)."""
    if body.get("model", served.name) != served.name:
        raise BadRequest(f"the model {body['model']!r} does not exist; this server serves {served.name!r}",
                         "model", 404)
    if body.get("n", 1) != 1:
        raise BadRequest("n must be 1: one choice per request", "n")
    max_tokens = body.get("max_tokens", 16)
    if max_tokens < 1:
        raise BadRequest(f"max_tokens={max_tokens} must be >= 1", "max_tokens")
    if prompt_len + max_tokens > served.max_seq_len:
        raise BadRequest(f"this model's maximum context length is {served.max_seq_len} tokens, but "
                         f"{prompt_len + max_tokens} were requested ({prompt_len} in the prompt, {max_tokens} for "
                         f"the completion)", "max_tokens")
    try:
        return SamplingParams(max_tokens, float(body.get("temperature", 1.0)), body.get("top_k", 0),
                              float(body.get("top_p", 1.0)), body.get("seed"))
    except ValueError as err:
        raise BadRequest(str(err)) from err


def completion_prompt(body: dict, served: Served) -> list[int]:
    """A completion request's prompt as token ids: a string (its bytes) or a list of token ids."""
    prompt = body["prompt"]
    if isinstance(prompt, str):
        ids = encode(prompt, served.vocab_size)
    elif all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = prompt
        if any(not 0 <= t < served.vocab_size for t in ids):
            raise BadRequest(f"token ids must lie in [0, {served.vocab_size})", "prompt")
    else:
        raise BadRequest("prompt must be a string or a list of token ids (one prompt per request)", "prompt")
    if not ids:
        raise BadRequest("the prompt is empty", "prompt")
    return ids


def chat_prompt_ids(body: dict, served: Served) -> list[int]:
    """A chat request's prompt as token ids: its messages checked, through the chat template, as bytes."""
    messages = body["messages"]
    for m in messages:
        if not (isinstance(m, dict) and set(m) == {"role", "content"} and m["role"] in CHAT_ROLES
                and isinstance(m["content"], str)):
            raise BadRequest(f"each message must be {{'role': one of {CHAT_ROLES}, 'content': a string}}, got {m!r}",
                             "messages")
    if not messages:
        raise BadRequest("messages is empty", "messages")
    return encode(chat_prompt(messages), served.vocab_size)


# -- OpenAI's responses ----------------------------------------------------------------------------------------


class Reply:
    """The OpenAI objects of one request, completion or chat: the whole response, or its stream's chunks."""

    def __init__(self, chat: bool, served: Served, prompt_len: int, max_tokens: int, request_id: int) -> None:
        self.chat, self.served, self.prompt_len, self.max_tokens = chat, served, prompt_len, max_tokens
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{request_id}"
        self.created = int(time.time())

    def _object(self, kind: str, choice: dict, **extra: object) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.served.name,
                "choices": [{"index": 0, **choice, "logprobs": None}], **extra}

    def finish_reason(self, generated: int) -> str:
        return "length" if generated >= self.max_tokens else "stop"

    def usage(self, generated: int) -> dict:
        return {"prompt_tokens": self.prompt_len, "completion_tokens": generated,
                "total_tokens": self.prompt_len + generated}

    def whole(self, tokens: list[int]) -> dict:
        text = Detokenizer()(tokens, final=True)
        choice = {"message": {"role": "assistant", "content": text}} if self.chat else {"text": text}
        choice |= {"finish_reason": self.finish_reason(len(tokens)), "token_ids": tokens}
        kind = "chat.completion" if self.chat else "text_completion"
        return self._object(kind, choice, usage=self.usage(len(tokens)))

    def chunk(self, text: str, tokens: list[int], finish_reason: str | None, first: bool = False) -> dict:
        if self.chat:
            delta = ({"role": "assistant"} if first else {}) | ({"content": text} if text or first else {})
            return self._object("chat.completion.chunk", {"delta": delta, "finish_reason": finish_reason,
                                                          "token_ids": tokens})
        return self._object("text_completion", {"text": text, "finish_reason": finish_reason, "token_ids": tokens})

    def usage_chunk(self, generated: int) -> dict:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.served.name, "choices": [],
                "usage": self.usage(generated)}


def sse(obj: dict | str) -> str:
    """One server-sent event: `data: <json>` and a blank line."""
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


async def stream_events(core: AsyncEngine, seq_id: int, reply: Reply, include_usage: bool) -> AsyncIterator[str]:
    """A streamed reply: a chunk per step that gave the request tokens, the last one with its finish_reason, the
    usage if asked, then `data: [DONE]`."""
    detok, generated = Detokenizer(), 0
    if reply.chat:
        yield sse(reply.chunk("", [], None, first=True))
    async for new, finished in core.tokens(seq_id):
        generated += len(new)
        yield sse(reply.chunk(detok(new, final=finished), new, reply.finish_reason(generated) if finished else None))
    if include_usage:
        yield sse(reply.usage_chunk(generated))
    yield sse("[DONE]")


async def until_disconnected(request: Request) -> None:
    """Returns when the client closes the connection (its body is already read: only the disconnect is left)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


# -- the app ---------------------------------------------------------------------------------------------------


def build_app(engine: LLMEngine, served: Served) -> Starlette:
    """The Starlette app serving `engine` under OpenAI's routes; its lifespan starts and stops the engine loop."""
    core, ids = AsyncEngine(engine), itertools.count()

    async def models(request: Request) -> Response:
        card = {"id": served.name, "object": "model", "created": served.created, "owned_by": "lab",
                "max_model_len": served.max_seq_len}
        return JSONResponse({"object": "list", "data": [card]})

    async def generate(request: Request, chat: bool) -> Response:
        try:
            try:
                body = await request.json()
            except ValueError as err:
                raise BadRequest(f"the request body is not JSON: {err}") from err
            body = check_fields(body, CHAT_FIELDS if chat else COMPLETION_FIELDS, "messages" if chat else "prompt")
            prompt = chat_prompt_ids(body, served) if chat else completion_prompt(body, served)
            params = sampling_params(body, served, len(prompt))
            try:
                seq_id = await core.add(prompt, params)
            except ValueError as err:  # the engine refuses a prompt its KV cache can never hold
                raise BadRequest(str(err), "prompt") from err
        except BadRequest as err:
            return error_response(err)
        reply = Reply(chat, served, len(prompt), params.max_tokens, next(ids))
        if body.get("stream", False):
            include_usage = bool(body.get("stream_options", {}).get("include_usage"))
            return StreamingResponse(stream_events(core, seq_id, reply, include_usage),
                                     media_type="text/event-stream")
        tokens = await collect(core, seq_id, request)
        if tokens is None:  # nobody is left to read it: nginx's 499, "client closed request", for the access log
            return Response(status_code=499)
        return JSONResponse(reply.whole(tokens))

    async def completions(request: Request) -> Response:
        return await generate(request, chat=False)

    async def chat_completions(request: Request) -> Response:
        return await generate(request, chat=True)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        core.start()
        yield
        await core.stop()

    app = Starlette(routes=[Route("/v1/models", models, methods=["GET"]),
                            Route("/v1/completions", completions, methods=["POST"]),
                            Route("/v1/chat/completions", chat_completions, methods=["POST"])], lifespan=lifespan)
    app.state.engine = core
    return app


async def collect(core: AsyncEngine, seq_id: int, request: Request) -> list[int] | None:
    """A non-streamed request's tokens; None, its sequence aborted, if the client disconnects first (a plain
    endpoint is not cancelled by Starlette when its client leaves, so a watcher listens for the disconnect)."""
    async def gather() -> list[int]:
        return [t async for new, _ in core.tokens(seq_id) for t in new]

    result, watcher = asyncio.create_task(gather()), asyncio.create_task(until_disconnected(request))
    await asyncio.wait({result, watcher}, return_when=asyncio.FIRST_COMPLETED)
    watcher.cancel()
    if result.done():
        return result.result()
    result.cancel()  # the generator's finally queues the abort
    with contextlib.suppress(asyncio.CancelledError):
        await result
    return None
