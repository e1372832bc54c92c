"""What a serving run's records add up to: its figures (``summarize_run``), its row of the table
``bench.serving`` prints, and the optional chart of several runs (``--plot``, needs matplotlib)."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any, Sequence

from bench.common import summarize
from bench.load_runner import RequestRecord

# ---------------------------------------------------------------------- metrics


def summarize_run(records: Sequence[RequestRecord], duration: float) -> dict[str, Any]:
    """The figures of one run from its request records (pure: unit-tested)."""
    ok = [r for r in records if r.error is None]
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_len for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    ttft = summarize([r.ttft * 1e3 for r in ok if r.ttft is not None])
    itl = summarize([g * 1e3 for r in ok for g in r.itl])
    lat = summarize([r.latency for r in ok if r.latency is not None])
    tpot = summarize(
        [
            (r.latency - r.ttft) / (r.output_len - 1) * 1e3
            for r in ok
            if r.latency is not None and r.ttft is not None and r.output_len > 1
        ]
    )
    return {
        "duration_s": duration,
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "request_throughput": len(ok) / duration if duration > 0 else math.nan,
        "output_tok_s": output_tokens / duration if duration > 0 else math.nan,
        "total_tok_s": (input_tokens + output_tokens) / duration if duration > 0 else math.nan,
        "ttft_p50_ms": ttft["p50"],
        "ttft_p99_ms": ttft["p99"],
        "ttft_mean_ms": ttft["mean"],
        "itl_p50_ms": itl["p50"],
        "itl_p99_ms": itl["p99"],
        "itl_mean_ms": itl["mean"],
        "tpot_p50_ms": tpot["p50"],
        "latency_p50_s": lat["p50"],
        "latency_p90_s": lat["p90"],
        "latency_p99_s": lat["p99"],
        "cache_hit_rate": cached / input_tokens if input_tokens else 0.0,
        "errors": sorted({r.error for r in records if r.error is not None}),
    }


TABLE_COLUMNS = [
    ("engine", "engine"),
    ("workload", "workload"),
    ("completed", "done"),
    ("duration_s", "time s"),
    ("output_tok_s", "out tok/s"),
    ("total_tok_s", "total tok/s"),
    ("ttft_p50_ms", "TTFT p50 ms"),
    ("ttft_p99_ms", "TTFT p99 ms"),
    ("itl_p50_ms", "ITL p50 ms"),
    ("itl_p99_ms", "ITL p99 ms"),
    ("latency_p50_s", "lat p50 s"),
    ("cache_hit_rate", "cache hit"),
    ("spec_accept_length", "accept len"),
    ("spec_accept_rate", "accept rate"),
]


def table_row(run: dict[str, Any]) -> dict[str, Any]:
    return {"engine": run["engine"], "workload": run["workload"]["name"], **run["metrics"]}


# ---------------------------------------------------------------------- the server


# ---------------------------------------------------------------------- chart


def plot_runs(runs: list[dict[str, Any]], path: str | Path) -> bool:
    """Bar charts of throughput and latency per (engine, workload); False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed; skipping the chart", file=sys.stderr)
        return False
    labels = [f"{r['engine']}\n{r['workload']['name']}" for r in runs]
    panels = [
        ("output tokens/s", ["output_tok_s"]),
        ("total tokens/s", ["total_tok_s"]),
        ("TTFT ms (p50, p99)", ["ttft_p50_ms", "ttft_p99_ms"]),
        ("ITL ms (p50, p99)", ["itl_p50_ms", "itl_p99_ms"]),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 4))
    for ax, (title, keys) in zip(axes, panels):
        width = 0.8 / len(keys)
        for j, key in enumerate(keys):
            vals = [r["metrics"].get(key) or 0.0 for r in runs]
            ax.bar([i + j * width for i in range(len(runs))], vals, width, label=key)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(runs))], labels, fontsize=7)
        ax.set_title(title)
        if len(keys) > 1:
            ax.legend(fontsize=7)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
