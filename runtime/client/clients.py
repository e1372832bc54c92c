"""Python clients of a tinyserve server (docs/serving.md shows them in use).

    from runtime.client import Client
    c = Client("tcp://127.0.0.1:30000")
    r = c.generate("Hello", {"max_new_tokens": 16, "temperature": 0})
    r["text"], r["output_ids"], r["meta"]

``AsyncClient`` is the implementation (one DEALER socket, a reader task that routes
replies to the waiting call by rid); ``Client`` (runtime/client/sync_client.py) runs an
``AsyncClient`` on a private event loop thread, so its blocking methods are safe to call from
several threads.

Errors: a rejected request raises ``RequestError(code, message)`` for that request
only, and so does one the client cannot encode (a lone surrogate in a string, an
integer past 64 bits, an object msgpack has no type for), before it is sent; no reply within ``timeout`` seconds raises ``RequestTimeout`` (a TimeoutError)
and aborts the request on the server. A server that stops tells every request in flight
(``RequestError`` code ``server_shutdown``); one that vanishes without a word (killed, or
hung so that it stops answering ZMQ heartbeats) is noticed by the client itself, and every
request in flight raises ``ServerGone`` within ``HEARTBEAT_IVL_S + HEARTBEAT_TIMEOUT_S``
seconds, also with ``timeout=None``; a request made while no connection is up raises it
after ``CONNECT_TIMEOUT_S``. A stream that is not read to the end (a
``break``, an exception, garbage collection) and every request still in flight when
the client closes are aborted on the server, so they stop holding KV memory.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any, AsyncGenerator

from runtime.client.connection import (
    CONNECT_TIMEOUT_S,
    HEARTBEAT_IVL_S,
    HEARTBEAT_TIMEOUT_S,
    ClientConnection,
)
from runtime.client.errors import RequestError, RequestTimeout, ServerGone
from runtime.client.generate_call import GenerateCall, chunk_dict, is_batch, result_dict
from runtime.protocol.messages import (
    AbortReq,
    ControlReply,
    DetokenizeReq,
    ErrorReply,
    FlushCacheReq,
    GenerateChunk,
    GenerateReq,
    HealthReq,
    LoraAdapterReq,
    LoraControl,
    ProfileOptions,
    ProfileReq,
    ServerInfoReq,
    TokenizeReq,
    UpdateWeightsReq,
    WeightUpdate,
)

logger = logging.getLogger(__name__)

DEFAULT_HEALTH_TIMEOUT_S = 30.0


async def _raise(exc: BaseException) -> Any:
    """A coroutine that fails with ``exc``: a batch member that was never sent, in its place."""
    raise exc


class AsyncClient(ClientConnection):
    """Asyncio client (works on uvloop). Use one per event loop; the socket, its liveness
    and the routing of replies are ``ClientConnection``'s."""

    # ------------------------------------------------------------------ public API

    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict[str, Any] | None = None,
        *,
        input_ids: list[int] | list[list[int]] | None = None,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]] | None = None,
        stream: bool = False,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        rid: str | list[str] | None = None,
        logprob_start_len: int = -1,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        deadline_s: float | None = None,
        priority: int = 0,
        token_ids_logprob: list[int] | None = None,
        lora_path: str | list[str | None] | None = None,
    ) -> "GenerateCall":
        """``await`` it for the result (a list for a batch or for n > 1); with
        ``stream=True`` iterate it (``async for chunk in client.generate(...)``).

        ``logprob_start_len`` >= 0 (with ``return_logprob``): the logprobs of the prompt tokens from
        that position on, in ``meta["input_token_logprobs"]`` (and ``input_top_logprobs``).
        ``tools`` (OpenAI function definitions) and ``chat_template_kwargs`` go to the chat
        template with ``messages``; the reply is the model's text (the OpenAI endpoint reads
        tool calls out of it). ``deadline_s``: the server aborts the request that many seconds
        after it arrived if it has not finished (finish_reason ``{"type": "abort", "message":
        "timeout"}``, with what it generated so far); unlike the client's ``timeout``, which only
        stops waiting, it is enforced by the server, also while the request waits in its queue.
        ``priority``: larger is scheduled first on a server with ``--enable-priority-scheduling``
        (ignored elsewhere). ``token_ids_logprob`` (SGLang's): the logprobs of these token ids at every
        output position, in ``meta["output_token_ids_logprobs"]`` (and at the prompt positions from
        ``logprob_start_len`` on, in ``meta["input_token_ids_logprobs"]``). ``lora_path``: the LoRA
        adapter to generate with, by the name it was loaded under (a list: one per prompt of a batch;
        None: the base model)."""
        if (tools is not None or chat_template_kwargs is not None) and messages is None:
            raise ValueError("tools and chat_template_kwargs go with messages")
        given = [x for x in (prompt, input_ids, messages) if x is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of prompt, input_ids, messages")
        batch = is_batch(prompt, input_ids, messages)
        items = list(given[0]) if batch else [given[0]]
        if batch and stream:
            raise ValueError("stream=True takes a single prompt")
        if rid is None:
            rids = [uuid.uuid4().hex for _ in items]
        elif batch:
            if isinstance(rid, str) or len(rid) != len(items):
                raise ValueError("for a batch, rid must be a list with one rid per prompt")
            rids = list(rid)
        else:
            if not isinstance(rid, str):
                raise ValueError("rid must be a str")
            rids = [rid]
        field = "text" if prompt is not None else "input_ids" if input_ids is not None else "messages"
        # One keyword per request; its value's shape is the server's to validate (msgspec).
        input_kwargs: list[dict[str, Any]] = [{field: item} for item in items]
        if isinstance(lora_path, list):
            if len(lora_path) != len(items):
                raise ValueError("lora_path: a list needs one adapter (or None) per prompt")
            adapters = list(lora_path)
        else:
            adapters = [lora_path] * len(items)
        reqs = [
            GenerateReq(
                rid=r,
                sampling_params=sampling_params,
                stream=stream,
                return_logprob=return_logprob,
                top_logprobs_num=top_logprobs_num,
                logprob_start_len=logprob_start_len,
                tools=tools,
                chat_template_kwargs=chat_template_kwargs,
                api_key=self.api_key,
                deadline_s=deadline_s,
                priority=priority,
                token_ids_logprob=token_ids_logprob,
                lora_path=adapter,
                **inputs,
            )
            for r, inputs, adapter in zip(rids, input_kwargs, adapters)
        ]
        n = sampling_params.get("n", 1) if isinstance(sampling_params, dict) else 1
        n = n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else 1
        return GenerateCall(
            reqs, run=lambda: self._run(reqs, batch, n), stream=(lambda: self._stream(reqs[0], n)) if stream else None
        )

    async def embed(
        self,
        text: str | None = None,
        input_ids: list[int] | None = None,
        text_pair: str | None = None,
        truncate_prompt_tokens: int | None = None,
        *,
        rid: str | None = None,
        deadline_s: float | None = None,
        priority: int = 0,
    ) -> list[float]:
        """The embedding of ``text`` or ``input_ids`` on a server started with ``--is-embedding``: the
        model's pooled vector (normalised where its pooling rule says), or for a cross-encoder its label
        scores, with ``text_pair`` the pair's second text (query, document). ``truncate_prompt_tokens``:
        keep the first k tokens of a longer input (-1: as many as the model takes) instead of having it
        refused (``RequestError`` code ``too_long``). Several calls in flight at once (``asyncio.gather``)
        are batched by the server."""
        if (text is None) == (input_ids is None):
            raise ValueError("give exactly one of text, input_ids")
        if text_pair is not None and text is None:
            raise ValueError("text_pair goes with text")
        req = GenerateReq(
            rid=rid if rid is not None else uuid.uuid4().hex,
            text=text,
            input_ids=input_ids,
            text_pair=text_pair,
            truncate_prompt_tokens=truncate_prompt_tokens,
            embed=True,
            api_key=self.api_key,
            deadline_s=deadline_s,
            priority=priority,
        )
        result = await self._run([req], False, 1)
        meta: dict[str, Any] = result["meta"]
        embedding = meta.get("embedding")
        if embedding is None:  # aborted (its deadline passed) before the server pooled it
            reason = meta.get("finish_reason") or {}
            raise RequestError("aborted", str(reason.get("message") or "the request was aborted"), req.rid)
        return list(embedding)

    async def abort(self, rid: str) -> bool:
        """Abort a request of this client; True if it was still in flight."""
        payload = await self._control("abort", AbortReq(rid=rid, api_key=self.api_key), rid)
        return bool(payload.get("aborted"))

    async def abort_all(self) -> int:
        """Abort every client's requests on a server with ``--api-key``, only this client's
        on one without (anyone could call it); the number aborted."""
        rid = uuid.uuid4().hex
        payload = await self._control("abort", AbortReq(rid=rid, api_key=self.api_key, all=True), rid)
        return int(payload.get("aborted", 0))

    async def flush_cache(self) -> dict[str, Any]:
        """Drop the prefix cache (only when the server is idle); the server's answer."""
        rid = uuid.uuid4().hex
        return await self._control("ctl", FlushCacheReq(rid=rid, api_key=self.api_key), rid)

    async def server_info(self) -> dict[str, Any]:
        """Scheduler figures (memory, queue, memory_invariant, ...), the tokenizer's
        figures ("tokenizer"), the model ("model") and the server's flags ("server_args")."""
        rid = uuid.uuid4().hex
        return await self._control("ctl", ServerInfoReq(rid=rid, api_key=self.api_key), rid)

    async def start_profile(
        self,
        output_dir: str,
        num_steps: int | None = None,
        activities: list[str] | None = None,
        profile_id: str | None = None,
    ) -> dict[str, Any]:
        """Start the torch profiler on every scheduler rank (``POST /start_profile``): each writes a
        Chrome trace ``{profile_id}-TP-{rank}.trace.json`` into ``output_dir`` at ``stop_profile``, or
        by itself after ``num_steps`` forward steps; ``activities``: ``CPU``, ``GPU`` (default: what
        the device has)."""
        rid = uuid.uuid4().hex
        options = ProfileOptions(output_dir, profile_id or rid, num_steps=num_steps, activities=activities)
        return await self._control("ctl", ProfileReq(rid=rid, start=True, options=options, api_key=self.api_key), rid)

    async def stop_profile(self) -> dict[str, Any]:
        """Stop the profiler; the answer lists the trace files (``trace_files``)."""
        rid = uuid.uuid4().hex
        return await self._control("ctl", ProfileReq(rid=rid, start=False, api_key=self.api_key), rid)

    async def update_weights_from_disk(
        self,
        model_path: str,
        *,
        load_format: str | None = None,
        weight_version: str | None = None,
        abort_all_requests: bool = False,
    ) -> dict[str, Any]:
        """Reload the served weights in place from another checkpoint of the same model (``POST
        /update_weights_from_disk``): running requests finish on the old weights first (or are aborted
        with ``abort_all_requests``). SGLang's answer: ``success``, ``message``, ``num_paused_requests``
        (a refused checkpoint is ``success`` False, and the old weights serve on)."""
        rid = uuid.uuid4().hex
        update = WeightUpdate(model_path, load_format, weight_version, abort_all_requests)
        return await self._control("ctl", UpdateWeightsReq(rid=rid, update=update, api_key=self.api_key), rid)

    async def load_lora_adapter(self, lora_name: str, lora_path: str, *, pinned: bool = False) -> dict[str, Any]:
        """Load the PEFT adapter folder ``lora_path`` as ``lora_name`` (``POST /load_lora_adapter``);
        ``pinned``: it keeps a slot for good. SGLang's answer: ``success``, ``message``, and here the
        adapters loaded afterwards (``loaded_adapters``)."""
        rid = uuid.uuid4().hex
        control = LoraControl(lora_name, lora_path, pinned)
        return await self._control(
            "ctl", LoraAdapterReq(rid=rid, load=True, adapter=control, api_key=self.api_key), rid
        )

    async def unload_lora_adapter(self, lora_name: str) -> dict[str, Any]:
        """Unload adapter ``lora_name`` once the requests running on it have finished (``POST
        /unload_lora_adapter``); from the call on, new requests naming it are refused."""
        rid = uuid.uuid4().hex
        control = LoraControl(lora_name)
        return await self._control(
            "ctl", LoraAdapterReq(rid=rid, load=False, adapter=control, api_key=self.api_key), rid
        )

    async def tokenize(
        self,
        prompt: str | None = None,
        *,
        messages: list[dict[str, Any]] | None = None,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        add_special_tokens: bool | None = None,
    ) -> dict[str, Any]:
        """A prompt's token ids as the server would serve it (``POST /tokenize``): a text, or ``messages``
        rendered with the model's chat template (the generation prompt on). The answer: ``tokens``,
        ``count``, ``max_model_len``. ``add_special_tokens`` defaults to on for a text and off for a
        chat (its template writes them)."""
        rid = uuid.uuid4().hex
        req = TokenizeReq(
            rid=rid,
            text=prompt,
            messages=messages,
            tools=tools,
            chat_template_kwargs=chat_template_kwargs,
            add_special_tokens=add_special_tokens,
            api_key=self.api_key,
        )
        return await self._control("ctl", req, rid)

    async def detokenize(self, tokens: list[int], *, skip_special_tokens: bool = False) -> str:
        """Token ids back to text (``POST /detokenize``)."""
        rid = uuid.uuid4().hex
        req = DetokenizeReq(rid=rid, tokens=tokens, skip_special_tokens=skip_special_tokens, api_key=self.api_key)
        return str((await self._control("ctl", req, rid))["text"])

    async def health(self, timeout: float | None = None) -> bool:
        """True when the server answered through a scheduler round trip within ``timeout``
        (default: the client's timeout, else 30 s)."""
        rid = uuid.uuid4().hex
        wait = timeout if timeout is not None else (self.timeout or DEFAULT_HEALTH_TIMEOUT_S)
        try:
            payload = await self._control("ctl", HealthReq(rid=rid, api_key=self.api_key), rid, timeout=wait)
        except (RequestError, RequestTimeout):
            return False
        return bool(payload.get("ok"))

    async def close(self) -> None:
        """Abort this client's requests in flight and close the socket."""
        if self._closed:
            return
        self._closed = True
        in_flight = [rid for kind, rid in self._queues if kind == "gen"]
        for rid in in_flight:
            self._send_nowait(AbortReq(rid=rid, api_key=self.api_key))
        # A short linger lets the aborts leave; without them nothing needs to wait.
        await self._disconnect(linger_ms=200 if in_flight else 0)

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------------ internals

    async def _control(self, kind: str, req: Any, rid: str, timeout: float | None = None) -> dict[str, Any]:
        self._ensure_open()
        frame = self._encode(req)
        queue = self._register(kind, rid)
        try:
            self._send_frame(frame)
            reply = await self._next(queue, timeout)
        finally:
            self._queues.pop((kind, rid), None)
        if isinstance(reply, ErrorReply):
            raise RequestError(reply.code, reply.message, reply.rid)
        assert isinstance(reply, ControlReply)
        return reply.payload

    async def _collect(self, req: GenerateReq, queue: asyncio.Queue[Any], n: int) -> Any:
        """Wait for every sample of one non-stream request."""
        results: list[dict[str, Any] | None] = [None] * n
        done = False
        try:
            while any(r is None for r in results):
                msg = await self._next(queue)
                if isinstance(msg, ErrorReply):
                    done = True  # the server has dropped the request
                    raise RequestError(msg.code, msg.message, msg.rid)
                if isinstance(msg, GenerateChunk) and msg.finished:
                    index = msg.meta.index or 0
                    if 0 <= index < n:
                        results[index] = result_dict(msg)
            done = True
        finally:
            self._queues.pop(("gen", req.rid), None)
            if not done and not self._closed:
                self._send_nowait(AbortReq(rid=req.rid, api_key=self.api_key))
        return results[0] if n == 1 else results

    async def _run(self, reqs: list[GenerateReq], batch: bool, n: int) -> Any:
        self._ensure_open()
        rids = [r.rid for r in reqs]
        if len(set(rids)) != len(rids):
            raise ValueError(f"a batch needs distinct rids, got {rids}")
        # A request that cannot be encoded fails alone: in a batch, in its place (as a server's
        # rejection would); a single one before anything is registered.
        frames: list[bytes | RequestError] = []
        for r in reqs:
            try:
                frames.append(self._encode(r))
            except RequestError as exc:
                frames.append(exc)
        if not batch and isinstance(frames[0], RequestError):
            raise frames[0]
        # Each request's reply queue, or, for one that is never sent, the error it fails with.
        queues: list[asyncio.Queue[Any] | RequestError] = []
        try:
            for r, frame in zip(reqs, frames):
                queues.append(self._register("gen", r.rid) if isinstance(frame, bytes) else frame)
        except ValueError:
            for r in reqs[: len(queues)]:  # leave nothing registered for a batch that never went out
                self._queues.pop(("gen", r.rid), None)
            raise
        # Send everything first, then wait: the server sees the whole batch at once.
        for frame in frames:
            if isinstance(frame, bytes):
                self._send_frame(frame)
        outcomes = await asyncio.gather(
            *(_raise(q) if isinstance(q, RequestError) else self._collect(r, q, n) for r, q in zip(reqs, queues)),
            return_exceptions=True,
        )
        errors = [o for o in outcomes if isinstance(o, BaseException)]
        if errors:
            first = errors[0]
            if isinstance(first, RequestError) and batch:
                first.results = list(outcomes)
            raise first
        return list(outcomes) if batch else outcomes[0]

    async def _stream(self, req: GenerateReq, n: int) -> AsyncGenerator[dict[str, Any], None]:
        self._ensure_open()
        frame = self._encode(req)
        queue = self._register("gen", req.rid)
        finished = 0
        done = False
        try:
            self._send_frame(frame)
            while finished < n:
                msg = await self._next(queue)
                if isinstance(msg, ErrorReply):
                    done = True
                    raise RequestError(msg.code, msg.message, msg.rid)
                if isinstance(msg, GenerateChunk):
                    finished += int(msg.finished)
                    yield chunk_dict(msg)
            done = True
        finally:
            self._queues.pop(("gen", req.rid), None)
            if not done and not self._closed:
                self._send_nowait(AbortReq(rid=req.rid, api_key=self.api_key))


__all__ = [
    "CONNECT_TIMEOUT_S",
    "HEARTBEAT_IVL_S",
    "HEARTBEAT_TIMEOUT_S",
    "AsyncClient",
    "GenerateCall",
    "RequestError",
    "RequestTimeout",
    "ServerGone",
]
