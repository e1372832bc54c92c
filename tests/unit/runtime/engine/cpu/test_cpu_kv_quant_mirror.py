"""The decode-key mirror over a quantized KV pool (runtime/engine/cpu/decode_mirror.py, mirror_codes.py): the
copies hold the pool's codes (and int8's scales) for every key of every running request, step after step,
rebuilt or appended (the same bytes, never values); their budget counts those bytes; the cascade keeps a
shared prefix once, dequantized, where the prefix kernel runs; and decoding through the mirror gives the
tokens of the gather path over the same cache (both read the same stored values).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from memory.kv_format import KVCacheFormat
from runtime.engine.cpu import attention_kernels as attn_kernels
from runtime.engine.cpu import attention_kernels_q8 as attn_q8
from runtime.engine.cpu import decode_layers, kv_quant_kernels, mirror_codes
from runtime.engine.forward_batch import ForwardMode
from runtime.engine.model_runner import ModelRunner
from tests.support.checkpoints import random_prompt
from tests.support.harness import Harness, HarnessRequest

FORMATS = ["int8", "fp8_e4m3", "fp8_e5m2"]


def _runner(tiny_checkpoints: Any, kv: str, dtype: str = "float32", name: str = "llama") -> ModelRunner:
    path = tiny_checkpoints.path(name)
    return ModelRunner(path, device="cpu", dtype=dtype, max_total_tokens=4096, kv_cache_dtype=kv, load_progress=False)


def _assert_mirror_holds_the_pool(runner: ModelRunner, reqs: list[HarnessRequest]) -> None:
    """Every layer's copies hold, for each request's own keys, the codes (and scales) of its pool rows."""
    mirror = runner.attn_backend.mirror
    pool = runner.token_to_kv_pool
    assert mirror.format == pool.format and mirror.rows is not None
    p = mirror.prefix_slots.numel() if mirror.prefix_slots is not None else 0
    d = pool.head_dim
    for layer in range(len(pool.k_buffer)):
        codes_k, codes_v = mirror.k[layer], mirror.v[layer]
        assert codes_k is not None and codes_v is not None and codes_k.dtype == pool.format.storage
        for b, req in enumerate(reqs):
            slots = torch.tensor(req.slots[p:], dtype=torch.int64)
            rows_k, rows_v = pool.k_buffer[layer][slots], pool.v_buffer[layer][slots]  # [L, Hkv, row]
            width = slots.numel()
            assert torch.equal(codes_k[b, :, :, :width], rows_k[..., :d].permute(1, 2, 0))
            assert torch.equal(codes_v[b, :, :width], rows_v[..., :d].transpose(0, 1))
            if pool.format.name == "int8":
                assert torch.equal(mirror.k_scales[layer][b, :, :width], kv_quant_kernels.row_scales(rows_k).T)
                assert torch.equal(mirror.v_scales[layer][b, :, :width], kv_quant_kernels.row_scales(rows_v).T)


@pytest.mark.parametrize("kv", FORMATS)
def test_the_copies_hold_the_pools_codes_after_rebuilds_and_appends(tiny_checkpoints: Any, kv: str) -> None:
    runner = _runner(tiny_checkpoints, kv)
    h = Harness(runner)
    reqs = [h.add_request(random_prompt(3 + 9 * i, runner.vocab_size, seed=40 + i)) for i in range(4)]
    h.prefill(reqs)
    with decode_layers.use_decode_layers(False):  # (the layers' path: the backend's appends)
        for step in range(40):  # past the first capacity: rebuilt, appended, rebuilt again
            h.step(reqs, ForwardMode.DECODE)
            if step in (0, 5, 39):
                _assert_mirror_holds_the_pool(runner, reqs)
    assert runner.attn_backend.mirror.cap > 32


@pytest.mark.parametrize("kv", FORMATS)
def test_decode_through_the_mirror_equals_the_gather_path(
    tiny_checkpoints: Any, kv: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The mirror's values are the gathered rows' values: the same tokens, logprobs to fp32 rounding. The
    layers' path (the one-call stack off): each append step's attention is the quantized kernel's."""
    kernel_calls = []
    kernel = attn_q8.decode_attention
    monkeypatch.setattr(attn_q8, "decode_attention", lambda *a, **k: kernel_calls.append(1) or kernel(*a, **k))
    outputs = []
    for mirrored in (True, False):
        runner = _runner(tiny_checkpoints, kv)
        if not mirrored:
            runner.attn_backend.mirrored_layers = 0  # no copies: every step gathers (and dequantizes) its rows
        prompts = [random_prompt(4 + 6 * i, runner.vocab_size, seed=50 + i) for i in range(3)]
        kernel_calls.clear()
        with decode_layers.use_decode_layers(False):
            reqs = Harness(runner).generate(prompts, 10, return_logprob=True)
        outputs.append([(r.output_ids, r.logprobs) for r in reqs])
        assert (runner.attn_backend.mirror.format is not None) == mirrored
        layers = runner.model_config.num_hidden_layers
        assert len(kernel_calls) == (9 * layers if mirrored else 0)  # every decode step (the rebuild's too)
    for (ids_a, lp_a), (ids_b, lp_b) in zip(*outputs):
        assert ids_a == ids_b
        torch.testing.assert_close(torch.tensor(lp_a), torch.tensor(lp_b), atol=1e-4, rtol=0)


def test_the_budget_counts_the_quantized_bytes() -> None:
    d, hkv, cap, n = 64, 3, 96, 2
    for name, per_value in (("int8", 1), ("fp8_e4m3", 1), ("bfloat16", 2)):
        fmt = KVCacheFormat(name, torch.float32)
        row = hkv * (d + 4 if name == "int8" else d) * per_value
        assert mirror_codes.nbytes_of_copies(n, cap, 0, hkv, d, 30, fmt) == 2 * 30 * n * cap * row
    fmt = KVCacheFormat("int8", torch.bfloat16)  # a prefix: dequantized to the model's dtype, kept twice
    assert mirror_codes.nbytes_of_copies(1, 32, 10, hkv, d, 1, fmt) == 2 * (32 * hkv * (d + 4) + 2 * 10 * hkv * d * 2)


@pytest.mark.parametrize("kv", ["int8", "fp8_e4m3"])
def test_a_shared_prefix_is_kept_once_dequantized_where_the_prefix_kernel_runs(tiny_checkpoints: Any, kv: str) -> None:
    runner = _runner(tiny_checkpoints, kv, name="llama_hd64")
    h = Harness(runner)
    shared = 40
    prefix = random_prompt(shared, runner.vocab_size, seed=3)
    reqs = h.prefill_sharing(
        [prefix + random_prompt(2 + 3 * i, runner.vocab_size, seed=60 + i) for i in range(3)], shared
    )
    with decode_layers.use_decode_layers(False):
        for _ in range(3):
            h.step(reqs, ForwardMode.DECODE)
    mirror = runner.attn_backend.mirror
    cascade = attn_kernels.prefix_supported(torch.float32, torch.device("cpu"), runner.token_to_kv_pool.head_dim)
    assert mirror.prefix_slots is not None and mirror.prefix_slots.numel() == (shared if cascade else 0)
    if cascade:
        prefix_k = mirror.prefix_k[0]
        assert prefix_k is not None and prefix_k.dtype == torch.float32 and mirror.packed_prefix(0) is not None
        k_rows, _ = runner.token_to_kv_pool.kv_rows(0)
        want = k_rows.gather(mirror.prefix_slots).unsqueeze(0).permute(0, 2, 3, 1)
        assert torch.equal(prefix_k, want)
    _assert_mirror_holds_the_pool(runner, reqs)


def test_soft_capped_layers_read_the_copies_in_torch(tiny_checkpoints: Any) -> None:
    """Gemma 2 (capped logits, windowed layers): its full layers keep quantized copies, which the torch
    paths read dequantized (the kernel does not cap): the gather path's tokens."""
    outputs = []
    for mirrored in (True, False):
        runner = _runner(tiny_checkpoints, "int8", name="gemma2")
        if not mirrored:
            runner.attn_backend.mirrored_layers = 0
        prompts = [random_prompt(5 + 7 * i, runner.vocab_size, seed=11 + i) for i in range(3)]
        outputs.append([r.output_ids for r in Harness(runner).generate(prompts, 8)])
        assert (runner.attn_backend.mirror.format is not None) == mirrored
    assert outputs[0] == outputs[1]
