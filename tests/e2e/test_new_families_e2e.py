"""The families added after Llama served through launch.py, as processes: Gemma 2 (soft-caps,
alternating windows, sandwich norms) and Phi-3 with LongRoPE (fused weights, partial rotary) over
``--tp-size 2 --dp-size 2`` (four scheduler ranks, TP over gloo between processes, a DP
controller), greedy equal to transformers; their text prompts tokenized by the server as
transformers' tokenizer does, and the memory invariant after. The math per rank is the unit suites'
(tests/unit/runtime/engine/models/test_gemma.py, test_phi3.py); here the processes, the collectives and the
front door carry it.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest

from tests.support.checkpoints import TinyCheckpoints, hf_greedy
from tests.support.server_process import launch_server

pytest_plugins = ["tests.support.server_fixtures"]

PROMPTS = ["Hello world", "The quick brown fox jumps over the lazy dog again and again", "def add(a, b):"]
NEW_TOKENS = 10


@pytest.mark.parametrize("name", ["gemma2", "phi3_longrope"])
def test_tp2_dp2_processes_serve_transformers_greedy_output(
    name: str, tiny_checkpoints: TinyCheckpoints, hf_reference: Callable[[str], Any]
) -> None:
    model, tok = hf_reference(name)
    args = ["--model-path", str(tiny_checkpoints.path(name)), "--dtype", "float32", "--device", "cpu"]
    args += ["--max-total-tokens", "2048", "--tp-size", "2", "--dp-size", "2", "--chunked-prefill-size", "8"]
    with launch_server(args, client_timeout=120) as client:
        results = client.generate(PROMPTS, {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True})
        info = client.server_info()
    assert client.server.process.returncode == 0, client.server.log_tail()
    for prompt, result in zip(PROMPTS, results, strict=True):
        ids = tok.encode(prompt)
        assert result["meta"]["prompt_tokens"] == len(ids)
        assert result["output_ids"] == hf_greedy(model, ids, NEW_TOKENS)[0], prompt
    assert info["memory_invariant"]["ok"] and min(info["dispatch_counts"]) >= 1
