"""Checkpoint loading: sharded == single file, clear errors, config parsing, TP shards."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from runtime.engine.config_reading import UnsupportedModelError
from runtime.engine.cpu.host_memory import cpu_mem_total_bytes
from runtime.engine.device import dtype_reason, resolve_device, resolve_dtype
from runtime.engine.loading.weight_loader import MissingWeightError, checkpoint_files
from runtime.engine.model_config import ModelConfig
from runtime.engine.model_runner import ModelRunner
from tests.support.checkpoints import TinyCheckpoints, copy_checkpoint, random_prompt
from tests.support.harness import Harness
from tests.support.tp_threads import ThreadTPGroup


def _runner(path: Path, **kwargs) -> ModelRunner:
    return ModelRunner(path, device="cpu", dtype="float32", max_total_tokens=2048, load_progress=False, **kwargs)


def _state(runner: ModelRunner) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in runner.model.state_dict().items()}


# ---- sharded vs single -----------------------------------------------------------------


@pytest.mark.parametrize("name", ["llama_tied_llama3", "qwen3"])
def test_sharded_checkpoint_loads_like_single_file(tiny_checkpoints: TinyCheckpoints, name: str) -> None:
    single = tiny_checkpoints.path(name)
    sharded = tiny_checkpoints.sharded(name)
    assert len(checkpoint_files(sharded)) > 1
    a, b = _runner(single), _runner(sharded)
    sa, sb = _state(a), _state(b)
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key
    prompt = random_prompt(11, a.vocab_size, seed=9)
    out_a = Harness(a).generate([prompt], 8)[0].output_ids
    out_b = Harness(b).generate([prompt], 8)[0].output_ids
    assert out_a == out_b


# ---- errors that name what is wrong ----------------------------------------------------


def test_missing_shard_file_is_named(tiny_checkpoints: TinyCheckpoints, tmp_path: Path) -> None:
    broken = copy_checkpoint(tiny_checkpoints.sharded("llama_tied_llama3"), tmp_path / "ckpt")
    victim = sorted(broken.glob("*.safetensors"))[-1]
    victim.unlink()
    with pytest.raises(FileNotFoundError, match=victim.name):
        _runner(broken)


def test_folder_without_weights(tiny_checkpoints: TinyCheckpoints, tmp_path: Path) -> None:
    broken = copy_checkpoint(tiny_checkpoints.path("llama"), tmp_path / "ckpt")
    (broken / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        _runner(broken)


def test_missing_config(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="config.json"):
        _runner(tmp_path)


def test_unsupported_architecture_is_named(tiny_checkpoints: TinyCheckpoints, tmp_path: Path) -> None:
    broken = copy_checkpoint(tiny_checkpoints.path("llama"), tmp_path / "ckpt")
    cfg = json.loads((broken / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (broken / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        _runner(broken)


def _rewrite_weights(folder: Path, edit) -> None:
    tensors = load_file(str(folder / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def test_shape_mismatch_names_the_tensor(tiny_checkpoints: TinyCheckpoints, tmp_path: Path) -> None:
    broken = copy_checkpoint(tiny_checkpoints.path("qwen2"), tmp_path / "ckpt")
    name = "model.layers.1.self_attn.k_proj.weight"

    def edit(t: dict[str, torch.Tensor]) -> None:
        t[name] = t[name][:-1].contiguous()

    _rewrite_weights(broken, edit)
    with pytest.raises(ValueError, match=f"{name} has shape \\(31, 64\\), expected \\(32, 64\\)"):
        _runner(broken)


def test_missing_tensor_is_named(tiny_checkpoints: TinyCheckpoints, tmp_path: Path) -> None:
    broken = copy_checkpoint(tiny_checkpoints.path("qwen3"), tmp_path / "ckpt")
    name = "model.layers.0.self_attn.k_norm.weight"
    _rewrite_weights(broken, lambda t: t.pop(name))
    with pytest.raises(MissingWeightError, match=name):
        _runner(broken)


# ---- config parsing --------------------------------------------------------------------

_BASE = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 100,
    "max_position_embeddings": 4096,
}


def test_old_style_rope_scaling_equals_rope_parameters(tmp_path: Path) -> None:
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 512}
    old = ModelConfig.from_dict(
        {**_BASE, "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", **scaling}}, tmp_path
    )
    new = ModelConfig.from_dict(
        {**_BASE, "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, **scaling}}, tmp_path
    )
    assert old.rope == new.rope and old.rope.theta == 500000.0 and old.rope.rope_type == "llama3"
    linear_cfg = ModelConfig.from_dict({**_BASE, "rope_scaling": {"type": "linear", "factor": 2.0}}, tmp_path)
    assert (linear_cfg.rope.rope_type, linear_cfg.rope.factor, linear_cfg.rope.theta) == ("linear", 2.0, 10000.0)
    with pytest.raises(UnsupportedModelError, match="yarn"):
        ModelConfig.from_dict({**_BASE, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, tmp_path)


def test_config_switches(tmp_path: Path) -> None:
    qwen2 = ModelConfig.from_dict({**_BASE, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 32}, tmp_path)
    assert qwen2.qkv_bias and not qwen2.qk_norm and qwen2.context_len == 4096  # window off without use_sliding_window
    assert qwen2.sliding_window is None and not qwen2.is_hybrid_swa
    hybrid = ModelConfig.from_dict(
        {
            **_BASE,
            "architectures": ["Qwen2ForCausalLM"],
            "sliding_window": 32,
            "use_sliding_window": True,
            "max_window_layers": 1,
        },
        tmp_path,
    )
    assert hybrid.layer_windows == (None, 32) and hybrid.sliding_window == 32 and hybrid.is_hybrid_swa
    qwen3 = ModelConfig.from_dict({**_BASE, "architectures": ["Qwen3ForCausalLM"], "head_dim": 32}, tmp_path)
    assert qwen3.qk_norm and not qwen3.qkv_bias and qwen3.head_dim == 32
    mistral = ModelConfig.from_dict(
        {**_BASE, "architectures": ["MistralForCausalLM"], "sliding_window": 1024}, tmp_path
    )
    assert mistral.context_len == 4096  # not capped at the window: windowed layers attend to their last 1024
    assert mistral.layer_windows == (1024,) * _BASE["num_hidden_layers"]
    assert (
        ModelConfig.from_dict(
            {**_BASE, "architectures": ["MistralForCausalLM"], "sliding_window": 1024}, tmp_path, context_length=1024
        ).layer_windows
        == (None,) * _BASE["num_hidden_layers"]
    )
    assert ModelConfig.from_dict(_BASE, tmp_path, context_length=100).context_len == 100
    with pytest.raises(ValueError, match="exceeds"):
        ModelConfig.from_dict(_BASE, tmp_path, context_length=5000)


def test_eos_ids_from_config_and_generation_config(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    cfg = ModelConfig.from_dict({**_BASE, "eos_token_id": 9}, tmp_path)
    assert cfg.eos_token_ids == [9, 7]


@pytest.mark.parametrize("native_bf16", [False, True], ids=["no-native-bf16", "native-bf16"])
def test_device_and_dtype_resolution(native_bf16: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The rules for each CPU class, set here (never the host's): the host's probe answers as the class
    says, and the class can also be handed in (what ModelRunner does with its one reading)."""
    from runtime.engine import device

    monkeypatch.setattr(device, "cpu_supports_bf16", lambda: native_bf16)
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_dtype("float32", "cpu") is torch.float32
    assert resolve_dtype("bfloat16", "cpu") is torch.bfloat16
    auto = torch.bfloat16 if native_bf16 else torch.float32
    assert resolve_dtype("auto", "cpu") is auto
    assert resolve_dtype("auto", "cpu", native_bf16=not native_bf16) is not auto  # the class handed in wins
    with pytest.raises(ValueError, match="unsupported dtype"):
        resolve_dtype("int8", "cpu")
    # weights kept quantized on a CPU: fp32 activations (the quantized kernels' one-call decode stack),
    # but a GGUF file's blocks on a CPU with native bf16 (their bf16 kernels); an explicit --dtype wins
    for method in ("gguf", "int8"):
        kept = torch.bfloat16 if method == "gguf" and native_bf16 else torch.float32
        assert resolve_dtype("auto", "cpu", method) is kept
        assert resolve_dtype("bfloat16", "cpu", method) is torch.bfloat16
        assert resolve_dtype("float32", "cpu", method) is torch.float32
        reason = dtype_reason("auto", "cpu", method)
        assert ("blocks' bf16 kernels" in reason) is (kept is torch.bfloat16)
        assert ("fp32 activations" in reason) is (kept is torch.float32)
    assert dtype_reason("float32", "cpu") == "--dtype"
    assert ("has native bf16" in dtype_reason("auto", "cpu")) is native_bf16
    assert ("has native bf16" in dtype_reason("auto", "cpu", native_bf16=not native_bf16)) is not native_bf16


def test_runner_attributes(tiny_llama_path: Path) -> None:
    runner = _runner(tiny_llama_path, max_running_requests=7)
    assert runner.max_total_tokens == 2048 and runner.max_running_requests == 7
    assert runner.context_len == runner.model_config.max_position_embeddings == 512
    assert runner.eos_token_ids == [2] and runner.vocab_size == runner.model_config.vocab_size
    assert runner.req_to_token_pool.req_to_token.shape[1] >= runner.context_len
    assert runner.token_to_kv_pool.k_buffer[0].shape == (2048 + 1, 2, 16)
    sized = ModelRunner(tiny_llama_path, device="cpu", dtype="float32", mem_fraction_static=0.0005, load_progress=False)
    # a share of MemTotal less the weights and their packed copies (fp32 panels where the kernels read them), to the token
    resident = sized.weight_bytes() + sized.ops.prepared_bytes(sized.model)
    assert (
        sized.resident_weight_bytes() == resident
        and sized.weight_info()["prepacked_bytes"] == resident - sized.weight_bytes()
    )
    assert sized.max_total_tokens == (cpu_mem_total_bytes() * 0.0005 - resident) // sized.kv_bytes_per_token()


# ---- tensor parallel shards (communication faked with threads) -----------------------


@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2"])  # mistral: 1 KV head, replicated on both ranks
def test_tp2_shards_reproduce_tp1(tiny_checkpoints: TinyCheckpoints, thread_tp_group: ThreadTPGroup, name: str) -> None:
    path = tiny_checkpoints.path(name)
    reference = _runner(path)
    prompts = [random_prompt(n, reference.vocab_size, seed=40 + n) for n in (5, 17)]
    expected = [r.output_ids for r in Harness(reference).generate(prompts, 6)]

    ranks = [_runner(path, tp_rank=r, tp_size=2) for r in range(2)]
    assert ranks[0].num_kv_heads == 1 and ranks[0].num_heads == 2
    assert ranks[0].model.lm_head.weight.shape[0] == -(-reference.vocab_size // 2)
    results: list[list[list[int]] | BaseException] = [[], []]

    def work(rank: int) -> None:
        thread_tp_group.local.rank = rank
        try:
            results[rank] = [r.output_ids for r in Harness(ranks[rank]).generate(prompts, 6)]
        except BaseException as exc:  # surfaced below; a dead rank would hang the other at the barrier
            thread_tp_group.barrier.abort()
            results[rank] = exc

    threads = [threading.Thread(target=work, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for res in results:
        if isinstance(res, BaseException):
            raise res
    assert results[0] == results[1] == expected


def test_tp_layer_without_group_refuses_to_run(tiny_llama_path: Path) -> None:
    runner = _runner(tiny_llama_path, tp_rank=0, tp_size=2)
    with pytest.raises(RuntimeError, match="set_tp_group"):
        Harness(runner).generate([[5, 6, 7]], 1)
