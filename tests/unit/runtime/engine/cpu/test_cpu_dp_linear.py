"""bf16 decode-batch linears on AVX512-BF16 dot products (``csrc/dp_linear.c``), for CPUs with
AVX512-BF16 and no AMX: the kernel on a layout built by hand (every row count around its 6-row
blocks, depth tails, bias, fp32 output) within one bf16 rounding of the fp32 product, each row
independent of the batch; and, in a process whose oneDNN is capped at AVX512_CORE_BF16 (the
packing such a CPU gets), ``prepacked.pack_weight`` finds that layout in oneDNN's copy and the
weight's plan runs it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from runtime.engine.cpu import kernel_library
from runtime.engine.cpu.prepacked import AMX_LINEAR_MAX_ROWS, DP_COLUMNS, dp_layout_of
from tests.support import REPO_ROOT as ROOT

needs_avx512_bf16 = pytest.mark.skipif(
    "avx512bf16" not in kernel_library.host_levels(), reason="needs a CPU with AVX512-BF16 (avx512_bf16)"
)


def _dp_layout(weight: torch.Tensor) -> torch.Tensor:
    """bf16 ``[out, in]`` as ``[out / 64][in / 2][64][2]`` (int16), what oneDNN packs for AVX512-BF16."""
    n, k = weight.shape
    return weight.view(torch.int16).view(n // DP_COLUMNS, DP_COLUMNS, k // 2, 2).transpose(1, 2).contiguous()


def _call(
    x: torch.Tensor, layout: torch.Tensor, n: int, bias: torch.Tensor | None, float_out: bool
) -> torch.Tensor | None:
    lib = kernel_library.load()
    assert lib is not None
    rows, k = x.shape
    out = torch.empty(rows, n, dtype=torch.float32 if float_out else torch.bfloat16)
    rc = lib.dp_linear_bf16(
        x.data_ptr(),
        rows,
        x.stride(0),
        layout.data_ptr(),
        n,
        k,
        bias.data_ptr() if bias is not None else None,
        int(float_out),
        out.data_ptr(),
    )
    return out if rc == 0 else None


@needs_avx512_bf16
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("out_features,in_features", [(192, 2816), (128, 300), (64, 64)])
def test_dp_linear_is_within_a_bf16_rounding(out_features: int, in_features: int, with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(out_features + in_features)
    weight = (torch.randn(out_features, in_features, generator=gen) * in_features**-0.5).bfloat16()
    bias = torch.randn(out_features, generator=gen).bfloat16() if with_bias else None
    layout = _dp_layout(weight)
    assert dp_layout_of(weight, layout.view(-1))
    wide = torch.randn(AMX_LINEAR_MAX_ROWS + 1, in_features + 32, generator=gen).bfloat16()
    with kernel_library.use_level("avx512bf16"):
        whole = _call(wide[:AMX_LINEAR_MAX_ROWS, 16 : 16 + in_features], layout, out_features, bias, False)
        assert whole is not None
        for rows in (1, 2, 3, 5, 6, 7, 13, AMX_LINEAR_MAX_ROWS):
            x = wide[:rows, 16 : 16 + in_features]  # rows in_features + 32 apart
            got = _call(x, layout, out_features, bias, False)
            assert got is not None and got.dtype == torch.bfloat16
            exact = x.float() @ weight.float().T + (0 if bias is None else bias.float())
            sums = x.float().abs() @ weight.float().abs().T  # fp32 sums in another order: within ~k eps of these
            assert ((got.float() - exact).abs() <= exact.abs() * 2**-8 + sums * 1e-5).all(), f"rows={rows}"
            assert torch.equal(got, whole[:rows]), f"rows={rows}: the rows differ from the same rows in a batch of 64"
            widened = _call(x, layout, out_features, bias, True)
            assert widened is not None and torch.equal(widened, got.float())  # the LM head's form
        assert _call(wide[:, 16 : 16 + in_features], layout, out_features, bias, False) is None  # 65 rows: oneDNN


@needs_avx512_bf16
def test_dp_layout_is_told_apart_from_the_amx_layout() -> None:
    weight = torch.randn(128, 64).bfloat16()
    amx = weight.view(torch.int16).view(4, 32, 2, 16, 2).permute(0, 2, 3, 1, 4).contiguous()  # AB16b32a2b
    assert dp_layout_of(weight, _dp_layout(weight).view(-1))
    assert not dp_layout_of(weight, amx.view(-1))
    assert not dp_layout_of(torch.randn(96, 64).bfloat16(), torch.zeros(96 * 64, dtype=torch.int16))  # 96 columns
    with kernel_library.use_level("avx512bf16"):
        x = torch.randn(4, 64).bfloat16()
        assert _call(x, _dp_layout(torch.randn(64, 64).bfloat16()), 96, None, False) is None  # not 64-column blocks


_CAPPED = textwrap.dedent("""
    import torch
    from runtime.engine.cpu.ops import CpuOps
    from runtime.engine.cpu.prepacked import DP_PAIRS, dp_linear, onednn_linear, pack_weight
    from runtime.engine.cpu.weight_plan import plan_weight
    ops = CpuOps()
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(1536, 1024, generator=gen).bfloat16()
    bias = torch.randn(1536, generator=gen).bfloat16()
    packed = pack_weight(weight)
    assert packed is not None and packed.layout == DP_PAIRS, "oneDNN packed another layout"
    plan = plan_weight(weight)
    assert [band.kernel for band in plan.bands] == ["dp", "onednn"]
    for rows in (1, 7, 64):
        x = torch.randn(rows, 1024, generator=gen).bfloat16()
        got = ops.linear(x, weight, bias, plan)
        assert torch.equal(got, dp_linear(x, packed, bias))
        exact = x.float() @ weight.float().T + bias.float()
        sums = x.float().abs() @ weight.float().abs().T  # fp32 sums in another order: within ~k eps of these
        assert ((got.float() - exact).abs() <= exact.abs() * 2**-8 + sums * 1e-5).all()
        assert torch.equal(ops.float_linear(x, weight, plan), dp_linear(x, packed, None, float_out=True))
    x = torch.randn(65, 1024, generator=gen).bfloat16()
    assert dp_linear(x, packed, bias) is None
    assert torch.equal(ops.linear(x, weight, bias, plan), onednn_linear(x, packed, bias))
    print("ok")
""")


@needs_avx512_bf16
def test_linear_takes_dp_kernel_on_onednns_avx512_bf16_packing() -> None:
    """A process whose oneDNN may use AVX512-BF16 but not AMX (ONEDNN_MAX_CPU_ISA is read when
    oneDNN starts) packs ``[out / 64][in / 2][64][2]``; ``linear`` and ``float_linear`` run the
    kernel on that copy for up to 64 rows, oneDNN's call beyond."""
    env = {
        **os.environ,
        "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16",
        "TINYSERVE_CPU_AMX": "0",
        "TINYSERVE_CPU_ISA": "avx512bf16",
    }  # (whatever build this run selected: the kernel is in that one)
    done = subprocess.run(
        [sys.executable, "-c", _CAPPED], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
