"""Smoke test of ``bench.moe_decode`` on its tiny shape (a few-hundred-KB MoE and dense pair built
into a temporary folder), and of its parameter accounting on the full-size shape (on the meta
device: nothing allocated). No figure is compared with a speed: only that every cell is there."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Iterator

import pytest
import torch

from bench import moe_decode


@pytest.fixture
def restore_threads(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """``main`` pins torch's thread count (and OMP_NUM_THREADS); the rest of the session keeps its own."""
    import os

    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", str(torch.get_num_threads())))
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _is_positive(value: object) -> bool:
    return isinstance(value, float) and math.isfinite(value) and value > 0


def test_tiny_shape_measures_both_engines_on_both_models(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], restore_threads: None
) -> None:
    out = tmp_path / "result.json"
    argv = ["--shape", "tiny", "--out-dir", str(tmp_path / "ckpt"), "--prompt-len", "8", "--decode-steps", "3"]
    argv += ["--repeat", "1", "--hf-repeat", "1", "--batch-sizes", "1", "3", "--threads", "1", "--output", str(out)]
    assert moe_decode.main(argv) == 0

    table = capsys.readouterr().out
    lines = table.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["batch", "ts"])
    assert "dense/MoE" in lines[header] and "ts/hf MoE" in lines[header]
    rows = [line.split() for line in lines[header + 2 : header + 4]]
    assert [r[0] for r in rows] == ["1", "3"] and all(len(r) == len(moe_decode.TABLE_COLUMNS) for r in rows)
    assert all(float(cell.replace(",", "")) > 0 for r in rows for cell in r[1:])  # no "-": every cell measured

    record = json.loads(out.read_text())
    assert [r["batch"] for r in record["rows"]] == [1, 3]
    for row in record["rows"]:
        for key, _ in moe_decode.TABLE_COLUMNS[1:]:
            assert _is_positive(row[key]), (key, row[key])
    assert _is_positive(record["goal"]["batch1_dense_over_moe"]) and isinstance(record["goal"]["met"], bool)
    assert record["params"]["moe_total"] > record["params"]["moe_active"] > record["params"]["dense_total"]
    assert record["machine"]["pinning"]["num_threads"] == 1 and isinstance(record["hf_experts_implementation"], str)

    # both checkpoints were built once, with the shapes that make them twins
    moe = json.loads((tmp_path / "ckpt" / moe_decode.SHAPES["tiny"].folder("moe") / "config.json").read_text())
    dense = json.loads((tmp_path / "ckpt" / moe_decode.SHAPES["tiny"].folder("dense") / "config.json").read_text())
    assert moe["model_type"] == "qwen3_moe" and dense["model_type"] == "qwen3"
    assert dense["intermediate_size"] == moe["num_experts_per_tok"] * moe["moe_intermediate_size"]
    shared = (
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
    )
    assert all(moe[key] == dense[key] for key in shared)
    again = moe_decode.build_pair(moe_decode.SHAPES["tiny"], tmp_path / "ckpt")  # cached: not rebuilt
    assert again == {kind: tmp_path / "ckpt" / moe_decode.SHAPES["tiny"].folder(kind) for kind in moe_decode.KINDS}


def test_full_size_shape_is_1b_total_and_0_2b_active() -> None:
    shape = moe_decode.SHAPES["moe-1b"]
    counts = moe_decode.parameter_counts(shape)
    assert 0.95e9 < counts["moe_total"] < 1.05e9 and 0.18e9 < counts["moe_active"] < 0.25e9
    # the dense twin is the MoE's active part without the routers
    routers = shape.num_layers * shape.num_experts * shape.hidden_size
    assert counts["dense_total"] == counts["moe_active"] - routers
    assert counts["moe_experts"] == shape.num_layers * shape.num_experts * 3 * shape.hidden_size * 384
    assert shape.dense_intermediate_size == shape.top_k * shape.moe_intermediate_size == 3072


def test_dry_run_builds_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert moe_decode.main(["--shape", "tiny", "--out-dir", str(tmp_path), "--dry-run"]) == 0
    rows = [line.split()[0] for line in capsys.readouterr().out.splitlines()[4:]]
    assert rows == ["moe", "dense"] and not any(tmp_path.iterdir())


def test_table_rows_leave_a_missing_engine_blank() -> None:
    results = {
        "tinyserve": {"moe": {1: {"tok_s": 10.0}}, "dense": {1: {"tok_s": 14.0}}},
        "hf": {"moe": {1: {"tok_s": 5.0}}},
    }
    (row,) = moe_decode.table_rows(results, [1])
    assert row["dense_over_moe"] == pytest.approx(1.4) and row["ts_over_hf_moe"] == pytest.approx(2.0)
    assert row["hf_dense"] is None and row["ts_over_hf_dense"] is None and row["hf_dense_over_moe"] is None
