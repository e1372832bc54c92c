"""Decode attention on a GPU: our split-K Triton kernel against gather + SDPA in torch.

Default shape (a Llama-3-8B layer under load): batch 64, 4096 cached tokens per request,
32 query heads, 8 KV heads, head_dim 128, bf16, KV slots scattered over a paged pool.
Decode attention is memory bound, so besides time per call the table shows the achieved
bandwidth: bytes of K and V the call must read (plus q, o and the indices) over time.
The torch reference first gathers each request's KV into a dense tensor (what a naive
backend does), so it moves those bytes three times; its "SDPA only" row times SDPA on the
already gathered tensors.

``--kv-cache-dtypes auto,int8,fp8_e4m3`` adds the same kernels over a quantized cache (the pool
quantized once up front with ``KVCacheFormat.quantize``; the kernels dequantize as they load): one
row per format, its bytes the format's, its error against attention over the dequantized values.
One user at 8k context, the case a quantized cache is for:

    .venv/bin/python bench/decode_attention_bench.py --batch 1 --context 8192 --kv-cache-dtypes auto,int8,fp8_e4m3

Run:

    .venv/bin/python bench/decode_attention_bench.py [--batch 64 --context 4096 ...]

Without a CUDA GPU it says so and exits 0 (the kernels' CPU path is the interpreter,
which is for tests, not for timing).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import default_output_path, machine_info, print_table, write_json  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=4096, help="cached tokens per request")
    p.add_argument("--num-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--page-size", type=int, default=16, help="KV slots come in runs of this many (shuffled pages)")
    p.add_argument("--max-kv-splits", type=int, default=8)
    p.add_argument(
        "--kv-cache-dtypes",
        default="auto",
        help="comma-separated KV cache formats to time (auto: --dtype; int8, fp8_e4m3, fp8_e5m2, bf16)",
    )
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="also write the results here (default: bench/results/)")
    p.add_argument("--no-json", action="store_true")
    return p.parse_args(argv)


def time_cuda(fn: Callable[[], Any], warmup: int, iters: int) -> float:
    """Median milliseconds per call, each call timed with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def build_inputs(args: argparse.Namespace, device: torch.device) -> dict[str, torch.Tensor]:
    """A paged pool holding every request's KV, pages shuffled; slot 0 stays padding."""
    gen = torch.Generator(device="cpu").manual_seed(args.seed)
    dtype = DTYPES[args.dtype]
    bs, ctx, ps = args.batch, args.context, args.page_size
    pages_per_req = -(-ctx // ps)
    num_pages = bs * pages_per_req
    pages = torch.randperm(num_pages, generator=gen) + 1  # page 0 holds the padding slot
    slots = (pages.view(bs, pages_per_req, 1) * ps + torch.arange(ps).view(1, 1, ps)).view(bs, -1)[:, :ctx]
    pool_slots = (num_pages + 1) * ps
    shape = (pool_slots, args.num_kv_heads, args.head_dim)
    k_buf = torch.randn(shape, dtype=dtype, device=device)
    v_buf = torch.randn(shape, dtype=dtype, device=device)
    q = torch.randn(bs, args.num_heads, args.head_dim, dtype=dtype, device=device)
    kv_indices = slots.reshape(-1).to(torch.int32).to(device)
    kv_indptr = torch.arange(0, (bs + 1) * ctx, ctx, dtype=torch.int32, device=device)
    return dict(q=q, k_buf=k_buf, v_buf=v_buf, kv_indices=kv_indices, kv_indptr=kv_indptr, slots=slots.to(device))


def quantized_rows(
    args: argparse.Namespace,
    x: dict[str, torch.Tensor],
    fmt_name: str,
    num_kv_splits: torch.Tensor,
    logits: torch.Tensor,
    lse: torch.Tensor,
    other_bytes: int,
) -> list[dict[str, Any]]:
    """The kernels over the pool quantized to ``fmt_name`` (grouped and per head): time, bandwidth
    (the format's K/V bytes) and error against SDPA over the dequantized values."""
    from memory.kv_format import kv_cache_format
    from runtime.engine.cuda.attention_kernels.decode_attention import decode_attention_fwd

    fmt = kv_cache_format(fmt_name, DTYPES[args.dtype])
    q, slots = x["q"], x["slots"]
    k_buf, v_buf = fmt.quantize(x["k_buf"]), fmt.quantize(x["v_buf"])  # (layer scales 1.0)
    bs, num_heads, head_dim = q.shape
    scale = head_dim**-0.5
    k = fmt.dequantize(k_buf[slots], dtype=torch.float32).transpose(1, 2)  # [bs, Hkv, ctx, D]
    v = fmt.dequantize(v_buf[slots], dtype=torch.float32).transpose(1, 2)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.float()[:, :, None, :], k, v, scale=scale, enable_gqa=num_heads != args.num_kv_heads
    )[:, :, 0, :]
    del k, v
    kv_bytes = 2 * bs * args.context * args.num_kv_heads * fmt.head_bytes(head_dim)
    rows = []
    for label, grouped in (("grouped (GQA)", True), ("per head", False)):
        out = torch.empty_like(q)

        def call(out: torch.Tensor = out, grouped: bool = grouped) -> None:
            decode_attention_fwd(
                q,
                k_buf,
                v_buf,
                out,
                x["kv_indptr"],
                x["kv_indices"],
                logits,
                lse,
                num_kv_splits,
                args.max_kv_splits,
                scale,
                grouped=grouped,
                kv_format=fmt,
            )

        call()
        err = float((out.float() - expected).abs().max())
        ms = time_cuda(call, args.warmup, args.iters)
        gbps = (kv_bytes + other_bytes) / (ms * 1e-3) / 1e9
        rows.append(
            {"kernel": f"triton split-K, {label}, {fmt_name} cache", "ms": ms, "gbps": gbps, "max_abs_err": err}
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("decode_attention_bench needs a CUDA GPU (none is visible here); nothing measured.")
        return 0

    from runtime.engine.cuda.attention_kernels.decode_attention import decode_attention_fwd, get_num_kv_splits

    device = torch.device("cuda", torch.cuda.current_device())
    x = build_inputs(args, device)
    q, k_buf, v_buf = x["q"], x["k_buf"], x["v_buf"]
    bs, num_heads, head_dim = q.shape
    scale = head_dim**-0.5
    seq_lens = torch.full((bs,), args.context, dtype=torch.int64, device=device)
    num_kv_splits = get_num_kv_splits(seq_lens, num_heads, args.num_kv_heads, args.max_kv_splits, device)
    logits = torch.empty(bs, num_heads, args.max_kv_splits, head_dim, dtype=torch.float32, device=device)
    lse = torch.empty(bs, num_heads, args.max_kv_splits, dtype=torch.float32, device=device)
    outs = {name: torch.empty_like(q) for name in ("grouped", "per_head")}

    def ours(grouped: bool) -> Callable[[], None]:
        out = outs["grouped" if grouped else "per_head"]

        def call() -> None:
            decode_attention_fwd(
                q,
                k_buf,
                v_buf,
                out,
                x["kv_indptr"],
                x["kv_indices"],
                logits,
                lse,
                num_kv_splits,
                args.max_kv_splits,
                scale,
                grouped=grouped,
            )

        return call

    slots = x["slots"]
    gqa = num_heads != args.num_kv_heads

    def gather() -> tuple[torch.Tensor, torch.Tensor]:
        k = k_buf[slots].transpose(1, 2)  # [bs, Hkv, ctx, D]
        v = v_buf[slots].transpose(1, 2)
        return k, v

    def torch_ref() -> torch.Tensor:
        k, v = gather()
        return torch.nn.functional.scaled_dot_product_attention(q[:, :, None, :], k, v, scale=scale, enable_gqa=gqa)

    k_dense, v_dense = gather()
    k_dense, v_dense = k_dense.contiguous(), v_dense.contiguous()

    def sdpa_only() -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(
            q[:, :, None, :], k_dense, v_dense, scale=scale, enable_gqa=gqa
        )

    # Correctness first: the kernels must agree with the reference before their time means anything.
    expected = torch_ref()[:, :, 0, :].float()
    errors = {}
    for name, grouped in (("grouped", True), ("per_head", False)):
        ours(grouped)()
        errors[name] = float((outs[name].float() - expected).abs().max())

    elem = q.element_size()
    kv_bytes = 2 * bs * args.context * args.num_kv_heads * head_dim * elem
    io_bytes = kv_bytes + 2 * q.numel() * elem + x["kv_indices"].numel() * 4
    rows = []
    cases = [
        ("triton split-K, grouped (GQA)", ours(True), io_bytes, errors["grouped"]),
        ("triton split-K, per head", ours(False), io_bytes, errors["per_head"]),
        ("torch gather + SDPA", torch_ref, io_bytes, 0.0),
        ("torch SDPA only (pre-gathered)", sdpa_only, io_bytes, 0.0),
    ]
    formats = [f.strip() for f in args.kv_cache_dtypes.split(",") if f.strip()]
    if "auto" not in formats:  # only the quantized rows: the torch rows time the model-dtype cache
        cases = []
    for name, fn, nbytes, err in cases:
        ms = time_cuda(fn, args.warmup, args.iters)
        rows.append({"kernel": name, "ms": ms, "gbps": nbytes / (ms * 1e-3) / 1e9, "max_abs_err": err})
    for fmt_name in formats:
        if fmt_name != "auto":
            rows.extend(quantized_rows(args, x, fmt_name, num_kv_splits, logits, lse, io_bytes - kv_bytes))

    splits = num_kv_splits.tolist()
    title = (
        f"decode attention: batch {bs}, context {args.context}, heads {num_heads}/{args.num_kv_heads}, "
        f"head_dim {head_dim}, {args.dtype}, page {args.page_size}, kv splits {min(splits)}..{max(splits)} "
        f"on {torch.cuda.get_device_name(device)}"
    )
    print_table(
        rows,
        [("kernel", "kernel"), ("ms", "ms/call"), ("gbps", "GB/s (KV+q+o+indices)"), ("max_abs_err", "max |err|")],
        title=title,
        digits=3,
    )
    print(f"bytes per call: {io_bytes / 1e6:.1f} MB (K and V: {kv_bytes / 1e6:.1f} MB)")
    if not args.no_json:
        path = args.json or default_output_path("decode_attention", args.dtype)
        write_json(path, {"args": vars(args), "machine": machine_info(), "results": rows, "num_kv_splits": splits})
        print(f"results written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
