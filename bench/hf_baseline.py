"""The baseline: the same workloads through transformers' ``generate`` on the same checkpoint.

Static batching as a plain transformers user would do it: batches of 16 prompts
(left-padded), greedy, exactly ``max_new_tokens`` new tokens each
(``min_new_tokens = max_new_tokens``, the equivalent of ignore_eos), same dtype.
Dependent requests (multi-turn) run level by level: turn t's batches start after
every turn t-1 finished. There is no prefix cache and no streaming, so it reports
throughput and per-batch latency only.

    python -m bench.hf_baseline --model bench --workload uniform --device cpu
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any, Sequence

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (
    default_output_path,
    machine_info,
    parse_cpu_list,
    pin_threads,
    print_table,
    progress,
    summarize,
    write_json,
)
from bench.workloads import BenchRequest, Workload

ENGINE = "hf-transformers"
DEFAULT_BATCH_SIZE = 16


def hf_batches(workload: Workload, batch_size: int = DEFAULT_BATCH_SIZE) -> list[list[BenchRequest]]:
    """Batches in run order: dependency level by level, ``batch_size`` requests at a time,
    never mixing two ``max_new_tokens`` values in one batch."""
    if batch_size < 1:
        raise ValueError("batch_size must be >= 1")
    batches: list[list[BenchRequest]] = []
    for level in workload.levels():
        by_len: dict[int, list[BenchRequest]] = {}
        for req in level:
            by_len.setdefault(req.max_new_tokens, []).append(req)
        for reqs in by_len.values():
            batches += [reqs[i : i + batch_size] for i in range(0, len(reqs), batch_size)]
    return batches


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[list[list[int]], list[list[int]]]:
    """Left-padded ids and their attention mask (decoder-only generation appends on the right)."""
    width = max(len(p) for p in prompts)
    ids = [[pad_id] * (width - len(p)) + list(p) for p in prompts]
    mask = [[0] * (width - len(p)) + [1] * len(p) for p in prompts]
    return ids, mask


class HFRunner:
    """A loaded transformers model that runs batches of token-id prompts."""

    def __init__(self, model_path: str, device: str = "auto", dtype: str = "bfloat16") -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)
        self.dtype = getattr(torch, dtype)
        from runtime.checkpoints.gguf.prepare import GGUFIndex, is_gguf_folder

        if is_gguf_folder(Path(model_path)):  # transformers' own GGUF loading, from the same file
            gguf_file = GGUFIndex.read(Path(model_path)).file
            model = AutoModelForCausalLM.from_pretrained(
                str(gguf_file.parent), gguf_file=gguf_file.name, dtype=self.dtype
            )
        else:
            model = AutoModelForCausalLM.from_pretrained(model_path, dtype=self.dtype)
        self.model = model.to(self.device).eval()
        cfg = self.model.config
        self.pad_id = cfg.pad_token_id if cfg.pad_token_id is not None else 0
        eos = cfg.eos_token_id
        self.eos_id = eos[0] if isinstance(eos, list) else eos

    def _sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize()

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy, exactly ``max_new_tokens`` tokens per prompt; the new tokens."""
        t = self.torch
        ids, mask = left_pad(prompts, self.pad_id)
        input_ids = t.tensor(ids, device=self.device)
        attention_mask = t.tensor(mask, device=self.device)
        with t.inference_mode():
            out = self.model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                do_sample=False,
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens,
                pad_token_id=self.pad_id,
                eos_token_id=self.eos_id,
            )
        self._sync()
        new = out[:, input_ids.shape[1] :]
        if new.shape[1] != max_new_tokens:
            raise RuntimeError(f"generate returned {new.shape[1]} new tokens, expected {max_new_tokens}")
        return new.tolist()

    def warm_up(self, workload: Workload, batch_size: int = DEFAULT_BATCH_SIZE, num: int = -1) -> None:
        """Run the first ``num`` batches (all when ``num < 0``) for 2 tokens: the measured shapes."""
        batches = hf_batches(workload, batch_size)
        for batch in batches if num < 0 else batches[:num]:
            self.generate([r.input_ids for r in batch], min(batch[0].max_new_tokens, 2))


def summarize_batches(
    batch_times: Sequence[float], batch_sizes: Sequence[int], input_tokens: int, output_tokens: int, duration: float
) -> dict[str, Any]:
    """The baseline's figures, with serving.py's keys where the meaning is the same (pure)."""
    lat = summarize(list(batch_times))
    return {
        "duration_s": duration,
        "completed": sum(batch_sizes),
        "failed": 0,
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "request_throughput": sum(batch_sizes) / duration if duration > 0 else math.nan,
        "output_tok_s": output_tokens / duration if duration > 0 else math.nan,
        "total_tok_s": (input_tokens + output_tokens) / duration if duration > 0 else math.nan,
        "ttft_p50_ms": math.nan,
        "ttft_p99_ms": math.nan,
        "itl_p50_ms": math.nan,
        "itl_p99_ms": math.nan,
        # every request of a batch finishes with it: request latency = batch latency (no queueing counted)
        "latency_p50_s": lat["p50"],
        "latency_p99_s": lat["p99"],
        "batch_latency_p50_s": lat["p50"],
        "batch_latency_p99_s": lat["p99"],
        "batch_latency_mean_s": lat["mean"],
        "num_batches": len(batch_times),
        "cache_hit_rate": 0.0,
        "errors": [],
    }


def run_baseline(
    runner: HFRunner,
    workload: Workload,
    batch_size: int = DEFAULT_BATCH_SIZE,
    model_dims: dict[str, int] | None = None,
    model_path: str | None = None,
    show_progress: bool = True,
) -> dict[str, Any]:
    """One run of ``workload``; a run record in serving.py's layout."""
    batches = hf_batches(workload, batch_size)
    times: list[float] = []
    out_tokens = 0
    t0 = time.perf_counter()
    for batch in progress(batches, total=len(batches), desc=f"hf {workload.name}", disable=not show_progress):
        b0 = time.perf_counter()
        outs = runner.generate([r.input_ids for r in batch], batch[0].max_new_tokens)
        times.append(time.perf_counter() - b0)
        out_tokens += sum(len(o) for o in outs)
    duration = time.perf_counter() - t0
    return {
        "kind": "hf_baseline",
        "engine": ENGINE,
        "workload": workload.spec(),
        "model": model_dims,
        "model_path": model_path,
        "settings": {"batch_size": batch_size, "device": str(runner.device), "dtype": str(runner.dtype)},
        "metrics": summarize_batches(times, [len(b) for b in batches], workload.prompt_tokens, out_tokens, duration),
    }


TABLE_COLUMNS = [
    ("engine", "engine"),
    ("workload", "workload"),
    ("completed", "done"),
    ("duration_s", "time s"),
    ("output_tok_s", "out tok/s"),
    ("total_tok_s", "total tok/s"),
    ("num_batches", "batches"),
    ("batch_latency_p50_s", "batch p50 s"),
    ("batch_latency_p99_s", "batch p99 s"),
]


def main(argv: Sequence[str] | None = None) -> int:
    from bench.roofline import ModelDims
    from bench.serving import add_model_args, add_pinning_args, add_workload_args, build_workloads, resolve_model_path

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    add_model_args(parser)
    add_workload_args(parser)
    parser.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE)
    parser.add_argument(
        "--warmup",
        type=int,
        default=-1,
        help="warm-up batches (2 tokens each) before each workload; -1: all of them (default)",
    )
    parser.add_argument("--device", default="auto", help="auto: cuda when available, else cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    add_pinning_args(parser)
    parser.add_argument("--output", default=None, help="JSON path (default bench/results/hf_<workloads>_<time>.json)")
    args = parser.parse_args(argv)

    pinning = pin_threads(args.threads, parse_cpu_list(args.cpus) if args.cpus else None)
    model_path = resolve_model_path(args)
    workloads = build_workloads(args, model_path)
    runner = HFRunner(model_path, args.device, args.dtype)
    dims = ModelDims.from_path(model_path).as_dict()
    runs = []
    for wl in workloads:
        runner.warm_up(wl, args.batch_size, args.warmup)
        run = run_baseline(runner, wl, args.batch_size, dims, model_path)
        run["machine"] = machine_info(pinning)
        runs.append(run)
    print_table(
        [{"engine": r["engine"], "workload": r["workload"]["name"], **r["metrics"]} for r in runs],
        TABLE_COLUMNS,
        title="transformers generate baseline",
    )
    tag = "-".join(w.name for w in workloads)
    out = write_json(args.output or default_output_path("hf", tag), {"kind": "hf_baseline", "runs": runs})
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
