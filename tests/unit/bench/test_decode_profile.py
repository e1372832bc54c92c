"""bench.decode_profile's pure parts, and its in-process profile of the tiny model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bench import decode_profile
from bench.common import read_json


def test_a_step_splits_into_its_components() -> None:
    before = {"c_layers": 1.0, "lm_head": 0.5, "sample": 0.1, "forward": 2.0}
    after = {"c_layers": 1.030, "lm_head": 0.507, "sample": 0.1002, "forward": 2.040}
    parts = decode_profile.split_step(before, after, step_s=0.042)
    assert parts["layers"] == pytest.approx(30.0) and parts["lm_head"] == pytest.approx(7.0)
    assert parts["python"] == pytest.approx(40.0 - 30.0 - 7.0 - 0.2) and parts["scheduler"] == pytest.approx(2.0)
    server = {"stream": {"decode_ms_per_token": 50.0}}
    rows = decode_profile.profile_rows(parts, "one C call", server)
    assert rows[0]["component"] == "decoder layers (one C call)" and rows[0]["share"] == "60.0%"
    assert rows[-2]["ms"] == pytest.approx(8.0) and rows[-1]["ms"] == 50.0  # served less in process; total
    assert [r["ms"] for r in decode_profile.profile_rows(parts, "x", None)][-1] == pytest.approx(42.0)


def test_process_cpu_time_is_read_from_proc() -> None:
    assert decode_profile.process_cpu_seconds(os.getpid()) > 0


def test_the_tiny_model_profiles_in_process(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "p.json"
    assert (
        decode_profile.main(
            [
                "--model",
                "tiny",
                "--prompt-len",
                "8",
                "--new-tokens",
                "6",
                "--skip-server",
                "--threads",
                "1",
                "--output",
                str(out),
            ]
        )
        == 0
    )
    data = read_json(out)
    assert data["server"] is None and data["in_process_ms"]["layers"] > 0 and data["in_process_ms"]["lm_head"] > 0
    assert "decoder layers" in capsys.readouterr().out
