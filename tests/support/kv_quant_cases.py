"""Cases for the Triton kernels over a quantized KV cache (``memory.kv_format``): the store against
``KVCacheFormat.quantize`` byte for byte, and the decode / extend kernels against softmax attention in
float64 over the pool's DEQUANTIZED values (``KVCacheFormat.dequantize``). Shared by the interpreter
tests (tests/unit/runtime/engine/cuda/test_triton_kv_quant.py, CPU, fp32) and the compiled GPU tests
(tests/gpu/test_kv_quant_gpu.py, bf16 / fp32); importing this module sets nothing up.

The formats: ``int8`` (per row, with its scale), ``fp8_e4m3`` / ``fp8_e5m2`` (per-layer scales, not
1.0 here so that they are really applied) and ``bf16`` (an unquantized bf16 cache under a wider model).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from memory.kv_format import KVCacheFormat, kv_cache_format
from memory.kv_pool import MHATokenToKVPool
from runtime.engine.ops import DeviceOps

FORMATS = ["int8", "fp8_e4m3", "fp8_e5m2", "bf16"]
FP8_SCALES = (0.37, 1.9)  # a layer's K and V scales in the fp8 cases


def layer_scales(name: str) -> tuple[float, float]:
    """The (K, V) layer scales a case uses: fp8's ``FP8_SCALES``, else 1.0."""
    return FP8_SCALES if name.startswith("fp8") else (1.0, 1.0)


# ---- store -----------------------------------------------------------------------------


def check_store(ops: DeviceOps, device: str, name: str, model_dtype: torch.dtype, head_dim: int) -> None:
    """``ops.store_kv`` into a pool of format ``name`` against the pool's own store (the reference):
    rows of every magnitude from 1e-8 to 1e3 (fp8's subnormals and saturation, int8's small rows), an
    all-zero row, K/V as strided views of one fused output; the same bytes, other slots untouched."""
    fmt = kv_cache_format(name, model_dtype)
    gen = torch.Generator().manual_seed(head_dim)
    n, hkv, slots, layers = 24, 2, 40, 2
    pools = [MHATokenToKVPool(slots, 1, model_dtype, layers, hkv, head_dim, device, fmt) for _ in range(2)]
    for p in pools:
        p.set_layer_scales([1.0, FP8_SCALES[0]], [1.0, FP8_SCALES[1]])
        for buf in (p.k_buffer[1], p.v_buffer[1]):  # something to overwrite, and to leave alone
            raw = buf.view(torch.uint8)
            raw.copy_((torch.arange(raw.numel()) % 251).view(raw.shape))
    magnitude = torch.logspace(-8, 3, n)[:, None]
    kv = (torch.randn(n, 3 * hkv * head_dim, generator=gen) * magnitude).to(model_dtype).to(device)
    kv[3] = 0  # an all-zero row: int8 scale 0, codes 0
    k = kv[:, hkv * head_dim : 2 * hkv * head_dim].view(n, hkv, head_dim)
    v = kv[:, 2 * hkv * head_dim :].view(n, hkv, head_dim)
    loc = (torch.randperm(slots, generator=gen)[:n] + 1).to(device)
    ops.store_kv(pools[0], 1, loc, k, v)
    pools[1].set_kv_buffer(1, loc, k, v)
    for got, want in ((pools[0].k_buffer[1], pools[1].k_buffer[1]), (pools[0].v_buffer[1], pools[1].v_buffer[1])):
        assert got.dtype == fmt.storage
        mismatched = (got.view(torch.uint8) != want.view(torch.uint8)).nonzero()
        assert mismatched.numel() == 0, f"{name}: {len(mismatched)} bytes differ, first at {mismatched[:4].tolist()}"
    assert not pools[0].k_buffer[0].view(torch.uint8).any(), "another layer was written"


def rounding_probe(name: str) -> torch.Tensor:
    """fp32 values where rounding decides the bytes: fp8, every finite value of the format, every
    midpoint between neighbours (ties go to the even code) and one fp32 ulp either side of it, values
    past the largest (saturated) and infinities; bf16, ties and their neighbours over many exponents;
    int8, rows of 12 whose inverse scale is 1 (amax 127) holding x.5 ties."""
    if name == "int8":
        ties = torch.arange(-126, 127, dtype=torch.float32) + 0.5
        rows = ties.view(-1, 11)
        return torch.cat([torch.full((rows.shape[0], 1), 127.0), rows], dim=1).reshape(-1)  # rows of 12
    if name == "bf16":
        high = torch.randint(0, 1 << 15, (2048,), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
        ties = ((high << 16) | 0x8000).view(torch.float32)
        ties = ties[torch.isfinite(ties)]
        return torch.cat([ties, _ulp_step(ties, 1), _ulp_step(ties, -1), -ties])
    fp8 = kv_cache_format(name, torch.float32).fp8_dtype
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fp8).float()
    values = values[torch.isfinite(values)].unique()  # sorted
    mids = (values[1:] + values[:-1]) / 2  # exact in fp32
    limit = torch.finfo(fp8).max
    beyond = torch.tensor([limit * 1.01, limit * 4, float("inf"), 1e-30, 0.0])
    return torch.cat([values, mids, _ulp_step(mids, 1), _ulp_step(mids, -1), beyond, -beyond])


def _ulp_step(x: torch.Tensor, direction: int) -> torch.Tensor:
    return torch.nextafter(x, torch.full_like(x, direction * float("inf")))


def check_store_rounding(device: str, name: str, reciprocal: bool | None = None) -> None:
    """The store kernel (``kernels.store_kv``) on ``rounding_probe``'s values against the reference
    bytes: as they are (layer scale 1: the ties are ties) and, for fp8, under a layer scale.
    ``reciprocal`` forces the kernel's division rule (None: the device's); True on a CPU checks the
    CUDA rule against ``quantize`` as torch computes it on CUDA (times the fp32 reciprocal)."""
    from runtime.engine.cuda import kernels

    fmt = kv_cache_format(name, torch.float32)
    values = rounding_probe(name)
    width, heads = (12, 4) if name == "int8" else (64, 4)
    per_token = heads * width
    n = -(-values.numel() // per_token)
    rows = torch.zeros(n * per_token)
    rows[: values.numel()] = values
    x = rows.view(n, heads, width).to(device)
    loc = torch.arange(1, n + 1, device=device)
    cuda_rule = reciprocal if reciprocal is not None else x.device.type == "cuda"
    for scale in (1.0, FP8_SCALES[0]) if fmt.is_fp8 else (1.0,):
        buf = torch.zeros(n + 1, heads, fmt.row_width(width), dtype=fmt.storage, device=device)
        other = torch.zeros_like(buf)
        assert kernels.store_kv(buf, other, loc, x, x, fmt, scale, scale, reciprocal=reciprocal)
        emulate = cuda_rule and x.device.type == "cpu"
        want = _cuda_rule_quantize(fmt, x, scale) if emulate else fmt.quantize(x, scale)
        bad = (buf[1:].view(torch.uint8) != want.view(torch.uint8)).any(-1).nonzero()
        assert bad.numel() == 0, f"{name} x{scale}: {len(bad)} rows differ, e.g. {x[tuple(bad[0])].tolist()[:8]}"
        assert torch.equal(other, buf), "V went elsewhere than K"


def _cuda_rule_quantize(fmt: KVCacheFormat, x: torch.Tensor, scale: float) -> torch.Tensor:
    """``fmt.quantize`` as torch computes it on CUDA, emulated on a CPU: a CUDA tensor divided by a
    Python number is multiplied by the number's fp32 reciprocal (torch's div_true_kernel_cuda)."""
    from runtime.engine.cuda.kv_quant import INV_INT8_MAX, fp32_reciprocal

    if fmt.is_fp8:
        limit = torch.finfo(fmt.fp8_dtype).max
        return (x.float() * fp32_reciprocal(scale)).clamp(-limit, limit).to(fmt.fp8_dtype).view(torch.uint8)
    if fmt.name != "int8":
        return fmt.quantize(x, scale)
    rows = fmt.quantize(x, scale)
    amax = x.float().abs().amax(dim=-1, keepdim=True)
    rows[..., -4:] = (amax * INV_INT8_MAX).view(torch.int8)
    return rows


# ---- attention -----------------------------------------------------------------------------


@dataclass
class PagedCase:
    """Requests over a quantized pool: request i's keys are its pool rows at ``slots[i]`` (prefix)
    and, for an extend, its new tokens ``k_new[rows[i]]`` (read unquantized)."""

    fmt: KVCacheFormat
    k_buffer: torch.Tensor
    v_buffer: torch.Tensor
    k_scale: float
    v_scale: float
    slots: list[torch.Tensor]
    q: torch.Tensor
    k_new: torch.Tensor | None = None
    v_new: torch.Tensor | None = None

    def kv_indptr(self) -> torch.Tensor:
        return _indptr([len(s) for s in self.slots], self.q.device)

    def kv_indices(self) -> torch.Tensor:
        return torch.cat(self.slots).to(torch.int32)

    def keys(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Request i's dequantized pool keys and values, float64."""
        k = self.fmt.dequantize(self.k_buffer[self.slots[i]], self.k_scale, torch.float64)
        v = self.fmt.dequantize(self.v_buffer[self.slots[i]], self.v_scale, torch.float64)
        return k, v


def _indptr(lens: list[int], device: torch.device | str) -> torch.Tensor:
    out = torch.zeros(len(lens) + 1, dtype=torch.int32)
    out[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int64), 0)
    return out.to(device)


def paged_case(
    name: str,
    model_dtype: torch.dtype,
    device: str,
    prefix_lens: list[int],
    new_lens: list[int] | None,
    group: int,
    head_dim: int,
    page_size: int,
    seed: int,
) -> PagedCase:
    """A pool of format ``name`` written through ``quantize`` (the reference store) at page-contiguous
    slots in shuffled page order; decode (``new_lens`` None): one query per request, else an extend's
    packed queries and new K/V. Values ``randn * 2`` (soft caps bite, fp8 spreads over its exponents)."""
    gen = torch.Generator().manual_seed(seed)
    fmt = kv_cache_format(name, model_dtype)
    k_scale, v_scale = layer_scales(name)
    hkv = max(4 // group, 1)
    pages = [-(-n // page_size) for n in prefix_lens]
    order = (torch.randperm(sum(pages) + 2, generator=gen) + 1).tolist()  # page 0: the padding slot
    slots, used = [], 0
    for n, p in zip(prefix_lens, pages):
        run = (
            torch.tensor(order[used : used + p], dtype=torch.int64)[:, None] * page_size
            + torch.arange(page_size)[None, :]
        )
        slots.append(run.reshape(-1)[:n].to(device))
        used += p
    size = (len(order) + 1) * page_size
    k = (torch.randn(size, hkv, head_dim, generator=gen) * 2).to(model_dtype).to(device)
    v = (torch.randn(size, hkv, head_dim, generator=gen) * 2).to(model_dtype).to(device)
    tokens = len(prefix_lens) if new_lens is None else sum(new_lens)
    q = torch.randn(tokens, hkv * group, head_dim, generator=gen).to(model_dtype).to(device)
    case = PagedCase(fmt, fmt.quantize(k, k_scale), fmt.quantize(v, v_scale), k_scale, v_scale, slots, q)
    if new_lens is not None:
        case.k_new = (torch.randn(tokens, hkv, head_dim, generator=gen) * 2).to(model_dtype).to(device)
        case.v_new = (torch.randn(tokens, hkv, head_dim, generator=gen) * 2).to(model_dtype).to(device)
    return case


def reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    cap: float | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """One request's queries ``q [n, H, D]`` over keys ``k``/``v`` ``[L, Hkv, D]`` aligned to the end
    (query j of n sees keys up to ``L - n + j``; with ``window`` W the last W of those), float64."""
    n, h = q.shape[0], q.shape[1]
    group = h // k.shape[1]
    kk, vv = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), kk) * scale
    if cap is not None:
        scores = torch.tanh(scores / cap) * cap
    distance = (k.shape[0] - n + torch.arange(n, device=q.device))[:, None] - torch.arange(k.shape[0], device=q.device)
    visible = (distance >= 0) & (distance < (window if window is not None else k.shape[0] + 1))
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv)


def check_decode(
    device: str,
    name: str,
    model_dtype: torch.dtype,
    grouped: bool,
    tol: float,
    cap: float | None = None,
    head_dim: int = 64,
    seed: int = 0,
) -> None:
    """Decode of 4 requests (lengths 1 .. 37, page size 1), split-K in 1 or 2 parts (the interpreted
    backend's most: each split slot is a program of the grid, empty or not)."""
    from runtime.engine.cuda.attention_kernels.decode_attention import decode_attention_fwd

    case = paged_case(name, model_dtype, device, [1, 9, 37, 20], None, 2, head_dim, 1, seed)
    bs, num_heads, _ = case.q.shape
    max_splits = 2
    out = torch.full_like(case.q, float("nan"))
    logits = torch.full((bs, num_heads, max_splits, head_dim), float("nan"), device=device)
    lse = torch.full((bs, num_heads, max_splits), float("nan"), device=device)
    splits = torch.tensor([1, 2, 2, 1], dtype=torch.int32, device=device)
    decode_attention_fwd(
        case.q,
        case.k_buffer,
        case.v_buffer,
        out,
        case.kv_indptr(),
        case.kv_indices(),
        logits,
        lse,
        splits,
        max_splits,
        head_dim**-0.5,
        grouped=grouped,
        logit_cap=cap or 0.0,
        kv_format=case.fmt,
        k_scale=case.k_scale,
        v_scale=case.v_scale,
    )
    want = torch.cat([reference(case.q[i : i + 1], *case.keys(i), head_dim**-0.5, cap) for i in range(bs)])
    assert out.dtype == model_dtype
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol, msg=lambda m: f"{name} decode: {m}")


def check_extend(
    device: str,
    name: str,
    model_dtype: torch.dtype,
    tol: float,
    cap: float | None = None,
    window: int | None = None,
    head_dim: int = 64,
    seed: int = 0,
) -> None:
    """Extend of 3 requests after cached prefixes (none, 21 and 30 tokens, page size 16): the prefix
    read from the quantized pool, the new tokens unquantized. ``window`` W: the kernel gets each
    prefix's last W - 1 tokens (what a windowed layer's plan hands it)."""
    from runtime.engine.cuda.attention_kernels.extend_attention import extend_attention_fwd

    prefix, new = [0, 21, 30], [7, 5, 18]
    case = paged_case(name, model_dtype, device, prefix, new, 2, head_dim, 16, seed)
    assert case.k_new is not None and case.v_new is not None
    qo = _indptr(new, device)
    read = [s[max(0, len(s) - window + 1) :] if window is not None else s for s in case.slots]
    out = torch.full_like(case.q, float("nan"))
    extend_attention_fwd(
        case.q,
        case.k_new,
        case.v_new,
        out,
        case.k_buffer,
        case.v_buffer,
        qo,
        _indptr([len(s) for s in read], device),
        torch.cat(read).to(torch.int32),
        max(new),
        head_dim**-0.5,
        window,
        logit_cap=cap or 0.0,
        kv_format=case.fmt,
        k_scale=case.k_scale,
        v_scale=case.v_scale,
    )
    parts = []
    for i in range(len(new)):
        rows = slice(int(qo[i]), int(qo[i + 1]))
        k_pre, v_pre = case.keys(i)
        k = torch.cat([k_pre, case.k_new[rows].double()])
        v = torch.cat([v_pre, case.v_new[rows].double()])
        parts.append(reference(case.q[rows], k, v, head_dim**-0.5, cap, window))
    assert out.dtype == model_dtype
    torch.testing.assert_close(out.double(), torch.cat(parts), atol=tol, rtol=tol, msg=lambda m: f"{name}: {m}")
