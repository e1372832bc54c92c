"""The Triton attention kernels against plain-torch references, on CPU under Triton's interpreter.

Triton picks interpreter or compiled mode when ``triton`` is first imported, so this module
sets ``TRITON_INTERPRET=1`` before anything imports it. When another test module already
imported ``triton`` in compiled mode (``transformers`` does), the tests of this module are
replaced by one test that runs this file in a fresh interpreter-mode process.
"""

from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported, see the module docstring

import pytest  # noqa: E402
import torch  # noqa: E402

from runtime.engine.cuda.triton_common import triton_loaded_interpreted  # noqa: E402

IN_PROCESS = "triton" not in sys.modules or triton_loaded_interpreted()

from runtime.engine.cuda.attention_kernels import decode_attention as decode_mod  # noqa: E402
from runtime.engine.cuda.attention_kernels.decode_attention import decode_attention_fwd, get_num_kv_splits  # noqa: E402
from runtime.engine.cuda.attention_kernels.extend_attention import extend_attention_fwd  # noqa: E402
from runtime.engine.cuda.attention_kernels.kv_indices import create_kv_indices  # noqa: E402
from tests.support.triton_interp import replace_tests_with_fresh_process_run  # noqa: E402

MAX_SPLITS = 8


# ---- helpers ---------------------------------------------------------------------------


def _indptr(lens: list[int]) -> torch.Tensor:
    out = torch.zeros(len(lens) + 1, dtype=torch.int32)
    out[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int64), 0)
    return out


def _slot_layout(total_lens: list[int], page_size: int, gen: torch.Generator) -> tuple[list[torch.Tensor], int]:
    """KV slots for each request's tokens, as a paged allocator hands them out.

    page_size 1: slots scattered at random. page_size > 1: each request owns whole pages
    (``page_size`` consecutive slots each), the pages themselves in shuffled order.
    Slot 0 (page 0) is the pool's padding and never used. Returns (slots per request, pool size).
    """
    pages_needed = [-(-n // page_size) for n in total_lens]
    num_pages = sum(pages_needed) + 3  # a few pages nobody owns
    order = torch.randperm(num_pages, generator=gen) + 1
    slots, used = [], 0
    for n, p in zip(total_lens, pages_needed):
        pages = order[used : used + p]
        used += p
        run = (pages[:, None] * page_size + torch.arange(page_size)[None, :]).reshape(-1)
        slots.append(run[:n])
    return slots, (num_pages + 1) * page_size


def _reference(
    q: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    q_rows: list[torch.Tensor],
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Softmax attention in fp64 per request: request i's queries ``q[q_rows[i]]`` see ``keys[i]``
    causally aligned to the end (query j of n sees keys ``0 .. len - n + j``; with ``window`` W,
    only the last W of those)."""
    num_heads = q.shape[1]
    out = torch.zeros(q.shape[0], num_heads, values[0].shape[-1], dtype=torch.float64)
    for rows, k, v in zip(q_rows, keys, values):
        group = num_heads // k.shape[1]
        k = k.double().repeat_interleave(group, 1)
        v = v.double().repeat_interleave(group, 1)
        qq = q[rows].double()
        n, total = qq.shape[0], k.shape[0]
        scores = torch.einsum("qhd,khd->hqk", qq, k) * scale
        distance = (total - n + torch.arange(n))[:, None] - torch.arange(total)[None, :]
        visible = (distance >= 0) & (distance < (window if window is not None else total + 1))
        scores = scores.masked_fill(~visible, float("-inf"))
        out[rows] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out


def _decode_case(
    group: int, head_dim: int, dtype: torch.dtype, seed: int
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    num_kv_heads = 4 // group if group <= 4 else 1
    num_heads = num_kv_heads * group
    lens = [1, 2] + torch.randint(3, 48, (2,), generator=gen).tolist()  # 1 and 2 < the 4 / 8 splits
    slots, pool = _slot_layout(lens, 1, gen)
    k_buf = torch.randn(pool, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_buf = torch.randn(pool, num_kv_heads, head_dim, generator=gen).to(dtype)
    q = torch.randn(len(lens), num_heads, head_dim, generator=gen).to(dtype)
    case = dict(
        q=q, k_buffer=k_buf, v_buffer=v_buf, kv_indptr=_indptr(lens), kv_indices=torch.cat(slots).to(torch.int32)
    )
    ref = _reference(
        q,
        [k_buf[s] for s in slots],
        [v_buf[s] for s in slots],
        [torch.tensor([i]) for i in range(len(lens))],
        head_dim**-0.5,
    )
    return case, ref


def _run_decode(case: dict[str, torch.Tensor], splits: list[int] | int, grouped: bool) -> torch.Tensor:
    q = case["q"]
    bs, num_heads, head_dim = q.shape
    if isinstance(splits, int):
        splits = [splits] * bs
    o = torch.full_like(q, float("nan"))
    logits = torch.full((bs, num_heads, MAX_SPLITS, head_dim), float("nan"))
    lse = torch.full((bs, num_heads, MAX_SPLITS), float("nan"))
    decode_attention_fwd(
        q,
        case["k_buffer"],
        case["v_buffer"],
        o,
        case["kv_indptr"],
        case["kv_indices"],
        logits,
        lse,
        torch.tensor(splits, dtype=torch.int32),
        MAX_SPLITS,
        head_dim**-0.5,
        grouped=grouped,
    )
    return o


# ---- kv_indices ------------------------------------------------------------------------


@pytest.mark.parametrize("with_start", [False, True])
def test_create_kv_indices_concatenates_req_to_token_rows(with_start: bool) -> None:
    gen = torch.Generator().manual_seed(1)
    req_to_token = torch.randint(1, 10_000, (6, 150), dtype=torch.int32, generator=gen)
    req_pool_indices = torch.tensor([4, 0, 2, 5], dtype=torch.int64)
    lens = torch.tensor([5, 0, 130, 1], dtype=torch.int64)  # 130 > one block: the loop runs twice
    starts = torch.tensor([3, 7, 10, 0], dtype=torch.int64) if with_start else torch.zeros(4, dtype=torch.int64)
    kv_indptr = _indptr(lens.tolist())
    kv_indices = torch.full((int(lens.sum()) + 3,), -1, dtype=torch.int32)  # tail must stay untouched
    create_kv_indices(req_to_token, req_pool_indices, lens, kv_indptr, starts if with_start else None, kv_indices)
    expected = torch.cat([req_to_token[r, s : s + n] for r, s, n in zip(req_pool_indices, starts, lens)])
    assert torch.equal(kv_indices[: expected.numel()], expected)
    assert (kv_indices[expected.numel() :] == -1).all()


# ---- decode ----------------------------------------------------------------------------


# Each group size and each head size (80: a padded block of dimensions), not every pair: under the
# interpreter a case costs 3-4 s of the suite, and the two choices meet in different places.
@pytest.mark.parametrize("group,head_dim", [(1, 64), (2, 80), (4, 80)])
def test_decode_matches_reference_fp32(group: int, head_dim: int) -> None:
    case, ref = _decode_case(group, head_dim, torch.float32, seed=10 * group + head_dim)
    variants = {
        "per_head/1": _run_decode(case, 1, grouped=False),
        "per_head/8": _run_decode(case, 8, grouped=False),
        "grouped/4": _run_decode(case, 4, grouped=True),
        "grouped/mixed": _run_decode(case, [8, 1, 4, 8], grouped=True),
    }
    for name, out in variants.items():
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5, msg=lambda m: f"{name}: {m}")
    # Splitting and grouping only reorder fp32 sums: all variants agree far below the tolerance.
    base = variants["per_head/1"]
    for name, out in variants.items():
        torch.testing.assert_close(out, base, atol=2e-6, rtol=0, msg=lambda m: f"{name} vs per_head/1: {m}")


def test_decode_with_gpu_split_alignment(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU split lengths are rounded up to whole blocks, which empties trailing parts."""
    monkeypatch.setattr(decode_mod, "split_align", lambda: 8)
    case, ref = _decode_case(4, 64, torch.float32, seed=5)
    for grouped in (False, True):
        out = _run_decode(case, [8, 8, 8, 3], grouped=grouped)
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype,tol", [(torch.float16, 2e-3), (torch.bfloat16, 1.6e-2)])
def test_decode_low_precision_inputs(dtype: torch.dtype, tol: float) -> None:
    """fp16/bf16 pools load as fp32 under the interpreter; the error is the output's rounding."""
    case, ref = _decode_case(2, 64, dtype, seed=3)
    for grouped in (False, True):
        out = _run_decode(case, 4, grouped=grouped)
        assert out.dtype == dtype
        torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


def test_num_kv_splits_heuristic(monkeypatch: pytest.MonkeyPatch) -> None:
    seq_lens = torch.tensor([1, 40, 4096, 700])
    cpu = get_num_kv_splits(seq_lens, 32, 8, MAX_SPLITS, "cpu")
    assert cpu.dtype == torch.int32 and cpu.tolist() == [1, 1, 1, 1]  # one core: no split pays off

    # A GPU with 132 SMs: a lone long request is split to the cap; lengths bound the splits.
    monkeypatch.setattr(decode_mod, "device_core_count", lambda device: 132)
    assert get_num_kv_splits(torch.tensor([4096]), 32, 8, MAX_SPLITS, "cpu").tolist() == [MAX_SPLITS]
    gpu = get_num_kv_splits(seq_lens, 32, 8, MAX_SPLITS, "cpu").tolist()
    assert gpu[0] == 1 and gpu[2] == MAX_SPLITS
    by_length = [gpu[i] for i in seq_lens.argsort().tolist()]
    assert by_length == sorted(by_length)  # a longer request never gets fewer parts
    assert all(1 <= s <= MAX_SPLITS for s in gpu)
    # A big batch already fills the device: no splitting at all.
    big = get_num_kv_splits(torch.full((256,), 4096), 32, 8, MAX_SPLITS, "cpu")
    assert big.max().item() == 1


# ---- extend ----------------------------------------------------------------------------


def _extend_case(
    group: int, page_size: int, head_dim: int, dtype: torch.dtype, seed: int, window: int | None = None
) -> tuple[dict, torch.Tensor]:
    """Four requests extending after cached prefixes. ``window`` W: the kernel gets each prefix's
    last W - 1 tokens only (what a windowed layer's plan hands it); the reference sees all of them
    and masks by distance."""
    gen = torch.Generator().manual_seed(seed)
    num_kv_heads = 4 // group
    num_heads = num_kv_heads * group
    # Request 0 has no prefix, request 1 extends by one token; the rest are random.
    prefix = [0, int(torch.randint(1, 40, (1,), generator=gen))] + torch.randint(1, 40, (2,), generator=gen).tolist()
    extend = [int(torch.randint(2, 20, (1,), generator=gen)), 1] + torch.randint(2, 36, (2,), generator=gen).tolist()
    slots, pool = _slot_layout([p + e for p, e in zip(prefix, extend)], page_size, gen)
    k_buf = torch.randn(pool, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_buf = torch.randn(pool, num_kv_heads, head_dim, generator=gen).to(dtype)
    num_tokens = sum(extend)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype)
    k_ext = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_ext = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    qo_indptr = _indptr(extend)
    rows = [torch.arange(int(qo_indptr[i]), int(qo_indptr[i + 1])) for i in range(len(extend))]
    keys = [torch.cat([k_buf[s[:p]], k_ext[r]]) for s, p, r in zip(slots, prefix, rows)]
    values = [torch.cat([v_buf[s[:p]], v_ext[r]]) for s, p, r in zip(slots, prefix, rows)]
    ref = _reference(q, keys, values, rows, head_dim**-0.5, window)
    first = [0 if window is None else max(0, p - window + 1) for p in prefix]  # the prefix the kernel reads
    case = dict(
        q_extend=q,
        k_extend=k_ext,
        v_extend=v_ext,
        k_buffer=k_buf,
        v_buffer=v_buf,
        qo_indptr=qo_indptr,
        kv_indptr=_indptr([p - f for p, f in zip(prefix, first)]),
        kv_indices=torch.cat([s[f:p] for s, f, p in zip(slots, first, prefix)]).to(torch.int32),
        max_len_extend=max(extend),
        sliding_window=window,
    )
    if page_size > 1:  # the layout really is page-contiguous runs in shuffled page order
        first = slots[2]
        assert torch.equal(first[:page_size] - first[0], torch.arange(page_size))
    return case, ref


def _run_extend(case: dict) -> torch.Tensor:
    o = torch.full_like(case["q_extend"], float("nan"))
    head_dim = case["q_extend"].shape[-1]
    extend_attention_fwd(
        case["q_extend"],
        case["k_extend"],
        case["v_extend"],
        o,
        case["k_buffer"],
        case["v_buffer"],
        case["qo_indptr"],
        case["kv_indptr"],
        case["kv_indices"],
        case["max_len_extend"],
        head_dim**-0.5,
        case["sliding_window"],
    )
    return o


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("group", [1, 4])
def test_extend_matches_reference_fp32(group: int, page_size: int) -> None:
    head_dim = 80 if group == 4 else 64  # 80 is padded to a 128-wide block inside the kernel
    case, ref = _extend_case(group, page_size, head_dim, torch.float32, seed=group * 100 + page_size)
    torch.testing.assert_close(_run_extend(case).double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [1, 5, 16, 24])
def test_extend_with_sliding_window_matches_reference_fp32(window: int) -> None:
    """Windows shorter than a prefix, than a block (16 under the interpreter), and spanning blocks."""
    case, ref = _extend_case(2, 1, 64, torch.float32, seed=window, window=window)
    torch.testing.assert_close(_run_extend(case).double(), ref, atol=1e-5, rtol=1e-5)
    full, _ = _extend_case(2, 1, 64, torch.float32, seed=window)
    assert not torch.allclose(_run_extend(full).double(), ref, atol=1e-3), "the window changed nothing"


@pytest.mark.parametrize("dtype,tol", [(torch.float16, 2e-3), (torch.bfloat16, 1.6e-2)])
def test_extend_low_precision_inputs(dtype: torch.dtype, tol: float) -> None:
    case, ref = _extend_case(4, 16, 64, dtype, seed=7)
    out = _run_extend(case)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


# ---- fallback when triton was imported in compiled mode first ----------------------------

if not IN_PROCESS:
    replace_tests_with_fresh_process_run(globals(), __file__)
