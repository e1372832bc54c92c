"""``FrontDoor``: all that the HTTP server may ask of the tokenizer manager.

The HTTP server (tokenizer_proc/http/server.py) submits its requests as *local clients*
of the TokenizerManager, so that they share the ZMQ path's validation, rid space, reply
routing, limits, metrics and aborts. This Protocol is the whole of that contact: the
request table, the request builder and the sockets stay the manager's own. The manager
(tokenizer_proc/tokenizer_manager.py) implements it.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from runtime.protocol.messages import ControlReply, DetokenizeReq, ErrorReply, GenerateReq, TokenizeReq
from tokenizer_proc.control import ControlRequest
from tokenizer_proc.embedding_model import EmbeddingModel
from tokenizer_proc.lora_names import LoraNames
from tokenizer_proc.metrics import Metrics


class FrontDoor(Protocol):
    @property
    def tokenizer(self) -> Any:
        """The HF tokenizer (token ids of logprobs -> text)."""

    @property
    def context_len(self) -> int:
        """The model's context length (``max_model_len`` of /v1/models)."""

    @property
    def embedding(self) -> EmbeddingModel | None:
        """An embedding server's model (pooling rule, size); None on a generation server."""

    @property
    def lora(self) -> LoraNames | None:
        """The LoRA adapters requests may name (listed by /v1/models); None without --enable-lora."""

    @property
    def metrics(self) -> Metrics | None:
        """The Prometheus metrics; None without --enable-metrics."""

    @property
    def draining(self) -> bool:
        """The graceful drain has started: new requests and health checks are refused."""

    def start_drain(self, why: str) -> bool:
        """Start the graceful drain (``POST /drain``); False when it had started already."""

    @property
    def weight_version(self) -> str:
        """The served weights' version (SGLang's ``weight_version``: a weight update may set it)."""

    def model_info(self) -> dict[str, Any]:
        """The model and the sampling defaults in force (``GET /get_model_info``)."""

    def open_local(self) -> tuple[bytes, "asyncio.Queue[Any]"]:
        """A new local client: its identity, and the queue its replies (chunks, errors) go to."""

    async def submit_local(self, identity: bytes, req: GenerateReq) -> int:
        """Validate, tokenize and send ``req`` for the local client; the number of samples
        (``n``). Raises ``request_builder.Rejected`` when it is refused."""

    def close_local(self, identity: bytes) -> None:
        """The local client is done or went away: abort whatever it still has in flight."""

    async def tokenize(self, req: TokenizeReq | DetokenizeReq) -> dict[str, Any]:
        """A prompt's token ids as it would be served (``tokens``, ``count``, ``max_model_len``), or
        token ids as text (``text``); raises ``request_builder.Rejected`` when the request is malformed."""

    async def local_control(self, req: ControlRequest) -> ControlReply | ErrorReply:
        """One control round trip through the scheduler (server info, flush, health, profiling, weight
        updates); raises ``request_builder.Rejected`` when it is refused before it reaches it."""

    async def abort_requests(self, rid: str, abort_all: bool, why: str) -> int:
        """Abort the requests in flight whose client rid is ``rid`` (any client), or all of them; how
        many (``POST /abort_request``)."""
