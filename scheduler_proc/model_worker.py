"""ModelWorker: runs the scheduler's forwards, inline or on a thread of its own (overlap).

With overlap the scheduler launches step N+1 before it has looked at step N's tokens.
Step N+1's decode inputs are then tokens that only exist on the device: the batch
carries ``FutureInputs`` (which entries of ``input_ids`` are placeholders, and which row
of the previous step's sampled ids fills each), and the worker resolves them right
before the forward, in launch order, so the host never waits for them. The one
device-to-host copy per step (token ids, plus logprobs when asked) is started on the
worker's stream and waited for by ``PendingStep.wait`` through an event.

Memory: a ``PendingStep`` holds its batch (and so every input tensor the device may still
read) until ``wait`` returns, at which point all of the step's device work is done.
The KV slots and request rows of a step belong to the scheduler throughout; the worker
only reads them and writes the step's new KV.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from memory.kv_pool import MHATokenToKVPool
from memory.req_to_token_pool import ReqToTokenPool
from runtime.config.args import ServerArgs
from runtime.engine.forward_batch import ForwardBatch, ForwardMode
from scheduler_proc.prefill_adder import PlannedExtend
from scheduler_proc.queues import RequestQueues
from scheduler_proc.req import Req

logger = logging.getLogger(__name__)


class ForwardRunner(Protocol):
    """What the scheduler needs of a model runner (ModelRunner and StubModelRunner both fit).

    The runner owns the pools; the scheduler writes ``req_to_token_pool`` rows, the
    forward writes the KV pool.
    """

    device: torch.device
    context_len: int
    vocab_size: int
    eos_token_ids: list[int]
    # The length past which the model's RoPE differs for every token (LongRoPE), or None.
    rope_switch_len: int | None
    max_total_tokens: int
    max_running_requests: int
    req_to_token_pool: ReqToTokenPool
    token_to_kv_pool: MHATokenToKVPool

    def forward(self, batch: ForwardBatch) -> Any: ...


@dataclass
class FutureInputs:
    """``batch.input_ids[positions] = previous step's next_token_ids[source_rows]``."""

    positions: torch.Tensor  # int64 [k], on the batch's device
    source_rows: torch.Tensor  # int64 [k], on the batch's device


@dataclass
class StepResult:
    """A finished step's outputs on the host, row i = batch request i (token ids are Python ints)."""

    token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: tuple[list[list[float]], list[list[int]]] | None = None
    # token_ids_logprob: row i's logprobs at its request's ids, in their order (padded past them).
    token_ids_logprobs: list[list[float]] | None = None
    # Prompt logprobs of the batch's prompt rows, in batch order (``ForwardBatch.input_logprobs``).
    input_logprobs: list[float] | None = None
    input_top_logprobs: tuple[list[list[float]], list[list[int]]] | None = None
    input_token_ids_logprobs: list[list[float]] | None = None
    # An embedding step's: row i's part of its request's pooled vector, fp32 on the host [bs, width].
    pooled: torch.Tensor | None = None


class PendingStep:
    """A launched forward; ``wait`` returns its host results (once ready)."""

    def __init__(self, batch: ForwardBatch, future: FutureInputs | None = None) -> None:
        # Held until ``wait``: the device may read them until the step is done.
        self.batch: ForwardBatch | None = batch
        self.future = future
        self._done = threading.Event()
        self._output: Any = None
        self._copied: torch.cuda.Event | None = None
        self._error: BaseException | None = None
        self._result: StepResult | None = None

    def _set(self, output: Any, copied: torch.cuda.Event | None) -> None:
        self._output, self._copied = output, copied
        self._done.set()

    def _fail(self, error: BaseException) -> None:
        self._error = error
        self._done.set()

    def wait(self) -> StepResult:
        if self._result is None:
            self._done.wait()
            if self._error is not None:
                raise RuntimeError("the model forward failed") from self._error
            if self._copied is not None:
                self._copied.synchronize()
            self._result = _to_result(self._output)
            self._output = self.batch = self.future = None  # the device is done with the step's tensors
        return self._result


def _host_copy(output: Any) -> Any:
    """Start the device-to-host copies of what the scheduler reads (non-blocking on cuda)."""

    def host(t: torch.Tensor) -> torch.Tensor:
        return t.to("cpu", non_blocking=True)

    top = output.top_logprobs
    copy = type(output)(
        next_token_ids=host(output.next_token_ids),
        logprobs=None if output.logprobs is None else host(output.logprobs),
        top_logprobs=None if top is None else (host(top[0]), host(top[1])),
    )
    named = getattr(output, "token_ids_logprobs", None)  # (a stub runner's output has none)
    if named is not None:
        copy.token_ids_logprobs = host(named)
    pooled = getattr(output, "pooled", None)
    if pooled is not None:
        copy.pooled = host(pooled)
    prompt = getattr(output, "input_token_logprobs", None)
    if prompt is not None:
        copy.input_token_logprobs = host(prompt)
        prompt_top = output.input_top_logprobs
        copy.input_top_logprobs = None if prompt_top is None else (host(prompt_top[0]), host(prompt_top[1]))
        prompt_named = output.input_token_ids_logprobs
        copy.input_token_ids_logprobs = None if prompt_named is None else host(prompt_named)
    return copy


def _top_lists(top: tuple[torch.Tensor, torch.Tensor]) -> tuple[list[list[float]], list[list[int]]]:
    """(values, ids) of top logprobs as host lists, the ids Python ints whatever the tensor's dtype
    (a float id would reach clients as ``3.0``)."""
    return top[0].tolist(), top[1].to(torch.int64).tolist()


def _to_result(output: Any) -> StepResult:
    top = output.top_logprobs
    result = StepResult(
        token_ids=output.next_token_ids.to(torch.int64).tolist(),
        logprobs=None if output.logprobs is None else output.logprobs.tolist(),
        top_logprobs=None if top is None else _top_lists(top),
    )
    named = getattr(output, "token_ids_logprobs", None)  # (a stub runner's output has none)
    if named is not None:
        result.token_ids_logprobs = named.tolist()
    pooled = getattr(output, "pooled", None)
    if pooled is not None:
        result.pooled = pooled.to("cpu", torch.float32)
    prompt = getattr(output, "input_token_logprobs", None)
    if prompt is not None:
        result.input_logprobs = prompt.tolist()
        prompt_top = output.input_top_logprobs
        result.input_top_logprobs = None if prompt_top is None else _top_lists(prompt_top)
        prompt_named = output.input_token_ids_logprobs
        result.input_token_ids_logprobs = None if prompt_named is None else prompt_named.tolist()
    return result


@dataclass
class LaunchedStep:
    """A forward on its way: batch rows are ``extend`` then ``decode``, in order."""

    pending: PendingStep
    mode: ForwardMode
    extend: list[PlannedExtend]
    decode: list[Req]
    # Each decode request's drafts in a verify step (scheduler_proc.spec); None: one token each.
    drafts: list[list[int]] | None = None

    def decode_rows(self) -> dict[Req, int]:
        """Batch row of each decoding request (the next step is planned ahead of decode steps only)."""
        return {req: i for i, req in enumerate(self.decode, start=len(self.extend))}


def can_plan_ahead(
    step: LaunchedStep, queues: RequestQueues, *, mixed_chunk: bool, speculative: bool, preemption_pending: bool
) -> bool:
    """Whether the next step may be planned while ``step`` (in flight) runs (overlap scheduling), or
    the host state must be exact first."""
    if speculative:
        return False  # drafts continue every token of a request (scheduler_proc.spec.verify)
    if step.extend:
        # Its processing inserts the prompts into the prefix cache, which remaps their rows,
        # frees duplicate slots (a host-tier load may reuse them at once) and moves SWA
        # slots: no later step may be in flight then. The next prefill may also hit them.
        return False
    if preemption_pending:
        return False  # a priority preemption retracts: the host state must be exact
    queued = [*queues.waiting, *([queues.chunked] if queues.chunked is not None else [])]
    if queued and (mixed_chunk or any(r.jumped for r in queued)):
        return False  # a mixed batch's decode part takes host inputs
    # Penalties read the output history, a grammar's mask (and jump-forward) the state after the
    # last token (bench/grammar_overlap.py measured this against filling masks later).
    return not any(
        r.to_abort is not None or r.sampling_params.has_penalties or r.grammar is not None for r in queues.running
    )


class ModelWorker:
    """Inline worker: ``launch`` runs the forward at once (no futures, no thread)."""

    overlap = False

    def __init__(self, runner: ForwardRunner) -> None:
        self.runner = runner

    def launch(self, batch: ForwardBatch, future: FutureInputs | None = None) -> PendingStep:
        if future is not None:
            raise ValueError("the inline worker has no step in flight to take future tokens from")
        pending = PendingStep(batch)
        pending._set(self.runner.forward(batch), None)
        return pending

    def close(self) -> None:
        pass


class OverlapModelWorker(ModelWorker):
    """Forwards run in launch order on a thread of their own (and a CUDA stream on cuda)."""

    overlap = True

    def __init__(self, runner: ForwardRunner) -> None:
        super().__init__(runner)
        self.device = torch.device(runner.device)
        self._cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if self._cuda else None
        self._queue: queue.SimpleQueue[tuple[ForwardBatch, FutureInputs | None, PendingStep, Any] | None] = (
            queue.SimpleQueue()
        )
        self._last_token_ids: torch.Tensor | None = None
        self._thread = threading.Thread(target=self._loop, name="model-worker", daemon=True)
        self._thread.start()

    def launch(self, batch: ForwardBatch, future: FutureInputs | None = None) -> PendingStep:
        pending = PendingStep(batch, future)
        ready = None
        if self._cuda:
            # Everything the scheduler wrote for this batch (req_to_token, inputs) happens first.
            ready = torch.cuda.Event()
            ready.record()
        self._queue.put((batch, future, pending, ready))
        return pending

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        if self._cuda:
            torch.cuda.set_device(self.device)
        while (item := self._queue.get()) is not None:
            batch, future, pending, ready = item
            try:
                pending._set(*self._run(batch, future, ready))
            except BaseException as exc:  # reported to the scheduler thread by wait()
                logger.exception("model forward failed")
                pending._fail(exc)

    def _run(self, batch: ForwardBatch, future: FutureInputs | None, ready: Any) -> tuple[Any, Any]:
        with torch.inference_mode(), torch.cuda.stream(self._stream) if self._cuda else contextlib.nullcontext():
            if ready is not None:
                torch.cuda.current_stream().wait_event(ready)
            if future is not None:
                if self._last_token_ids is None:
                    raise RuntimeError("future tokens referenced with no step before them")
                batch.input_ids[future.positions] = self._last_token_ids[future.source_rows]
            output = self.runner.forward(batch)
            self._last_token_ids = output.next_token_ids
            if not self._cuda:
                return output, None
            host = _host_copy(output)
            copied = torch.cuda.Event()
            copied.record()
            return host, copied


def create_model_runner(server_args: ServerArgs, tp_rank: int) -> ForwardRunner:
    """The real model runner of one TP rank, configured by the server flags."""
    from runtime.checkpoints.pooling import pooling_of
    from runtime.config.lora_args import lora_enabled, lora_refs
    from runtime.engine.lora.manager import LoraSettings
    from runtime.engine.model_runner import ModelRunner  # the model code: imported only when serving
    from scheduler_proc.lora_slots import initial_adapters

    lora = None
    if lora_enabled(server_args):
        modules = server_args.lora_target_modules
        lora = LoraSettings(
            slots=server_args.max_loras_per_batch,
            max_rank=server_args.max_lora_rank,
            target_modules=tuple(modules) if modules else None,
            initial=initial_adapters(lora_refs(server_args)),
        )

    return ModelRunner(
        server_args.resolved_model_path(),
        device=server_args.device,
        dtype=server_args.dtype,
        attention_backend=server_args.attention_backend,
        max_total_tokens=server_args.max_total_tokens,
        mem_fraction_static=server_args.mem_fraction_static,
        page_size=server_args.page_size,
        max_running_requests=server_args.max_running_requests,
        context_length=server_args.context_length,
        tp_rank=tp_rank,
        tp_size=server_args.tp_size,
        ep_size=server_args.ep_size,
        dp_size=server_args.dp_size,
        random_seed=server_args.random_seed or 0,
        disable_cuda_graph=server_args.disable_cuda_graph,
        cuda_graph_max_bs=server_args.cuda_graph_max_bs,
        cuda_graph_bs=server_args.cuda_graph_bs,
        swa_full_tokens_ratio=server_args.swa_full_tokens_ratio,
        disable_hybrid_swa_memory=server_args.disable_hybrid_swa_memory,
        kv_cache_dtype=server_args.kv_cache_dtype,
        quantization=server_args.quantization,
        int8_activations=server_args.quantized_activations == "int8",
        pooling=pooling_of(server_args.resolved_model_path(), server_args.pooling)
        if server_args.is_embedding
        else None,
        lora=lora,
    )


def create_model_worker(runner: ForwardRunner, overlap: bool) -> ModelWorker:
    return OverlapModelWorker(runner) if overlap else ModelWorker(runner)


def overlap_default(device: torch.device) -> bool:
    """Overlap when ``--disable-overlap-schedule`` / ``--enable-overlap-schedule`` say nothing.

    On cuda the host's scheduling hides behind the device's step. On cpu the forward and
    the scheduler share the same cores (and the GIL), so there is little to hide; the
    measurements in docs/benchmarks.md decided the cpu default.
    """
    return device.type == "cuda"
