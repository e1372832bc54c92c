"""Requests waiting for their grammar: compiled off the scheduler's loop, joined when ready.

A constrained request (``json_schema``, ``regex``, ``ebnf``) does not enter the waiting
queue until its grammar is compiled against the served vocabulary: compiles run on a few
threads of their own (xgrammar releases the GIL while compiling), so a schema that takes
seconds delays only its own requests while the loop keeps stepping the others, constrained
ones included. Requests that arrive while their constraint is compiling share that compile;
compiled grammars are cached (``GrammarBackend``).

Under tensor parallelism every rank compiles for itself, and rank 0 decides when a request
is ready (or has failed, or timed out); the others follow its decision, waiting for their
own compile if they must, so every rank's queues hold the same requests at every step.

Owner: the scheduler. A request here holds no memory; ``poll`` hands ready requests back
with their ``grammar`` set, and failed ones with the reason.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

import msgspec

from scheduler_proc.req import Req

logger = logging.getLogger(__name__)

COMPILE_THREADS = 4


@runtime_checkable
class BytesBroadcast(Protocol):
    """The control half of a TP group that rank 0's grammar decisions cross (the scheduler
    process's ``TPGroup``, over gloo). ``get_tp_group`` is typed as the layers' tensor-only
    ``TPCommunicator``, so ``_agree`` checks that the registered group also carries bytes."""

    def broadcast_bytes(self, payload: bytes | None, src: int = 0) -> bytes: ...


@dataclass
class _Waiting:
    req: Req
    compiled: Future[Any]  # runtime.text.grammar.backend.Compiled
    deadline: float  # time.monotonic() past which the request fails
    shared: bool = False  # another request started the compile: for this one it is a cache hit


@dataclass
class GrammarStats:
    """Counters for server_info (each request's own compile time goes out with its first output)."""

    constrained_requests: int = 0
    grammar_compiles: int = 0
    grammar_cache_hits: int = 0


class GrammarQueue:
    """The requests whose grammar is compiling; see the module docstring."""

    def __init__(
        self,
        load_tokenizer: Callable[[], Any],
        vocab_size: int,
        stop_token_ids: Sequence[int],
        timeout_s: float,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        self._load_tokenizer = load_tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = list(stop_token_ids)
        self._timeout_s = timeout_s
        self._tp_rank, self._tp_size = tp_rank, tp_size
        self._executor: ThreadPoolExecutor | None = None
        self._backend: Any = None  # runtime.text.grammar.GrammarBackend, made on a compile thread
        self._backend_lock = threading.Lock()
        self._waiting: list[_Waiting] = []
        self._compiling: dict[tuple[str, str], Future[Any]] = {}  # the latest compile of each constraint
        self.stats = GrammarStats()

    def __len__(self) -> int:
        return len(self._waiting)

    def requests(self) -> list[Req]:
        """The requests waiting for their grammar."""
        return [waiting.req for waiting in self._waiting]

    @property
    def tokenizer(self) -> Any:
        """The tokenizer the grammars were compiled for (set once the first compile started)."""
        return None if self._backend is None else self._backend.tokenizer

    def add(self, req: Req) -> None:
        constraint = req.sampling_params.constraint
        assert constraint is not None, f"{req.rid} has no grammar to wait for"
        if self._executor is None:
            # A few threads: a grammar that takes seconds to compile holds up only its own requests.
            self._executor = ThreadPoolExecutor(max_workers=COMPILE_THREADS, thread_name_prefix="grammar")
        future = self._compiling.get(constraint)
        shared = future is not None and not future.done()  # the same grammar is compiling: wait for it
        if not shared:
            future = self._compiling[constraint] = self._executor.submit(self._compile, *constraint)
        assert future is not None
        self._waiting.append(_Waiting(req, future, time.monotonic() + self._timeout_s, shared))
        self.stats.constrained_requests += 1

    def remove(self, rid: str) -> list[Req]:
        """Take out the requests with ``rid`` ('' = all): aborted before their grammar was ready."""
        gone = [w.req for w in self._waiting if rid in ("", w.req.rid)]
        self._waiting = [w for w in self._waiting if w.req not in gone]
        return gone

    def poll(self) -> tuple[list[Req], list[tuple[Req, str]]]:
        """(requests now ready, with their matcher; requests that failed, with the reason)."""
        if not self._waiting:
            return [], []
        decisions = self._decide() if self._tp_rank == 0 else {}
        if self._tp_size > 1:
            decisions = self._agree(decisions)
        ready: list[Req] = []
        failed: list[tuple[Req, str]] = []
        keep: list[_Waiting] = []
        for waiting in self._waiting:
            if waiting.req.rid not in decisions:
                keep.append(waiting)
                continue
            error = decisions[waiting.req.rid]
            if error is None:
                error = self._attach(waiting)
            if error is None:
                ready.append(waiting.req)
            else:
                failed.append((waiting.req, error))
        self._waiting = keep
        self._compiling = {key: f for key, f in self._compiling.items() if not f.done()}
        return ready, failed

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ pieces

    def _compile(self, kind: str, text: str) -> Any:
        """On the compile thread: the vocabulary (first time only), then the grammar."""
        from runtime.text.grammar import GrammarBackend

        with self._backend_lock:  # the first compiles wait for the one vocabulary
            if self._backend is None:
                self._backend = GrammarBackend(self._load_tokenizer(), self._vocab_size, self._stop_token_ids)
        return self._backend.compile(kind, text)

    def _decide(self) -> dict[str, str | None]:
        """rid -> None (ready) or the error, for each request whose fate is known now."""
        now = time.monotonic()
        decisions: dict[str, str | None] = {}
        for waiting in self._waiting:
            future = waiting.compiled
            if future.done():
                error = future.exception()
                decisions[waiting.req.rid] = None if error is None else str(error)
            elif now >= waiting.deadline:
                kind = waiting.req.sampling_params.constraint[0]  # type: ignore[index]
                decisions[waiting.req.rid] = (
                    f"{kind}: the grammar did not compile within {self._timeout_s:g} s (--grammar-compile-timeout)"
                )
        return decisions

    def _agree(self, decisions: dict[str, str | None]) -> dict[str, str | None]:
        """Rank 0's decisions, on every rank."""
        from runtime.engine.distributed import get_tp_group

        group = get_tp_group()
        if not isinstance(group, BytesBroadcast):
            raise TypeError(f"the TP group ({type(group).__name__}) cannot broadcast grammar decisions")
        payload = msgspec.msgpack.encode(decisions) if self._tp_rank == 0 else None
        agreed = group.broadcast_bytes(payload)
        return msgspec.msgpack.decode(agreed, type=dict[str, str | None]) if self._tp_rank else decisions

    def _attach(self, waiting: _Waiting) -> str | None:
        """Give the request its matcher (waiting for this rank's compile if rank 0 was quicker)."""
        from runtime.text.grammar import RequestGrammar

        try:
            compiled = waiting.compiled.result()
        except Exception as exc:  # only a rank other than 0 can get here with a failed compile
            return str(exc)
        if waiting.shared:
            compiled = dataclasses.replace(compiled, seconds=0.0, cache_hit=True)
        if compiled.cache_hit:
            self.stats.grammar_cache_hits += 1
        else:
            self.stats.grammar_compiles += 1
        waiting.req.grammar = RequestGrammar(compiled)
        return None
