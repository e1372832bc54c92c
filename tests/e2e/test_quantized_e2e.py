"""The default model served with its weights kept quantized (``--quantization``, launch.py, CPU):
the quality guard's questions (tests/e2e/test_real_model_e2e.py) answered right, through both
clients, and ``server_info`` reporting the weights' resident bytes as the formats say.

- ``gguf``: the GGUF file's Q4_1 linears and its Q8_0 token embedding (tied to the LM head) stay
  in their blocks: 0.75 bytes a value for Q4_1 as repacked (a fp32 scale and min per 32 values),
  1.125 for Q8_0. Multiplied weight-only (the default ``--quantized-activations none``: the auto rule's
  choice on CPUs without native bf16), their greedy answers are the dense fp32 model's token for token;
  with int8 activations the README's own question was answered wrong.
- ``int8``: the same model as a safetensors checkpoint (the file's values, dense fp32, written by
  the fixture), every linear made per-channel int8 at load (1 byte a value and a fp32 scale a row),
  the embedding dense; in process, through the model runner the scheduler builds.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Iterator

import pytest
import torch

from runtime.checkpoints.model_source import checkpoint_folder
from runtime.engine.loading.gguf_tensors import iterate_gguf_weights
from runtime.engine.model_config import ModelConfig
from runtime.engine.model_runner import ModelRunner
from runtime.engine.models.registry import get_model_class
from runtime.text.tokenizer import load_tokenizer
from tests.e2e.test_real_model_e2e import (
    ANSWER_TOKENS,
    BF16_QUESTIONS,
    CHATS,
    QUESTIONS,
    ask_both_clients,
    assert_idle_and_nothing_leaked,
    assert_right,
)
from tests.support.harness import Harness
from tests.support.real_model import chat_ids, real_model_args, serve_real_model, smollm2_file
from tests.support.server_process import ServedClient

pytest_plugins = ["tests.support.real_model"]

# SmolLM2-135M: 30 layers of hidden 576, 9 query and 3 KV heads of 64, MLP 1536; vocab 49152 (tied)
LINEAR_VALUES = 30 * (576 * (576 + 2 * 192) + 576 * 576 + 2 * 1536 * 576 + 576 * 1536)
EMBEDDING_VALUES = 49152 * 576


@pytest.fixture(scope="module")
def gguf_server(real_model_cache: Path) -> Iterator[ServedClient]:
    yield from serve_real_model(
        real_model_cache, real_model_args("float32", "--quantization", "gguf", max_total_tokens=2048)
    )


def test_kept_blocks_answer_as_the_dense_model_does(gguf_server: ServedClient, smollm2_server: ServedClient) -> None:
    """The README's question and eight chats, greedy: the Q4_1 blocks multiplied weight-only give the
    dense fp32 model's tokens (the session's server: the same file dequantized at load)."""
    greedy = {"max_new_tokens": 24, "temperature": 0}
    chats = [[{"role": "user", "content": "What is the capital of France?"}], *CHATS[:8]]
    kept = gguf_server.generate(messages=chats, sampling_params=greedy)
    dense = smollm2_server.generate(messages=chats, sampling_params=greedy)
    assert [r["output_ids"] for r in kept] == [r["output_ids"] for r in dense]
    assert "Paris" in kept[0]["text"]
    assert gguf_server.server_info()["weights"]["activations"].startswith("weight-only")
    assert_idle_and_nothing_leaked(gguf_server)


def test_gguf_blocks_answer_right_and_take_the_formats_bytes(gguf_server: ServedClient) -> None:
    ask_both_clients(gguf_server, list(QUESTIONS), "gguf Q4_1")
    info = gguf_server.server_info()
    assert info["server_args"]["quantization"] == "gguf"
    weights = info["weights"]
    assert weights["quantization"] == "gguf"
    assert weights["quantized_bytes"] == {"Q4_1": LINEAR_VALUES * 3 // 4, "Q8_0": EMBEDDING_VALUES * 9 // 8}
    dense = (2 * 30 + 1) * 576 * 4 + 2 * info["context_len"] * 32 * 4  # fp32 norms, rotary cos/sin tables
    assert weights["bytes"] == sum(weights["quantized_bytes"].values()) + dense
    assert_idle_and_nothing_leaked(gguf_server)


@pytest.fixture(scope="module")
def smollm2_safetensors(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model as a safetensors checkpoint: the GGUF file's values (dequantized, fp32, in
    the HF names and row order), its config and tokenizer files."""
    prepared = checkpoint_folder(str(smollm2_file()))
    out = tmp_path_factory.mktemp("smollm2-safetensors")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (prepared / name).is_file():
            shutil.copy(prepared / name, out / name)
    from safetensors.torch import save_file

    config = ModelConfig.from_pretrained(out)
    with torch.device("meta"):
        targets = get_model_class(config)(config).checkpoint_targets()
    save_file(
        {name: weight.load() for name, weight in iterate_gguf_weights(prepared, targets, config, progress=False)},
        str(out / "model.safetensors"),
    )
    return out


def test_int8_linears_of_a_safetensors_checkpoint_answer_right(smollm2_safetensors: Path) -> None:
    """In process (a second server would cost the suite half a minute): the model runner the
    scheduler builds, greedy, on the chat template's prompts."""
    runner = ModelRunner(
        smollm2_safetensors,
        device="cpu",
        dtype="float32",
        max_total_tokens=2048,
        load_progress=False,
        quantization="int8",
    )
    assert runner.weight_info()["quantized_bytes"] == {"int8": LINEAR_VALUES + 30 * (960 + 576 + 3072 + 576) * 4}
    assert isinstance(runner.model.model.embed_tokens.weight, torch.Tensor)  # (SGLang's w8a8_int8 keeps it dense)
    tokenizer = load_tokenizer(str(smollm2_safetensors))
    questions = BF16_QUESTIONS  # one question of each kind (the emulated-bf16 guard's): a CPU forward is not free
    prompts = [chat_ids(tokenizer, [{"role": "user", "content": q}]) for q in questions]
    for question, req in zip(questions, Harness(runner).generate(prompts, ANSWER_TOKENS)):
        assert_right(question, tokenizer.decode(req.output_ids, skip_special_tokens=True), "int8", "the model runner")
