"""Helpers every benchmark script shares: thread pinning, statistics, tables, JSON.

Why one module: two engines are only comparable when they run on the same cores
with the same thread count and are summarised by the same percentile code, so
those pieces live here once instead of drifting apart in each script.
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence, TypeVar

T = TypeVar("T")

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_RESULTS_DIR = REPO_ROOT / "bench" / "results"  # git-ignored


# ---------------------------------------------------------------------- thread pinning


def parse_cpu_list(spec: str) -> list[int]:
    """``"0-3,6"`` -> ``[0, 1, 2, 3, 6]`` (taskset's list syntax)."""
    cpus: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            lo, hi = part.split("-", 1)
            if int(hi) < int(lo):
                raise ValueError(f"bad cpu range {part!r}")
            cpus.update(range(int(lo), int(hi) + 1))
        else:
            cpus.add(int(part))
    if not cpus:
        raise ValueError(f"empty cpu list {spec!r}")
    return sorted(cpus)


@dataclass(frozen=True)
class Pinning:
    """Where a benchmark runs: the cores it may use and the intra-op thread count."""

    cpus: tuple[int, ...] | None  # None: the affinity could not be read or set (not Linux)
    num_threads: int

    def as_dict(self) -> dict[str, Any]:
        return {"cpus": list(self.cpus) if self.cpus is not None else None, "num_threads": self.num_threads}

    def child_env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """Environment for a child process (the server) so its torch uses the same thread count.

        The cpu affinity is inherited by children on Linux; the thread count is not,
        torch reads it from OMP_NUM_THREADS at start-up.
        """
        env = dict(os.environ if base is None else base)
        env["OMP_NUM_THREADS"] = str(self.num_threads)
        env["MKL_NUM_THREADS"] = str(self.num_threads)
        return env


def pin_threads(num_threads: int | None = None, cpus: Sequence[int] | None = None) -> Pinning:
    """Restrict this process to ``cpus`` (default: its current affinity) and set torch's
    intra-op threads to ``num_threads`` (default: one per allowed cpu).

    Uses ``os.sched_setaffinity`` (the system call behind taskset) where it exists.
    """
    import torch

    allowed: tuple[int, ...] | None = None
    if hasattr(os, "sched_setaffinity"):
        if cpus is not None:
            os.sched_setaffinity(0, set(cpus))
        allowed = tuple(sorted(os.sched_getaffinity(0)))
    threads = num_threads or (len(allowed) if allowed else (os.cpu_count() or 1))
    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    return Pinning(cpus=allowed, num_threads=threads)


def cpu_description(cpuinfo: str | None = None) -> str | None:
    """The CPU as a figure must name it: model, cores and its widest vector ISA, e.g.
    ``"AMD EPYC, 2 cores, AVX2-only"`` (None off Linux). ``cpuinfo``: /proc/cpuinfo's text."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return None
    fields: dict[str, str] = {}
    cores = 0
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
            cores += key.strip() == "processor"
    flags = set(fields.get("flags", "").split())
    if "amx_tile" in flags:
        isa = "AVX-512 + AMX"
    elif "avx512f" in flags:
        isa = "AVX-512" + (" + BF16" if "avx512_bf16" in flags else "")
    elif "avx2" in flags:
        isa = "AVX2-only"
    else:
        isa = "no AVX2"
    return f"{fields.get('model name', 'unknown CPU')}, {cores} cores, {isa}"


def machine_info(pinning: Pinning | None = None) -> dict[str, Any]:
    """What a result was measured on, stored next to every result."""
    import torch

    info: dict[str, Any] = {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "cpu_model": cpu_description(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if pinning is not None:
        info["pinning"] = pinning.as_dict()
    return info


def device_sync(device: Any) -> None:
    """Wait for the work queued on ``device`` (a no-op on cpu, where ops finish before returning).

    GPU timings need it on both ends of the measured region: launches return at once.
    """
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------- statistics


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation (numpy's default); NaN if empty."""
    if not values:
        return math.nan
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


def summarize(values: Sequence[float]) -> dict[str, float]:
    """mean / p50 / p90 / p99 / max of a sample (NaN for an empty one)."""
    return {
        "mean": statistics.fmean(values) if values else math.nan,
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
        "max": max(values) if values else math.nan,
    }


def median_of_runs(runs: Sequence[dict[str, Any]], keys: Iterable[str]) -> dict[str, float]:
    """Per key, the median over repeated runs (keys missing from a run are skipped)."""
    out: dict[str, float] = {}
    for key in keys:
        vals = [float(r[key]) for r in runs if isinstance(r.get(key), (int, float)) and not _isnan(r[key])]
        out[key] = median(vals)
    return out


def _isnan(x: Any) -> bool:
    return isinstance(x, float) and math.isnan(x)


# ---------------------------------------------------------------------- output


def format_value(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        if value != 0 and abs(value) < 10 ** (-digits):
            return f"{value:.{digits}e}"
        return f"{value:,.{digits}f}"
    return str(value)


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str]], digits: int = 2) -> str:
    """A plain-text table: ``columns`` is (key, header) pairs; numbers right-aligned."""
    cells = [[format_value(row.get(key), digits) for key, _ in columns] for row in rows]
    headers = [h for _, h in columns]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(headers, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    return "\n".join(lines)


def print_table(
    rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str]], title: str | None = None, digits: int = 2
) -> None:
    if title:
        print(f"\n== {title} ==")
    print(format_table(rows, columns, digits))


def _json_default(obj: Any) -> Any:
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "as_dict"):
        return obj.as_dict()
    if isinstance(obj, (set, tuple)):
        return list(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def write_json(path: str | Path, data: Any) -> Path:
    """Write ``data`` as indented JSON (NaN becomes null), creating parent folders."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(_nan_to_none(data), indent=2, default=_json_default) + "\n")
    return out


def read_json(path: str | Path) -> Any:
    return json.loads(Path(path).read_text())


def _nan_to_none(obj: Any) -> Any:
    if isinstance(obj, float) and (math.isnan(obj) or math.isinf(obj)):
        return None
    if isinstance(obj, dict):
        return {k: _nan_to_none(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_nan_to_none(v) for v in obj]
    return obj


def default_output_path(kind: str, tag: str) -> Path:
    """``bench/results/<kind>_<tag>_<timestamp>.json`` (the folder is git-ignored)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return DEFAULT_RESULTS_DIR / f"{kind}_{tag}_{stamp}.json"


def progress(iterable: Iterable[T], total: int | None = None, desc: str = "", disable: bool = False) -> Iterator[T]:
    """A tqdm bar on stderr (so stdout stays a clean table)."""
    from tqdm import tqdm

    yield from tqdm(iterable, total=total, desc=desc, file=sys.stderr, disable=disable, leave=False, dynamic_ncols=True)
