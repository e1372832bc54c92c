"""The config made from a GGUF file's metadata describes the same model as the source checkpoint.

Each tiny HF checkpoint is converted the way llama.cpp does; what ``runtime.engine.model_config``
reads from the prepared folder must equal what it reads from the source folder (dims, eps,
RoPE, tie, bias, head_dim, special token ids, the served architecture), so a GGUF file is
served as the model it was converted from.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.checkpoints.gguf.config import hf_config
from runtime.checkpoints.gguf.prepare import prepare_gguf
from runtime.checkpoints.gguf.reader import GGUFError, read_gguf
from runtime.engine.model_config import ModelConfig
from tests.support.checkpoints import TinyCheckpoints
from tests.support.gguf_files import write_checkpoint_gguf

FIELDS = (
    "architecture",
    "model_type",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "rope",
    "max_position_embeddings",
    "context_len",
    "tie_word_embeddings",
    "qkv_bias",
    "qk_norm",
    "hidden_act",
    "eos_token_ids",
    "bos_token_id",
    "pad_token_id",
)


@pytest.fixture(autouse=True)
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Prepared folders go to a temporary cache, never the user's."""
    monkeypatch.setenv("TINYSERVE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


# llama_tied_llama3: its llama3 RoPE scaling recovered from the file's rope_freqs tensor
@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2", "qwen3", "llama_tied_llama3"])
def test_config_from_metadata_equals_source_config(
    tiny_checkpoints: TinyCheckpoints, tmp_path: Path, name: str
) -> None:
    src = tiny_checkpoints.path(name)
    gguf_file = write_checkpoint_gguf(src, tmp_path / f"{name}.gguf")
    expected = ModelConfig.from_pretrained(src)
    got = ModelConfig.from_pretrained(prepare_gguf(gguf_file))
    for field in FIELDS:
        assert getattr(got, field) == getattr(expected, field), field
    # GGUF stores the epsilon as float32
    assert got.rms_norm_eps == pytest.approx(expected.rms_norm_eps, rel=1e-6)
    # Mistral's 4096-token window is longer than the model's context: no layer is windowed in effect
    assert all(w is None or w >= expected.context_len for w in expected.layer_windows)
    assert got.layer_windows == (None,) * got.num_hidden_layers


def test_distinguishing_fields_are_not_defaults(tiny_checkpoints: TinyCheckpoints, tmp_path: Path) -> None:
    """The checkpoints differ where it matters, so the comparison above covers each rule: Mistral
    named by general.name, one KV head, Qwen2's biases and linear RoPE scaling, Qwen3's head_dim."""
    configs = {
        name: hf_config(
            read_gguf(write_checkpoint_gguf(tiny_checkpoints.path(name), tmp_path / f"{name}.gguf", tokenizer=False))
        )
        for name in ("llama", "mistral", "qwen2", "qwen3")
    }
    assert configs["llama"]["architectures"] == ["LlamaForCausalLM"]
    assert configs["mistral"]["architectures"] == ["MistralForCausalLM"]
    assert configs["mistral"]["num_key_value_heads"] == 1
    assert configs["qwen2"]["attention_bias"] and not configs["llama"]["attention_bias"]
    assert configs["qwen2"]["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}
    assert configs["qwen2"]["rope_theta"] == 1000000.0 and configs["llama"]["rope_theta"] == 10000.0
    qwen3 = configs["qwen3"]
    assert qwen3["head_dim"] == 32 != qwen3["hidden_size"] // qwen3["num_attention_heads"]


def test_llama_named_otherwise_stays_llama(tiny_checkpoints: TinyCheckpoints, tmp_path: Path) -> None:
    """Only general.name tells Mistral from Llama in a llama-architecture file."""
    path = write_checkpoint_gguf(
        tiny_checkpoints.path("mistral"), tmp_path / "m.gguf", model_name="Tiny", tokenizer=False
    )
    assert hf_config(read_gguf(path))["architectures"] == ["LlamaForCausalLM"]
    path = write_checkpoint_gguf(
        tiny_checkpoints.path("llama"), tmp_path / "l.gguf", model_name="Mistral-7B-Instruct-v0.3", tokenizer=False
    )
    assert hf_config(read_gguf(path))["model_type"] == "mistral"


def test_no_output_tensor_means_tied_embeddings(tiny_checkpoints: TinyCheckpoints, tmp_path: Path) -> None:
    path = write_checkpoint_gguf(tiny_checkpoints.path("llama"), tmp_path / "tied.gguf", tie=True, tokenizer=False)
    contents = read_gguf(path)
    assert "output.weight" not in contents.tensors
    config = hf_config(contents)
    assert config["tie_word_embeddings"] is True
    assert ModelConfig.from_pretrained(prepare_gguf(path)).tie_word_embeddings


def test_token_ids_come_from_the_tokenizer_metadata(tiny_checkpoints: TinyCheckpoints, tmp_path: Path) -> None:
    """bos / eos / pad ids are tokenizer.ggml.* keys; a weights-only file has none of them."""
    src = tiny_checkpoints.path("qwen2")
    with_tok = hf_config(read_gguf(write_checkpoint_gguf(src, tmp_path / "a.gguf")))
    without = hf_config(read_gguf(write_checkpoint_gguf(src, tmp_path / "b.gguf", tokenizer=False)))
    expected = ModelConfig.from_pretrained(src)
    assert (with_tok["bos_token_id"], with_tok["eos_token_id"], with_tok["pad_token_id"]) == (
        expected.bos_token_id,
        expected.eos_token_ids[0],
        expected.pad_token_id,
    )
    assert not {"bos_token_id", "eos_token_id", "pad_token_id"} & set(without)


def test_end_of_turn_token_also_ends_generation(tiny_checkpoints: TinyCheckpoints, tmp_path: Path) -> None:
    """llama.cpp stops on eos and on a chat model's end-of-turn token: both become eos ids."""
    src = tiny_checkpoints.path("llama")
    path = write_checkpoint_gguf(src, tmp_path / "eot.gguf", extra=lambda w: w.add_eot_token_id(5))
    assert hf_config(read_gguf(path))["eos_token_id"] == [2, 5]
    assert ModelConfig.from_pretrained(prepare_gguf(path)).eos_token_ids == [2, 5]
    same = write_checkpoint_gguf(src, tmp_path / "eot-eos.gguf", extra=lambda w: w.add_eot_token_id(2))
    assert hf_config(read_gguf(same))["eos_token_id"] == 2


def test_sliding_window_metadata(tiny_checkpoints: TinyCheckpoints, tmp_path: Path) -> None:
    """attention.sliding_window windows every layer (Qwen2 needs use_sliding_window for it)."""
    for name in ("mistral", "qwen2"):
        path = write_checkpoint_gguf(
            tiny_checkpoints.path(name),
            tmp_path / f"{name}-swa.gguf",
            tokenizer=False,
            extra=lambda w: w.add_sliding_window(16),
        )
        config = ModelConfig.from_pretrained(prepare_gguf(path))
        assert config.layer_windows == (16, 16), name


def test_rope_scaling_we_cannot_apply_is_refused(tiny_checkpoints: TinyCheckpoints, tmp_path: Path) -> None:
    """Serving a model with the wrong RoPE would generate garbage quietly: refuse instead."""
    import gguf
    import numpy as np

    src = tiny_checkpoints.path("llama")

    def yarn(writer: object) -> None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)  # type: ignore[attr-defined]
        writer.add_rope_scaling_factor(4.0)  # type: ignore[attr-defined]

    path = write_checkpoint_gguf(src, tmp_path / "yarn.gguf", tokenizer=False, extra=yarn)
    with pytest.raises(GGUFError, match="unsupported RoPE scaling 'yarn'"):
        hf_config(read_gguf(path))
    # llama.cpp's per-frequency divisors (Llama 3.1-style scaling) must be one F32 per rotary
    # frequency (head_dim 16: 8), each a positive number
    for name, values in (
        ("short", np.ones(5, np.float32)),
        ("f16", np.ones(8, np.float16)),
        ("zero", np.zeros(8, np.float32)),
    ):
        freqs = write_checkpoint_gguf(
            src,
            tmp_path / f"freqs-{name}.gguf",
            tokenizer=False,
            extra=lambda w, v=values: w.add_tensor("rope_freqs.weight", v),
        )
        with pytest.raises(GGUFError, match="rope_freqs.weight"):
            hf_config(read_gguf(freqs))


def test_vocab_size_without_the_key(tiny_checkpoints: TinyCheckpoints, tmp_path: Path) -> None:
    """llama.cpp writes {arch}.vocab_size for llama only: a Qwen file's vocabulary is its token
    count, or the embedding's rows when it carries no tokenizer."""
    src = tiny_checkpoints.path("qwen2")
    for tokenizer in (True, False):
        contents = read_gguf(write_checkpoint_gguf(src, tmp_path / f"v{tokenizer}.gguf", tokenizer=tokenizer))
        assert contents.arch_value("vocab_size") is None
        assert ("tokenizer.ggml.tokens#count" in contents.metadata) is tokenizer
        assert hf_config(contents)["vocab_size"] == ModelConfig.from_pretrained(src).vocab_size
