"""bench/lora.py's pieces without a server: fresh prompts for every row and repeat, the adapters'
round-robin spread, the run checks, the summary's medians and ratios, the adapters peft makes from a
config alone, and the load driver naming an adapter on both backends."""

from __future__ import annotations

import argparse
import asyncio
import json
from itertools import combinations
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from bench import lora
from bench.http_backend import CompletionsClient
from bench.load_runner import _send_one
from bench.workloads import uniform


def bench_args(**over: Any) -> argparse.Namespace:
    args, _ = lora.parse_args(["--num-requests", "16", "--prompt-len", "12", "--max-new-tokens", "3"])
    return argparse.Namespace(**{**vars(args), **over})


def test_every_row_and_repeat_gets_fresh_prompts_and_the_adapters_are_spread_evenly() -> None:
    args = bench_args()
    names = lora.adapter_names(4)
    rows = (lora.BASE_ON_LORA, lora.ADAPTERS_ON_LORA, lora.BASE_ON_PLAIN)
    loads = {(row, rep): lora.workload_for(row, rep, args, (10, 500), names) for row in rows for rep in range(3)}
    for wl in loads.values():
        assert wl.num_requests == 16
        assert {len(r.input_ids) for r in wl.requests} == {12} and {r.max_new_tokens for r in wl.requests} == {3}
        assert all(10 <= t < 500 for r in wl.requests for t in r.input_ids)
    for (key_a, a), (key_b, b) in combinations(loads.items(), 2):
        shared = {tuple(r.input_ids) for r in a.requests} & {tuple(r.input_ids) for r in b.requests}
        assert not shared, f"{key_a} and {key_b} share prompts: the prefix cache could serve them"
    spread = loads[(lora.ADAPTERS_ON_LORA, 1)].requests
    assert [r.lora_path for r in spread[:4]] == names  # the warm-up's first requests name every adapter
    assert {name: sum(r.lora_path == name for r in spread) for name in names} == dict.fromkeys(names, 4)
    for row in (lora.BASE_ON_LORA, lora.BASE_ON_PLAIN):
        assert all(r.lora_path is None for r in loads[(row, 0)].requests)
    assert lora.workload_for(lora.ADAPTERS_ON_LORA, 1, args, (10, 500), names).requests == spread


def test_rotation_puts_each_row_first_once() -> None:
    assert [lora.rotated("abc", rep) for rep in range(4)] == [list("abc"), list("bca"), list("cab"), list("abc")]


def test_request_problems_name_failures_wrong_lengths_and_cache_hits() -> None:
    def rec(index: int, output_len: int = 4, error: str | None = None, cached: int = 0) -> dict[str, Any]:
        return {"index": index, "output_len": output_len, "error": error, "cached_tokens": cached}

    good = {"workload": {"name": "lora-adapters"}, "requests": [rec(0), rec(1)]}
    assert lora.request_problems(good, 4) == []
    bad = {"workload": {"name": "lora-base"}, "requests": [rec(0, 3), rec(1, 0, "invalid_request"), rec(2, cached=8)]}
    problems = lora.request_problems(bad, 4)
    assert len(problems) == 3 and all(p.startswith("lora-base: request ") for p in problems)
    assert "made 3 tokens, not 4" in problems[0] and "invalid_request" in problems[1] and "8 cached" in problems[2]


def test_summary_takes_medians_and_ratios_over_both_base_rows() -> None:
    def run(tok_s: float) -> dict[str, Any]:
        figures = ("request_throughput", "ttft_p50_ms", "tpot_p50_ms", "duration_s")
        return {"metrics": {"output_tok_s": tok_s, **{k: tok_s / 64 for k in figures}}}

    runs = {
        lora.BASE_ON_LORA: [run(100.0), run(90.0), run(110.0)],
        lora.ADAPTERS_ON_LORA: [run(50.0), run(40.0), run(45.0)],
        lora.BASE_ON_PLAIN: [run(125.0), run(120.0), run(130.0)],
    }
    labels = {key: key.upper() for key in runs}
    rows = {row["row"]: row for row in lora.summarize(runs, labels)}
    assert rows["LORA-BASE"]["output_tok_s"] == 100.0 and rows["LORA-ADAPTERS"]["output_tok_s"] == 45.0
    assert rows["LORA-ADAPTERS"]["request_throughput"] == pytest.approx(45.0 / 64)
    assert rows["LORA-ADAPTERS"]["each"] == "50, 40, 45"
    assert rows["LORA-ADAPTERS"]["vs_lora_base"] == pytest.approx(0.45)
    assert rows["LORA-BASE"]["vs_plain"] == pytest.approx(0.8)
    assert rows["PLAIN-BASE"]["vs_plain"] == 1.0


def test_adapters_come_from_the_config_alone_reproducibly_and_are_cached(tiny_llama_path: Path, tmp_path: Path) -> None:
    folders = lora.make_adapters(tiny_llama_path, tmp_path, count=2, rank=4, alpha=8.0, seed=3)
    assert [f.name for f in folders] == ["lora0", "lora1"]
    config = json.loads((folders[0] / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8 and set(config["target_modules"]) == set(lora.PROJECTIONS)
    first, second = (load_file(str(f / "adapter_model.safetensors")) for f in folders)
    layers = json.loads((tiny_llama_path / "config.json").read_text())["num_hidden_layers"]
    assert len(first) == 2 * len(lora.PROJECTIONS) * layers  # an A and a B per projection and layer
    assert all(t.abs().sum() > 0 for t in first.values())  # init_lora_weights=False: B is not zero
    assert any(not torch.equal(first[k], second[k]) for k in first)  # each adapter its own draw
    mtime = (folders[1] / "adapter_model.safetensors").stat().st_mtime_ns
    again = lora.make_adapters(tiny_llama_path, tmp_path / "other", count=2, rank=4, alpha=8.0, seed=3)
    assert all(torch.equal(first[k], v) for k, v in load_file(str(again[0] / "adapter_model.safetensors")).items())
    assert lora.make_adapters(tiny_llama_path, tmp_path, count=2, rank=4, alpha=8.0, seed=3) == folders
    assert (folders[1] / "adapter_model.safetensors").stat().st_mtime_ns == mtime  # reused, not redrawn


class _Recorder:
    """Stands in for the Python client: records generate's keywords."""

    def __init__(self) -> None:
        self.kwargs: list[dict[str, Any]] = []

    async def generate(self, **kwargs: Any) -> dict[str, Any]:
        self.kwargs.append(kwargs)
        return {"output_ids": [1, 2], "meta": {}}


class _Bar:
    def update(self, n: int) -> None:
        pass


def test_the_load_driver_names_the_adapter_only_on_lora_requests() -> None:
    from dataclasses import replace

    req = uniform(num_requests=1, prompt_len=4, max_new_tokens=2).requests[0]
    client = _Recorder()
    asyncio.run(_send_one(client, req, False, 0.0, _Bar()))
    asyncio.run(_send_one(client, replace(req, lora_path="lora3"), False, 0.0, _Bar()))
    assert "lora_path" not in client.kwargs[0] and client.kwargs[1]["lora_path"] == "lora3"
    http = CompletionsClient("http://127.0.0.1:1", "served")
    assert json.loads(http.body([5, 6], 2, stream=False))["model"] == "served"
    assert json.loads(http.body([5, 6], 2, stream=False, adapter="lora3"))["model"] == "served:lora3"


def test_flags_default_to_the_issue_shape() -> None:
    args, rest = lora.parse_args(["--device", "cpu"])
    assert (args.adapters, args.rank, args.alpha, args.num_requests, args.prompt_len, args.max_new_tokens) == (
        8,
        16,
        16.0,
        64,
        128,
        64,
    )
    assert args.repeat == 3 and args.backend == "http" and rest == ["--device", "cpu"]
    with pytest.raises(SystemExit):
        lora.parse_args(["--adapters", "0"])
