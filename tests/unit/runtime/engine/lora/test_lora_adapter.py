"""Reading PEFT adapter folders (``runtime.engine.lora.adapter``) and what a server refuses to load.

The oracle for what a folder means is peft itself: each adapted module's rank, scaling (``alpha / r``,
rsLoRA's ``alpha / sqrt(r)``, per-module ``rank_pattern`` / ``alpha_pattern``) and matrices must be
those peft's own ``LoraLayer`` holds after ``PeftModel.from_pretrained`` of the same folder. Every folder
that is not a plain LoRA adapter of this model's projections must be refused with a message that names
what is wrong, by the reader (config and files) or by the pool (``LoraPool.prepare``: rank, targets,
shapes), and a refused load must leave the adapters loaded as they were.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from runtime.engine.lora.adapter import LoraAdapter, LoraAdapterError, read_adapter
from runtime.engine.lora.manager import LoraSettings
from runtime.engine.model_runner import ModelRunner
from tests.support.checkpoints import load_hf_model
from tests.support.lora_adapters import AdapterSpec, build_adapter

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")

# Folders whose scaling must equal peft's. Pattern keys as users write them: a module's tail, a regex
# (peft matches ``(.*\.)?(KEY)$`` against the module's name), an alternation; the first key that matches wins.
SCALING_SPECS = {
    "plain": AdapterSpec(r=8, alpha=16, targets=ATTENTION, seed=11),
    "patterns": AdapterSpec(
        r=4,
        alpha=8,
        targets=ATTENTION + MLP,
        seed=12,
        rank_pattern={"layers.1.mlp.down_proj": 2, "k_proj|o_proj": 6, r"layers\.0\..*up_proj": 3},
        alpha_pattern={"v_proj": 3, r".*\.gate_proj": 5, "layers.1.self_attn.q_proj": 1.5},
    ),
    "rslora": AdapterSpec(
        r=16, alpha=4, targets=("q_proj", "v_proj", "down_proj"), seed=13, rslora=True, rank_pattern={"v_proj": 4}
    ),
}


@pytest.fixture(scope="module")
def llama(tiny_checkpoints: Any) -> Path:
    return Path(tiny_checkpoints.path("llama"))


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("lora_adapters")


def peft_layers(base: Path, folder: Path) -> dict[str, Any]:
    """peft's ``LoraLayer`` of each adapted module of ``folder`` loaded over ``base``, by checkpoint
    module name (``model.layers.0.self_attn.q_proj``)."""
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer

    model = PeftModel.from_pretrained(load_hf_model(base), str(folder)).eval()
    prefix = "base_model.model."
    return {name[len(prefix) :]: module for name, module in model.named_modules() if isinstance(module, LoraLayer)}


def peft_folder(base: Path, out: Path, save_embedding_layers: bool | str = "auto", **config: Any) -> Path:
    """A folder saved by peft for ``LoraConfig(**config)`` over ``base`` (random matrices, seed 0).
    ``save_embedding_layers``: peft's own default ("auto") saves the whole weights of targeted
    embeddings and LM heads beside the adapter."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    config.setdefault("init_lora_weights", False)
    model = get_peft_model(load_hf_model(base), LoraConfig(**config))
    model.save_pretrained(str(out), save_embedding_layers=save_embedding_layers)
    return out


def refused(path: Path, *needles: str) -> str:
    """``read_adapter(path)`` refuses the folder with a message naming the folder and each needle."""
    with pytest.raises(LoraAdapterError) as info:
        read_adapter(path)
    message = str(info.value)
    assert str(path) in message
    for needle in needles:
        assert needle in message, message
    return message


# ---- what a folder means ---------------------------------------------------------------


@pytest.mark.parametrize("name", list(SCALING_SPECS))
def test_ranks_scalings_and_matrices_equal_peft(llama: Path, folders: Path, name: str) -> None:
    spec = SCALING_SPECS[name]
    folder = build_adapter(llama, folders / name, spec)
    adapter = read_adapter(folder)
    layers = peft_layers(llama, folder)
    assert set(adapter.modules) == set(layers)
    for module, layer in layers.items():
        ours = adapter.modules[module]
        assert ours.rank == layer.r["default"], module
        assert ours.scaling == pytest.approx(layer.scaling["default"], rel=1e-6), module
        assert torch.equal(ours.a, layer.lora_A["default"].weight.float()), module
        assert torch.equal(ours.b, layer.lora_B["default"].weight.float()), module
    scalings = {module.scaling for module in adapter.modules.values()}
    ranks = {module.rank for module in adapter.modules.values()}
    if name != "plain":  # the patterns were taken: the test would not tell a reader that ignored them
        assert len(scalings) > 1 and len(ranks) > 1, (scalings, ranks)
    assert adapter.max_rank == max(ranks)
    assert adapter.target_leaves == set(spec.targets)


def test_a_bin_adapter_reads_as_its_safetensors_twin(llama: Path, folders: Path) -> None:
    """``save_pretrained(safe_serialization=False)``'s ``adapter_model.bin`` means what the
    ``.safetensors`` folder of the same adapter means."""
    from peft import PeftModel

    safe = build_adapter(llama, folders / "patterns", SCALING_SPECS["patterns"])
    binary = folders / "patterns-bin"
    PeftModel.from_pretrained(load_hf_model(llama), str(safe)).save_pretrained(str(binary), safe_serialization=False)
    assert (binary / "adapter_model.bin").is_file() and not (binary / "adapter_model.safetensors").exists()
    ours, theirs = read_adapter(binary), read_adapter(safe)
    assert set(ours.modules) == set(theirs.modules)
    for module, expected in theirs.modules.items():
        got = ours.modules[module]
        assert got.scaling == expected.scaling
        assert torch.equal(got.a, expected.a) and torch.equal(got.b, expected.b)


# ---- folders the reader refuses ----------------------------------------------------------


def test_dora_is_refused(llama: Path, folders: Path) -> None:
    folder = peft_folder(llama, folders / "dora", r=4, lora_alpha=8, target_modules=["q_proj"], use_dora=True)
    refused(folder, "DoRA")


def test_trained_biases_are_refused(llama: Path, folders: Path) -> None:
    folder = peft_folder(llama, folders / "bias", r=4, lora_alpha=8, target_modules=["q_proj"], bias="all")
    refused(folder, "trained biases", "bias='all'")


def test_modules_to_save_are_refused(llama: Path, folders: Path) -> None:
    folder = peft_folder(
        llama, folders / "to_save", r=4, lora_alpha=8, target_modules=["q_proj"], modules_to_save=["lm_head"]
    )
    refused(folder, "lm_head", "not served")


def test_an_embedding_target_is_refused(llama: Path, folders: Path) -> None:
    """peft saves the embedding's whole weight beside its ``lora_embedding_A/B`` (by default) or only
    those: either way the folder is refused, naming the embedding."""
    with_weight = peft_folder(llama, folders / "embed", r=4, lora_alpha=8, target_modules=["q_proj", "embed_tokens"])
    refused(with_weight, "whole weight of model.embed_tokens", "not served")
    lora_only = peft_folder(
        llama,
        folders / "embed-lora-only",
        save_embedding_layers=False,
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "embed_tokens"],
    )
    refused(lora_only, "model.embed_tokens.lora_embedding_", "not a plain LoRA matrix")


def test_missing_files_are_refused(llama: Path, folders: Path, tmp_path: Path) -> None:
    source = build_adapter(llama, folders / "plain", SCALING_SPECS["plain"])
    refused(tmp_path / "nowhere", "not a folder")
    no_config = tmp_path / "no_config"
    no_config.mkdir()
    shutil.copy(source / "adapter_model.safetensors", no_config)
    refused(no_config, "no adapter_config.json")
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    shutil.copy(source / "adapter_config.json", no_weights)
    refused(no_weights, "no adapter_model.safetensors or adapter_model.bin")
    not_json = tmp_path / "not_json"
    not_json.mkdir()
    (not_json / "adapter_config.json").write_text("{r: 8")
    refused(not_json, "not JSON")


def test_a_config_that_disagrees_with_its_matrices_is_refused(llama: Path, folders: Path, tmp_path: Path) -> None:
    """A rank in the config that is not the matrices' (a hand-edited or mixed-up folder)."""
    folder = shutil.copytree(build_adapter(llama, folders / "plain", SCALING_SPECS["plain"]), tmp_path / "edited")
    config = json.loads((folder / "adapter_config.json").read_text())
    config["r"] = 4
    (folder / "adapter_config.json").write_text(json.dumps(config))
    refused(folder, "has rank 8, the config says 4")


# ---- folders the server refuses to load (the pool: rank, targets, shapes) ------------------


@pytest.fixture(scope="module")
def runner(llama: Path) -> ModelRunner:
    """A LoRA server over the tiny Llama: rank up to 8, attention targets only, no adapter at start."""
    return ModelRunner(
        llama,
        device="cpu",
        dtype="float32",
        max_total_tokens=256,
        load_progress=False,
        lora=LoraSettings(slots=2, max_rank=8, target_modules=ATTENTION),
    )


def refused_load(runner: ModelRunner, folder: Path, *needles: str) -> None:
    """Loading ``folder`` fails naming it and each needle, and the adapters loaded stay as they were."""
    assert runner.lora is not None
    before = dict(runner.lora.adapters)
    with pytest.raises(LoraAdapterError) as info:
        runner.load_lora_adapter("refused#0", str(folder))
    message = str(info.value)
    assert str(folder) in message
    for needle in needles:
        assert needle in message, message
    assert runner.lora.adapters == before


def test_a_plain_adapter_loads(runner: ModelRunner, llama: Path, folders: Path) -> None:
    """(The refusals below are not of everything: the plain attention adapter loads and unloads.)"""
    assert runner.lora is not None
    runner.load_lora_adapter("plain#0", str(build_adapter(llama, folders / "plain", SCALING_SPECS["plain"])))
    assert "plain#0" in runner.lora.adapters
    runner.unload_lora_adapter("plain#0")
    assert "plain#0" not in runner.lora.adapters


def test_a_rank_above_max_lora_rank_is_refused(runner: ModelRunner, llama: Path, folders: Path) -> None:
    folder = build_adapter(llama, folders / "rank16", AdapterSpec(r=16, alpha=16, targets=ATTENTION, seed=14))
    refused_load(runner, folder, "rank 16 is above the server's --max-lora-rank 8")


def test_a_target_outside_lora_target_modules_is_refused(runner: ModelRunner, llama: Path, folders: Path) -> None:
    folder = build_adapter(llama, folders / "mlp", AdapterSpec(r=4, alpha=8, targets=("q_proj",) + MLP, seed=15))
    refused_load(runner, folder, "is not among the server's LoRA target modules (k_proj, o_proj, q_proj, v_proj)")


def test_an_lm_head_target_is_refused(runner: ModelRunner, llama: Path, folders: Path) -> None:
    """With the LM head's whole weight saved beside it (peft's default) the reader refuses the folder;
    without it the LM head's matrices are a plain pair, which the pool refuses."""
    with_weight = peft_folder(llama, folders / "lm_head", r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"])
    refused(with_weight, "whole weight of lm_head", "not served")
    lora_only = peft_folder(
        llama,
        folders / "lm_head-lora-only",
        save_embedding_layers=False,
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "lm_head"],
    )
    adapter: LoraAdapter = read_adapter(lora_only)
    assert "lm_head" in adapter.modules
    refused_load(runner, lora_only, "adapts lm_head", "only this model's attention and dense MLP projections")


def test_a_target_name_at_a_module_the_model_lacks_is_refused_as_such(runner: ModelRunner, tmp_path: Path) -> None:
    """A projection name the server targets, at a place this model has no such projection (an old
    per-expert adapter's ``mlp.experts.0.q_proj``, say): refused as no projection of this model, not
    as a target outside the server's."""
    from safetensors.torch import save_file

    folder = tmp_path / "per-expert"
    folder.mkdir()
    (folder / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 2, "lora_alpha": 2}')
    prefix = "base_model.model.model.layers.0.mlp.experts.0.q_proj"
    save_file(
        {f"{prefix}.lora_A.weight": torch.zeros(2, 64), f"{prefix}.lora_B.weight": torch.zeros(64, 2)},
        str(folder / "adapter_model.safetensors"),
    )
    refused_load(runner, folder, "adapts model.layers.0.mlp.experts.0.q_proj", "only this model's attention")


def test_another_models_adapter_is_refused(runner: ModelRunner, tiny_checkpoints: Any, folders: Path) -> None:
    """Qwen3's q_proj has 128 output rows (head_dim 32), the tiny Llama's 64: same names, other shapes."""
    qwen3 = Path(tiny_checkpoints.path("qwen3"))
    folder = build_adapter(qwen3, folders / "qwen3", AdapterSpec(r=4, alpha=8, targets=ATTENTION, seed=16))
    refused_load(runner, folder, "do not fit the model's projection", "another base model's adapter")
