"""Mixture-of-experts GGUF files, as llama.cpp's converters write them: ``qwen3moe``, ``qwen2moe`` (a
gated shared expert), ``olmoe`` (q/k norms over the whole projection) and Mixtral as a ``llama`` file
with expert tensors, its experts merged into ``ffn_{gate,up,down}_exps`` or, as the older converter
wrote Mixtral, one tensor per expert.

The reference is transformers on the source checkpoint: its GGUF loader reads neither OLMoE nor a
llama file with experts, nor a Qwen mixture's dense layers (the tiny Qwen checkpoints have one), and
an F32 file holds the checkpoint's weights exactly. With ``--quantization gguf`` each expert keeps
its own blocks (cut from the merged tensor without dequantizing the rest), whose values are the
dense load's; the model is then compared with the dense load of the same file along the dense
greedy continuation (teacher-forced): the tiny random models' top tokens are often within a few
hundredths of each other, where the kernels' int8 rounding of activations may swap them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
import torch

from runtime.checkpoints.families import BY_NAME, family_of_gguf
from runtime.checkpoints.gguf.config import hf_config
from runtime.checkpoints.gguf.reader import GGUFError, read_gguf
from runtime.engine.layers.moe import SparseMoeMLP
from runtime.engine.model_config import ModelConfig
from runtime.engine.model_runner import ModelRunner
from runtime.engine.quant.weight import QuantizedWeight
from tests.support.checkpoints import TinyCheckpoints, hf_greedy, load_hf_model, random_prompt
from tests.support.gguf_files import gguf_test_folder, reference_tensor, write_checkpoint_gguf
from tests.support.gguf_models import gguf_runner
from tests.support.harness import Harness

NEW_TOKENS = 8
PROMPT_LENS = (5, 17)
LOGPROB_ATOL = 2e-3
# Kept quantized, along the dense continuation: the log-probability of each dense greedy token moved
# by at most 0.07 (Q8_0) / 0.22 (Q4_0) over 120 positions of these models; a wrong expert moves it
# by far more. Where the dense top two are further apart than twice this, the greedy token is kept.
KEPT_LOGPROB_ATOL = 0.3
KEPT_TOKENS = 6
# (checkpoint, expert form): Mixtral also as the older converter's one tensor per expert
FILES = [("qwen3_moe", "merged"), ("olmoe", "merged"), ("qwen2_moe", "merged"), ("mixtral", "merged")]
FILES += [("mixtral", "per_expert")]


@pytest.fixture(scope="module")
def files(tiny_checkpoints: TinyCheckpoints, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A folder for this module's GGUF files, and a private cache for the folders prepared from them."""
    with gguf_test_folder(tmp_path_factory, "moe-gguf") as folder:
        yield folder


def _types(name: str, form: str, weight_type: str) -> dict[str, str] | None:
    """Mixtral's experts are 48 wide: their down projections (48 columns) cannot be 32-element blocks."""
    if name != "mixtral" or weight_type == "F32":
        return None
    if form == "merged":
        return {f"blk.{i}.ffn_down_exps.weight": "F32" for i in range(2)}
    return {f"blk.{i}.ffn_down.{e}.weight": "F32" for i in range(2) for e in range(8)}


def _file(tiny_checkpoints: TinyCheckpoints, files: Path, name: str, form: str, weight_type: str) -> Path:
    """The checkpoint as a GGUF file, written once per module."""
    path = files / f"{name}-{form}-{weight_type}.gguf"
    if not path.is_file():
        write_checkpoint_gguf(
            tiny_checkpoints.path(name),
            path,
            weight_type=weight_type,
            types=_types(name, form, weight_type),
            expert_form=form,
            tokenizer=weight_type == "F32",  # (OLMoE's: converted without a config transformers has)
        )
    return path


def _sparse_layers(runner: ModelRunner) -> list[tuple[int, SparseMoeMLP]]:
    return [(i, layer.mlp) for i, layer in enumerate(runner.model.model.layers) if isinstance(layer.mlp, SparseMoeMLP)]


@pytest.mark.parametrize(("name", "form"), FILES)
def test_the_metadata_gives_the_checkpoints_moe_config(
    tiny_checkpoints: TinyCheckpoints, files: Path, name: str, form: str
) -> None:
    """Experts, top-k, expert sizes, renormalisation (not in the file: llama.cpp's per-architecture
    choice), the dense layers (blocks without a router) and OLMoE's norms and clamp."""
    src = tiny_checkpoints.path(name)
    path = _file(tiny_checkpoints, files, name, form, "F32")
    ours, source = ModelConfig.from_dict(hf_config(read_gguf(path)), files), ModelConfig.from_pretrained(src)
    assert ours.num_experts > 0 and ours.family_config == source.family_config  # (OLMoE's: and its clamp)
    for field in ("family", "architecture", "qk_norm", "head_dim", "qkv_bias"):
        assert getattr(ours, field) == getattr(source, field), field


@pytest.mark.parametrize(("name", "form"), FILES)
def test_f32_file_greedy_equals_transformers_on_the_checkpoint(
    tiny_checkpoints: TinyCheckpoints, files: Path, name: str, form: str
) -> None:
    runner = gguf_runner(_file(tiny_checkpoints, files, name, form, "F32"))
    assert runner.model_config.family == name
    reference = load_hf_model(tiny_checkpoints.path(name))
    prompts = [random_prompt(n, runner.vocab_size, seed=90 + n) for n in PROMPT_LENS]
    for prompt, req in zip(prompts, Harness(runner).generate(prompts, NEW_TOKENS, return_logprob=True)):
        tokens, logprobs = hf_greedy(reference, prompt, NEW_TOKENS)
        assert req.output_ids == tokens, f"prompt of length {len(prompt)}"
        assert req.logprobs == pytest.approx(logprobs, abs=LOGPROB_ATOL), f"prompt of length {len(prompt)}"


def _next_logprobs(harness: Harness, sequence: list[int]) -> torch.Tensor:
    """log-softmax of the next-token logits after ``sequence`` (prefilled afresh)."""
    harness.reset()
    out = harness.step([harness.add_request(sequence)])
    return torch.log_softmax(out.logits[0].float(), dim=-1)


def _assert_follows_the_dense_model(kept: ModelRunner, dense: ModelRunner) -> None:
    """Along the dense greedy continuation of each prompt: the kept model's log-probability of each
    dense token within KEPT_LOGPROB_ATOL, and its greedy token the dense one where that is clear."""
    prompts = [random_prompt(n, dense.vocab_size, seed=95 + n) for n in PROMPT_LENS]
    kept_h, dense_h = Harness(kept), Harness(dense)
    for prompt, req in zip(prompts, Harness(dense).generate(prompts, KEPT_TOKENS)):
        for i, token in enumerate(req.output_ids):
            sequence = prompt + req.output_ids[:i]
            ours, theirs = _next_logprobs(kept_h, sequence), _next_logprobs(dense_h, sequence)
            assert int(theirs.argmax()) == token
            assert float(ours[token]) == pytest.approx(float(theirs[token]), abs=KEPT_LOGPROB_ATOL), (len(prompt), i)
            top, second = theirs.topk(2).values.tolist()
            if top - second > 2 * KEPT_LOGPROB_ATOL:
                assert int(ours.argmax()) == token, (len(prompt), i)


@pytest.mark.parametrize(
    ("name", "form", "weight_type"),
    [(name, form, "Q8_0") for name, form in FILES] + [("qwen3_moe", "merged", "Q4_0")],
)
def test_kept_quantized_experts_hold_their_own_blocks(
    tiny_checkpoints: TinyCheckpoints, files: Path, name: str, form: str, weight_type: str
) -> None:
    """``--quantization gguf``: every expert's gate/up and down projections keep the file's blocks (but
    Mixtral's 48-column down projections, stored F32), with the dense load's values, which are the
    file's (gguf-py's dequantization of the whole merged tensor, one expert's slice); the router stays
    dense (llama.cpp's quantizer leaves it F32)."""
    path = _file(tiny_checkpoints, files, name, form, weight_type)
    dense, kept = gguf_runner(path), gguf_runner(path, quantization="gguf")
    layers = _sparse_layers(kept)
    assert layers and all(type(mlp.gate.weight) is torch.nn.Parameter for _, mlp in layers)
    dense_layers = dict(_sparse_layers(dense))
    for i, mlp in layers:
        for expert in mlp.local_experts:
            gate_up, down = mlp.expert_weights(expert)
            dense_gate_up, dense_down = dense_layers[i].expert_weights(expert)
            assert isinstance(gate_up, QuantizedWeight) and gate_up.source == weight_type, (i, expert)
            assert torch.equal(gate_up.dequantize(), dense_gate_up), (i, expert)
            assert isinstance(down, QuantizedWeight) is (name != "mixtral"), (i, expert)
            if isinstance(down, QuantizedWeight):
                assert torch.equal(down.dequantize(), dense_down), (i, expert)
        if mlp.shared_expert is not None:
            assert isinstance(mlp.shared_expert.gate_up_proj.weight, QuantizedWeight)
    if form == "merged":
        i, mlp = layers[-1]
        expert, size = mlp.num_experts - 1, dense_layers[i].moe.intermediate_size
        in_file = reference_tensor(path, f"blk.{i}.ffn_up_exps.weight")[expert]
        assert np.array_equal(dense_layers[i].expert_weights(expert)[0][size:].numpy(), in_file)
    _assert_follows_the_dense_model(kept, dense)


def test_an_expert_parallel_rank_reads_only_its_experts(tiny_checkpoints: TinyCheckpoints, files: Path) -> None:
    """``--ep-size 2``: rank 1 holds (and loads, kept quantized) the second half of the experts, the
    values of the same experts of a whole model."""
    path = _file(tiny_checkpoints, files, "qwen3_moe", "merged", "Q8_0")
    whole = dict(_sparse_layers(gguf_runner(path)))
    rank = gguf_runner(path, tp_rank=1, tp_size=2, ep_size=2, quantization="gguf")
    for i, mlp in _sparse_layers(rank):
        assert list(mlp.local_experts) == list(range(8, 16)) and set(mlp.experts) == {str(e) for e in range(8, 16)}
        for expert in mlp.local_experts:
            for ours, theirs in zip(mlp.expert_weights(expert), whole[i].expert_weights(expert)):
                assert isinstance(ours, QuantizedWeight) and torch.equal(ours.dequantize(), theirs)


@pytest.mark.parametrize("form", ["merged", "per_expert"])
def test_the_file_holds_what_llama_cpps_converter_writes(
    tiny_checkpoints: TinyCheckpoints, files: Path, form: str
) -> None:
    """A Mixtral: a ``llama`` file with expert keys, Q/K rows interleaved, the experts stacked
    ``[E, rows, cols]`` (or one tensor each); a quantized Qwen2-MoE keeps its router F32 and its
    shared-expert gate 1-D, as llama.cpp's quantizer leaves them."""
    from safetensors.numpy import load_file

    path = _file(tiny_checkpoints, files, "mixtral", form, "F32")
    contents = read_gguf(path)
    assert contents.architecture == "llama" and contents.arch_value("expert_count") == 8
    assert contents.arch_value("expert_used_count") == 2 and "llama.expert_feed_forward_length" not in contents.metadata
    source = load_file(str(tiny_checkpoints.path("mixtral") / "model.safetensors"))
    w1 = np.stack([source[f"model.layers.1.block_sparse_moe.experts.{e}.w1.weight"] for e in range(8)])
    if form == "merged":
        assert contents.tensors["blk.1.ffn_gate_exps.weight"].shape == (8, 48, 64)
        assert contents.tensors["blk.1.ffn_down_exps.weight"].shape == (8, 64, 48)
        assert np.array_equal(reference_tensor(path, "blk.1.ffn_gate_exps.weight"), w1)
    else:
        assert not any(name.endswith("_exps.weight") for name in contents.tensors)
        assert np.array_equal(reference_tensor(path, "blk.1.ffn_gate.5.weight"), w1[5])
    qwen2 = read_gguf(_file(tiny_checkpoints, files, "qwen2_moe", "merged", "Q8_0")).tensors
    assert qwen2["blk.1.ffn_gate_inp.weight"].type_name == "F32"
    assert qwen2["blk.1.ffn_gate_inp_shexp.weight"].shape == (64,)
    assert qwen2["blk.1.ffn_up_exps.weight"].type_name == "Q8_0" and "blk.0.ffn_up.weight" in qwen2


def test_a_llama_file_with_experts_is_mixtral_whatever_its_name(tiny_checkpoints: TinyCheckpoints, files: Path) -> None:
    """llama.cpp names a converted Mixtral after its repository ("mistralai_Mixtral-8x7B..."), which
    names Mistral too: the experts decide."""
    path = write_checkpoint_gguf(
        tiny_checkpoints.path("mixtral"),
        files / "named-mixtral.gguf",
        model_name="mistralai_Mixtral-8x7B-Instruct-v0.1",
        tokenizer=False,
    )
    config: dict[str, Any] = hf_config(read_gguf(path))
    assert config["model_type"] == "mixtral" and config["architectures"] == ["MixtralForCausalLM"]
    assert family_of_gguf("llama", "mistralai_Mixtral-8x7B-Instruct-v0.1", 8) is BY_NAME["mixtral"]
    assert family_of_gguf("llama", "Mixtral-8x7B", 8) is BY_NAME["mixtral"]
    assert family_of_gguf("llama", "tiny", 8) is BY_NAME["mixtral"]
    assert family_of_gguf("llama", "mistralai_Mistral-7B-v0.3", 0) is BY_NAME["mistral"]
    assert family_of_gguf("llama", "Mixtral-looking dense llama", 0) is BY_NAME["llama"]
    assert family_of_gguf("qwen3moe", "Qwen3-30B-A3B", 128) is BY_NAME["qwen3_moe"]


@pytest.mark.parametrize(
    ("dropped", "form"), [("blk.0.ffn_up_exps.weight", "merged"), ("blk.1.ffn_down.7.weight", "per_expert")]
)
def test_a_missing_expert_tensor_is_named(
    tiny_checkpoints: TinyCheckpoints, files: Path, dropped: str, form: str
) -> None:
    path = write_checkpoint_gguf(
        tiny_checkpoints.path("mixtral"),
        files / f"mixtral-without-{dropped}.gguf",
        expert_form=form,
        tokenizer=False,
        tensor_hook=lambda name, values: None if name == dropped else values,
    )
    with pytest.raises(GGUFError, match=f"tensor {dropped} is missing"):
        hf_config(read_gguf(path))
