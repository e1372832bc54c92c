"""Prepacked linears on CPU (runtime/engine/cpu/prepacked.py): fp32 batches inside
``fp32_panel_rows`` take ``linear_f32`` on the panel copy, within the bound of F.linear, each
row independent of the batch and the same at every build level; outside the band and on a
build without the kernel F.linear runs (and no fp32 copy is made without the kernel); a reload
drops every packed copy;
fp32 greedy tokens still equal transformers' on a model wide enough (hidden 512) that the
packed sums differ from MKL's; and bf16 decode-sized batches take the AMX kernel on oneDNN's
packed copy where the CPU has AMX.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
import torch.nn.functional as F

from runtime.engine.cpu import kernel_library
from runtime.engine.cpu.ops import CpuOps
from runtime.engine.cpu.prepacked import (
    AMX_LINEAR_MAX_ROWS,
    AMX_TILES,
    DP_PAIRS,
    FP32_PANEL_MAX_ROWS,
    PackedCopy,
    amx_linear,
    amx_linear_silu_mul,
    dp_linear,
    fp32_panel_rows,
    onednn_linear,
    pack_weight,
    panel_linear,
    prepack_available,
)
from runtime.engine.cpu.weight_plan import CpuWeightPlan, plan_model, plan_weight
from runtime.engine.loading.weight_loader import load_model_weights
from runtime.engine.model_runner import ModelRunner
from runtime.engine.ops.linear_weights import LinearWeightLayer
from tests.support.checkpoints import hf_greedy, load_hf_model, random_prompt
from tests.support.harness import Harness

# |packed - F.linear| <= BOUND_EPS * eps * sum_k |x_k w_k| per output: the measured worst is
# ~1.2 eps (these shapes and the bench model's, every build level); the bound leaves room for other CPUs.
BOUND_EPS = 8.0
NEW_TOKENS = 16


def _kernel_runs() -> bool:
    """Whether ``linear_f32`` runs with the kernels' build in use (a vector build that loaded)."""
    return len(fp32_panel_rows()) > 0


_OPS = CpuOps()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, plan: CpuWeightPlan) -> torch.Tensor:
    """The CPU's linear as a layer calls it: its weight's plan, then F.linear where no band runs."""
    return _OPS.linear(x, weight, bias, plan)


def takes_packed(x: torch.Tensor, plan: CpuWeightPlan) -> bool:
    """Whether the plan runs a product of ``x``'s rows on a packed copy."""
    band = plan.band(x.numel() // x.shape[-1], x.dtype)
    return band is not None and isinstance(band.operand, PackedCopy)


def _has_copy(layer: LinearWeightLayer) -> bool:
    return layer.plan is not None and any(isinstance(b.operand, PackedCopy) for b in layer.plan.bands)


def _linears(runner: ModelRunner) -> list[LinearWeightLayer]:
    return [m for m in runner.model.modules() if isinstance(m, LinearWeightLayer)]


@pytest.mark.usefixtures("kernel_level")
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("out_features,in_features", [(1536, 1024), (1024, 2816), (192, 64), (48, 300), (64, 300)])
def test_fp32_panel_linear_is_within_the_bound(out_features: int, in_features: int, with_bias: bool) -> None:
    """The kernel's result (wherever it runs, inside the band or not) within the bound of F.linear,
    for row counts around its 6-row blocks and the band's ends, one or two 16-column panels per
    column group (48 and 1536 columns: a last panel on its own with AVX-512), a depth that is not a
    multiple of its 256-deep blocks, strided rows and a 3-d input; ``linear`` runs it inside the band
    and F.linear's bits outside it and on a build without the kernel (plain C)."""
    gen = torch.Generator().manual_seed(out_features + in_features)
    weight = torch.randn(out_features, in_features, generator=gen) * in_features**-0.5
    bias = torch.randn(out_features, generator=gen) if with_bias else None
    packed = pack_weight(weight)
    assert packed is not None and packed.tensor.shape == (out_features // 16, in_features, 16)
    plan = plan_weight(weight)
    band = fp32_panel_rows()
    eps = torch.finfo(torch.float32).eps
    wide = torch.randn(FP32_PANEL_MAX_ROWS + 1, in_features + 40, generator=gen)
    for rows in (1, 2, 3, 4, 5, 6, 7, 9, 13, 64, FP32_PANEL_MAX_ROWS, FP32_PANEL_MAX_ROWS + 1):
        x = wide[:rows, 8 : 8 + in_features]  # rows in_features + 40 apart
        got = linear(x, weight, bias, plan)
        plain = F.linear(x, weight, bias)
        direct = panel_linear(x, packed.tensor, bias, out_features)
        assert (direct is not None) == _kernel_runs(), (
            f"rows={rows}: the kernel ran where it cannot, or not where it can"
        )
        if direct is not None:
            scale = F.linear(x.abs(), weight.abs(), None if bias is None else bias.abs())
            excess = (direct - plain).abs() - BOUND_EPS * eps * scale
            assert excess.max().item() <= 0, f"rows={rows}: {(direct - plain).abs().max().item():.3e} off F.linear"
        if rows in band:
            assert takes_packed(x, plan) and direct is not None
            assert torch.equal(got, direct), f"rows={rows}: inside the band linear must run the kernel"
        else:
            assert not takes_packed(x, plan)
            assert torch.equal(got, plain), f"rows={rows}: outside the band linear must be F.linear"
    x3 = torch.randn(2, 8, in_features, generator=gen)  # [batch, seq, in]: rows are counted over both
    assert takes_packed(x3, plan) == (16 in band)
    got3 = linear(x3, weight, bias, plan)
    assert got3.shape == (2, 8, out_features)
    assert torch.equal(got3, linear(x3.reshape(16, -1), weight, bias, plan).view(2, 8, -1))
    assert torch.allclose(got3, F.linear(x3, weight, bias), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("out_features,in_features", [(1024, 2816), (48, 300)])
def test_fp32_panel_linear_rows_are_batch_independent_and_level_independent(
    out_features: int, in_features: int
) -> None:
    """A row's result is the same bits whatever else is in the batch and wherever it sits in it, at
    every build level that runs the kernel: each output is one sum in a fixed order."""
    gen = torch.Generator().manual_seed(7)
    weight = torch.randn(out_features, in_features, generator=gen) * in_features**-0.5
    bias = torch.randn(out_features, generator=gen)
    copy = pack_weight(weight)
    assert copy is not None
    packed = copy.tensor
    x = torch.randn(FP32_PANEL_MAX_ROWS, in_features, generator=gen)
    results = {}
    for level in kernel_library.host_levels():
        with kernel_library.use_level(level):
            whole = panel_linear(x, packed, bias, out_features)
            assert (whole is not None) == _kernel_runs(), level
            if whole is None:
                continue
            for rows in (1, 3, 5, 6, 7, 64):
                part = panel_linear(x[-rows:], packed, bias, out_features)
                assert torch.equal(part, whole[-rows:]), f"{level}: the last {rows} rows alone differ"
            results[level] = whole
    if not results:
        pytest.skip("needs a CPU with AVX2 or AVX-512: the kernel has no plain C build")
    first = next(iter(results.values()))
    for level, got in results.items():
        assert torch.equal(got, first), f"{level} differs from {next(iter(results))}"


def test_fp32_panel_copy_refuses_what_the_kernel_cannot_read() -> None:
    assert pack_weight(torch.randn(40, 64)) is None  # columns not a multiple of 16: F.linear only
    copy = pack_weight(torch.randn(64, 64))
    assert copy is not None and copy.layout != AMX_TILES
    assert (
        copy.nbytes == 64 * 64 * 4
    )  # (a whole copy beside the weight: counted with it, ModelRunner.resident_weight_bytes)
    if prepack_available() and (half := pack_weight(torch.randn(64, 64).bfloat16())) is not None:
        assert half.nbytes >= 64 * 64 * 2  # oneDNN's opaque copy, as oneDNN reports its bytes
    packed = copy.tensor
    x = torch.randn(8, 64)
    assert panel_linear(x, packed, None, 48) is None  # a copy of another shape is never read
    assert panel_linear(x, packed, torch.randn(32), 64) is None  # nor a bias of the wrong size
    assert panel_linear(x, packed, torch.randn(64, 2)[:, 0], 64) is None  # or strided
    assert panel_linear(x, packed, torch.randn(8, 8), 64) is None  # or not one row
    assert panel_linear(x, packed.transpose(0, 1).contiguous().transpose(0, 1), None, 64) is None  # a strided copy
    assert panel_linear(x.double(), packed, None, 64) is None


def test_mixed_dtypes_never_take_the_packed_copy() -> None:
    weight = torch.randn(32, 16)
    assert not takes_packed(torch.randn(8, 16, dtype=torch.bfloat16), plan_weight(weight))
    if prepack_available() and pack_weight(weight.bfloat16()) is not None:  # half precision: any size
        assert takes_packed(torch.randn(8, 16, dtype=torch.bfloat16), plan_weight(weight.bfloat16()))


def test_fp32_model_packs_every_linear_and_a_reload_drops_them(tiny_llama_path: Path) -> None:
    if not _kernel_runs():
        pytest.skip("needs a CPU with AVX2 or AVX-512: fp32 copies are made only for the panel kernel")
    runner = ModelRunner(tiny_llama_path, device="cpu", dtype="float32", max_total_tokens=1024, load_progress=False)
    layers = _linears(runner)
    assert layers and all(_has_copy(m) for m in layers)
    load_model_weights(runner.model, tiny_llama_path, progress=False)  # the loader drops every plan (and copy)
    assert all(m.plan is None for m in layers)
    assert plan_model(runner.model) == len(layers)


@pytest.fixture(scope="module")
def wide_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama with hidden 512 and MLP 1408: sums long enough that oneDNN's and MKL's differ."""
    from bench.checkpoint import BenchModelSpec, build_bench_checkpoint

    spec = BenchModelSpec(
        name="prepack-wide",
        hidden_size=512,
        num_layers=2,
        num_heads=8,
        num_kv_heads=2,
        intermediate_size=1408,
        vocab_size=600,
        max_positions=256,
        corpus_lines=400,
        lexicon_size=300,
    )
    return build_bench_checkpoint(tmp_path_factory.mktemp("wide"), spec)


@pytest.fixture(scope="module")
def wide_reference(wide_checkpoint: Path) -> Iterator[Any]:
    yield load_hf_model(wide_checkpoint)


def _greedy_equals_transformers(path: Path, model: Any) -> ModelRunner:
    runner = ModelRunner(path, device="cpu", dtype="float32", max_total_tokens=2048, load_progress=False)
    prompts = [random_prompt(n, runner.vocab_size, seed=n) for n in (3, 9, 20, 41)]
    h = Harness(runner)
    try:
        reqs = h.generate(prompts, NEW_TOKENS)  # batches of 4 rows: inside the packed band
    finally:
        h.reset()
    for prompt, req in zip(prompts, reqs):
        assert req.output_ids == hf_greedy(model, prompt, NEW_TOKENS)[0], f"prompt of length {len(prompt)}"
    return runner


def test_packed_fp32_greedy_equals_transformers(wide_checkpoint: Path, wide_reference: Any) -> None:
    runner = _greedy_equals_transformers(wide_checkpoint, wide_reference)
    packed = [m for m in _linears(runner) if _has_copy(m)]
    if not _kernel_runs():  # no copy that nothing would read
        assert not packed
        return
    assert packed, "fp32 linears were not packed"
    last = packed[-1]
    assert isinstance(last.weight, torch.Tensor) and isinstance(last.plan, CpuWeightPlan)
    x = torch.randn(8, last.weight.shape[1], generator=torch.Generator().manual_seed(0))
    assert not torch.equal(linear(x, last.weight, None, last.plan), F.linear(x, last.weight)), (
        "the packed path gave F.linear's bits: nothing was tested"
    )


def test_kernels_off_serve_unpacked(
    wide_checkpoint: Path, wide_reference: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the C kernels (``TINYSERVE_CPU_KERNELS=0``) no fp32 copy is made (nothing would
    read it), every call is F.linear's, and the greedy tokens are the same."""
    monkeypatch.setenv("TINYSERVE_CPU_KERNELS", "0")
    kernel_library.reset()
    try:
        assert len(fp32_panel_rows()) == 0
        runner = _greedy_equals_transformers(wide_checkpoint, wide_reference)
        assert not any(_has_copy(m) for m in _linears(runner))
    finally:
        monkeypatch.delenv("TINYSERVE_CPU_KERNELS")
        kernel_library.reset()


def test_cpu_linear_bench_times_every_variant(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from bench import cpu_linear
    from bench.common import read_json

    out = tmp_path / "linear.json"
    assert cpu_linear.main(["--shapes", "o", "--m", "4", "--repeat", "1", "--stream-mib", "0", "--json", str(out)]) == 0
    (row,) = read_json(out)["rows"]
    assert row["m"] == 4 and row["plain_ms"] > 0
    if prepack_available():
        assert row["onednn_ms"] > 0 and 0 <= row["onednn_rel"] < 1e-5
    if _kernel_runs():  # the fp32 panel kernel, at every vector level
        assert row["panel_ms"] > 0 and 0 <= row["panel_rel"] < 1e-5
    assert "plain/onednn" in capsys.readouterr().out


@pytest.mark.usefixtures("kernel_level")
@pytest.mark.parametrize("out_features,in_features,with_bias", [(1536, 1024, False), (96, 2816, True)])
def test_bf16_decode_rows_take_the_amx_kernel_on_onednns_copy(
    out_features: int, in_features: int, with_bias: bool, amx: bool
) -> None:
    """Up to AMX_LINEAR_MAX_ROWS bf16 rows: csrc/amx_linear.c on the oneDNN-packed copy, within one
    bf16 rounding of the fp32 product and of oneDNN's own result, for row counts around the
    kernel's 16- and 32-row blocks, strided rows and a 3-d input; beyond the band, without AMX or
    on a build without it, the AVX512-BF16 kernel where oneDNN packed for it
    (tests/unit/runtime/engine/cpu/test_cpu_dp_linear.py), else oneDNN's call itself."""
    if not prepack_available() or pack_weight(torch.ones(32, 32).bfloat16()) is None:
        pytest.skip("oneDNN does not pack bf16 weights on this CPU (no AVX-512)")
    gen = torch.Generator().manual_seed(out_features + in_features)
    weight = (torch.randn(out_features, in_features, generator=gen) * in_features**-0.5).bfloat16()
    bias = torch.randn(out_features, generator=gen).bfloat16() if with_bias else None
    packed = pack_weight(weight)
    assert packed is not None
    plan = plan_weight(weight)
    if "avx512bf16" in kernel_library.host_levels() and out_features % 64 == 0:
        assert packed.layout in (AMX_TILES, DP_PAIRS)  # oneDNN packed for AMX or AVX512-BF16: ours read both
    amx = amx and packed.layout == AMX_TILES  # (with oneDNN kept off AMX, as on a CPU without it, it packs the other)
    wide = torch.randn(AMX_LINEAR_MAX_ROWS + 1, in_features + 64, generator=gen).bfloat16()
    for rows in (1, 15, 16, 17, 32, 33, AMX_LINEAR_MAX_ROWS, AMX_LINEAR_MAX_ROWS + 1):
        x = wide[:rows, 32 : 32 + in_features]  # rows in_features + 64 apart
        onednn = onednn_linear(x, packed, bias)
        got = amx_linear(x, packed, bias)
        dp = dp_linear(x, packed, bias)
        assert torch.equal(linear(x, weight, bias, plan), got if got is not None else onednn if dp is None else dp)
        if bias is None:  # the LM head's call: those values widened to fp32 (by the kernel, where it runs)
            assert torch.equal(_OPS.float_linear(x, weight, plan), linear(x, weight, None, plan).float())
        if not amx or rows > AMX_LINEAR_MAX_ROWS:
            assert got is None
            continue
        assert got is not None and got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
        exact = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
        bf16_step = exact.abs() * 2**-8 + 1e-6  # one bf16 rounding of a sum (plus its order)
        assert ((got.float() - exact).abs() <= bf16_step).all(), f"rows={rows}"
        assert ((got.float() - onednn.float()).abs() <= 2 * bf16_step).all(), f"rows={rows}"
    x3 = torch.randn(2, 8, in_features, generator=gen).bfloat16()
    got3 = amx_linear(x3, packed, bias)
    assert (got3 is not None) == amx
    if got3 is not None:
        assert torch.equal(got3, amx_linear(x3.reshape(16, in_features), packed, bias).view(2, 8, -1))


def test_amx_linear_reads_only_the_tile_layout() -> None:
    """Shapes oneDNN does not block by 32 x 32 are never read by the AMX kernel, nor fp32 inputs."""
    for shape in ((100, 72), (64, 48)):
        packed_bf16 = pack_weight(torch.randn(shape).bfloat16())
        if packed_bf16 is not None:
            assert packed_bf16.layout != AMX_TILES
            assert amx_linear(torch.randn(4, shape[1]).bfloat16(), packed_bf16, None) is None
    weight = torch.randn(64, 64)
    packed = pack_weight(weight)  # fp32: the panel kernel (or F.linear), never the bf16 kernel
    assert packed is not None
    x = torch.randn(8, 64)
    assert amx_linear(x, packed, None) is None
    panel = panel_linear(x, packed.tensor, None, 64)
    assert torch.equal(linear(x, weight, None, plan_weight(weight)), F.linear(x, weight) if panel is None else panel)


@pytest.mark.usefixtures("kernel_level")
def test_gate_up_and_silu_mul_in_one_pass_equal_the_two(amx: bool) -> None:
    """The MLP's merged gate/up projection and silu*mul fused (csrc/amx_linear.c) give the bits of
    the linear followed by the silu*mul kernel, at row counts around the 16- and 32-row blocks;
    CpuOps.linear_silu_and_mul falls back to the two wherever the fused call does not apply."""
    from runtime.engine.cpu import kernels as cpu_kernels

    if not prepack_available() or pack_weight(torch.ones(32, 32).bfloat16()) is None:
        pytest.skip("oneDNN does not pack bf16 weights on this CPU (no AVX-512)")
    gen = torch.Generator().manual_seed(5)
    inter, hidden = 96, 256
    weight = (torch.randn(2 * inter, hidden, generator=gen) * hidden**-0.5 * 4).bfloat16()
    packed = pack_weight(weight)
    assert packed is not None
    amx = amx and packed.layout == AMX_TILES  # oneDNN kept off AMX (as on a CPU without it) packs another layout
    ops = _OPS
    plan = plan_weight(weight)  # what a layer hands CpuOps for this weight (plan_model makes it for a model)
    for rows in (1, 15, 16, 17, 33, AMX_LINEAR_MAX_ROWS, AMX_LINEAR_MAX_ROWS + 1):
        x = torch.randn(rows, hidden, generator=gen).bfloat16()
        two = ops.silu_and_mul(linear(x, weight, None, plan))
        fused = amx_linear_silu_mul(x, packed, None)
        assert (fused is not None) == (amx and rows <= AMX_LINEAR_MAX_ROWS), f"rows={rows}"
        if fused is not None:
            assert torch.equal(fused, two), f"rows={rows}"
            assert cpu_kernels.silu_and_mul(linear(x, weight, None, plan)) is not None  # the kernel ran in `two`
        assert torch.equal(ops.linear_silu_and_mul(x, weight, None, plan), two)
    x = torch.randn(4, hidden, generator=gen).bfloat16()
    bias = torch.randn(2 * inter, generator=gen).bfloat16()
    assert amx_linear_silu_mul(x, packed, bias) is None  # a bias: the two calls
    assert torch.equal(ops.linear_silu_and_mul(x, weight, bias, plan), ops.silu_and_mul(linear(x, weight, bias, plan)))
    fp32_copy = pack_weight(weight.float())
    assert fp32_copy is None or amx_linear_silu_mul(x.float(), fp32_copy, None) is None
