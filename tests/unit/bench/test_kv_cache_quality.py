"""bench/kv_cache_quality.py's core on the tiny checkpoint: teacher forcing through the model's own
cache reproduces the baseline exactly (so any drift the benchmark reports is the cache's), a
quantized cache gives bounded drift, and the scores count what they claim."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from bench import kv_cache_quality as kvq
from runtime.engine.model_runner import ModelRunner
from tests.support.checkpoints import random_prompt


def test_scores_count_positions_agreement_drift_and_divergence() -> None:
    reference = [[5, 6, 7, 8], [5, 9]]  # the baseline's tokens; position 0 is the prefill's
    baseline = kvq.Run([[6, 7, 8], [9]], [[-0.5, -1.0, -0.25], [-2.0]])
    forced = kvq.Run([[6, 3, 8], [9]], [[-0.5, -1.5, -0.25], [-1.0]])
    free = [[5, 6, 3], [5, 9]]  # the first left its reference at position 2, the second never
    scores = kvq.score(reference, baseline, forced, free)
    assert scores["positions"] == 4 and scores["agree"] == 0.75
    assert scores["mean_drift"] == pytest.approx((0 + 0.5 + 0 + 1.0) / 4) and scores["max_drift"] == 1.0
    assert scores["first_divergence"] == [2, None] and scores["diverged"] == 1
    assert kvq.divergence_text(scores["first_divergence"]) == "2, -"
    assert kvq.kv_dtypes_for("float32", ["int8"]) == ["bf16", "int8"]
    assert kvq.kv_dtypes_for("bfloat16", ["int8"]) == ["int8"]


def test_the_model_s_own_cache_reproduces_the_baseline_and_int8_drifts_little(tiny_llama_path: Path) -> None:
    def make_runner(kv: str, tokens: int) -> Any:
        return ModelRunner(
            str(tiny_llama_path),
            device="cpu",
            dtype="float32",
            max_total_tokens=tokens,
            max_running_requests=4,
            kv_cache_dtype=kv,
            load_progress=False,
        )

    prompts = [random_prompt(40 + 7 * i, 256, seed=i) for i in range(3)]
    rows, reference = kvq.measure(make_runner, prompts, ["auto", "int8"], max_new_tokens=10)
    by_kv = {row["kv_cache_dtype"]: row for row in rows}
    assert set(by_kv) == {"auto", "int8"}
    assert all(1 <= len(r) <= 10 for r in reference)
    positions = sum(len(r) - 1 for r in reference)  # the decode steps: the first token is the prefill's
    assert positions > 0 and all(row["positions"] == positions for row in rows)
    own = by_kv["auto"]  # the same cache again: every step must be the baseline's, bit for bit
    assert own["agree"] == 1.0 and own["mean_drift"] == 0.0 and own["max_drift"] == 0.0
    assert own["first_divergence"] == [None] * 3 and own["diverged"] == 0
    int8 = by_kv["int8"]
    assert int8["kv_bytes_per_token"] < own["kv_bytes_per_token"] / 3  # D + 4 bytes a row, not 4 D
    assert 0.0 < int8["mean_drift"] <= int8["max_drift"] < 0.1 and not math.isnan(int8["agree"])
    assert int8["agree"] >= 0.8
