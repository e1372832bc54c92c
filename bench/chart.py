"""Draw the README's performance chart from comparison and roofline JSON files.

    .venv/bin/python -m bench.chart bench/results/compare_*.json --roofline bench/results/roofline_*.json \\
        --output docs/performance.png

Left: output tokens/s per workload, tinyserve next to the transformers baseline, with the
speed-up written over each pair (medians from ``bench.compare``). Right (when a roofline
JSON is given): the fraction of this machine's matmul roofline each engine reached
(median over the repeats in ``bench.roofline``'s rows). Needs matplotlib (the ``plot``
extra); without it the script says so and exits with 2.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any, Sequence

OURS, BASELINE = "tinyserve", "hf-transformers"


def load_summary(paths: Sequence[str]) -> dict[tuple[str, str], dict[str, Any]]:
    """(engine, workload) -> summary row, from ``bench.compare`` JSON files (later files win)."""
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for path in paths:
        for row in json.loads(Path(path).read_text())["summary"]:
            rows[(row["engine"], row["workload"])] = row
    return rows


def load_fractions(path: str | None) -> dict[tuple[str, str], float]:
    """(engine, workload) -> median roofline fraction, from a ``bench.roofline`` JSON file."""
    if path is None:
        return {}
    values: dict[tuple[str, str], list[float]] = {}
    for row in json.loads(Path(path).read_text())["rows"]:
        values.setdefault((row["engine"], row["workload"]), []).append(row["fraction"])
    return {key: statistics.median(v) for key, v in values.items()}


def draw(
    summary: dict[tuple[str, str], dict[str, Any]], fractions: dict[tuple[str, str], float], out: Path, title: str
) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e .[plot]); no chart drawn", file=sys.stderr)
        return False
    workloads = list(dict.fromkeys(w for (e, w) in summary if e == OURS))
    panels = 2 if fractions else 1
    fig, axes = plt.subplots(1, panels, figsize=(6.5 * panels, 4.2), squeeze=False)
    ax = axes[0][0]
    x = range(len(workloads))
    ours = [summary[(OURS, w)]["output_tok_s"] for w in workloads]
    base = [summary.get((BASELINE, w), {}).get("output_tok_s") or 0.0 for w in workloads]
    ax.bar([i - 0.2 for i in x], ours, 0.4, label=OURS)
    ax.bar([i + 0.2 for i in x], base, 0.4, label="transformers generate (batch 16)")
    for i, (a, b) in enumerate(zip(ours, base)):
        if b:
            ax.annotate(f"{a / b:.2f}x", (i, max(a, b)), ha="center", va="bottom", fontsize=9)
    ax.set_xticks(list(x), workloads)
    ax.set_ylabel("output tokens/s")
    ax.set_ylim(0, max(ours + base) * 1.15)
    ax.set_title("throughput (median of repeats)")
    ax.legend(fontsize=8)
    if fractions:
        ax = axes[0][1]
        for k, (engine, label) in enumerate(((OURS, OURS), (BASELINE, "transformers"))):
            vals = [fractions.get((engine, w), 0.0) for w in workloads]
            ax.bar([i - 0.2 + 0.4 * k for i in x], vals, 0.4, label=label)
        ax.set_xticks(list(x), workloads)
        ax.set_ylim(0, 1.0)
        ax.set_ylabel("fraction of the measured matmul roofline")
        ax.set_title("useful FLOPs / roofline")
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return True


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("compare", nargs="+", help="bench.compare JSON files")
    parser.add_argument("--roofline", default=None, help="a bench.roofline JSON file over the same runs")
    parser.add_argument("--output", default="docs/performance.png")
    parser.add_argument("--title", default="tinyserve vs transformers, 200M Llama, bf16, 2 CPU cores")
    args = parser.parse_args(argv)
    if not draw(load_summary(args.compare), load_fractions(args.roofline), Path(args.output), args.title):
        return 2
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
