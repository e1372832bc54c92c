"""A bf16 server on a CPU with AMX (the decode step's layers in one C call, on by default) against
this process's model running its layers one by one: the same greedy tokens."""

from __future__ import annotations

from runtime.cpu import decode_layers
from runtime.model_runner import ModelRunner
from tests.support.checkpoints import random_prompt
from tests.support.cpu_features import needs_amx
from tests.support.harness import Harness
from tests.support.server_fixtures import CLIENT_TIMEOUT_S, base_args
from tests.support.server_process import launch_server


@needs_amx
def test_a_bf16_server_decodes_through_the_one_call_path_as_the_layers_do(tiny_checkpoints) -> None:
    """The real processes (launch.py, bf16, the path on by default) against this process's model
    running its layers: one request at a time (the same batch shapes on both sides), the same
    greedy tokens."""
    path = tiny_checkpoints.path("llama")
    runner = ModelRunner(path, device="cpu", dtype="bfloat16", max_total_tokens=8192, load_progress=False)
    prompts = [random_prompt(5 + 9 * i, runner.vocab_size, seed=500 + i) for i in range(3)]
    steps = 10
    expected = []
    with decode_layers.use_decode_layers(False):
        for prompt in prompts:
            h = Harness(runner)
            (req,) = h.generate([prompt], steps)
            expected.append(req.output_ids)
    with launch_server(base_args(path, "--dtype", "bfloat16"), client_timeout=CLIENT_TIMEOUT_S) as client:
        got = [client.generate(input_ids=p, sampling_params={"temperature": 0, "ignore_eos": True,
                                                             "max_new_tokens": steps})["output_ids"] for p in prompts]
    assert got == expected
