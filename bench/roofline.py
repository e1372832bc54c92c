"""How close a run came to this machine's matmul roofline.

Useful work is the least any engine must do for a workload (shared prefixes
counted once; see ``count_work``). Its FLOPs are

- 2 x (transformer-block linear parameters) per token run through the blocks: the
  unique prompt tokens plus every generated token but the last (that one is only
  sampled, never fed back);
- 2 x (LM-head parameters) per sampled token;
- attention's QK^T and PV products: 4 x heads x head_dim FLOPs per (query, key)
  pair per layer, causal (a token at position p attends to p + 1 keys).

The roofline is the time those FLOPs take at the bf16 matmul rate this machine
reaches at the shapes the workload produces: the model's linear layers at the
prefill batch token count and at the decode batch size, the LM head at the decode
batch size, and attention as batched matmuls at the average context. The fraction
reported is roofline time / measured time (1.0 = as fast as the matmuls alone).

Two device-wide rates are measured too (on cuda as on cpu): the copy bandwidth (bytes
read + written per second by one large ``copy_``) and the bf16 rate of one large square
GEMM. The first gives ``decode_memory_s``, the least time decode can take if every step
streams the weights once and every generated token reads its request's KV once; the
second is the compute ceiling the per-shape rates are measured against.

    python -m bench.roofline bench/results/serving_uniform_*.json
    python -m bench.roofline --model-path DIR --workload uniform   # the roofline alone
    python -m bench.roofline --device cuda --model-path DIR --workload uniform
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import default_output_path, pin_threads, print_table, read_json, write_json
from bench.matmul_meter import MatmulMeter
from bench.workloads import Workload, from_spec, make_workload, prefix_tree_stats

DEFAULT_PREFILL_CHUNK = 8192  # the server's default --chunked-prefill-size


@dataclass(frozen=True)
class ModelDims:
    """The shapes that decide a Llama-family model's FLOPs."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int

    @classmethod
    def from_path(cls, path: str | Path) -> "ModelDims":
        from runtime.engine.model_config import ModelConfig

        c = ModelConfig.from_pretrained(path)
        return cls(
            c.hidden_size,
            c.num_hidden_layers,
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
            c.intermediate_size,
            c.vocab_size,
        )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelDims":
        return cls(**{k: int(d[k]) for k in cls.__dataclass_fields__})

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    def linear_shapes(self) -> list[tuple[str, int, int]]:
        """(name, in_features, out_features) of one block's linears, fused as the engine runs them."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return [
            ("qkv_proj", self.hidden_size, q + 2 * kv),
            ("o_proj", q, self.hidden_size),
            ("gate_up_proj", self.hidden_size, 2 * self.intermediate_size),
            ("down_proj", self.intermediate_size, self.hidden_size),
        ]

    @property
    def block_params(self) -> int:
        """Linear-layer parameters of all blocks (norm scales are negligible and not matmuls)."""
        return self.num_layers * sum(i * o for _, i, o in self.linear_shapes())

    @property
    def lm_head_params(self) -> int:
        return self.hidden_size * self.vocab_size

    @property
    def embedding_params(self) -> int:
        return self.hidden_size * self.vocab_size


@dataclass(frozen=True)
class WorkCount:
    """Tokens of useful work in a workload (what ``useful_flops`` multiplies)."""

    prefill_tokens: int  # unique prompt tokens (trie nodes)
    prefill_keys: int  # sum over them of the keys each attends to
    decode_tokens: int  # generated tokens fed back through the model (all but the last of each request)
    decode_keys: int
    # of decode_keys, those in the prompt prefix common to every request: an engine can
    # attend to them as one GEMM per KV head (every request's queries against one copy)
    decode_shared_keys: int
    sampled_tokens: int  # tokens the LM head produces
    prefill_batch_tokens: int  # M of a prefill matmul
    decode_batch: int  # M of a decode matmul
    avg_prefill_context: float
    avg_decode_context: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def count_work(workload: Workload, prefill_chunk: int = DEFAULT_PREFILL_CHUNK) -> WorkCount:
    stats = prefix_tree_stats([r.input_ids for r in workload.requests])
    decode_tokens = decode_keys = decode_shared = sampled = 0
    common = _common_prefix_len([r.input_ids for r in workload.requests]) if workload.num_requests > 1 else 0
    for r in workload.requests:
        p, n = len(r.input_ids), r.max_new_tokens
        sampled += n
        steps = max(n - 1, 0)
        decode_tokens += steps
        # generated token j (0-based) sits at position p + j and attends to p + j + 1 keys
        decode_keys += steps * (p + 1) + steps * (steps - 1) // 2
        decode_shared += steps * common
    levels = max(len(workload.levels()), 1)
    prefill_m = max(1, min(prefill_chunk, math.ceil(stats.unique_tokens / levels)))
    decode_m = max(1, min(workload.max_parallel, workload.num_requests))
    return WorkCount(
        prefill_tokens=stats.unique_tokens,
        prefill_keys=stats.attended_keys,
        decode_tokens=decode_tokens,
        decode_keys=decode_keys,
        decode_shared_keys=decode_shared,
        sampled_tokens=sampled,
        prefill_batch_tokens=prefill_m,
        decode_batch=decode_m,
        avg_prefill_context=stats.attended_keys / stats.unique_tokens if stats.unique_tokens else 0.0,
        avg_decode_context=decode_keys / decode_tokens if decode_tokens else 0.0,
    )


def _common_prefix_len(prompts: list[list[int]]) -> int:
    """Length of the longest prefix every prompt starts with."""
    first = prompts[0]
    n = min(len(p) for p in prompts)
    for i in range(n):
        if any(p[i] != first[i] for p in prompts):
            return i
    return n


def useful_flops(dims: ModelDims, work: WorkCount) -> dict[str, float]:
    """FLOPs by kind: linear (blocks), lm_head, attention (prefill and decode), total."""
    attn_per_key = 4.0 * dims.num_layers * dims.num_heads * dims.head_dim
    out = {
        "linear_prefill": 2.0 * dims.block_params * work.prefill_tokens,
        "linear_decode": 2.0 * dims.block_params * work.decode_tokens,
        "lm_head": 2.0 * dims.lm_head_params * work.sampled_tokens,
        "attention_prefill": attn_per_key * work.prefill_keys,
        "attention_decode": attn_per_key * work.decode_keys,
    }
    out["total"] = sum(out.values())
    return out


# ---------------------------------------------------------------------- measuring


def roofline(dims: ModelDims, work: WorkCount, meter: MatmulMeter) -> dict[str, Any]:
    """Seconds the useful FLOPs take at the measured rates, by kind, plus the rates used."""
    flops = useful_flops(dims, work)
    rates: dict[str, float] = {}
    seconds: dict[str, float] = {}
    for phase, m, tokens in (
        ("prefill", work.prefill_batch_tokens, work.prefill_tokens),
        ("decode", work.decode_batch, work.decode_tokens),
    ):
        t = 0.0
        for name, k, n in dims.linear_shapes():
            g = meter.linear_gflops(m, k, n)
            rates[f"{name}@{phase}[M={m}]"] = g
            t += 2.0 * dims.num_layers * k * n * tokens / (g * 1e9)
        seconds[f"linear_{phase}"] = t
    g = meter.linear_gflops(work.decode_batch, dims.hidden_size, dims.vocab_size)
    rates[f"lm_head[M={work.decode_batch}]"] = g
    seconds["lm_head"] = flops["lm_head"] / (g * 1e9)
    group = max(dims.num_heads // dims.num_kv_heads, 1)
    # prefill: per KV head, the group's queries of one request's new tokens against its context
    per_req = max(1, round(work.prefill_tokens / max(work.decode_batch, 1)))
    ctx_p = max(1, round(work.avg_prefill_context * 2))  # average causal span -> full key count
    g = meter.bmm_gflops(dims.num_kv_heads, group * min(per_req, 2048), dims.head_dim, min(ctx_p, 8192))
    rates["attention@prefill"] = g
    seconds["attention_prefill"] = flops["attention_prefill"] / (g * 1e9)
    # decode: each request's own keys per (request, KV head) at the batched-matmul rate (a
    # memory-bound GEMM with M = group); keys of the prefix every request shares as one GEMM
    # per KV head with every request's queries (M = batch x group), which is compute-bound.
    per_key = flops["attention_decode"] / work.decode_keys if work.decode_keys else 0.0
    own_keys = work.decode_keys - work.decode_shared_keys
    ctx_d = max(1, round(own_keys / work.decode_tokens)) if work.decode_tokens else 1
    g = meter.bmm_gflops(work.decode_batch * dims.num_kv_heads, group, dims.head_dim, ctx_d)
    rates["attention@decode"] = g
    seconds["attention_decode"] = per_key * own_keys / (g * 1e9)
    if work.decode_shared_keys:
        shared_len = max(1, round(work.decode_shared_keys / work.decode_tokens))
        g = meter.bmm_gflops(dims.num_kv_heads, group * work.decode_batch, dims.head_dim, min(shared_len, 8192))
        rates["attention@decode-shared-prefix"] = g
        seconds["attention_decode"] += per_key * work.decode_shared_keys / (g * 1e9)
    total = sum(seconds.values())
    return {
        "flops": flops,
        "seconds": {**seconds, "total": total},
        "gflops_measured": rates,
        "roofline_gflops": flops["total"] / total / 1e9 if total else math.nan,
        "decode_memory_s": decode_bytes(dims, work, meter.dtype.itemsize) / (meter.copy_gbps() * 1e9),
    }


def decode_bytes(dims: ModelDims, work: WorkCount, elem_bytes: int) -> float:
    """Bytes decode must move at least: the weights once per step, each token's KV keys once."""
    steps = math.ceil(work.decode_tokens / work.decode_batch) if work.decode_tokens else 0
    weights = (dims.block_params + dims.lm_head_params) * elem_bytes
    kv_per_key = 2 * dims.num_layers * dims.num_kv_heads * dims.head_dim * elem_bytes
    return float(steps * weights + work.decode_keys * kv_per_key)


def evaluate_run(run: dict[str, Any], meter: MatmulMeter, prefill_chunk: int = DEFAULT_PREFILL_CHUNK) -> dict[str, Any]:
    """Roofline figures of one run record (as written by serving.py / hf_baseline.py / compare.py)."""
    dims = ModelDims.from_dict(run["model"])
    workload = from_spec(run["workload"])
    work = count_work(workload, prefill_chunk)
    roof = roofline(dims, work, meter)
    duration = float(run["metrics"]["duration_s"])
    achieved = roof["flops"]["total"] / duration / 1e9 if duration > 0 else math.nan
    return {
        "engine": run.get("engine", "?"),
        "workload": workload.name,
        "duration_s": duration,
        "useful_gflop": roof["flops"]["total"] / 1e9,
        "achieved_gflops": achieved,
        "roofline_gflops": roof["roofline_gflops"],
        "roofline_s": roof["seconds"]["total"],
        "fraction": roof["seconds"]["total"] / duration if duration > 0 else math.nan,
        "decode_memory_s": roof["decode_memory_s"],
        "work": work.as_dict(),
        "roofline": roof,
    }


def runs_in(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Every run record of a result file (serving / hf / compare layouts)."""
    return list(data.get("runs", []))


ROOF_COLUMNS = [
    ("engine", "engine"),
    ("workload", "workload"),
    ("duration_s", "time s"),
    ("useful_gflop", "useful GFLOP"),
    ("achieved_gflops", "achieved GFLOPS"),
    ("roofline_gflops", "roofline GFLOPS"),
    ("roofline_s", "roofline s"),
    ("fraction", "fraction"),
    ("decode_memory_s", "decode memory s"),
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Fraction of the bf16 matmul roofline that benchmark runs achieved.")
    parser.add_argument("results", nargs="*", help="JSON files written by serving.py, hf_baseline.py or compare.py")
    parser.add_argument("--model-path", default=None, help="without result files: the model whose roofline to print")
    parser.add_argument("--workload", default="uniform", help="without result files: the workload")
    parser.add_argument("--device", default="auto", help="auto: cuda when available, else cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument(
        "--prefill-chunk",
        type=int,
        default=DEFAULT_PREFILL_CHUNK,
        help="largest prefill batch (the server's --chunked-prefill-size)",
    )
    parser.add_argument("--min-time", type=float, default=0.2, help="seconds to time each shape")
    parser.add_argument(
        "--copy-bytes", type=int, default=None, help="bytes per bandwidth copy (default 1 GiB on cuda, 256 MiB on cpu)"
    )
    parser.add_argument(
        "--peak-gemm-size",
        type=int,
        default=None,
        help="side of the peak-rate GEMM (default 8192 on cuda, 2048 on cpu)",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: one per allowed cpu)")
    parser.add_argument("--output", default=None, help="write the figures here as JSON")
    args = parser.parse_args(argv)
    if not args.results and args.model_path is None:
        parser.error("give result files, or --model-path (and --workload) for the roofline alone")

    pin_threads(args.threads)
    import torch

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    meter = MatmulMeter(device, args.dtype, args.min_time)
    meter.copy_gbps(args.copy_bytes)
    meter.peak_gemm_gflops(args.peak_gemm_size)
    rows: list[dict[str, Any]] = []
    if args.results:
        for path in args.results:
            for run in runs_in(read_json(path)):
                rows.append({"file": str(path), **evaluate_run(run, meter, args.prefill_chunk)})
    else:
        dims = ModelDims.from_path(args.model_path)
        work = count_work(make_workload(args.workload), args.prefill_chunk)
        roof = roofline(dims, work, meter)
        rows.append(
            {
                "engine": "-",
                "workload": args.workload,
                "useful_gflop": roof["flops"]["total"] / 1e9,
                "roofline_gflops": roof["roofline_gflops"],
                "roofline_s": roof["seconds"]["total"],
                "decode_memory_s": roof["decode_memory_s"],
                "work": work.as_dict(),
                "roofline": roof,
            }
        )
    print_table(rows, ROOF_COLUMNS, title=f"roofline ({device}, {args.dtype})", digits=3)
    r = meter.device_rates
    print_table(
        [{"copy": r["copy_gbps"], "gemm": r["peak_gemm_gflops"], "size": int(r["peak_gemm_size"])}],
        [("copy", "copy GB/s (read + write)"), ("gemm", f"{args.dtype} GEMM GFLOPS"), ("size", "GEMM side")],
        title=f"device rates ({device})",
    )
    rates = [
        {
            "shape": f"{key[0]} {'x'.join(map(str, key[1:]))}",
            "gflops": g,
            "plain": meter.linear_methods.get(key, (None, None))[0],
            "packed": meter.linear_methods.get(key, (None, None))[1],
        }
        for key, g in meter.cache.items()
    ]
    print_table(
        rates,
        [
            ("shape", "shape (linear MxKxN / bmm BxMxKxN)"),
            ("gflops", "GFLOPS used"),
            ("plain", "F.linear"),
            ("packed", "prepacked"),
        ],
        title="measured matmul rates (linear: the faster of F.linear and oneDNN-prepacked weights)",
    )
    out = write_json(
        args.output or default_output_path("roofline", device),
        {
            "kind": "roofline",
            "device": device,
            "dtype": args.dtype,
            "rows": rows,
            "rates": rates,
            "device_rates": meter.device_rates,
        },
    )
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
