"""SGLang's frontend language (``sglang.lang``, from the pinned ``sglang`` wheel) drives the session's
real-model server unchanged: roles, gen with stop/max_tokens/temperature, ``dtype=int`` and
``regex``, ``select`` scored by prompt logprobs, ``fork``, ``run_batch`` and streaming, through
SGLang's own ``RuntimeEndpoint`` (tests/support/sglang_programs.py, run as a user's script in its own
process). The answers must be right (the capital of Japan is Tokyo; the sky is blue), and a greedy
gen must equal what this server's own client generates for the same text."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.register_assert_rewrite("tests.support.real_model")

from tests.support.real_model import API_KEY, ServedClient  # noqa: E402
from tests.support.server_fixtures import assert_idle_and_nothing_leaked  # noqa: E402

pytest_plugins = ["tests.support.real_model"]

ROOT = Path(__file__).resolve().parents[2]
PROGRAMS_TIMEOUT_S = 600  # a bound for a hung server, not a speed requirement
END = "<|im_end|>\n"


def test_frontend_programs_run_with_right_answers(smollm2_server: ServedClient) -> None:
    url = smollm2_server.server.http_address
    done = subprocess.run(
        [sys.executable, "-m", "tests.support.sglang_programs", str(url), API_KEY],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=PROGRAMS_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["model_path"]
    # roles in ChatML, a greedy gen stopped at the newline, equal to this server's own greedy answer
    answer, text = out["capital"]["answer"], out["capital"]["text"]
    assert "Paris" in answer and text.endswith(answer + END) and "<|im_start|>system\n" in text
    prompt = text[: -len(answer + END)]
    own = smollm2_server.generate(prompt, {"max_new_tokens": 16, "temperature": 0, "stop": "\n"})
    assert own["text"] == answer
    assert [c in a for c, a in zip(("Paris", "Tokyo", "London"), out["batch"])] == [True] * 3, out["batch"]
    pieces = out["stream"]["pieces"]
    assert len(pieces) > 1 and "".join(pieces) == out["stream"]["answer"] and "Tokyo" in out["stream"]["answer"]
    scores = out["select"]["meta"]
    assert out["select"]["colour"] == " blue" and max(scores) == scores[0]
    assert out["constrained"]["next"].strip() == "5" and out["constrained"]["wet"] in ("yes", "no")
    last = out["fork"]["messages"][-1]
    assert last["role"] == "assistant" and all(tip.strip() for tip in last["content"][len("Tips: ") :].split(" | "))
    assert {"model_path", "max_total_num_tokens"} <= set(out["server_info_keys"])
    assert_idle_and_nothing_leaked(smollm2_server)
