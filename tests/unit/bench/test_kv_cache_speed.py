"""bench/kv_cache_speed.py's core on the tiny checkpoint: a row per KV dtype with each repeat's
figure and the ratio to the auto cache, fresh prompts for every repeat and scenario, and the default
pool holding more tokens in a quantized format (never a speed)."""

from __future__ import annotations

from itertools import combinations
from pathlib import Path
from typing import Any

from bench import kv_cache_speed as kvs
from runtime.engine.model_runner import ModelRunner


def test_rows_per_kv_dtype_fresh_prompts_and_the_default_pools(tiny_llama_path: Path) -> None:
    def make_runner(kv: str, tokens: int | None = None, rows: int | None = None) -> Any:
        return ModelRunner(
            str(tiny_llama_path),
            device="cpu",
            dtype="float32",
            max_total_tokens=tokens,
            max_running_requests=rows,
            kv_cache_dtype=kv,
            load_progress=False,
        )

    rows = kvs.measure_scenario(
        make_runner, ["auto", "int8"], users=3, context=24, new_tokens=4, repeats=2, prefill_chunk=16
    )
    assert [r["kv_cache_dtype"] for r in rows] == ["auto", "int8"]
    for row in rows:
        assert row["scenario"] == "3 users @ 24" and len(row["runs"]) == 2
        assert row["output_tok_s"] > 0 and row["step_ms"] > 0 and row["prefill_tok_s"] > 0
        assert len(row["each"].split(", ")) == 2
    auto, int8 = rows
    assert auto["vs_auto"] == 1.0 and int8["vs_auto"] == int8["output_tok_s"] / auto["output_tok_s"]
    assert int8["kv_bytes_per_token"] < auto["kv_bytes_per_token"]

    seeds = {
        kvs.prompt_seed(0, rep, users, ctx) for rep in range(3) for users, ctx in ((1, 1024), (1, 4096), (64, 2048))
    }
    assert len(seeds) == 9  # every repeat of every scenario draws its own prompts
    draws = [kvs.random_prompts(2, 32, 500, seed) for seed in sorted(seeds)[:3]]
    assert all(6 <= t < 500 for d in draws for p in d for t in p) and all(len(p) == 32 for d in draws for p in d)
    assert all(not set(map(tuple, a)) & set(map(tuple, b)) for a, b in combinations(draws, 2))

    pools = {p["kv_cache_dtype"]: p for p in kvs.default_pools(make_runner, ["auto", "int8"])}
    assert pools["auto"]["format"] == "float32" and pools["int8"]["format"] == "int8"
    assert pools["int8"]["tokens"] > 2 * pools["auto"]["tokens"]  # 20 bytes a row, not 64: ~3x the tokens
    assert pools["int8"]["pool_mib"] <= pools["auto"]["pool_mib"] * 1.01  # the same memory, by need
    assert pools["auto"]["vs_auto"] == 1.0 and pools["int8"]["vs_auto"] > 2
