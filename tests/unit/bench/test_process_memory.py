"""bench/process_memory.py: resident memory of each server process, idle / peak / after a workload
(issue 47's figures), read from /proc; the run on the tiny model proves the whole tool."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from bench import process_memory
from bench.process_memory import PeakSampler, read_rss, snapshot, table_rows


def test_read_rss_of_a_live_and_a_gone_process() -> None:
    mine = read_rss(os.getpid())
    assert mine is not None and set(mine) == {"VmRSS", "RssAnon", "RssFile"}
    assert mine["VmRSS"] >= mine["RssAnon"] > 0
    assert read_rss(2**22 + 1) is None  # above the kernel's pid limit: never a process
    assert set(snapshot({"me": os.getpid(), "gone": 2**22 + 1})) == {"me"}  # a process gone is left out


def test_the_sampler_keeps_the_peak() -> None:
    with PeakSampler({"me": os.getpid()}, 0.01) as sampler:
        block = bytearray(64 << 20)  # 64 MiB, touched: resident while the sampler runs
        block[::4096] = b"x" * len(block[::4096])
        time.sleep(0.2)
        del block
    assert sampler.peak["me"]["VmRSS"] >= 64
    rows = table_rows({"rss_mib": {"idle": {"me": {"VmRSS": 1, "RssAnon": 0}}, "peak": sampler.peak, "after": {}}})
    assert rows[0]["process"] == "me" and rows[0]["idle"] == "1 (0)" and rows[0]["after"] == "- (-)"


def test_a_run_on_the_tiny_model_reports_every_process(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "memory.json"
    argv = ["--model", "tiny", "--device", "cpu", "--dtype", "float32", "--num-requests", "4", "--max-new-tokens", "4"]
    code = process_memory.main([*argv, "--settle", "0.2", "--output", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    idle, peak = result["rss_mib"]["idle"], result["rss_mib"]["peak"]
    assert {"launch", "scheduler-0", "tokenizer", "detokenizer"} <= set(idle)
    assert all(peak[name]["VmRSS"] >= idle[name]["VmRSS"] for name in idle)
    assert result["kv_pool"]["tokens"] == 64 * 512  # the tiny model's 512-token context, 64 requests
    assert "scheduler-0" in capsys.readouterr().out
