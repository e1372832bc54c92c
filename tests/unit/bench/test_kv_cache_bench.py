"""bench/kv_cache_attention.py at toy sizes: every KV cache format's attention step and whole decode step run
(on a tiny checkpoint), and the table's ratios are against the first format's."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.common import read_json
from runtime.engine.cpu import kernel_library


@pytest.mark.skipif(kernel_library.load() is None, reason="needs the CPU kernels (a C compiler)")
def test_the_bench_times_each_format_and_its_ratio(
    tmp_path: Path, tiny_llama_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from bench import kv_cache_attention

    out = tmp_path / "kv.json"
    argv = ["--contexts", "40", "100", "--layers", "2", "--repeat", "2", "--steps", "3", "--json", str(out)]
    assert kv_cache_attention.main([*argv, "--model", str(tiny_llama_path)]) == 0
    rows = read_json(out)["rows"]
    assert [(r["context"], r["cache"]) for r in rows] == [
        (c, f) for c in (40, 100) for f in ("bf16", "int8", "fp8_e4m3")
    ]
    assert all(r["attention_ms"] > 0 and r["step_ms"] > 0 and r["tok_s"] > 0 for r in rows)
    assert all(r["attention_x"] == 1.0 and r["tok_s_x"] == 1.0 for r in rows if r["cache"] == "bf16")
    assert "KV cache" in capsys.readouterr().out
