"""Mixtures of experts (tiny Qwen3-MoE, Mixtral, OLMoE, Qwen2-MoE checkpoints, CPU) beyond what the
parametrized suites check (test_model_equivalence, test_cpu_decode_layers, the speculative tests
run every MoE checkpoint against transformers at batch 1 and 32, chunked, with prefix hits):

- the router against transformers' own router modules: ties, every token to one expert,
  renormalised or not, fp32 or rounded weights;
- the device's grouped experts against a per-token reference (an expert with no tokens, every token
  to one expert, the experts split over ranks), in fp32 and bf16, dense and kept quantized, and a
  batch-1 step reading only its routed experts' weights;
- TP 2 and EP 2 (two ranks on threads) equal to TP 1, the memory invariant after each;
- the config: sparse layers, ``--ep-size`` checks.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from runtime.checkpoints.families import BY_NAME
from runtime.engine.config_reading import MoeConfig, UnsupportedModelError
from runtime.engine.layers.moe import SparseMoeMLP, route
from runtime.engine.model_config import ModelConfig
from runtime.engine.model_runner import ModelRunner
from runtime.engine.models.moe_config import MoeFamilyConfig
from runtime.engine.models.olmoe_config import OlmoeConfig
from runtime.engine.ops import get_ops
from runtime.engine.ops.experts import ExpertRouting
from runtime.engine.quant.weight import QuantizedWeight
from tests.support.checkpoints import MOE_CHECKPOINT_NAMES, TinyCheckpoints, random_prompt
from tests.support.harness import Harness
from tests.support.stub_scheduler import generate_greedy
from tests.support.tp_threads import ThreadTPGroup, run_on_ranks

NEW_TOKENS = 8


def _runner(path: Path, **kwargs: Any) -> ModelRunner:
    kwargs.setdefault("attention_backend", "torch_native")
    return ModelRunner(path, device="cpu", dtype="float32", max_total_tokens=2048, load_progress=False, **kwargs)


def _moe(num_experts: int = 8, top_k: int = 2, renormalize: bool = False, rounded: bool = True) -> MoeConfig:
    return MoeConfig(num_experts, top_k, 16, renormalize, rounded, (True,))


# ---- the router ---------------------------------------------------------------------------


def _transformers_router(kind: str, weight: torch.Tensor, top_k: int, renormalize: bool) -> Any:
    from transformers import MixtralConfig, OlmoeConfig, Qwen3MoeConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.olmoe.modeling_olmoe import OlmoeTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    experts, hidden = weight.shape
    common = {"hidden_size": hidden, "num_experts_per_tok": top_k}
    router: Any
    if kind == "mixtral":
        router = MixtralTopKRouter(MixtralConfig(**common, num_local_experts=experts))
    elif kind == "olmoe":
        router = OlmoeTopKRouter(OlmoeConfig(**common, num_experts=experts, norm_topk_prob=renormalize))
    else:
        router = Qwen3MoeTopKRouter(Qwen3MoeConfig(**common, num_experts=experts, norm_topk_prob=renormalize))
    with torch.no_grad():
        router.weight.copy_(weight)
    return router


def _router_weight(case: str, experts: int, hidden: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    weight = torch.randn(experts, hidden, generator=gen)
    if case == "ties":  # experts 1, 4 and 6 share a row: equal logits, broken as torch.topk breaks them
        weight[4] = weight[1]
        weight[6] = weight[1]
    elif case == "one_expert":  # for positive activations, expert 5's logit dwarfs every other
        weight *= 1e-3
        weight[5] = 1.0
    elif case == "all_equal":  # every logit equal
        weight.zero_()
    return weight.to(dtype)


# (Mixtral's router always renormalises)
ROUTERS = [("qwen3_moe", False), ("qwen3_moe", True), ("olmoe", False), ("olmoe", True), ("mixtral", True)]


@pytest.mark.parametrize(("kind", "renormalize"), ROUTERS)
@pytest.mark.parametrize("case", ["random", "ties", "one_expert", "all_equal"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_router_chooses_and_weighs_as_transformers(kind: str, renormalize: bool, case: str, dtype: torch.dtype) -> None:
    experts, hidden, top_k = 8, 32, 3
    weight = _router_weight(case, experts, hidden, dtype)
    x = torch.randn(19, hidden, generator=torch.Generator().manual_seed(3)).to(dtype)
    if case == "one_expert":
        x = x.abs() + 1.0
    reference = _transformers_router(kind, weight, top_k, renormalize).to(dtype)
    with torch.no_grad():
        _, ref_weights, ref_ids = reference(x)
    rounded = kind != "mixtral"
    ours = route(F.linear(x, weight), _moe(experts, top_k, renormalize, rounded))
    assert torch.equal(ours.ids, ref_ids)
    assert ours.weights.dtype == ref_weights.dtype and torch.equal(ours.weights, ref_weights)
    if case == "one_expert":
        assert bool((ours.ids[:, 0] == 5).all())
    if case in ("ties", "all_equal"):  # equal probabilities: still k distinct experts, as topk picked them
        assert all(len(set(row)) == top_k for row in ours.ids.tolist())


# ---- the grouped experts against a per-token reference --------------------------------------------


class _Experts(SparseMoeMLP):
    """A sparse MLP built from a tiny config, recording which experts' weights a forward read."""

    def __init__(self, num_experts: int, local: range | None, dtype: torch.dtype, act: str = "silu") -> None:
        config = _tiny_config(num_experts, act)
        moe = config.family_config_as(MoeFamilyConfig).moe
        assert moe is not None
        super().__init__(config, moe, 0, 1, dtype, get_ops("cpu", dtype))
        gen = torch.Generator().manual_seed(11)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
        if local is not None:
            self.local_experts = local
        self.read: list[int] = []

    def expert_weights(self, expert: int) -> tuple[Any, Any]:
        self.read.append(expert)
        return super().expert_weights(expert)


def _tiny_config(num_experts: int, act: str = "silu") -> ModelConfig:
    raw = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "hidden_size": 64,
        "intermediate_size": 96,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "vocab_size": 100,
        "num_experts": num_experts,
        "num_experts_per_tok": 2,
        "hidden_act": act,
    }
    return ModelConfig.from_dict(raw, Path("."))


def _per_token(layer: SparseMoeMLP, x: torch.Tensor, routing: ExpertRouting) -> torch.Tensor:
    """Each token alone through each of its experts, accumulated in ascending expert order."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        choices = sorted(zip(routing.ids[t].tolist(), routing.weights[t]))
        for expert, weight in choices:
            if expert not in layer.local_experts:
                continue
            gate_up, down = layer.expert_weights(expert)
            dense = [w.dequantize(dtype=x.dtype) if isinstance(w, QuantizedWeight) else w for w in (gate_up, down)]
            gate, up = F.linear(x[t : t + 1], dense[0]).chunk(2, dim=-1)
            act = F.silu(gate) if layer.activation == "silu" else F.gelu(gate, approximate="tanh")
            out[t] += (F.linear(act * up, dense[1]) * weight).to(x.dtype)[0]
    return out


def _routing(tokens: int, num_experts: int, case: str, dtype: torch.dtype) -> ExpertRouting:
    gen = torch.Generator().manual_seed(5)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:2] for _ in range(tokens)])
    if case == "empty_expert":
        ids[ids == 3] = (ids[ids == 3] + 1) % num_experts
        ids[:, 1] = torch.where(ids[:, 0] == ids[:, 1], (ids[:, 1] + 2) % num_experts, ids[:, 1])
        ids[ids == 3] = 0 if num_experts > 4 else 1
    elif case == "one_expert":
        ids[:, 0] = 2
        ids[:, 1] = torch.where(ids[:, 1] == 2, 0, ids[:, 1])
    weights = torch.rand(tokens, 2, generator=gen).to(dtype)
    return ExpertRouting(ids=ids, weights=weights)


@pytest.mark.parametrize("ops_name", ["torch", "cpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["random", "empty_expert", "one_expert"])
@pytest.mark.parametrize("tokens", [1, 5, 33])
def test_grouped_experts_equal_each_token_alone(ops_name: str, dtype: torch.dtype, case: str, tokens: int) -> None:
    from runtime.engine.ops import TorchOps

    layer = _Experts(8, None, dtype)
    ops = TorchOps() if ops_name == "torch" else get_ops("cpu", dtype)
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(tokens)).to(dtype)
    routing = _routing(tokens, 8, case, torch.float32 if ops_name == "torch" else dtype)
    got = ops.moe_experts(x, routing, layer)
    want = _per_token(layer, x, routing)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    if case == "empty_expert":
        assert 3 not in layer.read


def test_a_batch_of_one_reads_only_its_routed_experts() -> None:
    layer = _Experts(16, None, torch.float32)
    x = torch.randn(1, 64)
    routing = route(layer.gate(x), dataclasses.replace(_moe(16, 2), weights_in_model_dtype=True))
    layer.read.clear()
    get_ops("cpu", torch.float32).moe_experts(x, routing, layer)
    assert sorted(layer.read) == sorted(routing.ids[0].tolist())


def test_experts_split_over_ranks_sum_to_the_whole() -> None:
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(2))
    routing = _routing(9, 8, "random", torch.float32)
    ops = get_ops("cpu", torch.float32)
    whole = ops.moe_experts(x, routing, _Experts(8, None, torch.float32))
    halves = [ops.moe_experts(x, routing, _Experts(8, part, torch.float32)) for part in (range(0, 4), range(4, 8))]
    torch.testing.assert_close(halves[0] + halves[1], whole, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
def test_kept_quantized_experts_multiply_as_their_dequantized_values(act: str) -> None:
    from runtime.engine.quant.loading import finish_loading

    layer = _Experts(8, None, torch.float32, act)
    finish_loading(layer, "int8")
    assert not isinstance(layer.gate.weight, QuantizedWeight)  # the router stays dense
    gate_up, down = layer.expert_weights(0)
    assert isinstance(gate_up, QuantizedWeight) and isinstance(down, QuantizedWeight)
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(4))
    routing = _routing(6, 8, "random", torch.float32)
    got = get_ops("cpu", torch.float32).moe_experts(x, routing, layer)
    # the int8 kernels quantize the activations too: close to the dequantized weights' products
    torch.testing.assert_close(got, _per_token(layer, x, routing), rtol=0.05, atol=0.05)


# ---- tensor and expert parallelism --------------------------------------------------------------


@pytest.mark.parametrize("name", MOE_CHECKPOINT_NAMES)
@pytest.mark.parametrize("ep_size", [1, 2])
def test_two_ranks_reproduce_one(
    name: str, ep_size: int, tiny_checkpoints: TinyCheckpoints, thread_tp_group: ThreadTPGroup
) -> None:
    """TP 2 (each rank a slice of every expert) and EP 2 (each rank half the experts, whole)
    give TP 1's greedy tokens; every rank's KV pool is whole again after."""
    path = tiny_checkpoints.path(name)
    whole = _runner(path)
    prompts = [random_prompt(n, whole.vocab_size, seed=90 + n) for n in (3, 17, 40)]
    expected = [r.output_ids for r in Harness(whole).generate(prompts, NEW_TOKENS)]
    ranks = [_runner(path, tp_rank=r, tp_size=2, ep_size=ep_size) for r in range(2)]
    if ep_size == 2:
        layer = next(m for m in ranks[1].model.modules() if isinstance(m, SparseMoeMLP))
        experts = layer.num_experts
        assert layer.local_experts == range(experts // 2, experts) and len(layer.experts) == experts // 2
    # the experts' weights are counted where the KV pool is sized: each rank holds about half of them
    expert_bytes = sum(
        p.numel() * p.element_size()
        for m in whole.model.modules()
        if isinstance(m, SparseMoeMLP)
        for p in m.experts.parameters()
    )
    for runner in ranks:
        assert whole.weight_bytes() - runner.weight_bytes() >= expert_bytes // 2

    # each rank's own serial scheduler (the same batches on both), the memory invariant checked after
    outputs = run_on_ranks(thread_tp_group, lambda rank: generate_greedy(ranks[rank], prompts, NEW_TOKENS))
    assert outputs == [expected, expected]


# ---- the config ---------------------------------------------------------------------------------


def test_sparse_layers_and_expert_counts_are_read_per_family(tiny_checkpoints: TinyCheckpoints) -> None:
    got = {
        n: ModelConfig.from_pretrained(tiny_checkpoints.path(n)).family_config_as(MoeFamilyConfig).moe
        for n in MOE_CHECKPOINT_NAMES
    }
    summary = {
        n: (m.num_experts, m.top_k, m.intermediate_size, m.renormalize, m.weights_in_model_dtype, m.sparse_layers)
        for n, m in got.items()
        if m is not None
    }
    assert summary == {
        "qwen3_moe": (16, 4, 32, True, True, (True, False, True)),
        "mixtral": (8, 2, 48, True, False, (True, True)),
        "olmoe": (6, 2, 32, False, True, (True, True)),
        "qwen2_moe": (8, 2, 32, False, True, (False, True)),
    }
    assert got["qwen2_moe"] is not None and got["qwen2_moe"].shared_expert_intermediate_size == 96
    olmoe = ModelConfig.from_pretrained(tiny_checkpoints.path("olmoe"))
    assert (BY_NAME[olmoe.family].qk_norm_span, olmoe.family_config_as(OlmoeConfig).clip_qkv) == ("projection", 1.5)


def test_expert_parallelism_is_checked_against_the_model(tiny_checkpoints: TinyCheckpoints) -> None:
    assert ModelConfig.from_pretrained(tiny_checkpoints.path("olmoe"), ep_size=2).num_experts == 6
    with pytest.raises(UnsupportedModelError, match="6 experts cannot be split evenly over --ep-size 4"):
        ModelConfig.from_pretrained(tiny_checkpoints.path("olmoe"), ep_size=4)
    with pytest.raises(UnsupportedModelError, match="needs a mixture-of-experts model"):
        ModelConfig.from_pretrained(tiny_checkpoints.path("llama"), ep_size=2)


def test_int8_keeps_every_expert_quantized_and_the_routers_dense(tiny_checkpoints: TinyCheckpoints) -> None:
    """``--quantization int8`` on Qwen2-MoE: every expert's (and the shared expert's) projections kept
    as int8, both routers dense; the first step's log-probabilities stay close to the dense model's
    and the memory invariant holds after serving."""
    path = tiny_checkpoints.path("qwen2_moe")
    dense, int8 = _runner(path), _runner(path, quantization="int8")
    layer = next(m for m in int8.model.modules() if isinstance(m, SparseMoeMLP))
    assert all(isinstance(w, QuantizedWeight) for e in layer.local_experts for w in layer.expert_weights(e))
    assert layer.shared_expert is not None and isinstance(layer.shared_expert.down_proj.weight, QuantizedWeight)
    assert layer.shared_expert_gate is not None
    assert not isinstance(layer.gate.weight, QuantizedWeight) and not isinstance(
        layer.shared_expert_gate.weight, QuantizedWeight
    )
    prompts = [random_prompt(n, dense.vocab_size, seed=7 + n) for n in (4, 19)]
    first = []
    for runner in (dense, int8):
        harness = Harness(runner)
        first.append([r.logprobs[0] for r in harness.generate(prompts, 1, return_logprob=True)])
        harness.reset()
    assert first[1] == pytest.approx(first[0], abs=0.1)
    assert len(generate_greedy(int8, prompts, NEW_TOKENS)) == len(prompts)
