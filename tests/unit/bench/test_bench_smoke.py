"""Smoke tests of the benchmark suite's pure parts, on tiny inputs (no timing assertions).

The benchmarks themselves run for minutes on the full-size checkpoint; these tests
only prove that each script's building blocks compute what they claim: workload
shapes, prefix sharing, FLOP accounting on a known config, the metric summaries,
the baseline's batching, and a few real scheduler steps under the stub model.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

from bench import chart, compare, hf_baseline, roofline, scheduler_overhead, serving, structured
from bench.checkpoint import BENCH_SPEC, BenchModelSpec, build_bench_checkpoint, synthetic_corpus
from bench.common import format_table, median_of_runs, parse_cpu_list, percentile, read_json, write_json
from bench.workloads import (
    JSON_SCHEMAS,
    WORKLOADS,
    from_spec,
    json_schema,
    make_workload,
    multi_turn,
    parse_workload_args,
    prefix_tree_stats,
    shared_prefix,
    token_range_for,
    tree,
    uniform,
)

# ---------------------------------------------------------------------- common


def test_percentile_interpolates_like_numpy() -> None:
    vals = [4.0, 1.0, 3.0, 2.0]
    assert percentile(vals, 50) == 2.5
    assert percentile(vals, 0) == 1.0 and percentile(vals, 100) == 4.0
    assert percentile(list(range(101)), 99) == 99.0
    assert math.isnan(percentile([], 50))


def test_cpu_list_and_table_and_json(tmp_path: Path) -> None:
    assert parse_cpu_list("0-2,5") == [0, 1, 2, 5]
    with pytest.raises(ValueError):
        parse_cpu_list("3-1")
    table = format_table([{"a": 1.5, "b": "x"}, {"a": math.nan, "b": None}], [("a", "A"), ("b", "B")])
    assert table.splitlines()[0].split() == ["A", "B"]
    assert table.splitlines()[3].split() == ["-", "-"]  # NaN and None print as "-"
    path = write_json(tmp_path / "sub" / "r.json", {"x": math.nan, "y": [math.inf, 1.0]})
    assert read_json(path) == {"x": None, "y": [None, 1.0]}
    assert median_of_runs([{"v": 1.0}, {"v": 3.0}, {"v": math.nan}, {}], ["v"]) == {"v": 2.0}


# ---------------------------------------------------------------------- workloads


def test_default_workloads_have_the_issue_shapes() -> None:
    u = uniform()
    assert u.num_requests == 64 and {len(r.input_ids) for r in u.requests} == {128}
    assert {r.max_new_tokens for r in u.requests} == {64}

    s = shared_prefix()
    assert s.num_requests == 64 and {len(r.input_ids) for r in s.requests} == {512 + 32}
    assert len({tuple(r.input_ids[:512]) for r in s.requests}) == 1
    assert len({tuple(r.input_ids[512:]) for r in s.requests}) == 64
    assert prefix_tree_stats([r.input_ids for r in s.requests]).unique_tokens == 512 + 64 * 32

    t = tree()  # 1 root (256) -> 4 (128) -> 16 (64) -> 64 unique leaves (32)
    assert t.num_requests == 64 and {len(r.input_ids) for r in t.requests} == {480}
    assert prefix_tree_stats([r.input_ids for r in t.requests]).unique_tokens == 256 + 4 * 128 + 16 * 64 + 64 * 32
    assert len({tuple(r.input_ids[:384]) for r in t.requests}) == 4


def test_multi_turn_turns_extend_the_previous_turn() -> None:
    w = multi_turn(num_requests=6, num_turns=3, system_len=5, user_len=3, answer_len=2, max_new_tokens=4)
    assert w.num_requests == 6 and w.max_parallel == 2
    for chain in w.chains():
        assert chain[0].after is None
        for prev, cur in zip(chain, chain[1:]):
            assert cur.after == prev.index
            assert cur.input_ids[: len(prev.input_ids)] == prev.input_ids
            assert len(cur.input_ids) == len(prev.input_ids) + 2 + 3
    assert [len(level) for level in w.levels()] == [2, 2, 2]


def test_multi_turn_overflow_is_four_pools_of_history() -> None:
    w = make_workload("multi-turn-overflow", pool_tokens=1024)
    finals = [chain[-1].input_ids for chain in w.chains()]
    assert {len(f) for f in finals} == {600 + 4 * 64 + 3 * 64}
    # The fewest sessions whose histories (no prefix shared between sessions) reach 4 pools.
    working_set = prefix_tree_stats(finals).unique_tokens
    assert working_set >= 4 * 1024 > working_set - len(finals[0])
    assert w.max_parallel == len(finals) and w.num_requests == 4 * len(finals)


def test_workloads_are_deterministic_in_range_and_rebuildable() -> None:
    for name in WORKLOADS:
        w = make_workload(name, num_requests=8, max_new_tokens=2, vocab_low=10, vocab_high=20, seed=3)
        assert w.num_requests == 8
        assert all(10 <= t < 20 for r in w.requests for t in r.input_ids)
        again = from_spec(json.loads(json.dumps(w.spec())))
        assert again.requests == w.requests
    assert uniform(seed=1).requests != uniform(seed=2).requests
    with pytest.raises(ValueError):
        make_workload("nope")


def _bounded(schema: dict[str, Any]) -> bool:
    """Every string and array in ``schema`` has a length cap (so greedy outputs always close)."""
    kind = schema.get("type")
    if kind == "string" and "maxLength" not in schema and "pattern" not in schema:
        return False
    if kind == "array" and ("maxItems" not in schema or not _bounded(schema["items"])):
        return False
    return all(_bounded(p) for p in schema.get("properties", {}).values())


def test_json_schema_workload_is_chat_with_bounded_valid_schemas() -> None:
    import jsonschema

    for schema in JSON_SCHEMAS.values():
        jsonschema.validators.validator_for(schema).check_schema(schema)
        assert _bounded(schema) and schema["additionalProperties"] is False
    w = json_schema(num_requests=6, max_new_tokens=32)
    assert w.chat and not uniform(num_requests=1).chat
    assert {r.json_schema for r in w.requests} == {json.dumps(s) for s in JSON_SCHEMAS.values()}
    assert all(r.input_ids == [] and [m["role"] for m in r.messages or []] == ["system", "user"] for r in w.requests)
    assert len({r.messages[1]["content"] for r in w.requests if r.messages}) == 6  # a text of its own each
    assert serving.sampling_params(w.requests[0]) == {
        "max_new_tokens": 32,
        "temperature": 0.0,
        "json_schema": w.requests[0].json_schema,
    }
    wanted = argparse.Namespace(workload=["json-schema"], workload_arg=[], num_requests=2, max_new_tokens=None, seed=0)
    with pytest.raises(SystemExit, match="serving-only"):
        serving.build_workloads(wanted, None)  # hf / vllm / traces send token ids: not this one
    assert serving.build_workloads(wanted, None, chat_ok=True)[0].num_requests == 2


def test_json_schema_twin_validity_and_ratios() -> None:
    w = json_schema(num_requests=4)
    person = {"name": "Ann", "age": 30, "city": "Oslo", "occupation": "chef"}
    recs = [
        serving.RequestRecord(0, 50, output_len=20, text=json.dumps(person)),
        serving.RequestRecord(1, 50, output_len=9, text='{"customer": "Bo"'),  # cut short: does not parse
        serving.RequestRecord(2, 50, output_len=7, text=json.dumps(person)),  # parses, wrong schema
        serving.RequestRecord(3, 50, error="server_shutdown"),
    ]
    assert structured.valid_fraction(w, recs) == 0.25
    twin = structured.unconstrained_twin(w, recs)
    assert [(r.index, r.max_new_tokens, r.json_schema) for r in twin.requests] == [
        (0, 20, None),
        (1, 9, None),
        (2, 7, None),
    ]
    assert twin.requests[0].messages == w.requests[0].messages
    assert serving.sampling_params(twin.requests[0])["ignore_eos"] is True
    row = structured.ratio_row(
        "a / b", {"output_tok_s": 6.0, "decode_steps": 10}, {"output_tok_s": 3.0, "decode_steps": 0}
    )
    assert row["output_tok_s"] == 2.0 and math.isnan(row["decode_steps"])
    assert structured.same_outputs_pct(recs[:2], [recs[0], serving.RequestRecord(1, 50, text="{}")]) == 50.0


def test_prefix_tree_stats_counts_shared_prefixes_once() -> None:
    stats = prefix_tree_stats([[1, 2, 3], [1, 2, 4], [5]])
    assert stats.unique_tokens == 5  # 1, 2, 3, 4, 5
    assert stats.attended_keys == 1 + 2 + 3 + 3 + 1  # position + 1 of each unique token


def test_workload_args_and_token_range(tiny_llama_path: Path) -> None:
    assert parse_workload_args(["prefix_len=8", "segment_lens=4,2,1", "x=0.5"]) == {
        "prefix_len": 8,
        "segment_lens": [4, 2, 1],
        "x": 0.5,
    }
    low, high = token_range_for(str(tiny_llama_path))
    cfg = json.loads((tiny_llama_path / "config.json").read_text())
    assert low == 6 and high == cfg["vocab_size"]  # the 6 special tokens come first


# ---------------------------------------------------------------------- checkpoint


def test_bench_spec_is_about_200m_parameters() -> None:
    dims = roofline.ModelDims(
        BENCH_SPEC.hidden_size,
        BENCH_SPEC.num_layers,
        BENCH_SPEC.num_heads,
        BENCH_SPEC.num_kv_heads,
        BENCH_SPEC.hidden_size // BENCH_SPEC.num_heads,
        BENCH_SPEC.intermediate_size,
        BENCH_SPEC.vocab_size,
    )
    # per layer: q 1024x1024, k and v 1024x256, o 1024x1024, gate+up+down 3x1024x2816
    assert dims.block_params == 12 * (1024 * 1536 + 1024 * 1024 + 1024 * 5632 + 2816 * 1024)
    total = dims.block_params + dims.lm_head_params + dims.embedding_params
    assert 195e6 < total < 205e6


def test_small_spec_checkpoint_builds_and_caches(tmp_path: Path) -> None:
    spec = BenchModelSpec(
        name="t",
        hidden_size=32,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=64,
        vocab_size=300,
        max_positions=128,
        corpus_lines=400,
        lexicon_size=300,
    )
    assert synthetic_corpus(50, 100, 1) == synthetic_corpus(50, 100, 1)
    out = build_bench_checkpoint(tmp_path / "ckpt", spec)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["vocab_size"] == 300 and cfg["hidden_size"] == 32 and cfg["num_key_value_heads"] == 1
    assert (out / "tokenizer.json").is_file() and (out / "model.safetensors").is_file()
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert build_bench_checkpoint(tmp_path / "ckpt", spec) == out  # cached: not rebuilt
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp
    assert roofline.ModelDims.from_path(out).vocab_size == 300


# ---------------------------------------------------------------------- roofline

TINY = roofline.ModelDims(
    hidden_size=8, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4, intermediate_size=16, vocab_size=10
)


def test_flop_accounting_on_a_known_config() -> None:
    # per layer: qkv 8x(8+4+4), o 8x8, gate_up 8x32, down 16x8 -> 128 + 64 + 256 + 128 = 576
    assert TINY.block_params == 2 * 576
    assert TINY.lm_head_params == 80
    w = uniform(num_requests=2, prompt_len=4, max_new_tokens=3, vocab_low=0, vocab_high=1000)
    work = roofline.count_work(w)
    assert work.prefill_tokens == 8 and work.prefill_keys == 2 * (1 + 2 + 3 + 4)
    assert work.decode_tokens == 4 and work.decode_keys == 2 * (5 + 6)  # fed tokens at positions 4 and 5
    assert work.sampled_tokens == 6 and work.decode_batch == 2 and work.prefill_batch_tokens == 8
    flops = roofline.useful_flops(TINY, work)
    assert flops["linear_prefill"] == 2 * 1152 * 8
    assert flops["linear_decode"] == 2 * 1152 * 4
    assert flops["lm_head"] == 2 * 80 * 6
    per_key = 4 * 2 * 2 * 4  # 4 FLOPs x layers x heads x head_dim
    assert flops["attention_prefill"] == per_key * 20 and flops["attention_decode"] == per_key * 22
    assert flops["total"] == sum(v for k, v in flops.items() if k != "total")


def test_shared_prefix_counts_once_in_the_useful_work() -> None:
    w = shared_prefix(num_requests=4, prefix_len=10, suffix_len=2, max_new_tokens=1)
    assert roofline.count_work(w).prefill_tokens == 10 + 4 * 2


def test_decode_keys_of_the_common_prefix_are_counted_apart() -> None:
    w = shared_prefix(num_requests=4, prefix_len=10, suffix_len=2, max_new_tokens=5)
    work = roofline.count_work(w)
    assert work.decode_shared_keys == 4 * 4 * 10  # 4 requests x 4 fed-back tokens x 10 shared keys
    assert work.decode_keys == 4 * sum(12 + 1 + j for j in range(4))
    assert roofline.count_work(uniform(num_requests=4, prompt_len=8, max_new_tokens=3)).decode_shared_keys == 0


def test_roofline_of_a_run_record() -> None:
    meter = roofline.MatmulMeter("cpu", "float32", min_time_s=0.0)
    w = uniform(num_requests=2, prompt_len=4, max_new_tokens=3)
    run = {"engine": "x", "workload": w.spec(), "model": TINY.as_dict(), "metrics": {"duration_s": 0.5}}
    row = roofline.evaluate_run(run, meter)
    assert row["useful_gflop"] == pytest.approx(roofline.useful_flops(TINY, roofline.count_work(w))["total"] / 1e9)
    assert row["roofline_s"] > 0 and row["fraction"] == pytest.approx(row["roofline_s"] / 0.5)
    assert all(g > 0 and math.isfinite(g) for g in meter.cache.values())


# ---------------------------------------------------------------------- serving / baseline / compare


def test_serving_summary_from_records() -> None:
    recs = [
        serving.RequestRecord(
            0, prompt_len=10, output_len=4, cached_tokens=5, ttft=0.1, latency=0.4, itl=[0.1, 0.1, 0.1]
        ),
        serving.RequestRecord(
            1, prompt_len=10, output_len=4, cached_tokens=0, ttft=0.3, latency=0.6, itl=[0.1, 0.1, 0.1]
        ),
        serving.RequestRecord(2, prompt_len=10, error="too_long"),
    ]
    m = serving.summarize_run(recs, duration=2.0)
    assert (m["completed"], m["failed"], m["errors"]) == (2, 1, ["too_long"])
    assert m["output_tok_s"] == 4.0 and m["total_tok_s"] == 14.0
    assert m["ttft_p50_ms"] == pytest.approx(200.0) and m["itl_p50_ms"] == pytest.approx(100.0)
    assert m["tpot_p50_ms"] == pytest.approx(100.0)
    assert m["cache_hit_rate"] == 0.25


def test_arrivals_and_sampling_params() -> None:
    assert serving.arrival_times(3, math.inf, 0) == [0.0, 0.0, 0.0]
    times = serving.arrival_times(50, 10.0, 0)
    assert times == sorted(times) and times[0] == 0.0 and times == serving.arrival_times(50, 10.0, 0)
    req = uniform(num_requests=1, max_new_tokens=7).requests[0]
    assert serving.sampling_params(req) == {"max_new_tokens": 7, "temperature": 0.0, "ignore_eos": True}


def test_hf_batches_follow_dependency_levels() -> None:
    w = multi_turn(num_requests=12, num_turns=2, system_len=2, user_len=1, answer_len=1)
    batches = hf_baseline.hf_batches(w, batch_size=4)
    assert [len(b) for b in batches] == [4, 2, 4, 2]
    seen: set[int] = set()
    for batch in batches:
        assert all(r.after is None or r.after in seen for r in batch)
        seen |= {r.index for r in batch}
    ids, mask = hf_baseline.left_pad([[5, 6], [7]], pad_id=0)
    assert ids == [[5, 6], [0, 7]] and mask == [[1, 1], [0, 1]]


def test_hf_baseline_generates_exactly_max_new_tokens(tiny_llama_path: Path) -> None:
    runner = hf_baseline.HFRunner(str(tiny_llama_path), device="cpu", dtype="float32")
    low, high = token_range_for(str(tiny_llama_path))
    w = uniform(num_requests=3, prompt_len=5, max_new_tokens=4, vocab_low=low, vocab_high=high)
    run = hf_baseline.run_baseline(runner, w, batch_size=2, show_progress=False)
    m = run["metrics"]
    assert (m["completed"], m["output_tokens"], m["num_batches"]) == (3, 12, 2)
    assert m["input_tokens"] == 15 and run["workload"] == w.spec()


def test_compare_summary_has_medians_and_ratio() -> None:
    def run(engine: str, tok_s: float) -> dict:
        return {
            "engine": engine,
            "workload": {"name": "uniform"},
            "metrics": {"output_tok_s": tok_s, "total_tok_s": 2 * tok_s, "duration_s": 10.0 / tok_s},
        }

    runs = [run("ours", 10.0), run("ours", 30.0), run("ours", 20.0), run("hf", 5.0), run("hf", 5.0)]
    rows = compare.summarize_comparison(runs, "ours", "hf")
    assert [r["engine"] for r in rows] == ["ours", "hf", "ratio ours/hf"]
    assert rows[0]["output_tok_s"] == 20.0 and rows[0]["repeats"] == 3
    assert rows[2]["output_tok_s"] == 4.0 and rows[2]["total_tok_s"] == 4.0


@pytest.mark.parametrize("extra,streamed", [([], True), (["--no-stream"], False)])
def test_compare_streams_unless_asked_not_to(
    extra: list[str], streamed: bool, tiny_llama_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--no-stream sends tinyserve's requests unstreamed (whole outputs, as the offline baselines
    return them); the setting is recorded."""
    seen: list[bool] = []

    @contextlib.contextmanager
    def no_server(*args: Any, **kwargs: Any) -> Iterator[None]:
        yield None

    def fake_workloads(handle: Any, workloads: list[Any], **kwargs: Any) -> list[dict[str, Any]]:
        seen.append(kwargs["stream"])
        return [
            {
                "engine": serving.ENGINE,
                "workload": {"name": w.name},
                "metrics": {"output_tok_s": 1.0, "total_tok_s": 2.0, "duration_s": 1.0},
            }
            for w in workloads
        ]

    monkeypatch.setattr(serving, "server_for", no_server)
    monkeypatch.setattr(serving, "benchmark_workloads", fake_workloads)
    out = tmp_path / "cmp.json"
    assert (
        compare.main(
            [
                "--model-path",
                str(tiny_llama_path),
                "--device",
                "cpu",
                "--workload",
                "uniform",
                "--num-requests",
                "2",
                "--repeat",
                "2",
                "--skip-baseline",
                "--output",
                str(out),
                *extra,
            ]
        )
        == 0
    )
    assert seen == [streamed, streamed]
    assert read_json(out)["settings"]["stream"] is streamed


def test_chart_inputs_from_compare_and_roofline_files(tmp_path: Path) -> None:
    compare_file = tmp_path / "compare.json"
    write_json(
        compare_file,
        {
            "summary": [
                {"engine": "tinyserve", "workload": "uniform", "output_tok_s": 600.0},
                {"engine": "hf-transformers", "workload": "uniform", "output_tok_s": 200.0},
            ]
        },
    )
    roofline_file = tmp_path / "roofline.json"
    write_json(
        roofline_file,
        {"rows": [{"engine": "tinyserve", "workload": "uniform", "fraction": f} for f in (0.7, 0.9, 0.8)]},
    )
    summary = chart.load_summary([str(compare_file)])
    assert summary[("tinyserve", "uniform")]["output_tok_s"] == 600.0
    assert chart.load_fractions(str(roofline_file)) == {("tinyserve", "uniform"): 0.8}
    assert chart.load_fractions(None) == {}
    drawn = chart.draw(summary, {}, tmp_path / "chart.png", "t")
    assert drawn == (tmp_path / "chart.png").exists()  # False only where matplotlib is missing


# ---------------------------------------------------------------------- scheduler overhead


def test_scheduler_overhead_runs_decode_steps() -> None:
    result = scheduler_overhead.measure_overhead(num_requests=8, prompt_len=8, steps=5, warmup_steps=2)
    assert result["steps"] == 5 and result["num_requests"] == 8
    assert result["cpu_ms_p50"] >= 0 and math.isfinite(result["cpu_ms_p99"])


def test_scheduler_overhead_profile_names_scheduler_functions() -> None:
    import cProfile

    prof = cProfile.Profile()
    scheduler_overhead.measure_overhead(
        num_requests=4, prompt_len=4, steps=3, warmup_steps=1, page_size=4, profile=prof
    )
    report = scheduler_overhead.profile_report(prof, top=5)
    assert "scheduler_proc/scheduler.py" in report and "step" in report


def test_cpu_prefill_attention_bench_times_every_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from bench import cpu_prefill_attention

    out = tmp_path / "prefill.json"
    assert cpu_prefill_attention.main(["--shapes", "2x16", "--repeat", "1", "--json", str(out)]) == 0
    rows = read_json(out)["rows"]
    paths = {row["path"] for row in rows}
    assert {"matmul path", "flash"} <= paths  # the C kernel too where it applies (AVX-512, a compiler)
    assert all(row["shape"] == "2x16" and row["ms"] > 0 for row in rows)
    assert next(row for row in rows if row["path"] == "matmul path")["vs_matmul"] == 1.0
    assert "speed-up vs matmul path" in capsys.readouterr().out


# ---------------------------------------------------------------------- GPU benchmark support, run on CPU


def test_gpu_shapes_have_the_llama_block_dims() -> None:
    from bench.checkpoint import SHAPES

    one, eight = SHAPES["llama-1b"], SHAPES["llama-8b"]
    assert (one.hidden_size, one.num_layers, one.num_heads, one.num_kv_heads, one.intermediate_size) == (
        2048,
        16,
        32,
        8,
        8192,
    )
    assert (eight.hidden_size, eight.num_layers, eight.num_heads, eight.num_kv_heads, eight.intermediate_size) == (
        4096,
        32,
        32,
        8,
        14336,
    )
    assert one.vocab_size == eight.vocab_size == BENCH_SPEC.vocab_size  # the bench tokenizer's: every id decodes
    assert one.tie_word_embeddings and not eight.tie_word_embeddings
    dims = roofline.ModelDims(4096, 32, 32, 8, 128, 14336, eight.vocab_size)
    assert 6.9e9 < dims.block_params < 7.0e9  # Llama-3-8B's blocks; its 128256-token head is not modelled


def test_shaped_checkpoint_is_drawn_on_the_device_and_serves(
    tmp_path: Path, tiny_llama_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from bench import checkpoint
    from runtime.engine.model_runner import ModelRunner
    from tests.support.harness import Harness

    vocab = json.loads((tiny_llama_path / "config.json").read_text())["vocab_size"]
    spec = BenchModelSpec(
        name="t",
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=64,
        vocab_size=vocab,
        max_positions=128,
        rope_theta=500000.0,
        tie_word_embeddings=True,
    )
    monkeypatch.setitem(checkpoint.SHAPES, "tiny-test", spec)
    monkeypatch.setattr(checkpoint, "build_bench_checkpoint", lambda out_dir=None: tiny_llama_path)  # its tokenizer
    out = tmp_path / "shaped"
    assert checkpoint.main(["--shape", "tiny-test", "--out-dir", str(out), "--device", "cpu"]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]) == (32, 2, vocab)
    assert cfg["tie_word_embeddings"] and cfg.get("rope_theta", cfg.get("rope_parameters", {}).get("rope_theta")) == 5e5
    assert (out / "tokenizer.json").read_bytes() == (tiny_llama_path / "tokenizer.json").read_bytes()
    with pytest.raises(ValueError, match="tokens"):
        checkpoint.build_shaped_into(tmp_path / "bad", BenchModelSpec(vocab_size=vocab + 1), tiny_llama_path, "cpu")
    runner = ModelRunner(out, device="cpu", dtype="float32", max_total_tokens=256, load_progress=False)
    assert len(Harness(runner).generate([[5, 6, 7]], max_new_tokens=3)[0].output_ids) == 3


def test_launch_counts_per_step() -> None:
    from bench.model_step import launches_per_step

    counts = {"cudaLaunchKernel": 30, "cuLaunchKernel": 10, "cudaGraphLaunch": 4, "aten::mm": 8, "aten::add": 4}
    assert launches_per_step(counts, 4, "cuda") == {"kernel_launches": 10.0, "graph_launches": 1.0}
    assert launches_per_step(counts, 4, "cpu") == {"torch_ops": 3.0}


def test_model_step_runs_on_a_device_and_profiles(tiny_llama_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from bench import model_step

    assert (
        model_step.main(
            [
                "--model-path",
                str(tiny_llama_path),
                "--device",
                "cpu",
                "--dtype",
                "float32",
                "--scenario",
                "decode",
                "--batch",
                "2",
                "--context",
                "6",
                "--decode-steps",
                "2",
                "--repeat",
                "1",
                "--profile",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "ModelRunner ready" in out and "(cpu," in out and "no cuda graphs" in out
    per_step = [line for line in out.splitlines() if line.startswith("per step: torch ops")]
    assert per_step and float(per_step[0].split()[-1]) > 0
    assert any(line.split()[:1] == ["decode"] for line in out.splitlines())


def test_scheduler_trace_takes_a_device(tiny_llama_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from bench import scheduler_trace

    assert (
        scheduler_trace.main(
            [
                "--model-path",
                str(tiny_llama_path),
                "--device",
                "cpu",
                "--dtype",
                "float32",
                "--workload",
                "uniform",
                "--num-requests",
                "3",
                "--max-new-tokens",
                "3",
                "--workload-arg",
                "prompt_len=5",
                "--no-warmup",
                "--steps",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    rows = {
        " ".join(line.split()[1:3]): line.split()[3:] for line in out.splitlines() if line.split()[:1] == ["uniform"]
    }
    assert set(rows) == {"(overlap off)", "(overlap on)"}  # both modes by default, one table
    for cols in rows.values():
        decodes, device_ms, wall_ms, host_ms, exposed_ms, hidden_ms = cols[4:10]
        assert int(decodes) >= 2  # 3 tokens per request: one from the prefill, then two decode steps at least
        assert float(device_ms) > 0 and float(wall_ms) > 0 and float(host_ms) > 0
    assert float(rows["(overlap off)"][9]) == 0.0  # nothing is hidden without overlap


def test_roofline_measures_copy_bandwidth_and_peak_gemm(
    tiny_llama_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "roof.json"
    assert (
        roofline.main(
            [
                "--model-path",
                str(tiny_llama_path),
                "--device",
                "cpu",
                "--dtype",
                "float32",
                "--workload",
                "uniform",
                "--min-time",
                "0",
                "--copy-bytes",
                str(1 << 20),
                "--peak-gemm-size",
                "64",
                "--output",
                str(out),
            ]
        )
        == 0
    )
    data = read_json(out)
    rates = data["device_rates"]
    assert rates["copy_gbps"] > 0 and rates["peak_gemm_gflops"] > 0 and rates["peak_gemm_size"] == 64
    row = data["rows"][0]
    work = roofline.WorkCount(**row["work"])
    dims = roofline.ModelDims.from_path(tiny_llama_path)
    assert row["decode_memory_s"] == pytest.approx(roofline.decode_bytes(dims, work, 4) / (rates["copy_gbps"] * 1e9))
    assert "device rates (cpu)" in capsys.readouterr().out


def test_hicache_bandwidth_rows() -> None:
    import torch

    from bench.hicache_bandwidth import measure

    rows = measure(torch.device("cpu"), (2, 1, 4), tokens=32, page_size=4, dtype=torch.float32, repeat=1)
    assert [r["op"] for r in rows] == ["copy", "load", "backup"]
    assert all(r["mib"] == 32 * 2 * 2 * 4 * 4 / (1 << 20) and r["gb_s"] > 0 for r in rows)
    assert rows[0]["of_copy"] == 1.0


FAKE_VLLM = """
import json, os
__version__ = "fake"


class SamplingParams:
    def __init__(self, temperature=1.0, max_tokens=16, ignore_eos=False):
        self.max_tokens, self.temperature, self.ignore_eos = max_tokens, temperature, ignore_eos


class _Completion:
    def __init__(self, ids):
        self.token_ids = ids


class _Output:
    def __init__(self, ids):
        self.outputs = [_Completion(ids)]


class LLM:
    def __init__(self, model, dtype, max_model_len, seed, enable_prefix_caching):
        self.model = model

    def reset_prefix_cache(self):
        pass

    def generate(self, prompts, params, use_tqdm=True):
        params = params if isinstance(params, list) else [params] * len(prompts)
        with open(os.environ["FAKE_VLLM_LOG"], "a") as f:
            f.write(json.dumps([self.model, [p.prompt_token_ids for p in prompts],
                                [s.max_tokens for s in params], [s.temperature for s in params]]) + "\\n")
        return [_Output(list(range(s.max_tokens))) for s in params]
"""


def test_compare_with_vllm_runs_its_offline_engine_in_the_given_python(
    tiny_llama_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A stand-in vllm package in another interpreter gets the same prompts, greedy, with each
    request's max_new_tokens (after a 2-token warm pass); its timings become the baseline rows."""
    package = tmp_path / "fake" / "vllm"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(FAKE_VLLM)
    (package / "inputs.py").write_text(
        "class TokensPrompt:\n    def __init__(self, prompt_token_ids):\n"
        "        self.prompt_token_ids = prompt_token_ids\n"
    )
    log = tmp_path / "calls.jsonl"
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "fake"))
    monkeypatch.setenv("FAKE_VLLM_LOG", str(log))
    out = tmp_path / "cmp.json"
    flags = [
        "--model-path",
        str(tiny_llama_path),
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--workload",
        "uniform",
        "--num-requests",
        "3",
        "--max-new-tokens",
        "4",
        "--workload-arg",
        "prompt_len=5",
        "--repeat",
        "2",
        "--skip-ours",
        "--baseline",
        "vllm",
        "--output",
        str(out),
    ]
    with pytest.raises(SystemExit):
        compare.main(flags)  # --baseline vllm needs --vllm-python
    assert compare.main([*flags, "--vllm-python", sys.executable]) == 0
    assert "tinyserve vs vllm" in capsys.readouterr().out
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    wanted = argparse.Namespace(
        workload=["uniform"], workload_arg=["prompt_len=5"], num_requests=3, max_new_tokens=4, seed=0
    )
    workload = serving.build_workloads(wanted, str(tiny_llama_path))[0]
    prompts = [r.input_ids for r in workload.requests]
    assert len(calls) == 4  # per repeat: the warm pass, then the timed run
    for warm, timed in zip(calls[0::2], calls[1::2]):
        assert warm[0] == timed[0] == str(tiny_llama_path) and warm[1] == timed[1] == prompts
        assert warm[2] == [2, 2, 2] and timed[2] == [4, 4, 4] and set(timed[3]) == {0.0}
    data = read_json(out)
    assert data["settings"]["baseline"] == "vllm"
    rows = [r for r in data["summary"] if r["engine"] == "vllm"]
    assert len(rows) == 1 and rows[0]["repeats"] == 2 and rows[0]["output_tok_s"] > 0


def test_overload_rows_split_admitted_refused_and_other_errors() -> None:
    from bench import overload
    from bench.load_runner import RequestRecord

    records = [
        RequestRecord(0, 8, output_len=4, ttft=0.1, latency=0.5),
        RequestRecord(1, 8, output_len=4, ttft=0.3, latency=0.7),
        RequestRecord(2, 8, error="overloaded", latency=0.002),
        RequestRecord(3, 8, error="overloaded", latency=0.004),
        RequestRecord(4, 8, error="internal", latency=0.1),
    ]
    row = overload.load_row("2x", 10.0, records, 2.0)
    assert (row["sent"], row["admitted"], row["refused"], row["other_errors"]) == (5, 2, 2, "internal")
    assert row["ttft_p50_ms"] == pytest.approx(200.0) and row["refusal_p50_ms"] == pytest.approx(3.0)
    assert row["out_tok_s"] == pytest.approx(4.0)
