"""Fast paths of CpuAttnBackend (views, causal, cascade over a shared prefix, the
decode-key mirror) and prepacked bf16 linears, against per-request references.

The code under test: runtime/engine/attention/fastpaths.py (planning), runtime/engine/cpu/attention.py and
runtime/engine/cpu/prepacked.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from test_model_attention import HKV, D, H, _forward_and_check, _reference, _run

from memory.kv_pool import MHATokenToKVPool
from memory.req_to_token_pool import ReqToTokenPool
from runtime.engine.attention.base import AttentionLayerSpec
from runtime.engine.attention.plan import CASCADE_MIN_PREFIX, TorchNativeMetadata
from runtime.engine.cpu import attention_fastpaths as fastpaths
from runtime.engine.cpu import attention_kernels as attn_kernels
from runtime.engine.cpu import attention_kernels_f32
from runtime.engine.cpu import kernels as cpu_kernels
from runtime.engine.cpu.attention import CpuAttnBackend
from runtime.engine.cpu.prepacked import PackedCopy, prepack_available
from runtime.engine.cpu.weight_plan import plan_model
from runtime.engine.forward_batch import ForwardBatch, ForwardMode
from runtime.engine.loading.weight_loader import load_model_weights
from runtime.engine.model_runner import ModelRunner
from runtime.engine.ops.linear_weights import LinearWeightLayer
from tests.support.checkpoints import random_prompt
from tests.support.harness import Harness


def _record_calls(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str, record: Callable[..., Any]) -> list[Any]:
    """Wrap ``owner.<name>`` so each call appends ``record(*args, **kwargs)`` to the returned list."""
    calls: list[Any] = []
    real = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        calls.append(record(*args, **kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, wrapper)
    return calls


def t(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def test_equal_length_prefill_uses_views_and_causal() -> None:
    meta = _run(ForwardMode.EXTEND, [0, 0, 0], [9, 9, 9])
    (g,) = meta.groups
    assert g.keys_are_new and g.q_start == 0 and g.out_tokens is None


def test_equal_length_extend_after_prefix() -> None:
    meta = _run(ForwardMode.EXTEND, [5, 5, 5], [7, 7, 7])
    (g,) = meta.groups
    assert not g.keys_are_new and g.q_start == 0 and g.out_tokens is None


def test_decode_equal_lengths_has_no_mask() -> None:
    meta = _run(ForwardMode.DECODE, [12, 12, 12, 12], [1, 1, 1, 1])
    assert meta.groups[0].mask is None


def _run_shared(
    mode: ForwardMode,
    shared: int,
    own_lens: list[int],
    ext_lens: list[int],
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    head_dim: int = D,
) -> TorchNativeMetadata:
    """Requests whose first ``shared`` KV slots are the same (then ``own_lens`` cached tokens of
    their own), extended by ``ext_lens``; every output row checked against the reference
    (inputs rounded to ``dtype``; half precision within 3e-2)."""
    gen = torch.Generator().manual_seed(seed)
    bs = len(own_lens)
    total = shared + sum(o + e for o, e in zip(own_lens, ext_lens))
    pool = MHATokenToKVPool(total + 8, 1, dtype, 1, HKV, head_dim, "cpu")
    rtt = ReqToTokenPool(bs + 1, shared + max(o + e for o, e in zip(own_lens, ext_lens)) + 1, "cpu")
    slots = (torch.randperm(total, generator=gen) + 1).tolist()
    shared_slots, slots = slots[:shared], slots[shared:]
    k_sh = torch.randn(shared, HKV, head_dim, generator=gen).to(dtype)
    v_sh = torch.randn(shared, HKV, head_dim, generator=gen).to(dtype)
    pool.set_kv_buffer(0, torch.tensor(shared_slots, dtype=torch.int64), k_sh, v_sh)
    rows = list(range(bs))[::-1]
    k_seq, v_seq, new_locs, prefix_lens = [], [], [], []
    for i in range(bs):
        n = own_lens[i] + ext_lens[i]
        mine, slots = slots[:n], slots[n:]
        rtt.write(rows[i], 0, torch.tensor(shared_slots + mine))
        k_i = torch.randn(n, HKV, head_dim, generator=gen).to(dtype)
        v_i = torch.randn(n, HKV, head_dim, generator=gen).to(dtype)
        k_seq.append(torch.cat([k_sh, k_i]))
        v_seq.append(torch.cat([v_sh, v_i]))
        own = own_lens[i]
        pool.set_kv_buffer(0, torch.tensor(mine[:own], dtype=torch.int64), k_i[:own], v_i[:own])
        new_locs.extend(mine[own:])
        prefix_lens.append(shared + own)
    return _forward_and_check(mode, k_seq, v_seq, prefix_lens, ext_lens, rows, new_locs, pool, rtt, gen, dtype)


@pytest.mark.parametrize("score_bytes", [1 << 30, 64])  # one chunk of query rows / many
@pytest.mark.parametrize(
    "mode,own,ext",
    [
        (ForwardMode.EXTEND, [0, 0, 0], [5, 5, 5]),
        (ForwardMode.EXTEND, [0, 2, 0, 7], [3, 6, 1, 4]),
        (ForwardMode.DECODE, [0, 3, 9], [1, 1, 1]),
    ],
)
def test_bf16_cascade_over_shared_prefix(score_bytes, mode, own, ext, monkeypatch) -> None:
    """bf16 cascades: the shared keys through bf16 GEMMs + the C row softmax (prefill) or the
    decode kernel's prefix segment, against the fp32 reference."""
    monkeypatch.setattr(fastpaths, "_PREFILL_SCORE_BYTES", score_bytes)
    _run_shared(mode, CASCADE_MIN_PREFIX + 5, own, ext, dtype=torch.bfloat16)


@pytest.mark.parametrize("own", [[0, 0, 0], [3, 0, 7, 1], [5, 5]])
def test_decode_cascade_over_shared_prefix(own) -> None:
    meta = _run_shared(ForwardMode.DECODE, CASCADE_MIN_PREFIX + 9, own, [1] * len(own))
    (g,) = meta.groups
    assert g.shared is not None and g.shared.loc.numel() >= CASCADE_MIN_PREFIX + 9


def test_short_shared_prefix_is_not_cascaded() -> None:
    meta = _run_shared(ForwardMode.DECODE, CASCADE_MIN_PREFIX - 1, [2, 4], [1, 1])
    assert meta.groups[0].shared is None


def test_mixed_with_cascaded_one_token_rows() -> None:
    meta = _run_shared(ForwardMode.MIXED, CASCADE_MIN_PREFIX + 3, [4, 0, 6, 2], [1, 5, 1, 3])
    assert meta.groups[0].shared is not None


# ---- end to end through the tiny model: cascade + mirror against one request at a time ----


@pytest.fixture(scope="module")
def tiny_runner(tiny_llama_path: Path) -> ModelRunner:
    return ModelRunner(tiny_llama_path, device="cpu", dtype="float32", max_total_tokens=16384, load_progress=False)


def _alone(h: Harness, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    (r,) = h.generate([prompt], steps, return_logprob=True)
    out = (r.output_ids, r.logprobs)
    h.reset()
    return out


def test_shared_prefix_decode_batch_equals_alone(tiny_runner: ModelRunner) -> None:
    h = Harness(tiny_runner)
    vocab = tiny_runner.vocab_size
    prefix = random_prompt(45, vocab, seed=7)
    prompts = [prefix + random_prompt(1 + 3 * i, vocab, seed=70 + i) for i in range(6)]
    first = h.add_request(prompts[0])
    h.prefill([first], return_logprob=True)
    others = [h.add_request(p) for p in prompts[1:]]
    for o in others:
        h.share_prefix(first, o, len(prefix))
    h.prefill(others, return_logprob=True)
    reqs = [first] + others
    backend = tiny_runner.attn_backend
    h.decode(reqs, 7, return_logprob=True)
    assert backend.mirror.rows is not None and backend.mirror.prefix_slots.numel() >= len(prefix)
    batched = [(r.output_ids, r.logprobs) for r in reqs]
    h.reset()
    for p, (ids, lps) in zip(prompts, batched):
        ids1, lps1 = _alone(h, p, 8)
        assert ids == ids1
        assert lps == pytest.approx(lps1, abs=1e-4)


def test_mirror_survives_batch_changes(tiny_runner: ModelRunner) -> None:
    h = Harness(tiny_runner)
    vocab = tiny_runner.vocab_size
    prompts = [random_prompt(5 + 4 * i, vocab, seed=90 + i) for i in range(5)]
    a = [h.add_request(p) for p in prompts[:4]]
    h.prefill(a, return_logprob=True)
    h.decode(a, 3, return_logprob=True)  # rebuild, then appends
    h.decode(a[:3], 2, return_logprob=True)  # one left: rows differ -> rebuild
    late = h.add_request(prompts[4])
    h.prefill([late], return_logprob=True)  # an extend in between -> dropped
    h.decode(a[:3] + [late], 4, return_logprob=True)
    h.decode(a[:3], 1, return_logprob=True)
    got = [(r.output_ids, r.logprobs) for r in a[:3] + [a[3], late]]
    h.reset()
    steps = [11, 11, 11, 4, 5]
    for p, n, (ids, lps) in zip(prompts[:3] + [prompts[3], prompts[4]], steps, got):
        ids1, lps1 = _alone(h, p, n)
        assert ids == ids1
        assert lps == pytest.approx(lps1, abs=1e-4)


def _onednn_packing_refusal(dtype: torch.dtype) -> str | None:
    """None when oneDNN packs a ``dtype`` linear weight on this CPU, else why not: its own
    error names the CPU feature it lacks (bf16 wants AVX-512 BW/VL/DQ or AVX-NE-CONVERT, so
    an AVX2-only CPU refuses), or this torch build has no oneDNN linear ops at all."""
    if not prepack_available():
        return "this torch build has no oneDNN prepacked linear ops (torch.ops.mkldnn)"
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.ones(16, 16, dtype=dtype), 64)
    except RuntimeError as exc:
        return str(exc)
    return None


def test_prepacked_bf16_linears_are_bit_identical(tiny_llama_path: Path) -> None:
    """What packing does on this CPU: where oneDNN packs bf16 weights, every linear is packed
    and the packed path gives the same bits as F.linear, per layer and for the whole model;
    where it refuses (an AVX2-only CPU), nothing is packed and every linear runs F.linear.
    Both paths are checked here by capping oneDNN: ONEDNN_MAX_CPU_ISA=AVX2."""
    refusal = _onednn_packing_refusal(torch.bfloat16)
    runner = ModelRunner(tiny_llama_path, device="cpu", dtype="bfloat16", max_total_tokens=4096, load_progress=False)
    slots = [m for m in runner.model.modules() if isinstance(m, LinearWeightLayer)]
    packed = [m for m in slots if _has_packed_copy(m)]
    assert slots, "the model has no linear layer"
    if refusal is None:
        assert len(packed) == len(slots), "oneDNN packs bf16 weights on this CPU, yet some linears were left unpacked"
    else:
        assert packed == [], f"linears were packed although oneDNN refuses: {refusal}"
        assert plan_model(runner.model) == 0  # a refusal is no error: the model serves unpacked
    gen = torch.Generator().manual_seed(0)
    for m in slots:  # each layer's linear is F.linear's bits, packed or not
        x = torch.randn(7, m.weight.shape[1], generator=gen).to(torch.bfloat16)
        bias = getattr(m, "bias", None)
        got = runner.ops.linear(x, m.weight, bias, m.plan)  # (as the layer calls it: with its plan)
        plain = torch.nn.functional.linear(x, m.weight_values(), bias)  # (the values its packed copy holds)
        assert torch.equal(got, plain), (type(m).__name__, refusal)
    prompts = [random_prompt(n, runner.vocab_size, seed=n) for n in (3, 17, 30)]

    def logits() -> torch.Tensor:
        h = Harness(runner)
        reqs = [h.add_request(p) for p in prompts]
        batch, _ = h.build_batch(reqs, ForwardMode.EXTEND)
        out = runner.forward(batch).logits
        h.reset()
        return out

    as_loaded = logits()
    assert torch.isfinite(as_loaded).all()
    if refusal is not None:
        return  # nothing was packed: the model above ran on F.linear alone
    for m in packed:
        m.drop_plan()
    assert torch.equal(as_loaded, logits())
    assert plan_model(runner.model) == len(slots)
    load_model_weights(runner.model, tiny_llama_path, progress=False)  # a reload drops every plan (and its copy)
    assert all(m.plan is None for m in slots)


def _has_packed_copy(layer: LinearWeightLayer) -> bool:
    """Whether the layer's plan reads a packed copy of its weight."""
    return layer.plan is not None and any(isinstance(band.operand, PackedCopy) for band in layer.plan.bands)


@pytest.mark.parametrize(
    "own,ext", [([0, 0, 0], [5, 5, 5]), ([0, 2, 0, 7], [3, 6, 1, 4]), ([4, 4], [9, 9]), ([0, 0], [1, 6])]
)
def test_extend_cascade_over_shared_prefix(own, ext) -> None:
    meta = _run_shared(ForwardMode.EXTEND, CASCADE_MIN_PREFIX + 5, own, ext)
    multi = [g for g in meta.groups if not g.one_token]
    assert multi and all(g.shared_loc is not None for g in multi if g.q_index.shape[0] > 1)


def test_mixed_batch_with_uneven_cached_prefixes() -> None:
    _run_shared(ForwardMode.MIXED, CASCADE_MIN_PREFIX + 2, [3, 0, 11], [4, 1, 2])


def _decode_steps(
    dtype: torch.dtype, shared: int, own_lens: list[int], steps: int, seed: int = 0, head_dim: int = D
) -> list[TorchNativeMetadata]:
    """Consecutive decode steps through one backend (mirror rebuild, then appends) vs the reference."""
    gen = torch.Generator().manual_seed(seed)
    bs = len(own_lens)
    total = shared + sum(own_lens) + bs * steps
    pool = MHATokenToKVPool(total + 8, 1, dtype, 1, HKV, head_dim, "cpu")
    rtt = ReqToTokenPool(bs + 1, shared + max(own_lens) + steps + 1, "cpu")
    slots = (torch.randperm(total, generator=gen) + 1).tolist()
    shared_slots, slots = slots[:shared], slots[shared:]
    k_sh = torch.randn(shared, HKV, head_dim, generator=gen).to(dtype)
    v_sh = torch.randn(shared, HKV, head_dim, generator=gen).to(dtype)
    if shared:
        pool.set_kv_buffer(0, torch.tensor(shared_slots, dtype=torch.int64), k_sh, v_sh)
    rows = list(range(bs))[::-1]
    ks, vs, tables = [], [], []
    for i in range(bs):
        mine, slots = slots[: own_lens[i]], slots[own_lens[i] :]
        k_i = torch.randn(own_lens[i], HKV, head_dim, generator=gen).to(dtype)
        v_i = torch.randn(own_lens[i], HKV, head_dim, generator=gen).to(dtype)
        pool.set_kv_buffer(0, torch.tensor(mine, dtype=torch.int64), k_i, v_i)
        ks.append(torch.cat([k_sh, k_i]))
        vs.append(torch.cat([v_sh, v_i]))
        tables.append(shared_slots + mine)
        rtt.write(rows[i], 0, torch.tensor(tables[i]))
    backend = CpuAttnBackend()
    metas = []
    for _ in range(steps):
        new = slots[:bs]
        slots = slots[bs:]
        prefix_lens = [len(tb) for tb in tables]
        for i in range(bs):
            rtt.write(rows[i], prefix_lens[i], torch.tensor([new[i]]))
            tables[i].append(new[i])
        seq_lens = [p + 1 for p in prefix_lens]
        q = torch.randn(bs, H, head_dim, generator=gen).to(dtype)
        kv_new = torch.randn(bs, 2 * HKV, head_dim, generator=gen).to(dtype)
        k_new, v_new = kv_new[:, :HKV], kv_new[:, HKV:]  # strided rows, as views of the model's qkv output
        for i in range(bs):
            ks[i] = torch.cat([ks[i], k_new[i : i + 1]])
            vs[i] = torch.cat([vs[i], v_new[i : i + 1]])
        batch = ForwardBatch(
            forward_mode=ForwardMode.DECODE,
            input_ids=torch.zeros(bs, dtype=torch.int64),
            positions=torch.zeros(bs, dtype=torch.int64),
            req_pool_indices=t(rows),
            seq_lens=t(seq_lens),
            prefix_lens=t(prefix_lens),
            extend_lens=t([1] * bs),
            out_cache_loc=t(new),
            req_to_token_pool=rtt,
            token_to_kv_pool=pool,
            seq_lens_cpu=seq_lens,
            prefix_lens_cpu=prefix_lens,
            extend_lens_cpu=[1] * bs,
        )
        backend.init_forward_metadata(batch)
        out = backend.forward(q, k_new, v_new, AttentionLayerSpec(0, H, HKV, head_dim, head_dim**-0.5), batch)
        assert out.dtype == dtype
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        for i in range(bs):
            expected = _reference(q[i : i + 1].float(), ks[i].float(), vs[i].float(), prefix_lens[i])
            torch.testing.assert_close(out[i : i + 1].float(), expected, atol=tol, rtol=tol)
        metas.append(batch.attn_metadata)
    return metas


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shared", [0, CASCADE_MIN_PREFIX + 3])
def test_consecutive_decode_steps_through_the_mirror(dtype, shared, monkeypatch) -> None:
    appends = _record_calls(
        monkeypatch,
        attn_kernels,
        "decode_attention",
        lambda *args, **kwargs: kwargs.get("append", args[7] if len(args) > 7 else None) is not None,
    )
    metas = _decode_steps(dtype, shared, [5, 1, 9, 3], steps=4)
    plans = [m.groups[0].mirror for m in metas]
    assert plans[0].rebuild and not any(p.rebuild for p in plans[1:])  # one gather, then appends
    assert all((m.groups[0].shared is not None) == bool(shared) for m in metas)
    # The decode kernel (bf16 wherever the kernels build; fp32 on AVX2 / AVX-512 builds) stores each
    # append step's new keys itself (the first step rebuilds from the pool); else torch runs throughout.
    kernel = cpu_kernels.available() if dtype == torch.bfloat16 else attention_kernels_f32.applies()
    assert appends == ([False, True, True, True] if kernel else [])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decode_cascade_through_the_packed_prefix_kernel(dtype, monkeypatch) -> None:
    """Head dim 64: a shared prefix goes through attn_kernels.prefix_attention (packed once per
    rebuild) and each request's own keys through the decode kernel continuing its softmax."""
    calls = _record_calls(monkeypatch, attn_kernels, "prefix_attention", lambda q, packed, scale: packed.length)
    shared = CASCADE_MIN_PREFIX + 7
    metas = _decode_steps(dtype, shared, [5, 1, 9, 3], steps=3, head_dim=64)
    assert all(m.groups[0].shared is not None for m in metas)
    supported = attn_kernels.prefix_supported(dtype, torch.device("cpu"), 64)
    assert calls == ([shared] * 3 if supported else [])


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (8, 2)])
@pytest.mark.parametrize("score_bytes", [1 << 30, 700, 1])  # all in one chunk / runs of 6 positions / of 1
@pytest.mark.parametrize("c_softmax", [True, False])
def test_half_precision_prefill_matmul_path_is_causal_attention(
    heads, kv_heads, score_bytes, c_softmax, monkeypatch
) -> None:
    """The bf16 CPU prefill path (folded GQA groups, chunks of requests) against fp32 SDPA,
    with its log-sum-exp (the cascade's merge input), through the C softmax and through torch's."""
    monkeypatch.setattr(fastpaths, "_PREFILL_SCORE_BYTES", score_bytes)
    if not c_softmax:
        monkeypatch.setattr(cpu_kernels, "softmax_supported", lambda scores: False)
    gen = torch.Generator().manual_seed(3)
    n, length, d = 5, 11, 16
    q = torch.randn(n, length, heads, d, generator=gen).bfloat16()
    k = torch.randn(n, kv_heads, length, d, generator=gen).bfloat16()
    v = torch.randn(n, kv_heads, length, d, generator=gen).bfloat16()
    out, lse = fastpaths.matmul_causal_attention(q, k, v, d**-0.5, with_lse=True)
    assert out.shape == (n * length, heads, d) and out.dtype == torch.bfloat16
    assert lse is not None and lse.shape == (n * length, heads) and lse.dtype == torch.float32
    qf, kf = q.float().transpose(1, 2), k.float().repeat_interleave(heads // kv_heads, dim=1)
    expected = (
        torch.nn.functional.scaled_dot_product_attention(
            qf, k.float(), v.float(), is_causal=True, scale=d**-0.5, enable_gqa=True
        )
        .transpose(1, 2)
        .reshape(n * length, heads, d)
    )
    torch.testing.assert_close(out.float(), expected, atol=3e-2, rtol=3e-2)
    scores = (qf @ kf.transpose(-1, -2) * d**-0.5).masked_fill(
        torch.ones(length, length, dtype=torch.bool).triu(1), float("-inf")
    )
    expected_lse = scores.logsumexp(-1).transpose(1, 2).reshape(n * length, heads)
    torch.testing.assert_close(lse, expected_lse, atol=3e-2, rtol=1e-2)  # scores were bf16 GEMM outputs
    assert fastpaths.matmul_causal_attention(q, k, v, d**-0.5)[1] is None


def test_bf16_equal_length_prefill_takes_the_matmul_path(monkeypatch) -> None:
    calls = _record_calls(monkeypatch, fastpaths, "causal_prefill_attention", lambda q, *args, **kwargs: q.shape[0])
    _run(ForwardMode.EXTEND, [0, 0, 0], [9, 9, 9], dtype=torch.bfloat16)
    assert calls == [3]


@pytest.mark.parametrize("extend_lens", [[9, 9, 9], [40]])
def test_fp32_equal_length_prefill_takes_the_causal_kernel(extend_lens, monkeypatch) -> None:
    """fp32 prompts with no cached prefix go through attn_kernels.causal_attention where the fp32
    kernels apply (AVX2 / AVX-512 builds), else through the flash kernel; either way against the reference."""
    calls = _record_calls(monkeypatch, attn_kernels, "causal_attention", lambda q, *args, **kwargs: q.shape[0])
    _run(ForwardMode.EXTEND, [0] * len(extend_lens), extend_lens)
    assert calls == ([len(extend_lens)] if attention_kernels_f32.applies() else [])


@pytest.mark.parametrize("dtype,head_dim", [(torch.float32, D), (torch.bfloat16, 64)])
def test_extend_cascade_through_the_prefix_kernel(dtype, head_dim, monkeypatch) -> None:
    """A shared-prefix prefill attends the shared keys with attn_kernels.prefix_attention (where it
    applies: fp32 at the vector builds, bf16 at head dims of 64 on AVX-512, AMX where present) and
    merges with the causal part; checked against the reference."""
    calls = _record_calls(monkeypatch, attn_kernels, "prefix_attention", lambda q, packed, scale: packed.length)
    shared = CASCADE_MIN_PREFIX + 5
    _run_shared(ForwardMode.EXTEND, shared, [0, 0, 0], [5, 5, 5], dtype=dtype, head_dim=head_dim)
    _run_shared(ForwardMode.EXTEND, shared, [0, 2, 0, 7], [3, 6, 1, 4], dtype=dtype, head_dim=head_dim)
    supported = attn_kernels.prefix_supported(dtype, torch.device("cpu"), head_dim)
    assert calls == ([shared] * 2 if supported else [])
