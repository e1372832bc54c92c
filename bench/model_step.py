"""Time one ModelRunner step at the serving workloads' shapes, next to its matmuls alone.

The serving benchmarks measure the whole server; this one isolates the model: it loads
a ``ModelRunner`` (the bench checkpoint in bf16 by default), fills the KV pool the way
the scheduler would, and times

- ``prefill``: ``--batch`` requests x ``--prompt-len`` new tokens in one extend batch;
- ``decode``: one decode step of ``--batch`` requests at context ``--context``;
- ``shared``: the shared-prefix workload's second prefill: ``--batch - 1`` requests that
  each extend a cached ``--prefix-len`` prefix by ``--suffix-len`` tokens;
- ``shared-decode``: a decode step of ``--batch`` requests that share a cached
  ``--prefix-len`` prefix (same KV slots) and are ``--shared-context`` tokens long;

each against ``matmul``: the same step's linear layers (qkv, o, gate_up, down per
layer, plus the LM head on the sampled rows) as bare matmuls on the model's own weights
(prepacked where the model uses prepacked weights). ``model / matmul`` is the overhead factor the rest of the step adds
(attention, norms, rotary, gathers, the sampler, Python). Every figure is the median
(and min) of ``--repeat`` timings, per step; ``--profile`` prints torch.profiler's top ops
and the launches per step (on cuda: kernel and CUDA-graph launches, what graphs cut; on
cpu: torch ops).

``--device cuda`` runs the model on the GPU (decode through CUDA graphs unless
``--disable-cuda-graph``), timed with a device sync around each measurement.

    python -m bench.model_step                       # all scenarios, 64 requests
    python -m bench.model_step --scenario decode --profile
    python -m bench.model_step --device cuda --model-path DIR --scenario decode --profile
"""

from __future__ import annotations

import argparse
import functools
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import device_sync, pin_threads, print_table
from runtime.config.execution_args import QUANTIZATION_CHOICES

SCENARIOS = ("prefill", "decode", "shared", "shared-decode")


class StepDriver:
    """Builds ForwardBatches for a ModelRunner: one req_to_token row per request, KV slots
    handed out by a counter (the runner's pools are owned by this driver while it runs)."""

    def __init__(self, runner: Any, seed: int = 0) -> None:
        self.runner = runner
        self.rng = random.Random(seed)
        self.next_slot = 1  # slot 0 is the pool's padding slot
        self.rows: list[int] = []

    def reset(self) -> None:
        if self.rows:
            self.runner.req_to_token_pool.free(self.rows)
        self.rows = []
        self.next_slot = 1

    def _slots(self, n: int) -> list[int]:
        start = self.next_slot
        self.next_slot += n
        if self.next_slot > self.runner.max_total_tokens + 1:
            raise RuntimeError("KV pool too small for this scenario; raise --max-total-tokens")
        return list(range(start, start + n))

    def new_rows(self, n: int) -> list[int]:
        rows = self.runner.req_to_token_pool.alloc(n)
        if rows is None:
            raise RuntimeError("out of request rows")
        self.rows += rows
        return rows

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(6, self.runner.vocab_size) for _ in range(n)]

    def extend_batch(
        self, rows: Sequence[int], prefix_lens: Sequence[int], ext_lens: Sequence[int], decode: bool = False
    ) -> Any:
        """A batch running ``ext_lens[i]`` new tokens after ``prefix_lens[i]`` cached ones."""
        import torch

        from runtime.engine.forward_batch import ForwardBatch, ForwardMode
        from runtime.engine.sampling.batch_info import SamplingBatchInfo
        from runtime.protocol.sampling_params import SamplingParams

        pool = self.runner.req_to_token_pool
        locs: list[int] = []
        positions: list[int] = []
        for row, p, n in zip(rows, prefix_lens, ext_lens):
            new = self._slots(n)
            pool.write(row, p, torch.tensor(new, dtype=torch.int32))
            locs += new
            positions += range(p, p + n)
        seq_lens = [p + n for p, n in zip(prefix_lens, ext_lens)]
        params = [SamplingParams(temperature=0.0, max_new_tokens=64, ignore_eos=True) for _ in rows]
        info = SamplingBatchInfo.from_requests(
            params,
            [[1]] * len(rows),
            [[]] * len(rows),
            self.runner.vocab_size,
            self.runner.eos_token_ids,
            self.runner.device,
        )

        def t(values: Sequence[int]) -> torch.Tensor:
            return torch.tensor(list(values), dtype=torch.int64, device=self.runner.device)

        return ForwardBatch(
            forward_mode=ForwardMode.DECODE if decode else ForwardMode.EXTEND,
            input_ids=t(self.tokens(len(locs))),
            positions=t(positions),
            req_pool_indices=t(rows),
            seq_lens=t(seq_lens),
            prefix_lens=t(prefix_lens),
            extend_lens=t(ext_lens),
            out_cache_loc=t(locs),
            req_to_token_pool=pool,
            token_to_kv_pool=self.runner.token_to_kv_pool,
            seq_lens_cpu=list(seq_lens),
            prefix_lens_cpu=list(prefix_lens),
            extend_lens_cpu=list(ext_lens),
            sampling_info=info,
        )

    def copy_row_prefix(self, src: int, dst: int, n: int) -> None:
        table = self.runner.req_to_token_pool.req_to_token
        table[dst, :n] = table[src, :n]


def scenario_batches(driver: StepDriver, name: str, args: argparse.Namespace) -> tuple[Callable[[], Any], int, int]:
    """(make the timed batches, tokens through the blocks per batch, sampled rows) for one scenario.

    The KV state the timed batches read is prepared here once, outside the timing. Decode
    scenarios time ``--decode-steps`` consecutive steps (the first of them starts a new
    decode batch, as after a prefill; the rest extend it by one token each).
    """
    runner = driver.runner
    bs = args.batch
    if name == "prefill":

        def make() -> Any:
            driver.reset()
            rows = driver.new_rows(bs)
            return [driver.extend_batch(rows, [0] * bs, [args.prompt_len] * bs)]

        return make, bs * args.prompt_len, bs
    if name == "decode":
        driver.reset()
        rows = driver.new_rows(bs)
        runner.forward(driver.extend_batch(rows, [0] * bs, [args.context - 1] * bs))
        mark = driver.next_slot

        def make_decode() -> Any:
            driver.next_slot = mark  # every timed run rewrites the same slots
            return [
                driver.extend_batch(rows, [args.context - 1 + j] * bs, [1] * bs, decode=True)
                for j in range(args.decode_steps)
            ]

        return make_decode, bs, bs
    if name == "shared":
        n = bs - 1
        driver.reset()
        first = driver.new_rows(1)
        runner.forward(driver.extend_batch(first, [0], [args.prefix_len + args.suffix_len]))
        rows = driver.new_rows(n)
        for r in rows:
            driver.copy_row_prefix(first[0], r, args.prefix_len)
        mark = driver.next_slot

        def make_shared() -> Any:
            driver.next_slot = mark
            return [driver.extend_batch(rows, [args.prefix_len] * n, [args.suffix_len] * n)]

        return make_shared, n * args.suffix_len, n
    if name == "shared-decode":
        driver.reset()
        first = driver.new_rows(1)
        runner.forward(driver.extend_batch(first, [0], [args.prefix_len]))
        rows = driver.new_rows(bs)
        for r in rows:
            driver.copy_row_prefix(first[0], r, args.prefix_len)
        own = args.shared_context - 1 - args.prefix_len
        if own < 0:
            raise ValueError("--shared-context must exceed --prefix-len")
        if own:
            runner.forward(driver.extend_batch(rows, [args.prefix_len] * bs, [own] * bs))
        mark = driver.next_slot

        def make_shared_decode() -> Any:
            driver.next_slot = mark
            return [
                driver.extend_batch(rows, [args.shared_context - 1 + j] * bs, [1] * bs, decode=True)
                for j in range(args.decode_steps)
            ]

        return make_shared_decode, bs, bs
    raise ValueError(name)


def matmul_step(runner: Any, tokens: int, sampled: int) -> Callable[[], None]:
    """The step's linear layers alone, on the model's weights (same M, K, N as the model)."""
    import torch

    model = runner.model
    hidden = model.config.hidden_size
    on = dict(dtype=runner.dtype, device=runner.device)
    x = torch.randn(tokens, hidden, **on)
    layers = []
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        layers.append((a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj))
    o_in = torch.randn(tokens, layers[0][1].weight.shape[1], **on)
    d_in = torch.randn(tokens, layers[0][3].weight.shape[1], **on)
    head = model.lm_head
    xs = x[:sampled]

    def mm(inp: Any, layer: Any) -> None:
        # as the layer multiplies: the device ops with the weight's plan (its packed copy, its
        # blocks, or the kept-quantized kernel)
        runner.ops.linear(inp, layer.weight, None, layer.plan)

    def run() -> None:
        for qkv, o, gu, down in layers:  # through the same (possibly prepacked) weights as the model
            mm(x, qkv)
            mm(o_in, o)
            mm(x, gu)
            mm(d_in, down)
        mm(xs, head)

    return run


def time_calls(
    fn: Callable[[], Any],
    repeat: int,
    setup: Callable[[], Any] | None = None,
    clock: Callable[[], float] = time.perf_counter,
    sync: Callable[[], None] = lambda: None,
) -> list[float]:
    """Seconds per call; ``sync`` waits for queued device work (before the clock starts and stops)."""
    import torch

    times: list[float] = []
    with torch.inference_mode():
        arg = setup() if setup else None
        fn() if setup is None else fn(arg)  # warm-up
        for _ in range(repeat):
            arg = setup() if setup else None
            sync()
            t0 = clock()
            fn() if setup is None else fn(arg)
            sync()
            times.append(clock() - t0)
    return times


def run_batches(runner: Any, batches: list[Any]) -> None:
    for batch in batches:
        runner.forward(batch)


# Runtime-API events that start GPU work: one per kernel launched eagerly, one per graph replayed.
KERNEL_LAUNCH_EVENTS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")
GRAPH_LAUNCH_EVENTS = ("cudaGraphLaunch",)


def launches_per_step(counts: dict[str, int], steps: int, device_type: str) -> dict[str, float]:
    """Launches per step from profiler event counts (name -> calls) over ``steps`` steps.

    On cuda: kernel launches and graph launches (a replayed graph is one launch however
    many kernels it holds). On cpu there are no launches; torch ops (``aten::``, at every
    nesting level) are the nearest count of per-op dispatch work.
    """
    if device_type == "cuda":
        return {
            "kernel_launches": sum(counts.get(n, 0) for n in KERNEL_LAUNCH_EVENTS) / steps,
            "graph_launches": sum(counts.get(n, 0) for n in GRAPH_LAUNCH_EVENTS) / steps,
        }
    return {"torch_ops": sum(c for n, c in counts.items() if n.startswith("aten::")) / steps}


def profile_step(runner: Any, make: Callable[[], Any], rows: int = 25) -> dict[str, float]:
    """Print the top ops of one timed run and the launches per step; returns the latter."""
    from torch.profiler import ProfilerActivity, profile

    on_cuda = runner.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    run_batches(runner, make())
    batches = make()
    device_sync(runner.device)
    with profile(activities=activities, record_shapes=True) as prof:
        run_batches(runner, batches)
        device_sync(runner.device)
    sort = "self_cuda_time_total" if on_cuda else "self_cpu_time_total"
    print(prof.key_averages(group_by_input_shape=True).table(sort_by=sort, row_limit=rows))
    counts = {e.key: e.count for e in prof.key_averages()}
    per_step = launches_per_step(counts, len(batches), runner.device.type)
    print("per step: " + ", ".join(f"{k.replace('_', ' ')} {v:.1f}" for k, v in per_step.items()))
    return per_step


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", default=None, help="checkpoint folder (default: the bench checkpoint)")
    parser.add_argument(
        "--device", default="auto", choices=("auto", "cuda", "cpu"), help="auto: cuda when available, else cpu"
    )
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument(
        "--quantization",
        default=None,
        choices=[c for c in QUANTIZATION_CHOICES if c not in ("auto", "none")],
        help="keep weights quantized (the server's --quantization)",
    )
    parser.add_argument("--disable-cuda-graph", action="store_true", help="cuda: decode eagerly")
    parser.add_argument("--cuda-graph-max-bs", type=int, default=None, help="cuda: largest captured decode batch")
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--scenario", nargs="+", default=list(SCENARIOS), choices=SCENARIOS)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--context", type=int, default=160, help="decode: tokens per request incl. the new one")
    parser.add_argument(
        "--shared-context", type=int, default=576, help="shared-decode: tokens per request incl. the new one"
    )
    parser.add_argument("--prefix-len", type=int, default=512)
    parser.add_argument("--suffix-len", type=int, default=32)
    parser.add_argument("--decode-steps", type=int, default=16, help="consecutive steps per decode timing")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="cpu: this process's CPU time, which a busy shared machine inflates less "
        "(meaningful with --threads 1, where no thread spins at a barrier)",
    )
    parser.add_argument("--profile", action="store_true", help="print torch.profiler's top ops per scenario")
    args = parser.parse_args(argv)

    pin_threads(args.threads)
    from bench.checkpoint import build_bench_checkpoint
    from runtime.engine.model_runner import ModelRunner

    path = args.model_path or str(build_bench_checkpoint())
    t0 = time.perf_counter()
    runner = ModelRunner(
        path,
        device=args.device,
        dtype=args.dtype,
        attention_backend=args.attention_backend,
        max_total_tokens=args.batch * (args.shared_context + args.context + 2 * args.decode_steps) + 1024,
        max_running_requests=2 * args.batch + 2,
        load_progress=False,
        disable_cuda_graph=args.disable_cuda_graph,
        cuda_graph_max_bs=args.cuda_graph_max_bs,
        **({"quantization": args.quantization} if args.quantization else {}),
    )
    graphs = getattr(runner, "graph_runner", None)
    print(
        f"ModelRunner ready in {time.perf_counter() - t0:.2f}s ({runner.device}, {runner.attention_backend_name}, "
        f"{runner.dtype}, {graphs.summary() if graphs is not None else 'no cuda graphs'})"
    )
    sync = functools.partial(device_sync, runner.device)
    driver = StepDriver(runner)
    rows: list[dict[str, Any]] = []
    for name in args.scenario:
        make, tokens, sampled = scenario_batches(driver, name, args)
        clock = time.process_time if args.clock == "cpu" else time.perf_counter
        steps = len(make())
        model_t = [
            t / steps
            for t in time_calls(lambda b: run_batches(runner, b), args.repeat, setup=make, clock=clock, sync=sync)
        ]
        mm_t = time_calls(matmul_step(runner, tokens, sampled), args.repeat, clock=clock, sync=sync)
        med_m, med_mm = statistics.median(model_t), statistics.median(mm_t)
        rows.append(
            {
                "scenario": name,
                "tokens": tokens,
                "model_ms": med_m * 1e3,
                "model_min_ms": min(model_t) * 1e3,
                "matmul_ms": med_mm * 1e3,
                "matmul_min_ms": min(mm_t) * 1e3,
                "ratio": med_m / med_mm,
                "tok_s": tokens / med_m,
            }
        )
        if args.profile:
            print(f"\n== profile: {name} ==")
            profile_step(runner, make)
    print_table(
        rows,
        [
            ("scenario", "scenario"),
            ("tokens", "tokens"),
            ("model_ms", "model ms"),
            ("model_min_ms", "min"),
            ("matmul_ms", "matmuls ms"),
            ("matmul_min_ms", "min"),
            ("ratio", "model/matmul"),
            ("tok_s", "tok/s"),
        ],
        title=f"ModelRunner step vs its matmuls ({args.clock} clock, median of {args.repeat})",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
