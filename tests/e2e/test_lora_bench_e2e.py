"""bench/lora.py end to end on the tiny Llama: both servers through launch.py, the three rows, and
``--check``'s output checks (the LoRA server's base equals the plain server's, every adapter changes
the output), at a few requests and tokens so that it costs the suite seconds."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench import lora
from bench.common import read_json
from tests.support.server_fixtures import base_args

pytestmark = pytest.mark.e2e


def test_the_lora_bench_measures_three_rows_and_its_check_passes(
    tiny_llama_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # main() pins; the environment and torch's threads come back
    threads = torch.get_num_threads()
    flags = ["--repeat", "1", "--num-requests", "4", "--adapters", "2", "--rank", "4", "--prompt-len", "8"]
    flags += ["--max-new-tokens", "3", "--warmup", "2", "--check", "--threads", "1"]
    flags += ["--adapter-dir", str(tmp_path / "adapters"), "--output", str(tmp_path / "lora.json")]
    try:
        code = lora.main([*flags, *base_args(tiny_llama_path)])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert code == 0, out
    assert "check passed" in out and "(2) 2 adapters, LoRA server" in out
    result = read_json(tmp_path / "lora.json")
    assert result["problems"] == []
    for key in (lora.BASE_ON_LORA, lora.ADAPTERS_ON_LORA, lora.BASE_ON_PLAIN):
        (run,) = result["runs"][key]
        assert run["metrics"]["completed"] == 4 and run["metrics"]["output_tokens"] == 12
        assert run["metrics"]["cache_hit_rate"] == 0.0
    lora_args = result["runs"][lora.ADAPTERS_ON_LORA][0]["server_args"]
    assert lora_args["max_loras_per_batch"] == 2 and len(lora_args["lora_paths"]) == 2
    assert not result["runs"][lora.BASE_ON_PLAIN][0]["server_args"]["lora_paths"]
