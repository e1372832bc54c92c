"""The fused mixture-of-experts Triton kernels (``runtime.engine.cuda.moe_kernels`` and the routing
layout of ``moe_align``) against a plain per-(token, choice) loop, on CPU under Triton's interpreter
in fp32. The same checks run compiled in bf16/fp16/fp32, with a CUDA graph, in
tests/gpu/test_fused_moe_gpu.py.

Triton picks interpreter or compiled mode when ``triton`` is first imported, so this module sets
``TRITON_INTERPRET=1`` before anything imports it (see tests/support/triton_interp.py).
"""

from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

from typing import Any  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from runtime.engine.cuda.triton_common import triton_loaded_interpreted  # noqa: E402

IN_PROCESS = "triton" not in sys.modules or triton_loaded_interpreted()

from runtime.engine.cuda.moe_align import align_pairs_to_blocks, max_padded_pairs  # noqa: E402
from runtime.engine.cuda.moe_kernels import fused_experts, reference_experts  # noqa: E402
from tests.support.moe_cases import expert_case  # noqa: E402
from tests.support.triton_interp import replace_tests_with_fresh_process_run  # noqa: E402

FP32 = torch.float32
TOL = 1e-5
ACTIVATIONS = ["silu", "gelu_pytorch_tanh"]


# ---- the meaning, written as plainly as possible -----------------------------------------


def _plain_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str,
    expert_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """out[t] = sum over token t's local choices j of (down(act(gate) * up) * weight[t, j]).to(x.dtype)."""
    inter = w2.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            if expert_map is not None:
                e = int(expert_map[e])
            if e < 0:
                continue  # the expert lives on another rank
            gate_up = F.linear(x[t : t + 1], w13[e])
            gate, up = gate_up[:, :inter], gate_up[:, inter:]
            act = F.silu(gate) if activation in ("silu", "swish") else F.gelu(gate, approximate="tanh")
            contribution = F.linear(act * up, w2[e]) * topk_weights[t, j]
            out[t] += contribution.to(x.dtype).float()[0]
    return out.to(x.dtype)


def _check(case: dict[str, Any], activation: str, expert_map: torch.Tensor | None = None) -> torch.Tensor:
    out = fused_experts(**case, activation=activation, expert_map=expert_map)
    want = _plain_experts(**case, activation=activation, expert_map=expert_map)
    assert out.shape == case["x"].shape and out.dtype == case["x"].dtype
    torch.testing.assert_close(out, want, atol=TOL, rtol=TOL)
    return out


# ---- the reference itself ------------------------------------------------------------------


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_reference_experts_is_the_plain_loop(activation: str) -> None:
    case = expert_case(9, 8, 2, 40, 24, seed=1)
    torch.testing.assert_close(
        reference_experts(**case, activation=activation),
        _plain_experts(**case, activation=activation),
        atol=1e-6,
        rtol=1e-6,
    )
    emap = torch.tensor([0, -1, 1, -1, 2, -1, 3, -1], dtype=torch.int32)
    local = {k: v[::2] if k in ("w13", "w2") else v for k, v in case.items()}
    torch.testing.assert_close(
        reference_experts(**local, activation=activation, expert_map=emap),
        _plain_experts(**local, activation=activation, expert_map=emap),
        atol=1e-6,
        rtol=1e-6,
    )


# ---- alignment -----------------------------------------------------------------------------


def _check_alignment(ids: torch.Tensor, num_experts: int, block_m: int, expert_map: torch.Tensor | None) -> None:
    num_pairs = ids.numel()
    align = align_pairs_to_blocks(ids, num_experts, block_m, expert_map)
    num_blocks = -(-max_padded_pairs(num_pairs, num_experts, block_m) // block_m)
    assert align.sorted_ids.shape == (num_blocks * block_m,) and align.expert_of_block.shape == (num_blocks,)
    assert align.sorted_ids.dtype == align.expert_of_block.dtype == align.num_tokens_post_padded.dtype == torch.int32
    local = ids.reshape(-1).long()
    if expert_map is not None:
        local = expert_map.long()[local]
    counts = [int((local == e).sum()) for e in range(num_experts)]
    padded = [-(-c // block_m) * block_m for c in counts]
    assert int(align.num_tokens_post_padded) == sum(padded)

    sorted_ids = align.sorted_ids.long()
    block_expert = align.expert_of_block.long().repeat_interleave(block_m)  # each slot's expert
    is_pair = sorted_ids < num_pairs
    assert ((sorted_ids == num_pairs) | is_pair).all(), "padding is only the sentinel"
    placed = sorted_ids[is_pair]
    assert sorted(placed.tolist()) == [p for p in range(num_pairs) if local[p] >= 0], "each local pair once, no remote"
    assert torch.equal(block_expert[is_pair], local[placed]), "each pair sits in its expert's block"
    # blocks: experts ascending over the padded total, each run exactly its padded size, then -1
    used = sum(padded) // block_m
    want_blocks = [e for e in range(num_experts) for _ in range(padded[e] // block_m)] + [-1] * (num_blocks - used)
    assert align.expert_of_block.tolist() == want_blocks
    # within an expert, pairs keep their order (a stable layout: the same routing, the same rows)
    for e in range(num_experts):
        mine = sorted_ids[(block_expert == e) & is_pair].tolist()
        assert mine == sorted(mine) and len(mine) == counts[e]


@pytest.mark.parametrize("tokens,top_k,experts,block_m", [(1, 1, 4, 16), (3, 2, 8, 16), (17, 2, 8, 16), (50, 4, 6, 8)])
def test_alignment_places_every_local_pair_once(tokens: int, top_k: int, experts: int, block_m: int) -> None:
    gen = torch.Generator().manual_seed(tokens * 7 + experts)
    ids = torch.rand(tokens, experts, generator=gen).topk(top_k, dim=1).indices
    _check_alignment(ids, experts, block_m, None)


def test_alignment_with_remote_experts_and_skewed_routing() -> None:
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 16, (40, 2), generator=gen)
    ids[:20, 0] = 5  # one expert far past a block; 80 pairs: two of the interpreter's 64-pair scan chunks
    emap = torch.full((16,), -1, dtype=torch.int32)
    emap[[1, 5, 9, 12, 14]] = torch.tensor([4, 0, 1, 2, 3], dtype=torch.int32)  # five local, in shuffled order
    _check_alignment(ids, 5, 16, emap)
    _check_alignment(torch.full((40, 2), 7), 5, 16, emap)  # every choice remote: no block has work


def test_alignment_sizes_depend_only_on_the_shapes() -> None:
    """What a CUDA graph needs: the same buffers for any routing of the same batch."""
    shapes = set()
    for ids in (torch.zeros(7, 2, dtype=torch.int64), torch.arange(14).reshape(7, 2) % 8, torch.full((7, 2), 3)):
        align = align_pairs_to_blocks(ids, 8, 16)
        shapes.add((align.sorted_ids.shape, align.expert_of_block.shape, align.num_tokens_post_padded.shape))
    assert len(shapes) == 1
    assert max_padded_pairs(8, 128, 16) == 8 + 8 * 15  # decode: only as many experts as pairs can be busy


# ---- fused_experts -------------------------------------------------------------------------

SHAPES = [
    # tokens, experts, top_k, hidden, inter
    (1, 4, 1, 32, 16),
    (3, 8, 2, 32, 16),
    (17, 8, 2, 40, 24),  # hidden and inter not multiples of the blocks
    (17, 4, 1, 40, 24),
    (3, 4, 2, 64, 48),  # two depth steps in both GEMMs
]


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("tokens,experts,top_k,hidden,inter", SHAPES)
def test_fused_experts_matches_reference(
    tokens: int, experts: int, top_k: int, hidden: int, inter: int, activation: str
) -> None:
    _check(expert_case(tokens, experts, top_k, hidden, inter, seed=tokens + 10 * experts + top_k), activation)


def test_swish_is_silu_and_unknown_activations_are_refused() -> None:
    case = expert_case(3, 4, 2, 32, 16, seed=2)
    assert torch.equal(fused_experts(**case, activation="swish"), fused_experts(**case, activation="silu"))
    with pytest.raises(ValueError, match="relu"):
        fused_experts(**case, activation="relu")


def test_an_expert_without_tokens_and_one_with_them_all() -> None:
    ids = torch.tensor([[0, 3], [3, 1], [1, 0], [3, 0], [0, 1]])  # expert 2 gets nothing
    _check(expert_case(5, 4, 2, 40, 24, seed=4, ids=ids), "silu")
    _check(expert_case(17, 8, 1, 40, 24, seed=5, ids=torch.full((17, 1), 6)), "gelu_pytorch_tanh")
    both = torch.tensor([[2, 5]]).expand(17, 2)  # every token to the same two experts: runs past a block
    _check(expert_case(17, 8, 2, 40, 24, seed=6, ids=both), "silu")


@pytest.mark.parametrize("interleaved", [False, True])
def test_expert_parallel_ranks_add_up_to_one_rank(interleaved: bool) -> None:
    """Two ranks with complementary expert maps: each matches the reference for its experts, and
    their outputs sum to the one-rank output (a token whose choices are all remote gets zeros)."""
    case = expert_case(17, 8, 2, 40, 24, seed=7)
    case["topk_ids"][0] = torch.tensor([1, 3]) if interleaved else torch.tensor([4, 6])  # all remote on rank 0
    whole = _check(case, "silu")
    owned = [list(range(0, 8, 2)), list(range(1, 8, 2))] if interleaved else [list(range(4)), list(range(4, 8))]
    parts = []
    for experts in owned:
        emap = torch.full((8,), -1, dtype=torch.int32)
        emap[experts] = torch.arange(len(experts), dtype=torch.int32)
        rank_case = dict(case, w13=case["w13"][experts], w2=case["w2"][experts])
        parts.append(_check(rank_case, "silu", emap))
    assert torch.equal(parts[0][0], torch.zeros(40))
    torch.testing.assert_close(parts[0] + parts[1], whole, atol=TOL, rtol=TOL)


def test_rank_without_any_local_choice_gives_zeros() -> None:
    case = expert_case(3, 2, 2, 32, 16, seed=8, ids=torch.tensor([[0, 1], [1, 0], [0, 1]]))
    emap = torch.tensor([-1, -1, 0, 1], dtype=torch.int32)  # this rank holds experts 2 and 3: nobody chose them
    assert torch.equal(fused_experts(**case, activation="silu", expert_map=emap), torch.zeros(3, 32))


def test_routing_weights_in_the_model_dtype() -> None:
    """bf16 activations (fp32 math under the interpreter) with weights in bf16 and in fp32: each
    follows the reference to about one bf16 rounding."""
    for weights_dtype in (torch.bfloat16, FP32):
        case = expert_case(9, 4, 2, 32, 16, seed=9, dtype=torch.bfloat16, weights_dtype=weights_dtype)
        out = fused_experts(**case, activation="silu")
        assert out.dtype == torch.bfloat16
        want = _plain_experts(**case, activation="silu")
        torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)


def test_empty_batch() -> None:
    case = expert_case(0, 4, 2, 32, 16, seed=10)
    assert fused_experts(**case, activation="silu").shape == (0, 32)


class _RecordOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.add(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


# aten ops that read a device value on the host (or size a result from values): each would sync on cuda
_SYNCING_OPS = {"aten._local_scalar_dense", "aten.item", "aten.nonzero", "aten.masked_select", "aten.bincount"}
_SYNCING_OPS |= {"aten.unique", "aten._unique", "aten._unique2", "aten.unique_consecutive", "aten.repeat_interleave"}


def test_no_torch_op_reads_values_on_the_host() -> None:
    """A CPU stand-in for the GPU test's CUDA-graph capture: no torch op in ``fused_experts`` turns
    a tensor's value into a host value or sizes a result from values (the Triton launches pass
    pointers and shapes only)."""
    case = expert_case(9, 8, 2, 32, 16, seed=11)
    emap = torch.tensor([0, 1, 2, 3, -1, -1, -1, -1], dtype=torch.int32)
    case = dict(case, w13=case["w13"][:4], w2=case["w2"][:4])
    with _RecordOps() as seen:
        fused_experts(**case, activation="silu", expert_map=emap)
    assert {"aten.full", "aten.zeros", "aten.sum"} <= seen.ops, seen.ops  # (the mode saw the wrapper's torch ops)
    assert not seen.ops & _SYNCING_OPS, seen.ops & _SYNCING_OPS
    with _RecordOps() as seen:
        reference_experts(**case, activation="silu")
    assert "aten.nonzero" in seen.ops  # the recorder does see a syncing op where there is one


# ---- through the device ops: a whole tiny model, and experts split over ranks ----------------------


def test_whole_moe_model_through_triton_ops_matches_torch_ops(tiny_checkpoints: Any, monkeypatch: Any) -> None:
    """Tiny Qwen3-MoE (16 experts, top-4, a dense layer between) and OLMoE (whole-projection q/k norms):
    the same greedy tokens and logprobs through TritonOps (the fused kernel on stacked experts) as
    through TorchOps (the expert loop); TritonOps can capture the model's decode, TorchOps cannot."""
    from runtime.engine import model_runner
    from runtime.engine.cuda import moe_kernels
    from runtime.engine.cuda.ops import TritonOps
    from runtime.engine.ops import TorchOps
    from tests.support.harness import Harness

    calls = []
    real = moe_kernels.fused_experts
    monkeypatch.setattr(moe_kernels, "fused_experts", lambda *a, **k: calls.append(1) or real(*a, **k))
    for name in ("qwen3_moe", "olmoe"):
        outputs = []
        for ops in (TritonOps(), TorchOps()):
            monkeypatch.setattr(model_runner, "get_ops", lambda device, dtype, ops=ops: ops)
            runner = model_runner.ModelRunner(
                tiny_checkpoints.path(name), device="cpu", dtype="float32", max_total_tokens=512, load_progress=False
            )
            assert ops.graph_safe(runner.model) == isinstance(ops, TritonOps)
            prompts = [[3, 9, 27, 5, 11, 70][: 3 + i] for i in range(3)]
            h = Harness(runner)
            outputs.append([(r.output_ids, r.logprobs) for r in h.generate(prompts, 5, return_logprob=True)])
        (tri, ref) = outputs
        assert [ids for ids, _ in tri] == [ids for ids, _ in ref], name
        for (_, lp_tri), (_, lp_ref) in zip(tri, ref):
            assert lp_tri == pytest.approx(lp_ref, abs=1e-4)
    assert calls  # the fused kernel ran


def test_stacked_experts_of_one_rank_view_the_stack_and_map_remote_ids(tiny_checkpoints: Any) -> None:
    """An EP rank's experts are stacked with a map sending other ranks' ids to -1; each expert's
    parameters view their row of the stack (one copy), and the fused output equals the loop's."""
    from runtime.engine.cuda.ops import TritonOps, stack_experts
    from runtime.engine.layers.moe import SparseMoeMLP
    from runtime.engine.model_config import ModelConfig
    from runtime.engine.models.moe_config import MoeFamilyConfig
    from runtime.engine.ops import TorchOps
    from runtime.engine.ops.experts import ExpertRouting

    config = ModelConfig.from_pretrained(tiny_checkpoints.path("qwen3_moe"), ep_size=2)
    ops = TritonOps()
    moe = config.family_config_as(MoeFamilyConfig).moe
    assert moe is not None
    layer = SparseMoeMLP(config, moe, tp_rank=1, tp_size=2, dtype=FP32, ops=ops)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    stacked = stack_experts(layer)
    assert stacked is not None and stacked.expert_map is not None
    assert stacked.expert_map.tolist() == [-1] * 8 + list(range(8))
    gate_up, down = layer.expert_weights(9)
    assert gate_up.data_ptr() == stacked.w13[1].data_ptr() and down.data_ptr() == stacked.w2[1].data_ptr()
    ops.prepare_model(layer)
    x = torch.randn(7, 64, generator=gen)
    ids = torch.stack([torch.randperm(16, generator=gen)[:4] for _ in range(7)])  # both ranks' experts
    routing = ExpertRouting(ids=ids, weights=torch.rand(7, 4, generator=gen))
    torch.testing.assert_close(
        ops.moe_experts(x, routing, layer), TorchOps().moe_experts(x, routing, layer), rtol=TOL, atol=TOL
    )


if not IN_PROCESS:
    replace_tests_with_fresh_process_run(globals(), __file__)
