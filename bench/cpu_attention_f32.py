"""fp32 attention on CPU: the fp32 C kernels against the torch paths they replace, per build level.

Shapes are the bench model's (16 query heads, 4 KV heads, head dim 64), one layer:

- ``decode``: 64 requests x 160 keys through the decode-key mirror (``cap`` 192): the C
  kernel (``attn_kernels.decode_attention``) vs two batched matmuls around an fp32 softmax
  (``few_query_attention``'s torch path);
- ``cascade``: the same requests sharing a 512-key prefix, 64 keys of their own: the packed
  prefix kernel then the decode kernel continuing each softmax (``init``) vs the torch cascade
  (flash over the prefix, the matmul path over the own keys, the log-sum-exp merge);
- ``prefill``: 64 prompts x 128 tokens, no cached keys: ``attn_kernels.causal_attention`` vs
  torch's flash kernel (``F.scaled_dot_product_attention(is_causal=True)``).

Timing: process CPU time per call with one intra-op thread (the machine may be shared: CPU
time is what the call costs, whoever else runs), the median of ``--repeat`` calls. Each level
is a build of the kernels (``TINYSERVE_CPU_ISA``'s names; ``native``: the best this CPU runs).

    .venv/bin/python -m bench.cpu_attention_f32 [--levels avx2 native] [--repeat 30]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from runtime.engine.cpu import attention_fastpaths as cpu_attention  # noqa: E402
from runtime.engine.cpu import attention_kernels as attn_kernels  # noqa: E402
from runtime.engine.cpu import kernel_library  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--levels", nargs="+", default=["avx2", "native"])
    p.add_argument("--repeat", type=int, default=30)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--keys", type=int, default=160, help="decode: keys per request")
    p.add_argument("--prefix", type=int, default=512, help="cascade: shared keys")
    p.add_argument("--own", type=int, default=64, help="cascade: own keys per request")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument(
        "--scenarios", nargs="+", choices=["decode", "cascade", "prefill"], default=["decode", "cascade", "prefill"]
    )
    return p.parse_args(argv)


def cpu_ms(fn: Callable[[], Any], repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        start = time.process_time()
        fn()
        times.append((time.process_time() - start) * 1e3)
    return statistics.median(times)


def torch_only(fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` with the C attention kernels declined (the torch paths run)."""

    def call() -> Any:
        real = attn_kernels.supports
        attn_kernels.supports = lambda *a, **k: False
        try:
            return fn()
        finally:
            attn_kernels.supports = real

    return call


Case = tuple[str, Callable[[], Any], Callable[[], Any]]  # (label, C kernel, torch path)


def decode_case(args: argparse.Namespace, gen: torch.Generator, n: int, hkv: int, group: int, d: int) -> Case:
    width = args.keys
    cap = -(-(width + 32) // 32) * 32
    q = torch.randn(n, hkv, group, d, generator=gen)
    k_t, v = torch.randn(n, hkv, d, cap, generator=gen), torch.randn(n, hkv, cap, d, generator=gen)
    bias = torch.zeros(n, 1, 1, cap)
    bias[..., width:] = float("-inf")

    def dec() -> Any:
        return cpu_attention.few_query_attention(q, k_t, v, bias, d**-0.5, False, width=width)

    return f"decode {n} x {width} keys", dec, torch_only(dec)


def cascade_case(args: argparse.Namespace, gen: torch.Generator, n: int, hkv: int, group: int, d: int) -> Case:
    p, own, scale = args.prefix, args.own, d**-0.5
    cap = -(-(own + 32) // 32) * 32
    q = torch.randn(n, hkv, group, d, generator=gen)
    k_pre, v_pre = torch.randn(p, hkv, d, generator=gen), torch.randn(p, hkv, d, generator=gen)
    k_t, v = torch.randn(n, hkv, d, cap, generator=gen), torch.randn(n, hkv, cap, d, generator=gen)
    bias = torch.zeros(n, 1, 1, cap)
    bias[..., own:] = float("-inf")
    kp, vp = k_pre.permute(1, 0, 2).unsqueeze(0), v_pre.permute(1, 0, 2).unsqueeze(0).contiguous()
    packed = attn_kernels.pack_prefix(k_pre, v_pre)  # once per mirror rebuild, not per step

    def kernel() -> Any:
        init = attn_kernels.prefix_attention(q, packed, scale)
        return attn_kernels.decode_attention(q, k_t, v, bias, scale, own, False, None, init)[0]

    def reference() -> Any:
        return cpu_attention.cascade_attention(q, kp, vp, k_t, v, bias, scale, own)

    return f"cascade {n} x ({p} shared + {own} own)", kernel, torch_only(reference)


def prefill_case(args: argparse.Namespace, gen: torch.Generator, n: int, hkv: int, group: int, d: int) -> Case:
    length, h, scale = args.prompt_len, hkv * group, d**-0.5
    qkv = torch.randn(n * length, (h + 2 * hkv) * d, generator=gen)  # q, k, v: views of a fused output
    q = qkv[:, : h * d].view(n, length, h, d)
    k = qkv[:, h * d : (h + hkv) * d].view(n, length, hkv, d)
    v = qkv[:, (h + hkv) * d :].view(n, length, hkv, d)

    def fused() -> Any:
        return attn_kernels.causal_attention(q, k, v, scale)

    def flash() -> Any:
        return F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=scale, enable_gqa=True
        )

    return f"prefill {n} x {length} tokens", fused, flash


SCENARIOS = {"decode": decode_case, "cascade": cascade_case, "prefill": prefill_case}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    print(
        f"fp32 attention, one layer, CPU ms per call (process time, 1 thread, median of {args.repeat}); "
        f"host levels: {', '.join(kernel_library.host_levels())}"
    )
    print(f"{'level':<11} {'case':<38} {'C kernel':>9} {'torch':>9} {'speed-up':>9}")
    for level in args.levels:
        name = kernel_library.host_levels()[0] if level == "native" else level
        if name not in kernel_library.host_levels():
            print(f"{level:<11} (this CPU cannot run it)")
            continue
        with kernel_library.use_level(name):
            for scenario in args.scenarios:
                gen = torch.Generator().manual_seed(0)
                label, kernel, reference = SCENARIOS[scenario](args, gen, args.batch, 4, 4, 64)
                ours, theirs = cpu_ms(kernel, args.repeat), cpu_ms(reference, args.repeat)
                print(f"{name:<11} {label:<38} {ours:>9.3f} {theirs:>9.3f} {theirs / ours:>8.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
