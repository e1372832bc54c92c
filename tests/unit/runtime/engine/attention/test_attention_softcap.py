"""Soft-capped attention logits (``AttentionLayerSpec.logit_softcap``, Gemma 2) in every backend.

torch_native, the CPU backend (whose C kernels do not cap: capped layers take its torch paths)
and Triton under the interpreter each run the batches of ``tests.support.attention_softcap``
(prefills, extends after a shared cached prefix, decodes through the CPU mirror, a mixed batch;
a full and a windowed layer; GQA) against the formula of transformers' eager Gemma 2 attention.
Without a cap nothing changes: no backend reaches the explicit-score code, and the outputs are
the plain attention's.

Triton picks interpreter or compiled mode when ``triton`` is first imported, so this module sets
``TRITON_INTERPRET=1`` before anything imports it; when another test module already imported
``triton`` in compiled mode, this file runs in a fresh process instead.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported, see the module docstring

import pytest  # noqa: E402
import torch  # noqa: E402

from runtime.engine.cuda.triton_common import triton_loaded_interpreted  # noqa: E402

IN_PROCESS = "triton" not in sys.modules or triton_loaded_interpreted()

from runtime.engine.attention import softcap as softcap_mod  # noqa: E402
from runtime.engine.attention import torch_native  # noqa: E402
from runtime.engine.attention.base import AttentionBackend  # noqa: E402
from runtime.engine.attention.torch_native import TorchNativeAttnBackend  # noqa: E402
from runtime.engine.cpu import attention as cpu_attention  # noqa: E402
from runtime.engine.cpu import attention_fastpaths as fastpaths  # noqa: E402
from runtime.engine.cpu import attention_kernels as attn_kernels  # noqa: E402
from runtime.engine.cpu.attention import CpuAttnBackend  # noqa: E402
from runtime.engine.cuda.attention import TritonAttnBackend  # noqa: E402
from runtime.engine.cuda.attention_kernels import decode_attention as decode_mod  # noqa: E402
from runtime.engine.forward_batch import ForwardMode  # noqa: E402
from tests.support.attention_softcap import CAP, Scenario, check, layer_specs, run_steps, runner_view  # noqa: E402
from tests.support.triton_interp import replace_tests_with_fresh_process_run  # noqa: E402

BACKENDS: dict[str, Callable[[Any], AttentionBackend]] = {
    "torch_native": TorchNativeAttnBackend,
    "cpu": CpuAttnBackend,
    "triton": TritonAttnBackend,
}


def _backend(name: str, num_heads: int = 4, num_kv_heads: int = 2) -> AttentionBackend:
    return BACKENDS[name](runner_view(num_heads, num_kv_heads, "cpu"))


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_softcapped_layers_match_the_formula(name: str) -> None:
    """fp32, GQA (4 query heads on 2 KV heads): every path of every backend, full and windowed layers."""
    results = run_steps(_backend(name), layer_specs(4, 2, 16, CAP), CAP)
    check(results, 2e-5)
    # the cap bites: the capped rows are far from plain attention's, in every kind of step
    for mode in (ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.MIXED):
        assert max(float((r.expected - r.uncapped).abs().max()) for r in results if r.mode == mode) > 0.1


def test_triton_per_head_decode_and_split_k_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    """MHA (the per-head decode kernel) with decodes planned as on a 132-SM GPU: every split caps
    its own scores and stage 2 merges them."""
    monkeypatch.setattr(decode_mod, "device_core_count", lambda device: 132)
    check(run_steps(_backend("triton", 2, 2), layer_specs(2, 2, 16, CAP), CAP), 2e-5)


def test_cpu_backend_bf16_softcap() -> None:
    """bf16 pools and activations: the CPU backend's C kernels would take these groups uncapped; the
    capped layers' torch paths match the formula (on the bf16-rounded inputs) to bf16 precision."""
    results = run_steps(_backend("cpu"), layer_specs(4, 2, 16, CAP), CAP, dtype=torch.bfloat16)
    check(results, 5e-2)


def _refuse(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("an uncapped layer reached the soft-capping code")


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_no_cap_is_plain_attention(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``logit_softcap=None``: the outputs are plain attention's and no explicit-score code runs
    (torch_native keeps SDPA, the CPU backend its kernels; Triton compiles the cap out)."""
    for module in (torch_native, cpu_attention, fastpaths, softcap_mod):
        for attr in ("softcapped_attention", "cap_scores_"):
            if hasattr(module, attr):
                monkeypatch.setattr(module, attr, _refuse)
    check(run_steps(_backend(name), layer_specs(4, 2, 16, None), None), 2e-5)


def test_cpu_capped_layers_take_no_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """No C attention kernel runs for a capped layer (they would silently drop the cap)."""
    for attr in ("decode_attention", "prefix_attention", "causal_attention"):
        monkeypatch.setattr(attn_kernels, attr, _refuse)
    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", _refuse, raising=False)
    check(run_steps(_backend("cpu"), layer_specs(4, 2, 16, CAP), CAP), 2e-5)


def test_capped_model_declines_the_one_call_decode_stack() -> None:
    """``claim_decode_step`` (the C decode stack, whose attention does not cap) declines once a capped
    layer has run; an uncapped model's append step is claimed."""
    claimed = {}
    for cap in (None, CAP):
        backend = CpuAttnBackend()  # no runner: every layer full attention, every layer mirrored
        layers = [spec for spec in layer_specs(4, 2, 16, cap) if spec.sliding_window is None]
        sc = Scenario(2, 16, torch.float32, "cpu", seed=0, num_layers=1)
        work = [("a", 5), ("e", 3)]
        for mode, step in ((ForwardMode.EXTEND, work), (ForwardMode.DECODE, [(n, 1) for n, _ in work])):
            batch = sc.batch(mode, step)
            backend.init_forward_metadata(batch)
            for layer in layers:
                t = batch.num_tokens
                backend.forward(sc.randn(t, 4, 16), sc.randn(t, 2, 16), sc.randn(t, 2, 16), layer, batch)
        batch = sc.batch(ForwardMode.DECODE, [(n, 1) for n, _ in work])
        backend.init_forward_metadata(batch)
        claimed[cap] = backend.claim_decode_step(batch, 1)
    assert claimed[None] is not None and claimed[CAP] is None


def test_kernels_refuse_a_negative_cap() -> None:
    q = torch.zeros(1, 2, 16)
    logits = torch.zeros(1, 2, 2, 16)
    with pytest.raises(ValueError, match="logit_cap"):
        decode_mod.decode_attention_fwd(
            q,
            torch.zeros(4, 2, 16),
            torch.zeros(4, 2, 16),
            q.clone(),
            torch.zeros(2, dtype=torch.int32),
            torch.zeros(0, dtype=torch.int32),
            logits,
            logits[..., 0],
            torch.ones(1, dtype=torch.int32),
            2,
            0.25,
            logit_cap=-1.0,
        )


# ---- fallback when triton was imported in compiled mode first ----------------------------

if not IN_PROCESS:
    replace_tests_with_fresh_process_run(globals(), __file__)
