"""Decode under CUDA graphs: the model's decode forward captured once per batch size, then replayed.

Why: a decode step is a few hundred small kernels (per layer: norms, projections, rotary,
the KV write, attention, the MLP). Launching each from Python costs microseconds of CPU
time, so on a GPU a small-batch step is bound by launches, not by the GPU. A captured
graph replays all of them with one launch.

How (SGLang's design, our code):

- Batch sizes ``1, 2, 4, 8, 16, 24, 32, ...`` up to the largest (``--cuda-graph-max-bs``,
  at most ``max_running_requests``, halved while capture runs out of memory), or the
  ``--cuda-graph-bs`` list. A batch runs in the graph of the next captured size; the rows
  past its own are padding.
- The graphs read fixed input buffers (``_StaticInputs``): a replay copies the batch into
  them. Padded rows are requests of length 1 in request row 0 whose token goes to KV slot 0,
  the pool's padding slot: they write nowhere else, and their logits are cut off.
- The attention plan is split in two (``AttentionBackend.init_forward_metadata_capture /
  replay_cuda_graph``): views of fixed buffers at capture, rewritten in place before replay.
- Capture runs largest size first into one shared memory pool, so smaller graphs reuse the
  larger ones' activation memory. Sampling stays outside the graph (it varies per batch).
- ``replay="eager"`` does all of the above except capture: the forward runs on the static
  buffers where ``graph.replay()`` would be. It is how the padding, buffer and planning
  logic is tested on a CPU, and a way to rule graphs in or out when debugging a GPU run.

At start-up ``setup_cuda_graphs`` replays one size that needs padding against the eager
path on a warm-up batch; on a mismatch (or a capture error) it logs why and the runner
serves eager. A replayed batch's logits are a view of the graph's output buffer: valid
until the next decode forward.
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass
from typing import Any, Literal, Sequence

import torch

from runtime.engine.forward_batch import ForwardBatch, ForwardMode

logger = logging.getLogger(__name__)

DEFAULT_CUDA_GRAPH_MAX_BS = 256
PAD_SLOT = 0  # MHATokenToKVPool's padding slot: never handed out to a request
PAD_SEQ_LEN = 1  # a padded row is a request holding just its new token
ReplayMode = Literal["cuda", "eager"]
# Self-check tolerance on logits, relative to their largest magnitude: graph and eager run
# the same kernels on the same inputs, so anything beyond rounding noise is a real fault.
SELF_CHECK_RTOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 1e-2}
SELF_CHECK_PROMPT_LEN = 4


def capture_batch_sizes(max_bs: int, explicit: Sequence[int] | None = None) -> list[int]:
    """The batch sizes to capture, ascending: ``explicit`` (deduplicated) or ``1, 2, 4, 8, 16, 24, ...``.

    Sizes above ``max_bs`` are dropped. The default list ends at ``max_bs`` itself, so every
    batch of at most ``max_bs`` requests has a graph to pad into.
    """
    if max_bs < 1:
        raise ValueError(f"the largest CUDA graph batch size must be >= 1, got {max_bs}")
    if explicit:
        if any(b < 1 for b in explicit):
            raise ValueError(f"CUDA graph batch sizes must be >= 1, got {list(explicit)}")
        return sorted({b for b in explicit if b <= max_bs})
    sizes = [b for b in (1, 2, 4, 8) if b <= max_bs] + list(range(16, max_bs + 1, 8))
    if sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


class _StaticInputs:
    """The fixed input buffers every graph reads (sized for the largest batch), plus padding."""

    def __init__(self, max_bs: int, device: torch.device) -> None:
        i64 = torch.int64
        # Rows: input_ids, positions, req_pool_indices, seq_lens, prefix_lens, out_cache_loc.
        self.rows = torch.zeros(6, max_bs, dtype=i64, device=device)
        # What a padded column holds: token 0 at position 0 of request row 0, length 1, slot 0.
        pad_column = torch.tensor([0, 0, 0, PAD_SEQ_LEN, PAD_SEQ_LEN - 1, PAD_SLOT], dtype=i64, device=device)
        self.pad = pad_column[:, None].expand(6, max_bs)
        self.rows.copy_(self.pad)
        self.extend_lens = torch.ones(max_bs, dtype=i64, device=device)

    def load(self, batch: ForwardBatch, bs: int) -> None:
        """Copy ``batch`` into the first columns and padding into the rest, up to ``bs``."""
        raw = batch.batch_size
        if bs > raw:
            self.rows[:, raw:bs].copy_(self.pad[:, raw:bs])
        for row, src in enumerate(
            (
                batch.input_ids,
                batch.positions,
                batch.req_pool_indices,
                batch.seq_lens,
                batch.prefix_lens,
                batch.out_cache_loc,
            )
        ):
            self.rows[row, :raw].copy_(src)

    def batch(self, bs: int, like: Any) -> ForwardBatch:
        """The static decode batch of ``bs`` rows (views of the buffers); pools from ``like`` (the runner)."""
        r = self.rows
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE,
            input_ids=r[0, :bs],
            positions=r[1, :bs],
            req_pool_indices=r[2, :bs],
            seq_lens=r[3, :bs],
            prefix_lens=r[4, :bs],
            extend_lens=self.extend_lens[:bs],
            out_cache_loc=r[5, :bs],
            req_to_token_pool=like.req_to_token_pool,
            token_to_kv_pool=like.token_to_kv_pool,
            seq_lens_cpu=[PAD_SEQ_LEN] * bs,
            prefix_lens_cpu=[PAD_SEQ_LEN - 1] * bs,
            extend_lens_cpu=[1] * bs,
        )


class CudaGraphRunner:
    """Captured decode forwards of one ModelRunner, keyed by batch size."""

    def __init__(self, model_runner: Any, batch_sizes: Sequence[int], replay: ReplayMode = "cuda") -> None:
        if not batch_sizes:
            raise ValueError("no CUDA graph batch sizes to capture")
        if replay == "cuda" and model_runner.device.type != "cuda":
            raise ValueError("CUDA graph replay needs a cuda device; use replay='eager' elsewhere")
        self.model_runner = model_runner
        self.model = model_runner.model
        self.layer_stack = model_runner.layer_stack  # the device's own layer stack (None on cuda)
        self.backend = model_runner.attn_backend
        self.replay_mode: ReplayMode = replay
        self.batch_sizes = sorted(batch_sizes)
        self.max_bs = self.batch_sizes[-1]
        # Decode reads each request's whole sequence; requests sharing a cached prefix each
        # list its slots, so the plan is sized per request row, not by the pool.
        self.max_kv_tokens = self.max_bs * model_runner.req_to_token_pool.max_context_len
        self.inputs = _StaticInputs(self.max_bs, model_runner.device)
        self.backend.init_cuda_graph_state(self.max_bs, self.max_kv_tokens)
        self.batches: dict[int, ForwardBatch] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.capture_s = 0.0

    # ---- capture ------------------------------------------------------------------------

    @torch.inference_mode()
    def capture(self) -> None:
        """Plan (and on cuda capture) every size, largest first so the shared pool fits them all."""
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle() if self.replay_mode == "cuda" else None
        for bs in reversed(self.batch_sizes):
            batch = self.inputs.batch(bs, self.model_runner)
            self.backend.init_forward_metadata_capture_cuda_graph(batch)
            self.batches[bs] = batch
            if self.replay_mode == "cuda":
                for _ in range(2):  # outside the graph: autotuning, lazy allocations, library handles
                    self.model(batch, self.backend, self.layer_stack)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[bs] = self.model(batch, self.backend, self.layer_stack)
                self.graphs[bs] = graph
        if self.replay_mode == "cuda":
            torch.cuda.synchronize()
        self.capture_s = time.perf_counter() - start

    def release(self) -> None:
        """Drop the graphs and their memory (after a failed self-check)."""
        self.graphs.clear()
        self.outputs.clear()
        self.batches.clear()
        if self.replay_mode == "cuda":
            torch.cuda.empty_cache()

    # ---- replay -------------------------------------------------------------------------

    def can_run(self, batch: ForwardBatch) -> bool:
        """Decode batches of at most the largest size whose sequences fit the plan's buffers (a
        graph computes one logit row per request: never a batch asking for prompt logprobs)."""
        if (
            not batch.forward_mode.is_decode()
            or batch.input_logprobs is not None
            or not 0 < batch.batch_size <= self.max_bs
            or not self.batches
        ):
            return False
        lens = batch.seq_lens_cpu if len(batch.seq_lens_cpu) == batch.batch_size else None
        return lens is not None and sum(lens) + self.max_bs * PAD_SEQ_LEN <= self.max_kv_tokens

    def padded_size(self, raw_bs: int) -> int:
        return self.batch_sizes[bisect.bisect_left(self.batch_sizes, raw_bs)]

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        """fp32 logits ``[batch_size, vocab]`` of a decode batch (``can_run`` must hold)."""
        raw = batch.batch_size
        bs = self.padded_size(raw)
        self.inputs.load(batch, bs)
        static = self.batches[bs]
        pad = bs - raw
        static.seq_lens_cpu = list(batch.seq_lens_cpu) + [PAD_SEQ_LEN] * pad
        static.prefix_lens_cpu = [n - 1 for n in static.seq_lens_cpu]
        self.backend.init_forward_metadata_replay_cuda_graph(static)
        if self.replay_mode == "cuda":
            self.graphs[bs].replay()
            logits = self.outputs[bs]
        else:
            logits = self.model(static, self.backend, self.layer_stack)
        return logits[:raw]

    def summary(self) -> str:
        sizes = self.batch_sizes
        shown = ", ".join(map(str, sizes)) if len(sizes) <= 6 else f"{sizes[0]}, {sizes[1]}, ..., {sizes[-1]}"
        verb = "captured" if self.replay_mode == "cuda" else "planned (eager replay)"
        return f"cuda graphs: {len(sizes)} batch sizes [{shown}] {verb} in {self.capture_s:.2f}s"


# ---- start-up ---------------------------------------------------------------------------


@dataclass
class SelfCheckResult:
    ok: bool
    detail: str


def setup_cuda_graphs(
    model_runner: Any,
    *,
    max_bs: int | None = None,
    batch_sizes: Sequence[int] | None = None,
    replay: ReplayMode = "cuda",
) -> CudaGraphRunner | None:
    """Capture, self-check and return the graph runner; None (and a log line saying why) to serve eager."""
    reason = _unsupported_reason(model_runner, replay)
    if reason:
        logger.info("cuda graphs off: %s", reason)
        return None
    limit = min(max_bs or DEFAULT_CUDA_GRAPH_MAX_BS, model_runner.max_running_requests)
    sizes = capture_batch_sizes(limit, batch_sizes)
    if not sizes:
        logger.info("cuda graphs off: no batch size in %s is <= %d", list(batch_sizes or []), limit)
        return None
    while True:
        runner = CudaGraphRunner(model_runner, sizes, replay)
        try:
            runner.capture()
            check = self_check(model_runner, runner)
        except torch.OutOfMemoryError as exc:  # "or what fits": halve the largest size and retry
            runner.release()
            smaller = [b for b in sizes if b <= sizes[-1] // 2]
            if not smaller:
                check = SelfCheckResult(False, f"out of memory capturing batch size {sizes[-1]}: {exc}")
                break
            logger.warning("out of memory capturing decode batches up to %d: retrying up to %d", sizes[-1], smaller[-1])
            sizes = smaller
            continue
        except RuntimeError as exc:  # an op that cannot be captured, a CUDA error: eager still works
            check = SelfCheckResult(False, f"capture failed: {exc}")
        break
    if not _agreed_on_every_rank(model_runner, check.ok):
        runner.release()
        logger.warning("cuda graph self-check failed (%s): serving eager", check.detail)
        return None
    logger.info("%s; self-check: %s", runner.summary(), check.detail)
    return runner


def _unsupported_reason(model_runner: Any, replay: ReplayMode) -> str | None:
    if replay == "cuda" and model_runner.device.type != "cuda":
        return f"device is {model_runner.device.type}"
    if not model_runner.attn_backend.supports_cuda_graph:
        return f"the {model_runner.attention_backend_name} attention backend cannot run in a graph"
    return None


@torch.inference_mode()
def self_check(model_runner: Any, graph_runner: CudaGraphRunner) -> SelfCheckResult:
    """Replay one padded size on a warm-up decode batch and compare its logits with eager.

    Runs before the scheduler exists: it borrows request rows ``0..n-1`` and KV slots from
    1 up (free at start-up), prefills short prompts eagerly, then decodes one step both
    ways, and clears the rows again. The eager step runs first; the replay rewrites the
    same KV slots with the same values.
    """
    raw = _check_batch_size(graph_runner.batch_sizes)
    prompt = SELF_CHECK_PROMPT_LEN
    if raw * (prompt + 1) > model_runner.max_total_tokens or raw > model_runner.req_to_token_pool.size:
        return SelfCheckResult(True, "skipped (KV pool smaller than the warm-up batch)")
    device, vocab = model_runner.device, model_runner.vocab_size
    rows = list(range(raw))
    slots = torch.arange(1, 1 + raw * (prompt + 1), device=device).view(raw, prompt + 1)
    table = model_runner.req_to_token_pool.req_to_token
    table[rows, : prompt + 1] = slots.to(torch.int32)
    ids = (torch.arange(raw * (prompt + 1), device=device).view(raw, prompt + 1) * 7 + 11) % vocab

    def batch(mode: ForwardMode, start: int, n: int) -> ForwardBatch:
        def t(x: torch.Tensor) -> torch.Tensor:
            return x.reshape(-1).to(torch.int64).contiguous()

        pos = torch.arange(start, start + n, device=device).expand(raw, n)
        return ForwardBatch(
            forward_mode=mode,
            input_ids=t(ids[:, start : start + n]),
            positions=t(pos),
            req_pool_indices=torch.tensor(rows, dtype=torch.int64, device=device),
            seq_lens=torch.full((raw,), start + n, dtype=torch.int64, device=device),
            prefix_lens=torch.full((raw,), start, dtype=torch.int64, device=device),
            extend_lens=torch.full((raw,), n, dtype=torch.int64, device=device),
            out_cache_loc=t(slots[:, start : start + n]),
            req_to_token_pool=model_runner.req_to_token_pool,
            token_to_kv_pool=model_runner.token_to_kv_pool,
            seq_lens_cpu=[start + n] * raw,
            prefix_lens_cpu=[start] * raw,
            extend_lens_cpu=[n] * raw,
        )

    try:
        eager_forward(model_runner, batch(ForwardMode.EXTEND, 0, prompt))
        decode = batch(ForwardMode.DECODE, prompt, 1)
        expected = eager_forward(model_runner, decode).clone()
        got = graph_runner.replay(decode).clone()
    finally:
        table[rows] = 0
    bs = graph_runner.padded_size(raw)
    err = float((got - expected).abs().max())
    scale = max(float(expected.abs().max()), 1.0)
    tol = SELF_CHECK_RTOL.get(model_runner.dtype, 1e-2)
    detail = f"batch {raw} padded to {bs}, max |graph - eager| {err:.3g} (tolerance {tol * scale:.3g})"
    return SelfCheckResult(bool(err <= tol * scale) and got.shape == expected.shape, detail)


def eager_forward(model_runner: Any, batch: ForwardBatch) -> torch.Tensor:
    """The model's fp32 logits through the ordinary (ungraphed) path, with the runner's layer
    stack (``ModelRunner.layer_stack``: the device's own way of running the layers, if any)."""
    model_runner.attn_backend.init_forward_metadata(batch)
    return model_runner.model(batch, model_runner.attn_backend, model_runner.layer_stack)


def _check_batch_size(sizes: Sequence[int]) -> int:
    """A batch size that needs padding (one below a captured size past a gap), else the largest."""
    for lower, upper in zip(sizes, sizes[1:]):
        if upper - lower > 1:
            return upper - 1
    return sizes[-1]


def _agreed_on_every_rank(model_runner: Any, ok: bool) -> bool:
    """Under TP every rank must take the same path: graphs only if every rank's check passed."""
    if getattr(model_runner, "tp_size", 1) == 1:
        return ok
    from runtime.engine.distributed import get_tp_group

    flag = torch.tensor([0 if ok else 1], dtype=torch.int32, device=model_runner.device)
    return int(get_tp_group().all_reduce(flag).item()) == 0
