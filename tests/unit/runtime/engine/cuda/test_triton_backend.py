"""TritonAttnBackend against TorchNativeAttnBackend, on CPU under Triton's interpreter.

Two levels: the backends on the same real ForwardBatches over the same pools (extend with
and without a cached prefix, decode with split-K, mixed; page size 1 and 16), and the tiny
Llama generating greedily through ModelRunner with either backend.

Triton picks interpreter or compiled mode when ``triton`` is first imported, so this module
sets ``TRITON_INTERPRET=1`` before anything imports it; when another test module already
imported ``triton`` in compiled mode, this file runs in a fresh process instead.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported, see the module docstring

import pytest  # noqa: E402
import torch  # noqa: E402

from runtime.engine.cuda.triton_common import triton_loaded_interpreted  # noqa: E402

IN_PROCESS = "triton" not in sys.modules or triton_loaded_interpreted()

from memory.kv_pool import MHATokenToKVPool  # noqa: E402
from memory.req_to_token_pool import ReqToTokenPool  # noqa: E402
from runtime.engine.attention.base import AttentionLayerSpec  # noqa: E402
from runtime.engine.attention.registry import create_attention_backend  # noqa: E402
from runtime.engine.attention.torch_native import TorchNativeAttnBackend  # noqa: E402
from runtime.engine.cuda.attention import TritonAttnBackend, TritonAttnMetadata  # noqa: E402
from runtime.engine.cuda.attention_kernels import decode_attention as decode_mod  # noqa: E402
from runtime.engine.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from runtime.engine.model_runner import ModelRunner  # noqa: E402
from tests.support import REPO_ROOT  # noqa: E402
from tests.support.checkpoints import random_prompt  # noqa: E402
from tests.support.harness import Harness  # noqa: E402
from tests.support.triton_interp import replace_tests_with_fresh_process_run  # noqa: E402

NUM_LAYERS = 2
LAYER = 1  # not layer 0: the backend must write and read the layer it is given


class PagedRequests:
    """A minimal scheduler stand-in: request rows and page-contiguous KV slots in shuffled page order."""

    def __init__(self, pool: MHATokenToKVPool, req_pool: ReqToTokenPool, gen: torch.Generator) -> None:
        self.pool = pool
        self.req_pool = req_pool
        self.page_size = pool.page_size
        num_pages = pool.size // pool.page_size
        self.free_pages = (torch.randperm(num_pages, generator=gen) + 1).tolist()  # page 0 holds padding slot 0
        self.slots: dict[int, list[int]] = {}  # request row -> its KV slots

    def new(self) -> int:
        rows = self.req_pool.alloc(1)
        assert rows is not None
        self.slots[rows[0]] = []
        return rows[0]

    def grow(self, row: int, n: int) -> list[int]:
        """Give request ``row`` ``n`` more tokens: fill its last page, then take whole new pages."""
        slots = self.slots[row]
        new = []
        for _ in range(n):
            j = len(slots)
            if j % self.page_size == 0:
                page = self.free_pages.pop()
            else:
                page = slots[-1] // self.page_size
            slots.append(page * self.page_size + j % self.page_size)
            new.append(slots[-1])
        self.req_pool.write(row, len(slots) - n, torch.tensor(new, dtype=torch.int32))
        return new

    def batch(self, mode: ForwardMode, work: list[tuple[int, int]]) -> ForwardBatch:
        """A ForwardBatch running ``n`` new tokens for each ``(row, n)`` in ``work``."""
        prefix = [len(self.slots[row]) for row, _ in work]
        locs = [s for row, n in work for s in self.grow(row, n)]
        ext = [n for _, n in work]
        seq = [p + n for p, n in zip(prefix, ext)]
        positions = [p + i for p, n in zip(prefix, ext) for i in range(n)]

        def t(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64)

        return ForwardBatch(
            forward_mode=mode,
            input_ids=torch.zeros(len(locs), dtype=torch.int64),
            positions=t(positions),
            req_pool_indices=t([row for row, _ in work]),
            seq_lens=t(seq),
            prefix_lens=t(prefix),
            extend_lens=t(ext),
            out_cache_loc=t(locs),
            req_to_token_pool=self.req_pool,
            token_to_kv_pool=self.pool,
            seq_lens_cpu=seq,
            prefix_lens_cpu=prefix,
            extend_lens_cpu=ext,
        )


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,page_size,sm_count,window",
    [(4, 4, 64, 1, None, None), (8, 2, 80, 16, 132, None), (4, 2, 64, 1, None, 7), (8, 2, 64, 16, 132, 11)],
    ids=["mha-d64-page1", "gqa4-d80-page16-splitk", "window7-page1", "window11-page16-splitk"],
)
def test_backend_matches_torch_native_on_shared_pools(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    sm_count: int | None,
    window: int | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if sm_count is not None:  # plan decode as on a GPU with this many SMs: real split-K
        monkeypatch.setattr(decode_mod, "device_core_count", lambda device: sm_count)
    gen = torch.Generator().manual_seed(page_size)
    num_pages = 128 if page_size == 1 else 16  # room for the 73 tokens below, plus unused pages
    pool = MHATokenToKVPool(num_pages * page_size, page_size, torch.float32, NUM_LAYERS, num_kv_heads, head_dim, "cpu")
    reqs = PagedRequests(pool, ReqToTokenPool(8, 256, "cpu"), gen)
    layer = AttentionLayerSpec(LAYER, num_heads, num_kv_heads, head_dim, head_dim**-0.5, sliding_window=window)
    runner = type(
        "RunnerView", (), {"device": torch.device("cpu"), "num_heads": num_heads, "num_kv_heads": num_kv_heads}
    )
    triton_backend, native = TritonAttnBackend(runner), TorchNativeAttnBackend(runner)

    a, b, c, d, e = (reqs.new() for _ in range(5))
    steps = [
        (ForwardMode.EXTEND, [(a, 9), (b, 20), (c, 1)]),  # plain prefill
        (ForwardMode.EXTEND, [(a, 14), (d, 13)]),  # a continues after a cached prefix (chunked prefill)
        (ForwardMode.DECODE, [(a, 1), (b, 1), (c, 1), (d, 1)]),
        (ForwardMode.DECODE, [(a, 1), (b, 1), (c, 1), (d, 1)]),
        (ForwardMode.MIXED, [(e, 6), (a, 1), (b, 1)]),  # a prefill mixed with two decodes
    ]
    for mode, work in steps:
        batch = reqs.batch(mode, work)
        num_tokens = batch.num_tokens
        q = torch.randn(num_tokens, num_heads, head_dim, generator=gen)
        k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
        v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)

        native.init_forward_metadata(batch)
        expected = native.forward(q, k, v, layer, batch)
        triton_backend.init_forward_metadata(batch)
        meta = batch.attn_metadata
        assert isinstance(meta, TritonAttnMetadata) and meta.is_decode == mode.is_decode()
        got = triton_backend.forward(q, k, v, layer, batch)

        assert got.shape == (num_tokens, num_heads, head_dim)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5, msg=lambda m: f"{mode.name} {work}: {m}")
        k_buf, v_buf = pool.get_kv_buffer(LAYER)
        assert torch.equal(k_buf[batch.out_cache_loc], k) and torch.equal(v_buf[batch.out_cache_loc], v)
        assert not pool.get_kv_buffer(0)[0].any(), "another layer's KV was written"
        if mode.is_decode() and sm_count is not None and window is None:
            assert int(meta.num_kv_splits.max()) > 1, "the GPU plan should split these decodes"
        if window is not None:  # each request's plan covers its last W keys at most
            plan = meta.windowed[window]
            reach = window if mode.is_decode() else window - 1
            ends = batch.seq_lens if mode.is_decode() else batch.prefix_lens
            assert (plan.kv_indptr[1:] - plan.kv_indptr[:-1]).tolist() == ends.clamp(max=reach).tolist()


def test_registry_builds_triton_backend_from_runner_view() -> None:
    runner = type("RunnerView", (), {"device": torch.device("cpu"), "num_heads": 4, "num_kv_heads": 2})
    assert isinstance(create_attention_backend("triton", runner), TritonAttnBackend)


_FRESH_PROCESS_SCRIPT = """
import os, sys, torch
if sys.argv[1] == "triton-first":
    import triton  # what transformers does: triton is now loaded in compiled mode
from runtime.engine.cuda.attention import TritonAttnBackend
runner = type("RunnerView", (), {"device": torch.device("cpu"), "num_heads": 2, "num_kv_heads": 1})
try:
    TritonAttnBackend(runner)
except RuntimeError as exc:
    print("refused:", exc)
    sys.exit(0)
assert os.environ.get("TRITON_INTERPRET") == "1"
from runtime.engine.cuda.attention_kernels import create_kv_indices
req_to_token = torch.arange(12, dtype=torch.int32).view(2, 6)
out = torch.empty(5, dtype=torch.int32)
create_kv_indices(req_to_token, torch.tensor([1, 0]), torch.tensor([3, 2]), torch.tensor([0, 3, 5], dtype=torch.int32), None, out)
print("ran:", out.tolist())
"""


def test_cpu_backend_turns_on_the_interpreter_or_says_why_not() -> None:
    """In a process without TRITON_INTERPRET the cpu backend switches the interpreter on itself;
    when triton was already imported in compiled mode it refuses with the fix instead of crashing later."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    outputs = {}
    for order in ("backend-first", "triton-first"):
        result = subprocess.run(
            [sys.executable, "-c", _FRESH_PROCESS_SCRIPT, order],
            cwd=REPO_ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        outputs[order] = result.stdout
    assert "ran: [6, 7, 8, 0, 1]" in outputs["backend-first"]
    assert "refused:" in outputs["triton-first"] and "TRITON_INTERPRET=1" in outputs["triton-first"]


def test_tiny_llama_greedy_matches_torch_native(tiny_llama_path: Path) -> None:
    """Same greedy tokens with either backend: prefill (one chunked), then 7 decode steps."""
    prompts = [[5, 9, 11], list(range(20, 41)), [7] * 12]
    outputs = {}
    for backend in ("torch_native", "triton"):
        runner = ModelRunner(
            tiny_llama_path,
            device="cpu",
            dtype="float32",
            attention_backend=backend,
            max_total_tokens=512,
            load_progress=False,
        )
        assert type(runner.attn_backend).__name__ == ("TritonAttnBackend" if backend == "triton" else "CpuAttnBackend")
        harness = Harness(runner)
        whole = harness.generate(prompts, max_new_tokens=8)
        harness.reset()
        chunked = harness.generate(prompts[1:2], max_new_tokens=8, chunk_size=8)  # extend over cached prefixes
        outputs[backend] = [r.output_ids for r in whole] + [chunked[0].output_ids]
    assert all(len(ids) == 8 for ids in outputs["triton"])
    assert outputs["triton"] == outputs["torch_native"]
    assert outputs["triton"][1] == outputs["triton"][3]  # chunked prefill changes nothing


@pytest.mark.parametrize("name", ["mistral_swa", "qwen2_swa", "gemma2", "gemma3", "phi3_longrope"])
def test_sliding_window_models_greedy_match_torch_native(tiny_checkpoints, name: str) -> None:
    """Windowed layers through the Triton plans (decode: the last W keys; extend: the last W - 1
    cached keys and the kernel's window mask), whole and chunked (29 > W), equal torch_native's
    tokens (which tests/unit/runtime/engine/attention/test_sliding_window.py and the parity suites check
    against transformers). Gemma 2 adds the kernels' logit soft-cap and alternating windowed and
    full layers, Gemma 3 windowed layers with their own RoPE base, Phi-3 partial rotary."""
    path = tiny_checkpoints.path(name)
    prompts = [random_prompt(50, 384, seed=1), random_prompt(23, 384, seed=2)]
    outputs = {}
    for backend in ("torch_native", "triton"):
        runner = ModelRunner(
            path,
            device="cpu",
            dtype="float32",
            attention_backend=backend,
            max_total_tokens=1024,
            load_progress=False,
            disable_hybrid_swa_memory=True,
        )  # (the harness's own slots)
        harness = Harness(runner)
        whole = harness.generate(prompts, max_new_tokens=8)
        harness.reset()
        chunked = harness.generate(prompts[:1], max_new_tokens=8, chunk_size=29)
        outputs[backend] = [r.output_ids for r in whole] + [chunked[0].output_ids]
    assert outputs["triton"] == outputs["torch_native"]
    assert outputs["triton"][0] == outputs["triton"][2]


@pytest.mark.parametrize("name", ["qwen2_swa", "gemma3"])
def test_hybrid_swa_pool_scheduler_matches_torch_native(tiny_checkpoints, name: str) -> None:
    """The Triton plans read windowed layers through the SWA pool's slots (translate_swa) while
    the scheduler frees what left the window and tombstones tree nodes: same tokens as torch_native."""
    from tests.support.stub_scheduler import generate_greedy

    path = tiny_checkpoints.path(name)
    prompts = [random_prompt(34, 384, seed=5), random_prompt(28, 384, seed=6)]
    outputs = {}
    for backend in ("torch_native", "triton"):
        runner = ModelRunner(
            path,
            device="cpu",
            dtype="float32",
            attention_backend=backend,
            max_total_tokens=512,
            swa_full_tokens_ratio=0.5,
            load_progress=False,
        )
        outputs[backend] = generate_greedy(runner, prompts, 12, chunked_prefill_size=16)
    assert outputs["triton"] == outputs["torch_native"] and all(len(ids) == 12 for ids in outputs["triton"])


def test_speculative_verify_batches_match_plain_decoding(tiny_llama_path) -> None:
    """Speculative decoding's verify batches (each request's last token plus its drafts, a causal
    extend after its KV) through the Triton extend kernels: the tokens of plain decoding."""
    from tests.support.stub_scheduler import generate_greedy

    base = random_prompt(6, 384, seed=7)
    prompts = [base * 3, random_prompt(8, 384, seed=8)]
    runner = ModelRunner(
        tiny_llama_path,
        device="cpu",
        dtype="float32",
        attention_backend="triton",
        max_total_tokens=512,
        load_progress=False,
    )
    spec = generate_greedy(runner, prompts, 8, speculative_algorithm="ngram")
    assert spec == generate_greedy(runner, prompts, 8) and all(len(ids) == 8 for ids in spec)


# ---- fallback when triton was imported in compiled mode first ----------------------------

if not IN_PROCESS:
    replace_tests_with_fresh_process_run(globals(), __file__)
