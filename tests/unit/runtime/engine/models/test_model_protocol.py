"""The model protocol, the family table and the registry: one list of families, read the same way
by the HF config parser and the GGUF config builder; the engine asks a model only what
``CausalLM`` declares; a device's layer stack takes only the layer choices it implements."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from runtime.checkpoints.families import (
    BY_ARCHITECTURE,
    BY_NAME,
    FAMILIES,
    WindowRule,
    family_of_gguf,
    gguf_architecture_of,
)
from runtime.checkpoints.gguf.config import hf_config
from runtime.checkpoints.gguf.reader import read_gguf
from runtime.engine.config_reading import UnsupportedModelError
from runtime.engine.cpu.decode_layers import CpuLayerStack
from runtime.engine.model_config import ModelConfig
from runtime.engine.model_runner import ModelRunner
from runtime.engine.models.base import CausalLM
from runtime.engine.models.family_configs import FAMILY_CONFIGS
from runtime.engine.models.moe_config import MoeFamilyConfig
from runtime.engine.models.registry import MODEL_CLASSES, get_model_class
from runtime.engine.ops import DecoderLayerWeights, RopeInputs
from runtime.engine.ops.layer_stack import LayerDescription
from tests.support import REPO_ROOT
from tests.support.checkpoints import MOE_CHECKPOINT_NAMES
from tests.support.gguf_files import write_checkpoint_gguf

FAMILY_CHECKPOINTS = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", *MOE_CHECKPOINT_NAMES)


def test_every_family_has_one_implementation_and_nothing_else_does(tiny_checkpoints) -> None:
    assert set(MODEL_CLASSES) == set(BY_NAME)
    for name in FAMILY_CHECKPOINTS:
        config = ModelConfig.from_pretrained(tiny_checkpoints.path(name))
        assert config.family == name and issubclass(get_model_class(config), CausalLM)


def test_each_family_reads_its_own_config_and_no_other(tiny_checkpoints) -> None:
    """The families' own configs (``family_configs``) belong to families of the table, every mixture
    of experts reads its experts, and a model asking for another family's config is refused."""
    assert set(FAMILY_CONFIGS) <= set(BY_NAME)
    assert {n for n, f in BY_NAME.items() if f.moe is not None} == {
        n for n, kind in FAMILY_CONFIGS.items() if issubclass(kind, MoeFamilyConfig)
    }
    for name in FAMILY_CHECKPOINTS:
        config = ModelConfig.from_pretrained(tiny_checkpoints.path(name))
        kind = FAMILY_CONFIGS.get(name)
        assert (type(config.family_config) if kind else None) is kind, name
    gemma = ModelConfig.from_pretrained(tiny_checkpoints.path("gemma2"))
    with pytest.raises(TypeError, match="a gemma2 config has no MoeFamilyConfig"):
        gemma.family_config_as(MoeFamilyConfig)


def test_an_unknown_family_is_refused_by_the_registry(tiny_checkpoints) -> None:
    config = dataclasses.replace(ModelConfig.from_pretrained(tiny_checkpoints.path("llama")), family="deepseek_v3")
    with pytest.raises(UnsupportedModelError, match="deepseek_v3"):
        get_model_class(config)


def test_the_registry_imports_a_family_module_only_when_one_is_built() -> None:
    code = "import sys; import runtime.engine.models.registry as r; print('runtime.engine.models.llama' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("name", FAMILY_CHECKPOINTS)
def test_the_hf_parser_and_the_gguf_builder_read_a_family_alike(name: str, tiny_checkpoints, tmp_path: Path) -> None:
    """The same checkpoint as config.json and as the GGUF file llama.cpp's converter writes: both
    readings come from the family's one entry (architecture, biases, q/k norm, windows, choices).

    llama.cpp writes a Gemma's window but not which layers use it (it hard-codes every 2nd / 6th
    layer full): the GGUF reading's windows are the HF reading's of the config without its
    ``layer_types`` (the tiny gemma3 checkpoint's windowed, full, windowed is not that pattern)."""
    src = tiny_checkpoints.path(name)
    raw = json.loads((src / "config.json").read_text())
    from_hf = ModelConfig.from_dict(raw, src)
    family = BY_NAME[from_hf.family]
    contents = read_gguf(write_checkpoint_gguf(src, tmp_path / f"{name}.gguf"))
    assert contents.architecture == gguf_architecture_of(family)
    from_gguf = ModelConfig.from_dict(hf_config(contents), tmp_path)
    for field in ("family", "architecture", "qkv_bias", "qk_norm", "hidden_act", "norm", "rope_style", "layer_windows"):
        if field == "layer_windows" and family.window_rule is WindowRule.EVERY_NTH_FULL:
            without_types = {k: v for k, v in raw.items() if k not in ("layer_types", "sliding_window_pattern")}
            assert from_gguf.layer_windows == ModelConfig.from_dict(without_types, src).layer_windows
            assert set(from_gguf.layer_windows) - {None} == set(from_hf.layer_windows) - {None}  # the one window
            continue
        assert getattr(from_gguf, field) == getattr(from_hf, field), field
    assert from_hf.qk_norm == family.qk_norm
    assert from_hf.qkv_bias == (
        family.always_qkv_bias or bool(json.loads((src / "config.json").read_text()).get("attention_bias", False))
    )


def test_the_table_names_each_architecture_once_and_finds_converted_mistral() -> None:
    architectures = [arch for family in FAMILIES for arch in family.architectures]
    assert len(architectures) == len(set(architectures)) == len(BY_ARCHITECTURE)
    assert family_of_gguf("llama", "Mistral-7B-Instruct-v0.3") is BY_NAME["mistral"]
    assert family_of_gguf("llama", "SmolLM2 135M Instruct") is BY_NAME["llama"]
    assert family_of_gguf("gemma3", "gemma-3-270m") is BY_NAME["gemma3"]
    assert family_of_gguf("gpt2", "gpt2") is None


@pytest.mark.parametrize(("key", "value", "what"), [("hidden_act", "relu", "hidden_act")])
def test_a_layer_choice_the_layers_lack_is_refused_before_any_weight(
    key: str, value: str, what: str, tiny_checkpoints
) -> None:
    raw = json.loads((tiny_checkpoints.path("llama") / "config.json").read_text())
    with pytest.raises(
        UnsupportedModelError, match=f"unsupported {what} '{value}'; supported: silu, swish, gelu_pytorch_tanh"
    ):
        ModelConfig.from_dict({**raw, key: value}, tiny_checkpoints.path("llama"))


def _runner(path: Path) -> ModelRunner:
    return ModelRunner(path, device="cpu", dtype="float32", max_total_tokens=512, load_progress=False)


def test_the_runner_sizes_attention_from_the_models_attention_layers(tiny_checkpoints) -> None:
    runner = _runner(tiny_checkpoints.path("qwen3"))
    specs = runner.model.attention_layers()
    cfg = runner.model_config
    assert [s.layer_id for s in specs] == list(range(cfg.num_hidden_layers))
    assert {(s.num_heads, s.num_kv_heads, s.head_dim) for s in specs} == {
        (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
    }
    assert (runner.num_heads, runner.num_kv_heads) == (specs[0].num_heads, specs[0].num_kv_heads)


class _RewrittenLayer:
    """A decoder layer whose declared description is rewritten (the choices named in ``rewrite``)."""

    def __init__(self, layer: Any, rewrite: dict[str, str]) -> None:
        self.layer, self.rewrite = layer, rewrite

    def describe(self) -> LayerDescription:
        return dataclasses.replace(self.layer.describe(), **self.rewrite)

    def decode_weights(self) -> DecoderLayerWeights:
        return dataclasses.replace(self.layer.decode_weights(), description=self.describe())


class _Declared:
    """A model as a layer stack sees it, whose layers' descriptions are rewritten (or withheld: None,
    a model that declares no layers)."""

    def __init__(self, model: CausalLM, rewrite: dict[str, str] | None) -> None:
        self.model, self.rewrite = model, rewrite

    def decoder_layers(self) -> list[Any]:
        if self.rewrite is None:
            return []
        return [_RewrittenLayer(layer, self.rewrite) for layer in self.model.decoder_layers()]

    def run_layers(
        self, rope: RopeInputs, hidden: torch.Tensor, batch: Any, backend: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model.run_layers(rope, hidden, batch, backend)

    def rope_tables(self, rope: RopeInputs, dtype: torch.dtype) -> tuple[RopeInputs, ...]:
        return self.model.rope_tables(rope, dtype)


def test_the_cpu_stack_takes_only_the_layer_choices_it_implements(tiny_checkpoints) -> None:
    runner = _runner(tiny_checkpoints.path("llama"))
    assert CpuLayerStack(_Declared(runner.model, {})).description() is not None  # the C call takes these layers
    for rewrite in ({"activation": "gelu"}, {"norm": "rms_one_plus"}, {"rope_style": "gptj"}):
        assert CpuLayerStack(_Declared(runner.model, rewrite)).description() is None, rewrite
    assert CpuLayerStack(_Declared(runner.model, None)).description() is None  # "not of that form"


def test_a_model_without_stackable_layers_serves_through_its_layers(tiny_checkpoints) -> None:
    """``decoder_layers() -> ()`` (the protocol's default) costs nothing but the one-call path."""
    from runtime.engine.forward_batch import ForwardMode
    from tests.support.harness import Harness

    runner = _runner(tiny_checkpoints.path("llama"))
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    h = Harness(runner)
    reqs = h.prefill_sharing(prompts, 0)
    want = h.step(reqs, ForwardMode.DECODE).logits.clone()
    h.reset()
    runner.layer_stack = runner.ops.layer_stack(_Declared(runner.model, None))
    reqs = h.prefill_sharing(prompts, 0)
    got = h.step(reqs, ForwardMode.DECODE).logits.clone()
    h.reset()
    assert torch.equal(want, got)


def test_the_layers_implement_exactly_the_choices_the_table_lists() -> None:
    from runtime.checkpoints import families
    from runtime.engine.layers import choices

    assert set(choices.GATED_ACTIVATIONS) == set(families.ACTIVATIONS)
    assert set(choices.PLAIN_ACTIVATIONS) == set(families.PLAIN_ACTIVATIONS)
    assert set(choices.NORM_LAYERS) == set(families.NORM_FORMS)
    assert set(choices.ROPE_ROTATIONS) == set(families.ROPE_STYLES)
    for family in FAMILIES:
        activations = families.ACTIVATIONS if family.gated_mlp else families.PLAIN_ACTIVATIONS
        assert family.activation in activations and family.norm in families.NORM_FORMS
        assert family.rope_style in families.ROPE_STYLES


def test_reading_a_config_imports_no_torch(tiny_checkpoints) -> None:
    """The tokenizer process reads the config for its limits; the family table is plain data, and
    so are the families' own configs (read beside their models, which need torch)."""
    paths = [str(tiny_checkpoints.path(name)) for name in ("qwen3", "gemma3", "olmoe")]
    code = (
        "import sys; from runtime.engine.model_config import ModelConfig; "
        f"[ModelConfig.from_pretrained(p) for p in {paths!r}]; print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# What llama.cpp's converter and transformers do for each family, written out by hand (not read from
# the table, which both the product and the tests' GGUF writer read): a wrong entry fails here.
EXPECTED = {
    # family: (GGUF architecture written, Q/K rows permuted, q/k/v bias always, q/k norm, window rule)
    "llama": ("llama", True, False, False, "none"),
    "mistral": ("llama", True, False, False, "every_layer"),
    "qwen2": ("qwen2", False, True, False, "from_max_window_layers"),
    "qwen3": ("qwen3", False, False, True, "from_max_window_layers"),
    "phi3": ("phi3", False, False, False, "every_layer"),  # (Phi-3-mini-4k's sliding_window 2047)
    "gemma2": ("gemma2", False, False, False, "every_nth_full"),  # (windowed, full, windowed, ...)
    "gemma3": ("gemma3", False, False, True, "every_nth_full"),  # (five windowed to one full)
    "qwen2_moe": ("qwen2moe", False, True, False, "from_max_window_layers"),
    "qwen3_moe": ("qwen3moe", False, False, True, "from_max_window_layers"),
    "mixtral": ("llama", True, False, False, "every_layer"),  # (converted as a llama with experts)
    "olmoe": ("olmoe", False, False, True, "none"),  # (its q/k norms span the whole projection)
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_family_entry_says_what_its_checkpoints_hold(name: str) -> None:
    from runtime.checkpoints.gguf.config import needs_qk_unpermute

    family = BY_NAME[name]
    arch = gguf_architecture_of(family)
    got = (arch, needs_qk_unpermute(arch), family.always_qkv_bias, family.qk_norm, family.window_rule.value)
    assert got == EXPECTED[name]
    assert set(BY_NAME) == set(EXPECTED) | set(ENCODERS)


# The encoders, served from safetensors only: (their architectures, the MLP's activation and the norm)
ENCODERS = {
    "bert": (("BertModel", "BertForSequenceClassification"), "gelu", "layer_norm"),
    "xlm_roberta": (("XLMRobertaModel", "XLMRobertaForSequenceClassification"), "gelu", "layer_norm"),
}


@pytest.mark.parametrize("name", sorted(ENCODERS))
def test_the_encoder_entries_have_no_gguf_form_and_an_ungated_mlp(name: str) -> None:
    family = BY_NAME[name]
    assert family.encoder and not family.gated_mlp and family.always_qkv_bias
    assert (family.architectures, family.activation, family.norm) == ENCODERS[name]
    assert family.gguf_architectures == () and family_of_gguf(name, name) is None
    with pytest.raises(ValueError, match=f"the {name} family has no GGUF form"):
        gguf_architecture_of(family)
