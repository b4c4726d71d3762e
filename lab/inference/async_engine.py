"""`AsyncEngine`: one `LLMEngine` shared by the requests of many connections, in an asyncio server.

What belongs here: the loop that steps the engine while any request is unfinished, and the hand-over of requests
and tokens between that loop and the connections; nothing of HTTP (that is `lab.inference.server`).

The engine has one owner, the loop task. It runs `engine.step()` in a worker thread, so that the event loop keeps
serving connections meanwhile, and between steps, on the event loop, it admits the requests that arrived, aborts
those whose client went away, and puts each request's newly generated tokens on that request's asyncio queue.
No connection ever touches the engine while a step runs, and requests from different connections share every
step: continuous batching across clients, exactly as the offline engine batches a list of prompts. Finished and
aborted requests are popped from the engine once delivered, so a long-running server does not keep them.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from lab.inference.engine import LLMEngine
from lab.inference.sampling import SamplingParams
from lab.inference.sequence import SequenceStatus


class AsyncEngine:
    """The one owner of an `LLMEngine` in an asyncio server: requests come in from any connection, one loop task
    steps the engine for all of them, and each request's new tokens go to its own queue."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.aborted = 0  # requests cancelled because their client went away
        self._arrived: list[tuple[list[int], SamplingParams, asyncio.Future[int]]] = []
        self._cancelled: list[int] = []
        self._queues: dict[int, asyncio.Queue] = {}  # seq_id -> (new tokens, finished) items, or an exception
        self._sent: dict[int, int] = {}  # seq_id -> generated tokens already handed to its queue
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def add(self, prompt: list[int], params: SamplingParams) -> int:
        """Queue a request (admitted by the loop between steps); its seq_id, or the engine's ValueError."""
        future = asyncio.get_running_loop().create_future()
        self._arrived.append((prompt, params, future))
        self._wake.set()
        return await future

    async def tokens(self, seq_id: int) -> AsyncIterator[tuple[list[int], bool]]:
        """The request's new tokens after each step that gave it some, with whether it has finished. Leaving
        early (the connection closed, its task cancelled) aborts it and frees its blocks."""
        queue, finished = self._queues[seq_id], False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                new, finished = item
                yield new, finished
        finally:
            if not finished:
                self._cancelled.append(seq_id)
                self._wake.set()

    async def _run(self) -> None:
        while True:
            self._admit_and_cancel()
            if not self.engine.has_unfinished():
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                await asyncio.to_thread(self.engine.step)
            except Exception as err:  # a failed step fails its requests, not the server
                for seq_id in list(self._queues):
                    self._queues[seq_id].put_nowait(err)
                    self._forget(seq_id, abort=True)
                continue
            self._route()

    def _admit_and_cancel(self) -> None:
        arrived, self._arrived = self._arrived, []
        for prompt, params, future in arrived:
            try:
                seq_id = self.engine.add_request(prompt, params)
            except ValueError as err:  # a prompt the KV cache can never hold
                future.set_exception(err)
                continue
            self._queues[seq_id], self._sent[seq_id] = asyncio.Queue(), 0
            future.set_result(seq_id)
        cancelled, self._cancelled = self._cancelled, []
        for seq_id in cancelled:
            if seq_id in self._queues:
                self.aborted += 1
                self._forget(seq_id, abort=True)

    def _route(self) -> None:
        """After a step: every request's new tokens to its connection; finished requests leave the engine."""
        for seq_id in list(self._queues):
            seq = self.engine.sequences[seq_id]
            new, finished = seq.generated[self._sent[seq_id]:], seq.status is SequenceStatus.FINISHED
            if new or finished:
                self._queues[seq_id].put_nowait((new, finished))
                self._sent[seq_id] += len(new)
            if finished:
                self._forget(seq_id, abort=False)

    def _forget(self, seq_id: int, abort: bool) -> None:
        if abort:
            self.engine.abort(seq_id)
        self.engine.pop(seq_id)
        del self._queues[seq_id], self._sent[seq_id]
