"""The blocking client, ``Client``: an ``AsyncClient`` (runtime/client/clients.py, which has the
errors and the protocol) on a private uvloop thread, so that a script, a notebook or several threads
call a server without an event loop of their own; every method blocks on the ``AsyncClient``'s."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import weakref
from typing import Any, Coroutine, Iterator, TypeVar

from runtime.client.clients import AsyncClient
from runtime.client.generate_call import GenerateCall

logger = logging.getLogger(__name__)

T = TypeVar("T")


class Client:
    """Blocking client: an ``AsyncClient`` on a private uvloop thread.

    ``generate(..., stream=True)`` returns a generator of chunk dicts; leaving it early
    aborts the request on the server. Thread-safe; use as a context manager or close().
    """

    def __init__(
        self, address: str = "tcp://127.0.0.1:30000", api_key: str | None = None, timeout: float | None = None
    ) -> None:
        import uvloop

        self.address = address
        self._loop = uvloop.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tinyserve-client", daemon=True)
        self._thread.start()

        async def make() -> AsyncClient:
            return AsyncClient(address, api_key=api_key, timeout=timeout)

        self._async = self._call(make())
        # Runs on close(), on garbage collection, or at interpreter exit (while the loop
        # thread still runs), whichever comes first; it holds no reference to self.
        self._finalizer = weakref.finalize(self, _shutdown, self._loop, self._thread, self._async)

    @property
    def api_key(self) -> str | None:
        return self._async.api_key

    @property
    def timeout(self) -> float | None:
        return self._async.timeout

    def _call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        future: concurrent.futures.Future[T] = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout)
        except BaseException:
            future.cancel()  # e.g. KeyboardInterrupt: the request is aborted on the server
            raise

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
    ) -> Any:
        """A result dict (``text``, ``output_ids``, ``meta``, ``rid``); a list of them for
        a batch of prompts (same order) or for n > 1; a generator of chunk dicts when
        ``stream=True`` (``text`` and ``output_ids`` are deltas)."""
        call = self._async.generate(
            prompt,
            sampling_params,
            input_ids=input_ids,
            messages=messages,
            stream=stream,
            return_logprob=return_logprob,
            top_logprobs_num=top_logprobs_num,
            rid=rid,
            logprob_start_len=logprob_start_len,
            tools=tools,
            chat_template_kwargs=chat_template_kwargs,
            deadline_s=deadline_s,
            priority=priority,
            token_ids_logprob=token_ids_logprob,
            lora_path=lora_path,
        )
        if stream:
            return self._iterate(call)

        async def run() -> Any:
            return await call

        return self._call(run())

    def embed(
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
        """The embedding of ``text`` or ``input_ids`` (``AsyncClient.embed``); call it from several threads
        to have the server batch the inputs."""
        return self._call(
            self._async.embed(
                text, input_ids, text_pair, truncate_prompt_tokens, rid=rid, deadline_s=deadline_s, priority=priority
            )
        )

    def _iterate(self, call: GenerateCall) -> Iterator[dict[str, Any]]:
        agen = call.__aiter__()
        try:
            while True:
                try:
                    chunk = self._call(agen.__anext__())
                except StopAsyncIteration:
                    return
                yield chunk
        finally:
            if not self.closed:
                self._call(agen.aclose())  # aborts an unfinished stream

    def abort(self, rid: str) -> bool:
        return self._call(self._async.abort(rid))

    def abort_all(self) -> int:
        return self._call(self._async.abort_all())

    def flush_cache(self) -> dict[str, Any]:
        return self._call(self._async.flush_cache())

    def server_info(self) -> dict[str, Any]:
        return self._call(self._async.server_info())

    def start_profile(
        self,
        output_dir: str,
        num_steps: int | None = None,
        activities: list[str] | None = None,
        profile_id: str | None = None,
    ) -> dict[str, Any]:
        return self._call(self._async.start_profile(output_dir, num_steps, activities, profile_id))

    def stop_profile(self) -> dict[str, Any]:
        return self._call(self._async.stop_profile())

    def update_weights_from_disk(
        self,
        model_path: str,
        *,
        load_format: str | None = None,
        weight_version: str | None = None,
        abort_all_requests: bool = False,
    ) -> dict[str, Any]:
        return self._call(
            self._async.update_weights_from_disk(
                model_path,
                load_format=load_format,
                weight_version=weight_version,
                abort_all_requests=abort_all_requests,
            )
        )

    def load_lora_adapter(self, lora_name: str, lora_path: str, *, pinned: bool = False) -> dict[str, Any]:
        return self._call(self._async.load_lora_adapter(lora_name, lora_path, pinned=pinned))

    def unload_lora_adapter(self, lora_name: str) -> dict[str, Any]:
        return self._call(self._async.unload_lora_adapter(lora_name))

    def tokenize(
        self,
        prompt: str | None = None,
        *,
        messages: list[dict[str, Any]] | None = None,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        add_special_tokens: bool | None = None,
    ) -> dict[str, Any]:
        return self._call(
            self._async.tokenize(
                prompt,
                messages=messages,
                tools=tools,
                chat_template_kwargs=chat_template_kwargs,
                add_special_tokens=add_special_tokens,
            )
        )

    def detokenize(self, tokens: list[int], *, skip_special_tokens: bool = False) -> str:
        return self._call(self._async.detokenize(tokens, skip_special_tokens=skip_special_tokens))

    def health(self, timeout: float | None = None) -> bool:
        return self._call(self._async.health(timeout))

    def close(self) -> None:
        """Abort this client's requests in flight, close the socket, stop the loop thread."""
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _shutdown(loop: asyncio.AbstractEventLoop, thread: threading.Thread, aclient: AsyncClient) -> None:
    try:
        if thread.is_alive():
            asyncio.run_coroutine_threadsafe(aclient.close(), loop).result(10)
    except Exception:  # closing must not raise (it also runs from the garbage collector)
        logger.debug("error while closing a client", exc_info=True)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        if not thread.is_alive():
            loop.close()
