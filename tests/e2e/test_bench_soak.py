"""bench.soak at smoke size against a real server (launch.py): the soak's own accounting holds."""

from __future__ import annotations

from pathlib import Path

from bench.common import read_json


def test_soak_on_tiny_settings_leaks_nothing(tiny_llama_path: Path, tmp_path: Path) -> None:
    """bench.soak at smoke size: every request ends (completed, aborted or abandoned), none
    hangs, and the idle server has every KV slot back."""
    from bench import soak

    out = tmp_path / "soak.json"
    code = soak.main(
        [
            "--model-path",
            str(tiny_llama_path),
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--num-requests",
            "40",
            "--concurrency",
            "8",
            "--abort-frac",
            "0.3",
            "--disconnect-frac",
            "0.3",
            "--max-prompt",
            "24",
            "--max-new-tokens",
            "12",
            "--timeout",
            "60",
            "--output",
            str(out),
        ]
    )
    result = read_json(out)["result"]
    assert code == 0, result
    assert result["requests"] == 40 and result["planned"]["abort"] > 0 and result["planned"]["disconnect"] > 0
    assert result["completed"] + result["aborted"] + result["disconnected"] == 40, result
    assert result["completed"] == result["planned"]["complete"]
    assert (result["hung"], result["errors"], result["leaked_slots"]) == (0, 0, 0), result
    assert result["invariant_ok"] and result["max_total_tokens"] == soak.SMALL_POOL_TOKENS
