"""Structured outputs under load: ``python -m bench.serving --workload json-schema``.

What a constraint costs is only readable next to the same decoding without it, so one
invocation makes three runs of the json-schema workload (bench/workloads.py: chat extraction
requests, greedy, each with a bounded JSON schema) and prints them side by side:

1. constrained, on a server with jump-forward (the default);
2. unconstrained on the same server: the same chat prompts without a schema, with
   ``ignore_eos`` and each request's ``max_new_tokens`` set to the tokens its constrained
   output had, so the same number of tokens is decoded (the baseline);
3. constrained again on a second server started with ``--disable-jump-forward`` (skipped
   against ``--address``: this script cannot restart someone else's server).

Per run: output tok/s, requests/s, latency p50/p90, the scheduler's counters over the run
(server_info deltas: decode batches = decode steps, prefill batches, tokens appended by
jump-forward = decode steps saved) and the share of outputs that parse and validate against
their schema (jsonschema). Ratio rows divide by the unconstrained run. The warm-up compiles
every schema, so the timed runs exclude compiles; a second table times them in this process
on the served tokenizer with ``runtime.text.grammar.GrammarBackend``, the scheduler's own
(the vocabulary's one-off TokenizerInfo, each schema's first compile, a cached one).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Sequence

from bench.common import Pinning, default_output_path, machine_info, print_table, write_json
from bench.load_runner import RequestRecord, run_workload
from bench.serving import (
    ENGINE,
    ServerHandle,
    build_workloads,
    flush_cache,
    server_for,
    summarize_run,
    warm_up,
)
from bench.workloads import JSON_SCHEMAS, Workload

JF_FLAG = "--disable-jump-forward"
# server_info counters read before and after a run -> the metric their difference is stored as
# (retractions only in the JSON: a pool too small for the load would show there).
COUNTERS = {
    "num_decode_batches": "decode_steps",
    "num_prefill_batches": "prefill_batches",
    "jump_forward_tokens": "jump_forward_tokens",
    "num_retracted_reqs": "retracted_reqs",
}

TABLE_COLUMNS = [
    ("run", "run"),
    ("completed", "done"),
    ("output_tokens", "out tokens"),
    ("duration_s", "time s"),
    ("output_tok_s", "out tok/s"),
    ("request_throughput", "req/s"),
    ("latency_p50_s", "lat p50 s"),
    ("latency_p90_s", "lat p90 s"),
    ("decode_steps", "decode steps"),
    ("prefill_batches", "prefill batches"),
    ("jump_forward_tokens", "jf tokens"),
    ("valid_pct", "valid %"),
]
RATIO_KEYS = ("output_tok_s", "request_throughput", "latency_p50_s", "latency_p90_s", "decode_steps")
COMPILE_COLUMNS = [("schema", "grammar compile (this process)"), ("first_ms", "first ms"), ("cached_us", "cached us")]


def valid_fraction(workload: Workload, records: Sequence[RequestRecord]) -> float:
    """Share of the requests whose output parses as JSON and validates against its schema
    (a failed request counts as invalid)."""
    import jsonschema

    schemas = {r.index: r.json_schema for r in workload.requests}
    good = 0
    for rec in records:
        try:
            jsonschema.validate(json.loads(rec.text or ""), json.loads(schemas[rec.index] or "{}"))
        except (ValueError, jsonschema.ValidationError):  # json's decode error is a ValueError
            continue
        good += 1
    return good / len(records) if records else math.nan


def unconstrained_twin(workload: Workload, records: Sequence[RequestRecord]) -> Workload:
    """The same chat prompts without a schema, each decoding as many tokens (``ignore_eos``) as
    its constrained output had; requests that failed or produced nothing are left out."""
    lengths = {r.index: r.output_len for r in records if r.error is None and r.output_len > 0}
    reqs = [
        replace(r, json_schema=None, max_new_tokens=lengths[r.index]) for r in workload.requests if r.index in lengths
    ]
    return Workload(workload.name, workload.params, reqs)


def counters(handle: ServerHandle) -> dict[str, int]:
    from runtime.client import Client

    with Client(handle.address, api_key=handle.api_key, timeout=60) as c:
        info = c.server_info()
    return {k: int(info.get(k, 0)) for k in COUNTERS}


def timed_run(
    handle: ServerHandle, workload: Workload, label: str, args: argparse.Namespace
) -> tuple[dict[str, Any], list[RequestRecord]]:
    """Warm up (compiling the schemas), flush the prefix cache, run; the run record and its requests."""
    warm_up(handle.address, handle.api_key, workload, args.warmup)
    if not flush_cache(handle.address, handle.api_key):
        print("warning: could not flush the prefix cache", file=sys.stderr)
    before = counters(handle)
    records, duration = run_workload(
        handle.address,
        workload,
        api_key=handle.api_key,
        request_rate=args.request_rate,
        max_concurrency=args.max_concurrency,
        stream=not args.no_stream,
        seed=args.seed,
        timeout=args.timeout,
    )
    after = counters(handle)
    metrics = summarize_run(records, duration)
    metrics.update({name: after[k] - before[k] for k, name in COUNTERS.items()})
    constrained = any(r.json_schema is not None for r in workload.requests)
    caps = {r.index: r.max_new_tokens for r in workload.requests}
    metrics["valid_pct"] = 100 * valid_fraction(workload, records) if constrained else math.nan
    run = {
        "kind": "serving-json-schema",
        "engine": ENGINE,
        "run": label,
        "workload": workload.spec(),
        "constrained": constrained,
        "model_path": handle.model_path,
        "server_args": handle.server_args,
        "settings": {
            "request_rate": args.request_rate,
            "max_concurrency": args.max_concurrency,
            "stream": not args.no_stream,
            "seed": args.seed,
            "warmup": args.warmup,
        },
        "metrics": metrics,
        "requests": [
            {k: v for k, v in asdict(r).items() if k != "itl"} | {"max_new_tokens": caps[r.index]} for r in records
        ],
    }
    return run, records


def ratio_row(label: str, num: dict[str, Any], den: dict[str, Any]) -> dict[str, Any]:
    row: dict[str, Any] = {"run": label}
    for key in RATIO_KEYS:
        a, b = num.get(key), den.get(key)
        row[key] = a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else math.nan
    return row


def compile_times(model_path: str) -> list[dict[str, Any]]:
    """Grammar compile times of JSON_SCHEMAS on the model's tokenizer, as the scheduler compiles them."""
    from runtime.engine.model_config import ModelConfig
    from runtime.text.grammar import GrammarBackend
    from runtime.text.tokenizer import load_tokenizer

    cfg = ModelConfig.from_pretrained(model_path)
    tokenizer = load_tokenizer(model_path)
    start = time.perf_counter()
    backend = GrammarBackend(tokenizer, cfg.vocab_size, cfg.eos_token_ids)
    rows = [
        {
            "schema": "vocabulary (once per server)",
            "first_ms": (time.perf_counter() - start) * 1e3,
            "cached_us": math.nan,
        }
    ]
    for name, schema in JSON_SCHEMAS.items():
        text = json.dumps(schema)  # the text the workload sends
        first = backend.compile("json_schema", text)
        start = time.perf_counter()
        again = backend.compile("json_schema", text)
        cached = time.perf_counter() - start
        assert not first.cache_hit and again.cache_hit
        rows.append({"schema": name, "first_ms": first.seconds * 1e3, "cached_us": cached * 1e6})
    return rows


def same_outputs_pct(a: Sequence[RequestRecord], b: Sequence[RequestRecord]) -> float:
    """Share of requests (by index) whose output text is the same in both runs."""
    texts = {r.index: r.text for r in b if r.error is None}
    same = sum(1 for r in a if r.error is None and texts.get(r.index) == r.text)
    return 100 * same / len(a) if a else math.nan


def main_json_schema(
    args: argparse.Namespace, server_flags: list[str], pinning: Pinning, model_path: str | None
) -> int:
    if args.workload != ["json-schema"]:
        raise SystemExit("json-schema is a comparison of its own: give it alone (--workload json-schema)")
    if args.backend != ["zmq"]:
        raise SystemExit("json-schema sends chat messages through the Python client (--backend zmq)")
    if JF_FLAG in server_flags:
        raise SystemExit(f"json-schema runs with and without jump-forward itself; drop {JF_FLAG}")
    workload = build_workloads(args, model_path, chat_ok=True)[0]
    compile_rows = compile_times(model_path) if model_path else []  # before any server: a quiet machine
    runs: dict[str, dict[str, Any]] = {}
    with server_for(args.address, model_path, server_flags, args.api_key, pinning) as handle:
        if not compile_rows and handle.model_path and Path(handle.model_path, "config.json").is_file():
            compile_rows = compile_times(handle.model_path)  # a running server whose model is on this machine
        label = "no jump-forward" if handle.server_args.get("disable_jump_forward") else "jump-forward"
        runs[label], jf_records = timed_run(handle, workload, label, args)
        runs["unconstrained"], _ = timed_run(handle, unconstrained_twin(workload, jf_records), "unconstrained", args)
    if args.address is None:
        with server_for(None, model_path, [*server_flags, JF_FLAG], args.api_key, pinning) as handle:
            runs["no jump-forward"], off_records = timed_run(handle, workload, "no jump-forward", args)
        runs["no jump-forward"]["metrics"]["same_output_as_jump_forward_pct"] = same_outputs_pct(
            off_records, jf_records
        )
    else:
        print(
            f"note: against --address only the server's own setting runs; start one with {JF_FLAG} for the other",
            file=sys.stderr,
        )
    rows = [{"run": f"constrained, {k}" if k != "unconstrained" else k, **r["metrics"]} for k, r in runs.items()]
    base = runs["unconstrained"]["metrics"]
    ratios = [ratio_row(f"{k} / unconstrained", r["metrics"], base) for k, r in runs.items() if k != "unconstrained"]
    if len(ratios) == 2:
        ratios.append(
            ratio_row(
                "jump-forward / no jump-forward", runs["jump-forward"]["metrics"], runs["no jump-forward"]["metrics"]
            )
        )
    print_table(
        rows + ratios,
        TABLE_COLUMNS,
        title=f"json-schema serving benchmark ({workload.num_requests} requests, "
        f"max concurrency {args.max_concurrency or 'all'})",
    )
    if "no jump-forward" in runs and "jump-forward" in runs:
        same = runs["no jump-forward"]["metrics"]["same_output_as_jump_forward_pct"]
        print(f"outputs identical with and without jump-forward: {same:.1f} %")
    if compile_rows:
        print_table(compile_rows, COMPILE_COLUMNS)
    machine = machine_info(pinning)
    out = write_json(
        args.output or default_output_path("serving", "json-schema"),
        {
            "kind": "serving-json-schema",
            "runs": list(runs.values()),
            "ratios": ratios,
            "compile": compile_rows,
            "machine": machine,
        },
    )
    print(f"\nwrote {out}")
    for run in runs.values():
        if run["metrics"]["failed"]:
            print(
                f"warning: {run['metrics']['failed']} requests failed in {run['run']}: {run['metrics']['errors']}",
                file=sys.stderr,
            )
    return 1 if any(r["metrics"]["completed"] == 0 for r in runs.values()) else 0
