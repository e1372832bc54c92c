"""CpuAttnBackend (the torch_native plan on CPU) over the paged pool, against a per-request reference softmax."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from memory.kv_pool import MHATokenToKVPool
from memory.req_to_token_pool import ReqToTokenPool
from runtime.engine.attention.base import AttentionLayerSpec
from runtime.engine.attention.plan import TorchNativeMetadata
from runtime.engine.attention.registry import get_attention_backend_class, resolve_attention_backend_name
from runtime.engine.cpu import attention_fastpaths as fastpaths
from runtime.engine.cpu import decode_layers
from runtime.engine.cpu.attention import CpuAttnBackend
from runtime.engine.forward_batch import ForwardBatch, ForwardMode
from runtime.engine.model_runner import ModelRunner
from tests.support.checkpoints import random_prompt
from tests.support.harness import Harness

H, HKV, D = 4, 2, 8


def _reference(q_req: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, prefix: int) -> torch.Tensor:
    """Plain causal attention of one request: q ``[n, H, D]`` over its ``prefix + n`` keys."""
    n = q_req.shape[0]
    k = k_all.repeat_interleave(H // HKV, dim=1)  # [L, H, D]
    v = v_all.repeat_interleave(H // HKV, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q_req.double(), k.double()) / math.sqrt(q_req.shape[-1])
    allowed = torch.arange(k.shape[0])[None, :] <= (prefix + torch.arange(n))[:, None]
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double()).float()


def _run(
    mode: ForwardMode, prefix_lens: list[int], extend_lens: list[int], seed: int = 0, dtype: torch.dtype = torch.float32
) -> TorchNativeMetadata:
    """One attention forward over a scattered pool, every output row checked against ``_reference``
    (inputs rounded to ``dtype``; half precision within 3e-2)."""
    gen = torch.Generator().manual_seed(seed)
    bs = len(prefix_lens)
    total = sum(p + e for p, e in zip(prefix_lens, extend_lens))
    pool = MHATokenToKVPool(total + 8, 1, dtype, 1, HKV, D, "cpu")
    rtt = ReqToTokenPool(bs + 1, max(p + e for p, e in zip(prefix_lens, extend_lens)) + 1, "cpu")
    # Scattered, non-contiguous slots, so reading through req_to_token is really tested.
    slots = (torch.randperm(total, generator=gen) + 1).tolist()
    rows = list(range(bs))[::-1]
    k_seq, v_seq, new_locs = [], [], []
    for i in range(bs):
        n = prefix_lens[i] + extend_lens[i]
        mine, slots = slots[:n], slots[n:]
        rtt.write(rows[i], 0, torch.tensor(mine))
        k_seq.append(torch.randn(n, HKV, D, generator=gen).to(dtype))
        v_seq.append(torch.randn(n, HKV, D, generator=gen).to(dtype))
        pool.set_kv_buffer(
            0,
            torch.tensor(mine[: prefix_lens[i]], dtype=torch.int64),
            k_seq[i][: prefix_lens[i]],
            v_seq[i][: prefix_lens[i]],
        )
        new_locs.extend(mine[prefix_lens[i] :])
    return _forward_and_check(mode, k_seq, v_seq, prefix_lens, extend_lens, rows, new_locs, pool, rtt, gen, dtype)


def _forward_and_check(
    mode: ForwardMode,
    k_seq: list[torch.Tensor],
    v_seq: list[torch.Tensor],
    prefix_lens: list[int],
    extend_lens: list[int],
    rows: list[int],
    new_locs: list[int],
    pool: MHATokenToKVPool,
    rtt: ReqToTokenPool,
    gen: torch.Generator,
    dtype: torch.dtype,
) -> TorchNativeMetadata:
    """One backend forward of requests whose cached keys are in ``pool`` (their new keys are
    ``k_seq[i][prefix_lens[i]:]``), every output row checked against ``_reference``."""
    d = k_seq[0].shape[-1]  # the keys' head dim
    q = torch.randn(sum(extend_lens), H, d, generator=gen).to(dtype)
    k_new = torch.cat([k[p:] for k, p in zip(k_seq, prefix_lens)])
    v_new = torch.cat([v[p:] for v, p in zip(v_seq, prefix_lens)])
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]

    def t(x: list[int]) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.int64)

    batch = ForwardBatch(
        forward_mode=mode,
        input_ids=torch.zeros(sum(extend_lens), dtype=torch.int64),
        positions=torch.zeros(sum(extend_lens), dtype=torch.int64),
        req_pool_indices=t(rows),
        seq_lens=t(seq_lens),
        prefix_lens=t(prefix_lens),
        extend_lens=t(extend_lens),
        out_cache_loc=t(new_locs),
        req_to_token_pool=rtt,
        token_to_kv_pool=pool,
        seq_lens_cpu=seq_lens,
        prefix_lens_cpu=list(prefix_lens),
        extend_lens_cpu=list(extend_lens),
    )
    backend = CpuAttnBackend()
    backend.init_forward_metadata(batch)
    out = backend.forward(q, k_new, v_new, AttentionLayerSpec(0, H, HKV, d, d**-0.5), batch)
    assert out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    start = 0
    for i in range(len(prefix_lens)):
        n = extend_lens[i]
        expected = _reference(q[start : start + n].float(), k_seq[i].float(), v_seq[i].float(), prefix_lens[i])
        torch.testing.assert_close(out[start : start + n].float(), expected, atol=tol, rtol=tol)
        start += n
    return batch.attn_metadata


def test_extend_with_and_without_prefix() -> None:
    meta = _run(ForwardMode.EXTEND, [0, 5, 0, 17], [9, 4, 1, 6])
    assert len(meta.groups) == 2  # the 1-token extend runs in the decode-shaped group


def test_decode_is_one_padded_group() -> None:
    meta = _run(ForwardMode.DECODE, [3, 40, 1, 12, 7], [1, 1, 1, 1, 1])
    assert len(meta.groups) == 1


@pytest.mark.parametrize(
    "mode,prefix_lens,extend_lens",
    [
        (ForwardMode.DECODE, [3, 40, 1, 12, 7], [1, 1, 1, 1, 1]),  # padded one-token group (key bias)
        (ForwardMode.EXTEND, [0, 0, 0, 0], [6, 6, 6, 6]),  # equal-length prompts: the matmul prefill path
        (ForwardMode.MIXED, [10, 0, 33, 4], [1, 12, 1, 5]),
    ],
)
def test_bf16_paths_match_the_reference(mode: ForwardMode, prefix_lens: list[int], extend_lens: list[int]) -> None:
    _run(mode, prefix_lens, extend_lens, dtype=torch.bfloat16)


def test_mixed_decode_rows_and_extends() -> None:
    _run(ForwardMode.MIXED, [10, 0, 33, 4], [1, 12, 1, 5])


def test_long_prompt_is_not_padded_against_many_short_ones() -> None:
    meta = _run(ForwardMode.EXTEND, [0] * 9, [300] + [2] * 8)
    # Padding one short prompt to 300x300 doubles the group's work: the limit. The rest go apart.
    shapes = sorted(tuple(g.q_index.shape) for g in meta.groups)
    assert shapes == [(2, 300), (7, 2)]


def test_registry_names() -> None:
    assert resolve_attention_backend_name("auto", torch.device("cpu")) == "torch_native"
    assert resolve_attention_backend_name("auto", torch.device("cuda")) == "triton"
    assert get_attention_backend_class("torch_native", torch.device("cpu")) is CpuAttnBackend
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        resolve_attention_backend_name("flash", torch.device("cpu"))


def test_64_concurrent_decodes_match_one_at_a_time(tiny_llama_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runner = ModelRunner(tiny_llama_path, device="cpu", dtype="float32", max_total_tokens=16384, load_progress=False)
    harness = Harness(runner)
    prompts = [random_prompt(1 + (7 * i) % 50, runner.vocab_size, seed=500 + i) for i in range(64)]
    steps = 6
    reqs = [harness.add_request(p) for p in prompts]
    harness.prefill(reqs)

    calls = []
    real_attention = fastpaths.few_query_attention

    def counting_attention(*args, **kwargs):
        calls.append(args[0].shape[0])
        return real_attention(*args, **kwargs)

    monkeypatch.setattr(fastpaths, "few_query_attention", counting_attention)
    with decode_layers.use_decode_layers(False):  # the backend's own calls (the one-call path runs them in C)
        harness.decode(reqs, steps - 1)
    monkeypatch.undo()
    # One batched attention call per layer per decode step, each covering all 64 requests.
    assert calls == [64] * (runner.model_config.num_hidden_layers * (steps - 1))
    batched = [r.output_ids for r in reqs]
    harness.reset()

    for prompt, expected in zip(prompts, batched):
        (alone,) = harness.generate([prompt], steps)
        assert alone.output_ids == expected
        harness.reset()
