"""CUDA graph settings: the SGLang flags, their validation, and the captured batch-size list."""

from __future__ import annotations

import pytest

from runtime.config.args import ServerArgs
from runtime.engine.cuda.graph_runner import capture_batch_sizes
from tests.support.server_process import server_argv


def test_flags_parse_with_sglang_names_and_round_trip() -> None:
    d = ServerArgs()
    assert (d.disable_cuda_graph, d.cuda_graph_max_bs, d.cuda_graph_bs) == (False, None, None)
    a = ServerArgs.from_cli(["--disable-cuda-graph", "--cuda-graph-max-bs", "64", "--cuda-graph-bs", "1", "4", "12"])
    assert (a.disable_cuda_graph, a.cuda_graph_max_bs, a.cuda_graph_bs) == (True, 64, [1, 4, 12])
    assert ServerArgs.from_cli(server_argv(a)) == a  # launch_server turns ServerArgs back into flags
    help_text = ServerArgs.make_parser().format_help()
    assert "--cuda-graph-bs BS [BS ...]" in help_text


@pytest.mark.parametrize("argv", [["--cuda-graph-max-bs", "0"], ["--cuda-graph-bs", "2", "0"]])
def test_bad_graph_flags_exit_with_the_flag_named(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        ServerArgs.from_cli(argv)
    assert exc.value.code == 2
    assert argv[0] in capsys.readouterr().err


def test_default_batch_sizes_step_by_8_and_end_at_the_limit() -> None:
    assert capture_batch_sizes(256) == [1, 2, 4, 8] + list(range(16, 257, 8))
    assert capture_batch_sizes(20) == [1, 2, 4, 8, 16, 20]  # every batch <= 20 has a graph to pad into
    assert capture_batch_sizes(3) == [1, 2, 3]
    assert capture_batch_sizes(1) == [1]
    with pytest.raises(ValueError):
        capture_batch_sizes(0)


def test_explicit_batch_sizes_are_sorted_deduplicated_and_capped() -> None:
    assert capture_batch_sizes(256, [8, 1, 8, 300, 24]) == [1, 8, 24]
    assert capture_batch_sizes(4, [8, 16]) == []
    with pytest.raises(ValueError):
        capture_batch_sizes(8, [0, 2])
