"""vLLM's offline engine on the same checkpoint and workloads, as a baseline for bench.compare.

vLLM lives in a Python of its own (its own torch build), so this module runs in two places:
in tinyserve's environment, ``run_vllm_baseline`` writes the workloads' prompts (token ids)
and settings to a JSON file and starts ``--vllm-python`` on this same file; in vLLM's
environment, ``child_main`` (standard library and vllm only) loads the checkpoint with
``vllm.LLM``, runs every workload ``repeat`` times through ``LLM.generate`` (all requests of a
workload at once, greedy, ``ignore_eos``, each request's own ``max_new_tokens``; the prefix
cache reset before each run and warmed by a 2-token pass of the same prompts) and prints one
``RESULT {json}`` line per run. Dependent (multi-turn) workloads are not supported: vLLM's
offline API has no arrival order.

vLLM-CPU's best settings are environment variables (thread binding, KV cache space, a
preloaded allocator): they pass through. Unless already set, ``VLLM_CPU_OMP_THREADS_BIND``
is the pinned cpus and ``VLLM_CPU_KVCACHE_SPACE`` is 4 (GiB).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

ENGINE = "vllm"
RESULT_PREFIX = "RESULT "


def vllm_env(cpus: Sequence[int] | None) -> dict[str, str]:
    """The child's environment: ours, plus vLLM-CPU defaults for what the caller did not set."""
    env = dict(os.environ)
    if cpus and "VLLM_CPU_OMP_THREADS_BIND" not in env:
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(str(c) for c in cpus)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    env.setdefault("HF_HUB_OFFLINE", "1")
    return env


def run_vllm_baseline(
    python: str,
    model_path: str,
    workloads: Sequence[Any],
    dtype: str,
    repeat: int,
    cpus: Sequence[int] | None = None,
    timeout: float = 3600.0,
) -> list[dict[str, Any]]:
    """Run record per (repeat, workload) in serving.py's layout, from the vLLM child's RESULT lines."""
    from bench.hf_baseline import summarize_batches

    for wl in workloads:
        if any(r.after is not None for r in wl.requests):
            raise SystemExit(f"the vLLM baseline runs independent requests only; {wl.name!r} has turns")
    spec = {
        "model_path": model_path,
        "dtype": dtype,
        "repeat": repeat,
        "max_model_len": max(len(r.input_ids) + r.max_new_tokens for wl in workloads for r in wl.requests) + 8,
        "workloads": [
            {
                "name": wl.name,
                "prompts": [r.input_ids for r in wl.requests],
                "max_new_tokens": [r.max_new_tokens for r in wl.requests],
            }
            for wl in workloads
        ],
    }
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    try:
        proc = subprocess.run(
            [python, os.path.abspath(__file__), "--child", f.name],
            env=vllm_env(cpus),
            stdout=subprocess.PIPE,
            text=True,
            timeout=timeout,
        )
    finally:
        os.unlink(f.name)
    results = [
        json.loads(line[len(RESULT_PREFIX) :]) for line in proc.stdout.splitlines() if line.startswith(RESULT_PREFIX)
    ]
    if proc.returncode != 0 or len(results) != repeat * len(workloads):
        raise RuntimeError(
            f"the vLLM baseline ({python}) exited {proc.returncode} with {len(results)} of "
            f"{repeat * len(workloads)} results (its stderr is above)"
        )
    by_name = {wl.name: wl for wl in workloads}
    runs = []
    for res in results:
        wl = by_name[res["workload"]]
        metrics = summarize_batches(
            [res["time_s"]], [wl.num_requests], wl.prompt_tokens, res["output_tokens"], res["time_s"]
        )
        metrics.pop("num_batches")
        metrics["cache_hit_rate"] = math.nan  # vLLM's offline API does not report it
        runs.append(
            {
                "kind": "vllm_baseline",
                "engine": ENGINE,
                "workload": wl.spec(),
                "repeat": res["repeat"],
                "model_path": model_path,
                "settings": {"dtype": dtype, "python": python, "vllm_version": res.get("vllm_version")},
                "metrics": metrics,
            }
        )
    return runs


# ---------------------------------------------------------------------- in vLLM's python


def child_main(spec_path: str) -> None:
    """Standard library and vllm only: this runs in the vLLM install's interpreter."""
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = json.loads(Path(spec_path).read_text())
    llm = LLM(
        model=spec["model_path"],
        dtype=spec["dtype"],
        max_model_len=spec["max_model_len"],
        seed=0,
        enable_prefix_caching=True,
    )
    for rep in range(spec["repeat"]):
        for wl in spec["workloads"]:
            prompts = [TokensPrompt(prompt_token_ids=p) for p in wl["prompts"]]
            llm.reset_prefix_cache()
            llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), use_tqdm=False)
            llm.reset_prefix_cache()
            params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in wl["max_new_tokens"]]
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - t0
            result = {
                "workload": wl["name"],
                "repeat": rep,
                "time_s": elapsed,
                "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
                "vllm_version": getattr(vllm, "__version__", None),
            }
            print(RESULT_PREFIX + json.dumps(result), flush=True)


if __name__ == "__main__" and sys.argv[1:2] == ["--child"]:
    child_main(sys.argv[2])
