"""Decode speed per ``--kv-cache-dtype``: one user at long contexts, many users at a medium one, and
the tokens the default CPU pool holds in each format.

A ``ModelRunner`` per KV dtype (the same model, ``--dtype``: bf16 by default, the CPU default where
the CPU has native bf16), driven directly (``bench.sequence_driver``: no scheduler, no server), per
scenario:

- ``1 user @ C``: a random prompt of ``C`` tokens (``--contexts``: 1k, 4k, 8k), prefilled (in
  ``--prefill-chunk`` extends, untimed), then ``--new-tokens`` (64) greedy decode steps, timed;
- ``U users @ C``: ``--users`` (64) random prompts of ``--users-context`` (2k) tokens each, then the
  same decode steps for all of them as one batch.

Output tok/s is the decoded tokens (users x new tokens) over the decode steps' wall time. Each repeat
(``--repeats``, 3) draws fresh prompts (the same for every KV dtype within the repeat) and runs the
dtypes in a rotated order (none always first after a prefill); the table has the median, each
repeat's figure and the ratio of the medians to the ``auto`` cache's (the model's dtype) in the same
run. All runners of a scenario are loaded at once, each pool sized to the scenario (64 users x 2k in
bf16 on SmolLM2-135M: ~3 GiB, about half that quantized).

The second table is the default CPU pool (``ModelRunner`` without ``--max-total-tokens``, sized by
need in the model dtype's bytes: a narrower cache holds more tokens in the same memory): its tokens,
bytes per token and bytes, per KV dtype.

    python -m bench.kv_cache_speed --device cpu --cpus 0-1
    python -m bench.kv_cache_speed --device cpu --cpus 0-1 --contexts 256 512 --users 4 --users-context 256 --repeats 1
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (
    default_output_path,
    device_sync,
    machine_info,
    median,
    parse_cpu_list,
    pin_threads,
    print_table,
    write_json,
)
from bench.sequence_driver import SequenceDriver, slots_needed

KV_DTYPES = ("auto", "bf16", "int8", "fp8_e4m3", "fp8_e5m2")
BASELINE = "auto"


def random_prompts(users: int, context: int, vocab: int, seed: int) -> list[list[int]]:
    """``users`` prompts of ``context`` random token ids (ids from 6: clear of the usual special tokens)."""
    rng = random.Random(seed)
    return [[rng.randrange(6, vocab) for _ in range(context)] for _ in range(users)]


def decode_once(runner: Any, prompts: Sequence[Sequence[int]], new_tokens: int, prefill_chunk: int) -> dict[str, float]:
    """Prefill ``prompts`` (timed apart), then ``new_tokens`` greedy decode steps for all of them as
    one batch (timed): seconds of each, and output tok/s of the decode."""
    with SequenceDriver(runner, prompts) as driver:
        device_sync(runner.device)
        t0 = time.perf_counter()
        tokens = driver.prefill(prefill_chunk).argmax(dim=-1).tolist()
        device_sync(runner.device)
        t1 = time.perf_counter()
        for _ in range(new_tokens):
            tokens = driver.decode(tokens).next_token_ids.tolist()
        device_sync(runner.device)
        t2 = time.perf_counter()
    decoded = len(prompts) * new_tokens
    return {
        "prefill_s": t1 - t0,
        "prefill_tok_s": sum(len(p) for p in prompts) / (t1 - t0),
        "decode_s": t2 - t1,
        "output_tok_s": decoded / (t2 - t1),
        "step_ms": 1e3 * (t2 - t1) / new_tokens,
    }


def warm_up(runner: Any) -> None:
    """A short prefill and a few decode steps, untimed: the first forward of a runner pays one-time
    costs (kernel builds and loads, first touches of the pool's pages) that no repeat should carry."""
    with SequenceDriver(runner, random_prompts(2, 16, runner.vocab_size, seed=-1)) as driver:
        tokens = driver.prefill().argmax(dim=-1).tolist()
        for _ in range(3):
            tokens = driver.decode(tokens).next_token_ids.tolist()


def prompt_seed(seed: int, repeat: int, users: int, context: int) -> int:
    """The prompts' seed of one repeat of one scenario: a fresh draw for every repeat and scenario."""
    return ((seed * 1_000_003 + repeat) * 100_003 + users) * 1_000_003 + context


def rotated(items: Sequence[str], by: int) -> list[str]:
    k = by % len(items)
    return [*items[k:], *items[:k]]


def measure_scenario(
    make_runner: Callable[[str, int, int], Any],
    kv_dtypes: Sequence[str],
    users: int,
    context: int,
    new_tokens: int,
    repeats: int,
    prefill_chunk: int,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """One scenario (``users`` at ``context``) for every KV dtype: ``make_runner(kv, pool tokens,
    request rows)`` each, then ``repeats`` rounds of fresh prompts; a row per KV dtype with the
    medians, each repeat's output tok/s and the ratio to ``auto``'s median (NaN without it)."""
    capacity = slots_needed([context] * users, new_tokens)
    runners = {kv: make_runner(kv, max(capacity, 64), users + 2) for kv in kv_dtypes}
    for runner in runners.values():
        warm_up(runner)
    vocab = next(iter(runners.values())).vocab_size
    runs: dict[str, list[dict[str, float]]] = {kv: [] for kv in kv_dtypes}
    for rep in range(repeats):
        prompts = random_prompts(users, context, vocab, prompt_seed(seed, rep, users, context))
        for kv in rotated(list(kv_dtypes), rep):
            runs[kv].append(decode_once(runners[kv], prompts, new_tokens, prefill_chunk))
    rows = []
    for kv in kv_dtypes:
        tok_s = [r["output_tok_s"] for r in runs[kv]]
        rows.append(
            {
                "scenario": f"{users} user{'s' if users > 1 else ''} @ {context}",
                "users": users,
                "context": context,
                "kv_cache_dtype": kv,
                "kv_bytes_per_token": runners[kv].token_to_kv_pool.bytes_per_token(),
                "output_tok_s": median(tok_s),
                "each": ", ".join(f"{x:.1f}" for x in tok_s),
                "step_ms": median([r["step_ms"] for r in runs[kv]]),
                "prefill_tok_s": median([r["prefill_tok_s"] for r in runs[kv]]),
                "runs": runs[kv],
            }
        )
    base = next((r["output_tok_s"] for r in rows if r["kv_cache_dtype"] == BASELINE), float("nan"))
    for row in rows:
        row["vs_auto"] = row["output_tok_s"] / base
    runners.clear()
    gc.collect()  # (a runner and its attention backend form a cycle: only gc frees their pools)
    return rows


def default_pools(make_runner: Callable[[str], Any], kv_dtypes: Sequence[str]) -> list[dict[str, Any]]:
    """The pool a runner sizes itself (no max_total_tokens) per KV dtype: tokens, bytes a token (the
    pool's own), the pool's bytes and its budget (with the CPU decode mirror's room), tokens over
    ``auto``'s."""
    rows = []
    for kv in kv_dtypes:
        runner = make_runner(kv)
        pool = runner.kv_pool
        rows.append(
            {
                "kv_cache_dtype": kv,
                "format": runner.kv_format.name,
                "tokens": runner.max_total_tokens,
                "kv_bytes_per_token": pool.kv_bytes_per_token,
                "pool_mib": runner.max_total_tokens * pool.kv_bytes_per_token / 2**20,
                "budget_mib": pool.bytes / 2**20 if pool.bytes is not None else float("nan"),
                "max_running_requests": runner.max_running_requests,
            }
        )
        del runner, pool
        gc.collect()
    base = next((r["tokens"] for r in rows if r["kv_cache_dtype"] == BASELINE), float("nan"))
    for row in rows:
        row["vs_auto"] = row["tokens"] / base
    return rows


SPEED_COLUMNS = [
    ("scenario", "scenario"),
    ("kv_cache_dtype", "KV cache"),
    ("kv_bytes_per_token", "bytes/token"),
    ("output_tok_s", "out tok/s"),
    ("each", "each repeat"),
    ("step_ms", "ms/step"),
    ("vs_auto", "/ auto"),
    ("prefill_tok_s", "prefill tok/s"),
]
POOL_COLUMNS = [
    ("kv_cache_dtype", "--kv-cache-dtype"),
    ("format", "format"),
    ("tokens", "tokens"),
    ("kv_bytes_per_token", "bytes/token"),
    ("pool_mib", "pool MiB"),
    ("budget_mib", "budget MiB (with mirror room)"),
    ("vs_auto", "tokens / auto"),
]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default="smollm2-135m-instruct", help="model name, GGUF file or checkpoint")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float16"))
    p.add_argument("--kv-cache-dtypes", nargs="+", choices=KV_DTYPES, default=["auto", "int8", "fp8_e4m3"])
    p.add_argument("--contexts", nargs="*", type=int, default=[1024, 4096, 8192], help="one user's contexts")
    p.add_argument("--users", type=int, default=64, help="users of the batch scenario (0: none)")
    p.add_argument("--users-context", type=int, default=2048, help="each user's context in the batch scenario")
    p.add_argument("--new-tokens", type=int, default=64, help="decode steps timed (64)")
    p.add_argument("--repeats", type=int, default=3, help="fresh prompts each (medians; 3)")
    p.add_argument("--prefill-chunk", type=int, default=2048, help="prefill extends (untimed)")
    p.add_argument("--no-pools", action="store_true", help="skip the default pools' table")
    p.add_argument("--device", default="cpu", help="cpu (the only device whose kernels read a quantized cache yet)")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: one per allowed cpu)")
    p.add_argument("--cpus", type=str, default=None, help="restrict to these cpus, taskset syntax: 0-1")
    p.add_argument("--output", default=None, help="JSON path (default bench/results/kv_cache_speed_<time>.json)")
    args = p.parse_args(argv)
    if min([args.new_tokens, args.repeats, args.prefill_chunk, *args.contexts]) < 1 or args.users < 0:
        p.error("--new-tokens, --repeats, --prefill-chunk and --contexts must be >= 1, --users >= 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    pinning = pin_threads(args.threads, parse_cpu_list(args.cpus) if args.cpus else None)
    from runtime.checkpoints.model_source import checkpoint_folder
    from runtime.engine.model_runner import ModelRunner

    folder = str(checkpoint_folder(args.model_path))

    def make_runner(kv: str, tokens: int | None = None, rows: int | None = None) -> Any:
        return ModelRunner(
            folder,
            device=args.device,
            dtype=args.dtype,
            attention_backend=args.attention_backend,
            max_total_tokens=tokens,
            max_running_requests=rows,
            kv_cache_dtype=kv,
            load_progress=False,
        )

    scenarios = [(1, c) for c in args.contexts] + ([(args.users, args.users_context)] if args.users else [])
    rows: list[dict[str, Any]] = []
    for users, context in scenarios:
        t0 = time.perf_counter()
        rows += measure_scenario(
            make_runner,
            args.kv_cache_dtypes,
            users,
            context,
            args.new_tokens,
            args.repeats,
            args.prefill_chunk,
            args.seed,
        )
        print(f"{users} x {context}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    machine = machine_info(pinning)
    print_table(
        rows,
        SPEED_COLUMNS,
        title=f"decode speed per KV cache dtype: {args.model_path}, --dtype {args.dtype}, {args.new_tokens} greedy "
        f"decode steps after each prompt, medians of {args.repeats} (fresh random prompts each), "
        f"{machine.get('cpu_model') or args.device}; {pinning.num_threads} threads on cpus {pinning.cpus}",
    )
    pools = []
    if not args.no_pools:
        pools = default_pools(make_runner, args.kv_cache_dtypes)
        print_table(
            pools,
            POOL_COLUMNS,
            title=f"the default pool (no --max-total-tokens): {args.model_path}, --dtype {args.dtype}, {args.device}",
        )
    out = write_json(
        args.output or default_output_path("kv_cache_speed", args.dtype),
        {
            "kind": "kv_cache_speed",
            "machine": machine,
            "settings": vars(args),
            "model_path": folder,
            "rows": rows,
            "default_pools": pools,
        },
    )
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
