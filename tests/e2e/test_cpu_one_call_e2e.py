"""A CPU server whose decode steps run their layers in one C call (on by default) against this
process's model running its layers one by one: the same greedy tokens. bf16 on a CPU with AMX;
fp32 wherever the panel kernel takes one row (AVX2: a lone request's step is a matrix-vector
product on every linear, the case of one person chatting with the server)."""

from __future__ import annotations

import pytest

from runtime.engine.cpu import attention_kernels_f32, decode_layers
from runtime.engine.cpu.prepacked import fp32_panel_rows
from runtime.engine.model_runner import ModelRunner
from tests.support.checkpoints import random_prompt
from tests.support.cpu_features import needs_amx
from tests.support.harness import Harness
from tests.support.server_fixtures import CLIENT_TIMEOUT_S, base_args
from tests.support.server_process import launch_server

needs_fp32_one_row = pytest.mark.skipif(
    not (1 in fp32_panel_rows() and attention_kernels_f32.applies()),
    reason="needs the fp32 panel kernel and decode attention kernels (an AVX2 + FMA or AVX-512 build)",
)


@pytest.mark.parametrize(
    "dtype", [pytest.param("bfloat16", marks=needs_amx), pytest.param("float32", marks=needs_fp32_one_row)]
)
def test_a_server_decodes_through_the_one_call_path_as_the_layers_do(dtype: str, tiny_checkpoints) -> None:
    """The real processes (launch.py, the path on by default) against this process's model
    running its layers: one request at a time (the same batch shapes on both sides), the same
    greedy tokens."""
    path = tiny_checkpoints.path("llama")
    runner = ModelRunner(path, device="cpu", dtype=dtype, max_total_tokens=8192, load_progress=False)
    prompts = [random_prompt(5 + 9 * i, runner.vocab_size, seed=500 + i) for i in range(3)]
    steps = 10
    expected = []
    with decode_layers.use_decode_layers(False):
        for prompt in prompts:
            h = Harness(runner)
            (req,) = h.generate([prompt], steps)
            expected.append(req.output_ids)
    with launch_server(base_args(path, "--dtype", dtype), client_timeout=CLIENT_TIMEOUT_S) as client:
        got = [
            client.generate(
                input_ids=p, sampling_params={"temperature": 0, "ignore_eos": True, "max_new_tokens": steps}
            )["output_ids"]
            for p in prompts
        ]
    assert got == expected
