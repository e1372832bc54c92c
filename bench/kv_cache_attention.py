"""A quantized KV cache on CPU: one user decoding at 1k, 4k and 8k tokens of context, the bf16 cache against
int8 and fp8_e4m3 (``--kv-cache-dtype``), at SmolLM2-135M's shapes (30 layers, 9 query heads, 3 KV heads,
head dim 64, a bf16 model).

- ``attention``: one decode step's attention, every layer, over its decode-key mirror as the server keeps
  it (copies gathered from a pool filled by the pool's own store; the step's new key appended by the
  kernel): the bf16 kernel (``attention_kernels.decode_attention``) on bf16 copies, the quantized kernel
  (``attention_kernels_q8.decode_attention``) on the codes, which it widens in registers;
- ``step``: the whole decode step (the one C call: every layer's linears, the quantizing store and that
  attention) of a model of SmolLM2-135M's shape with random weights (built once into the tinyserve cache),
  after a chunked prefill of the context, through the model runner; tokens/s = 1 / its median time.
  ``--no-step`` skips it (the prefills take a while on two cores).

Decode attention is memory bound at long contexts: a bf16 mirror is 2 bytes a value, the quantized one
1 (int8's scale adds 4 bytes per key and head), so the figure to read is the ratio to bf16. Wall-clock
medians of ``--repeat`` steps, on the threads this process may run (pin it: ``taskset -c 0-1``), or on
``--threads`` of them (one thread is the figure to trust on a machine other work shares: OpenMP's
barriers make a descheduled thread stall the others).

    taskset -c 0-1 .venv/bin/python -m bench.kv_cache_attention [--contexts 1024 4096 8192] [--no-step]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import default_output_path, machine_info, pin_threads, print_table, write_json  # noqa: E402
from memory.kv_format import kv_cache_format  # noqa: E402
from memory.kv_pool import MHATokenToKVPool  # noqa: E402
from runtime.engine.cpu import attention_kernels as attn_kernels  # noqa: E402
from runtime.engine.cpu import attention_kernels_q8 as attn_q8  # noqa: E402
from runtime.engine.cpu import kernel_library, mirror_codes  # noqa: E402
from runtime.engine.cpu import kernels as cpu_kernels  # noqa: E402

FORMATS = ("bf16", "int8", "fp8_e4m3")
SMOLLM2_135M = dict(hidden=576, inter=1536, layers=30, heads=9, kv_heads=3, vocab=49152, rope_theta=100000.0)
MODEL_NAME = "bench-smollm2-135m-shape-v1"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 8192])
    p.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS))
    p.add_argument("--layers", type=int, default=SMOLLM2_135M["layers"])
    p.add_argument("--heads", type=int, default=SMOLLM2_135M["heads"])
    p.add_argument("--kv-heads", type=int, default=SMOLLM2_135M["kv_heads"])
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeat", type=int, default=30, help="attention steps timed (the median is reported)")
    p.add_argument("--steps", type=int, default=24, help="whole decode steps timed per context")
    p.add_argument("--no-step", action="store_true", help="time the attention only (no model, no prefill)")
    p.add_argument("--threads", type=int, default=None, help="threads (default: one per cpu this process may use)")
    p.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="wall-clock time, or this process's CPU time (with --threads 1: what a step costs, whoever else runs)",
    )
    p.add_argument("--model", type=Path, default=None, help="a checkpoint for the whole step (default: built)")
    p.add_argument("--json", type=Path, default=None, help="also write the results here (default: bench/results/)")
    p.add_argument("--no-json", action="store_true")
    return p.parse_args(argv)


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def median_ms(fn: Callable[[], Any], repeat: int, clock: Callable[[], float] = time.perf_counter) -> float:
    fn()
    times = []
    for _ in range(repeat):
        start = clock()
        fn()
        times.append((clock() - start) * 1e3)
    return statistics.median(times)


def attention_step(args: argparse.Namespace, name: str, context: int, gen: torch.Generator) -> Callable[[], Any]:
    """One decode step's attention over every layer's mirror of ``context`` keys (the last one appended by
    the kernel, as a step appends its token), the copies made as the server makes them."""
    layers, hkv, d, group = args.layers, args.kv_heads, args.head_dim, args.heads // args.kv_heads
    fmt = kv_cache_format(name, torch.bfloat16)
    pool = MHATokenToKVPool(context + 1, 1, torch.bfloat16, layers, hkv, d, "cpu", fmt)
    loc = torch.arange(1, context + 1)
    for layer in range(layers):
        pool.set_kv_buffer(
            layer, loc, torch.randn(context, hkv, d, generator=gen), torch.randn(context, hkv, d, generator=gen)
        )
    cap = -(-(context + 32) // 32) * 32  # the mirror's capacity step
    q = torch.randn(1, hkv, group, d, generator=gen).bfloat16()
    bias = torch.zeros(1, 1, 1, cap)
    bias[..., context:] = float("-inf")
    pos, new_loc, scale = torch.tensor([context - 1]), torch.tensor([context]), d**-0.5
    if not fmt.quantized:
        copies = []
        for layer in range(layers):
            k_buf, v_buf = pool.get_kv_buffer(layer)
            dense_k, dense_v = torch.zeros(1, hkv, d, cap, dtype=torch.bfloat16), torch.zeros(1, hkv, cap, d).bfloat16()
            assert cpu_kernels.mirror_gather(k_buf, v_buf, loc, context, dense_k, dense_v)
            copies.append(
                (
                    dense_k,
                    dense_v,
                    attn_kernels.KeyAppend(k_buf[context : context + 1], v_buf[context : context + 1], pos),
                )
            )

        def step() -> None:
            for k_t, v, append in copies:
                attn_kernels.decode_attention(q, k_t, v, bias, scale, context, False, append)

        return step
    mirrors = []
    for layer in range(layers):
        k_rows, v_rows = pool.kv_rows(layer)
        keys = mirror_codes.new_copies(k_rows, v_rows, 1, cap)
        mirror_codes.gather(keys, k_rows, v_rows, loc, context)
        mirrors.append((keys, attn_q8.PoolAppend(k_rows.buffer, v_rows.buffer, new_loc, pos)))
    assert attn_q8.supports(q, mirrors[0][0], bias)

    def quantized_step() -> None:
        for keys, append in mirrors:
            attn_q8.decode_attention(q, keys, bias, scale, context, False, append)

    return quantized_step


def model_path(args: argparse.Namespace) -> Path:
    """A random-weight model of SmolLM2-135M's shape (bf16), built once into the tinyserve cache."""
    if args.model is not None:
        return Path(args.model)
    from transformers import LlamaConfig

    from runtime.checkpoints.model_cache import build_once, cache_root
    from runtime.checkpoints.tiny_model import build_checkpoint

    s = SMOLLM2_135M
    config = LlamaConfig(
        vocab_size=s["vocab"],
        hidden_size=s["hidden"],
        intermediate_size=s["inter"],
        num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"],
        max_position_embeddings=16384,
        rms_norm_eps=1e-5,
        rope_theta=s["rope_theta"],  # type: ignore[call-arg]
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        initializer_range=0.04,
    )
    return build_once(
        cache_root() / MODEL_NAME,
        lambda tmp: build_checkpoint(config, tmp, seed=135, dtype=torch.bfloat16),
        "the SmolLM2-135M-shaped bench model",
    )


def decode_step_ms(
    path: Path, name: str, contexts: list[int], steps: int, clock: Callable[[], float] = time.perf_counter
) -> dict[int, float]:
    """Per context: the median time of a whole decode step (after the context's chunked prefill)."""
    from runtime.engine.forward_batch import ForwardMode
    from runtime.engine.model_runner import ModelRunner
    from tests.support.harness import Harness

    runner = ModelRunner(
        path,
        device="cpu",
        dtype="bfloat16",
        max_total_tokens=max(contexts) + steps + 64,
        kv_cache_dtype=name,
        load_progress=False,
    )
    gen = torch.Generator().manual_seed(1)
    out = {}
    for context in contexts:
        h = Harness(runner)
        (req,) = [h.add_request(torch.randint(3, runner.vocab_size, (context,), generator=gen).tolist())]
        h.prefill([req], chunk_size=2048)
        times = []
        for _ in range(steps):
            start = clock()
            h.step([req], ForwardMode.DECODE)
            times.append((clock() - start) * 1e3)
        out[context] = statistics.median(times[1:])  # (the first step gathers the mirror)
        h.reset()
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    pinning = pin_threads(args.threads)
    if kernel_library.load() is None:
        print("the CPU kernels are not built here (no compiler, or TINYSERVE_CPU_KERNELS=0): nothing to time")
        return 0
    rows: list[dict[str, Any]] = []
    for context in args.contexts:
        for name in args.formats:
            step = attention_step(args, name, context, torch.Generator().manual_seed(context))
            ms = median_ms(step, args.repeat, CLOCKS[args.clock])
            rows.append({"context": context, "cache": name, "attention_ms": ms})
    if not args.no_step:
        path = model_path(args)
        for name in args.formats:
            for context, ms in decode_step_ms(path, name, args.contexts, args.steps, CLOCKS[args.clock]).items():
                row = next(r for r in rows if r["context"] == context and r["cache"] == name)
                row["step_ms"], row["tok_s"] = ms, 1e3 / ms
    for row in rows:
        ref = next(r for r in rows if r["context"] == row["context"] and r["cache"] == args.formats[0])
        row["attention_x"] = ref["attention_ms"] / row["attention_ms"]
        if "tok_s" in row:
            row["tok_s_x"] = row["tok_s"] / ref["tok_s"]
    columns = [("context", "context"), ("cache", "KV cache"), ("attention_ms", "attention ms/step")]
    columns.append(("attention_x", f"vs {args.formats[0]}"))
    if not args.no_step:
        columns += [("step_ms", "decode step ms"), ("tok_s", "tok/s"), ("tok_s_x", f"vs {args.formats[0]}")]
    title = (
        f"one user decoding, {args.layers} layers x {args.heads} heads / {args.kv_heads} KV heads x D {args.head_dim} "
        f"(bf16 model), kernels {kernel_library.level()}, {pinning.num_threads} thread(s), {args.clock} time, medians"
    )
    print_table(rows, columns, title=title, digits=2)
    if not args.no_json:
        out = args.json or default_output_path("kv_cache_attention", "cpu")
        write_json(out, {"machine": machine_info(pinning), "args": vars(args), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
