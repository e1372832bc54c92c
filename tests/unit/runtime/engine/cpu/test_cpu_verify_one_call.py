"""A speculative verify step through the one-call decode path (runtime/engine/cpu/decode_layers.py with the
decode-key mirror's ``plan_verify``): each request's input token and drafts are rows of the call that
share the request's mirror row (``kv_row``), each attending to its keys up to itself.

The oracle is the same tokens fed one decode step at a time through the model's layers: in fp32 a
verify row's logits must equal that decode step's bit for bit (the fp32 linears give a row the same
bits in any batch, and the attention kernel reads the same keys in the same order, in whole vectors);
in bf16 (AMX or AVX512-BF16 linears, whose row invariance is not a contract) they must agree to
bf16's rounding. After the step,
the drafts a request rejected are cut (their keys lie past its length in the copies), and the next
decode step must append to the copies, not rebuild them, and still equal the oracle.
"""

from __future__ import annotations

import random

import pytest
import torch

from runtime.engine.cpu import attention_kernels_f32, decode_layers, kernel_library
from runtime.engine.cpu.ops import CpuOps
from runtime.engine.cpu.prepacked import fp32_panel_rows
from runtime.engine.cpu.weight_plan import plan_weight
from runtime.engine.forward_batch import ForwardMode
from runtime.engine.model_runner import ModelRunner
from tests.support.checkpoints import random_prompt
from tests.support.cpu_features import bf16_kernels
from tests.support.harness import Harness, HarnessRequest

DTYPES = [
    pytest.param(
        "bfloat16",
        marks=pytest.mark.skipif(
            bf16_kernels() is None,
            reason="needs a CPU with AVX512-BF16 (avx512_bf16; AMX where it has them) for the bf16 call",
        ),
    ),
    pytest.param(
        "float32",
        marks=pytest.mark.skipif(
            not (fp32_panel_rows() and attention_kernels_f32.applies()),
            reason="needs a CPU with AVX2 and FMA (or AVX-512) and the kernels' vector build of it for the fp32 call",
        ),
    ),
]
PRE_STEPS = 2  # decode steps before the verify: the mirror's rebuild, then an append


def _same(got: torch.Tensor, want: torch.Tensor, dtype: str) -> bool:
    """Bit for bit in fp32; to bf16's rounding in bf16."""
    if dtype == "float32":
        return torch.equal(got, want)
    return torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2 * float(want.abs().max()))


@pytest.fixture
def calls(one_call_runs: list[bool]) -> list[bool]:
    """Per forward that asked: whether ``decode_layers.run`` ran the layers (True) or declined."""
    return one_call_runs


def _start(runner: ModelRunner, shared_prefix: int, requests: int) -> tuple[Harness, list[HarnessRequest]]:
    """Prefill ``requests`` prompts (the first ``shared_prefix`` tokens common, cached once) and decode
    ``PRE_STEPS`` steps (through the one call where it applies)."""
    h = Harness(runner)
    vocab = runner.vocab_size
    prefix = random_prompt(shared_prefix, vocab, seed=3) if shared_prefix else []
    prompts = [prefix + random_prompt(3 + 4 * i, vocab, seed=40 + i) for i in range(requests)]
    reqs = h.prefill_sharing(prompts, shared_prefix)
    with decode_layers.use_decode_layers(True):
        h.decode(reqs, PRE_STEPS)
    return h, reqs


def _fed_logits(runner: ModelRunner, shared_prefix: int, feeds: list[list[int]]) -> list[list[torch.Tensor]]:
    """The oracle: after ``_start``, each request's pending token and then ``feeds[r]`` run one decode
    step at a time through the layers, the whole batch every step (a request whose feeds ended takes
    its own samples: a batch of other rows may round differently, e.g. one row alone); the logits of
    each step, per request, up to its feeds' end."""
    h, reqs = _start(runner, shared_prefix, len(feeds))
    out: list[list[torch.Tensor]] = [[] for _ in reqs]
    for step in range(max(len(f) for f in feeds) + 1):
        with decode_layers.use_decode_layers(False):
            logits = h.step(reqs, ForwardMode.DECODE).logits
        for i, feed in enumerate(feeds):
            if step <= len(feed):
                out[i].append(logits[i].clone())
            if step < len(feed):
                reqs[i].output_ids[-1] = feed[step]  # teacher forcing: the next input is the draft
    h.reset()
    return out


def _verify(h: Harness, reqs: list[HarnessRequest], drafts: list[list[int]]) -> torch.Tensor:
    """One verify forward: each request's pending token and its drafts; the logits of every row."""
    for req, draft in zip(reqs, drafts):
        req.output_ids.extend(draft)
    batch, counts = h.build_batch(reqs, ForwardMode.VERIFY)
    assert counts == [1 + len(d) for d in drafts]
    with decode_layers.use_decode_layers(True):
        return h.runner.forward(batch).logits.clone()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("name", "shared_prefix"), [("llama", 0), ("qwen2", 0), ("llama_hd64", 40)])
def test_verify_rows_equal_decode_steps_and_the_next_step_appends(
    name: str, shared_prefix: int, dtype: str, tiny_checkpoints, calls: list[bool]
) -> None:
    runner = ModelRunner(
        tiny_checkpoints.path(name), device="cpu", dtype=dtype, max_total_tokens=8192, load_progress=False
    )
    rng = random.Random(7)
    drafts = [[rng.randrange(3, runner.vocab_size) for _ in range(k)] for k in (4, 0, 2, 3, 1)]
    oracle = _fed_logits(runner, shared_prefix, drafts)

    calls.clear()
    h, reqs = _start(runner, shared_prefix, len(drafts))
    starts = [req.kv_len for req in reqs]  # each request's first new key in the pool row
    logits = _verify(h, reqs, drafts)
    assert calls[-1] is True, calls  # the verify ran through the one call, on the copies
    row = 0
    for i, draft in enumerate(drafts):
        for j in range(len(draft) + 1):
            assert _same(logits[row], oracle[i][j], dtype), f"request {i}, verify row {j} differs"
            row += 1

    # Each request keeps its input token and ``accepted`` drafts, then emits the token its row sampled.
    accepted = [min(len(d), a) for d, a in zip(drafts, (1, 0, 2, 0, 1))]
    row_of = [sum(len(d) + 1 for d in drafts[:i]) for i in range(len(drafts))]
    emitted = [int(logits[row_of[i] + a].argmax()) for i, a in enumerate(accepted)]
    for req, draft, a, start, token in zip(reqs, drafts, accepted, starts, emitted):
        del req.output_ids[len(req.output_ids) - (len(draft) - a) :]
        del req.slots[start + 1 + a :]  # (the rejected drafts' slots; the harness never reuses them)
        req.output_ids.append(token)
    with decode_layers.use_decode_layers(True):
        after = h.step(reqs, ForwardMode.DECODE).logits.clone()
    assert calls[-1] is True, calls  # appended to the copies: their rejected keys were simply overwritten
    h.reset()
    expected = _fed_logits(runner, shared_prefix, [d[:a] + [t] for d, a, t in zip(drafts, accepted, emitted)])
    for i, a in enumerate(accepted):
        assert _same(after[i], expected[i][a + 1], dtype), f"request {i}: the decode step after the verify differs"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shared_prefix", [0, 40])
def test_verify_of_other_requests_gathers_the_copies_again(
    dtype: str, shared_prefix: int, tiny_checkpoints, calls: list[bool]
) -> None:
    """A verify whose requests are not the mirrored ones (one dropped out, as when a request
    finishes) cannot append: the copies are gathered again from the pool first, and the step still
    runs through the one call, its rows equal to the decode steps' (a row's bits do not depend on
    the other rows of its batch)."""
    runner = ModelRunner(
        tiny_checkpoints.path("llama_hd64"), device="cpu", dtype=dtype, max_total_tokens=8192, load_progress=False
    )
    drafts = [[5, 6, 7], [8, 9]]
    oracle = _fed_logits(runner, shared_prefix, drafts + [[]])
    calls.clear()
    h, reqs = _start(runner, shared_prefix, 3)
    logits = _verify(h, reqs[:2], drafts)
    assert calls[-1] is True, calls
    if shared_prefix:  # the gathered copies keep the shared prefix apart (cascade), as a decode rebuild does
        assert runner.attn_backend.mirror.prefix_slots.numel() == shared_prefix
    rows = [oracle[0][0], oracle[0][1], oracle[0][2], oracle[0][3], oracle[1][0], oracle[1][1], oracle[1][2]]
    for i, (got, want) in enumerate(zip(logits, rows)):
        assert _same(got, want, dtype), f"verify row {i} differs"
    h.reset()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_rows_share_mirror_rows(dtype: torch.dtype) -> None:
    """The attention kernel alone (each dtype's): query rows mapped onto shared mirror rows equal
    each row run against its own copy of that row."""
    from runtime.engine.cpu import attention_kernels as attn_kernels

    torch.manual_seed(0)
    kv_n, hkv, group, d, cap = 3, 2, 2, 16, 32
    q = torch.randn(7, hkv, group, d).to(dtype)
    k_t, v = torch.randn(kv_n, hkv, d, cap).to(dtype), torch.randn(kv_n, hkv, cap, d).to(dtype)
    kv_row = torch.tensor([0, 0, 0, 1, 2, 2, 2], dtype=torch.int64)
    pos = torch.tensor([10, 11, 12, 5, 20, 21, 22], dtype=torch.int64)
    new_k, new_v = torch.randn(7, hkv, d).to(dtype), torch.randn(7, hkv, d).to(dtype)
    bias = torch.zeros(7, 1, 1, cap).masked_fill_(
        torch.arange(cap)[None, None, None, :] > pos[:, None, None, None], float("-inf")
    )
    if not attn_kernels.supports(q, k_t, v, bias):
        pytest.skip("needs the CPU kernels (fp32: a vector build, AVX2 and FMA or AVX-512)")
    # the reference: each query row against its own copy of its mirror row with every new key of that row stored
    ref_k, ref_v = k_t.clone(), v.clone()
    for b in range(7):
        ref_k[kv_row[b], :, :, pos[b]] = new_k[b]
        ref_v[kv_row[b], :, pos[b]] = new_v[b]
    own_k, own_v = ref_k[kv_row].contiguous(), ref_v[kv_row].contiguous()
    want, want_lse = attn_kernels.decode_attention(q, own_k, own_v, bias, 0.25, 24, True)
    got, got_lse = attn_kernels.decode_attention(
        q, k_t, v, bias, 0.25, 24, True, attn_kernels.KeyAppend(new_k, new_v, pos), kv_row=kv_row
    )
    assert torch.equal(k_t, ref_k) and torch.equal(v, ref_v)  # every append landed in its request's row
    assert torch.equal(got, want) and torch.equal(got_lse, want_lse)


@pytest.mark.parametrize("level", [name for name in kernel_library.host_levels() if name != "baseline"])
def test_fp32_linear_rows_do_not_depend_on_the_batch_size(level: str) -> None:
    """What the fp32 verify above rests on, at every vector level this host runs (AVX2, AVX-512,
    AVX-512 + BF16): a weight's plan gives a row the same bits in a call of any decode size,
    one row included. (The AVX-512 builds once left one to three rows to F.linear, MKL's sums, so a
    3-request decode step and the same rows in a 7-row verify differed in the last bits.)"""
    torch.manual_seed(1)
    weight, bias = torch.randn(96, 300), torch.randn(96)
    x = torch.randn(9, 300)
    ops = CpuOps()
    with kernel_library.use_level(level):
        if not fp32_panel_rows():
            pytest.skip(f"no vector build of the {level} kernels here (a compiler is needed)")
        assert 1 in fp32_panel_rows(), f"{level}: one row must take the panel kernel as larger batches do"
        plan = plan_weight(weight)  # (made at this level: its band is this level's)
        assert [band.kernel for band in plan.bands] == ["f32"]
        whole = ops.linear(x, weight, bias, plan)
        for m in range(1, x.shape[0]):
            for r0 in (0, x.shape[0] - m):
                part = ops.linear(x[r0 : r0 + m], weight, bias, plan)
                assert torch.equal(part, whole[r0 : r0 + m]), f"{level}: rows {r0}..{r0 + m - 1} alone differ"
