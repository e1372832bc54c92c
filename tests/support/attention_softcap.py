"""A batch sequence that reaches every attention path, checked against the soft-capping formula.

Shared by tests/unit/runtime/engine/attention/test_attention_softcap.py (torch_native, the CPU backend, Triton under
the interpreter) and tests/gpu/test_attention_softcap_gpu.py (the compiled kernels).

``run_steps`` drives one backend through ``STEPS`` over a two-layer pool (layer 0 full attention,
layer 1 windowed, both with the same cap) and compares every output row with ``reference``: the
formula of transformers' eager Gemma 2 attention in float64, ``scores = (q @ k^T) * scaling;
scores = tanh(scores / C) * C; scores += mask; softmax; @ v``. The steps cover plain prefills
(one prompt; unequal prompts), extends after a cached prefix (several requests sharing 36 cached
slots, as after a radix hit: the CPU backend's extend cascade, unpadded and padded), consecutive
decodes (the CPU mirror's rebuild and appends, with and without a shared prefix), and a mixed batch
of decode rows and extends with and without a cached prefix; the window (7) cuts into all of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from memory.kv_pool import MHATokenToKVPool
from memory.req_to_token_pool import ReqToTokenPool
from runtime.engine.attention.base import AttentionBackend, AttentionLayerSpec
from runtime.engine.forward_batch import ForwardBatch, ForwardMode

WINDOW = 7
SHARED = 36  # cached slots that requests b, c, d, g take from a (>= the cascade minimum, 32)
CAP = 5.0
MAGNITUDE = 2.0  # q and k are randn * MAGNITUDE: scaled scores of std ~4 at head dim 16, so the cap bites

# (mode, [(request, new tokens)]); requests named by letter, created on first use.
STEPS: list[tuple[ForwardMode, list[tuple[str, int]]]] = [
    (ForwardMode.EXTEND, [("a", 40)]),  # one prompt: unpadded, causal over its own tokens
    (ForwardMode.EXTEND, [("b", 5), ("c", 5)]),  # after a's first 36 slots: equal lengths
    (ForwardMode.EXTEND, [("d", 3), ("g", 6)]),  # after a's first 36 slots: padded
    (ForwardMode.EXTEND, [("e", 9), ("f", 4)]),  # unequal prompts, no prefix
    (ForwardMode.DECODE, [("a", 1), ("b", 1), ("c", 1), ("d", 1), ("g", 1)]),  # shared prefix, mirror rebuilt
    (ForwardMode.DECODE, [("a", 1), ("b", 1), ("c", 1), ("d", 1), ("g", 1)]),  # mirror appends
    (ForwardMode.MIXED, [("a", 1), ("b", 1), ("e", 6), ("h", 4)]),  # decode rows, extend after prefix, prompt
    (ForwardMode.DECODE, [("a", 1), ("b", 1), ("c", 1), ("e", 1), ("f", 1), ("h", 1)]),  # no shared prefix
    (ForwardMode.DECODE, [("a", 1), ("b", 1), ("c", 1), ("e", 1), ("f", 1), ("h", 1)]),
]
SHARING = {"b": "a", "c": "a", "d": "a", "g": "a"}  # request -> whose first SHARED slots it starts with


def layer_specs(num_heads: int, num_kv_heads: int, head_dim: int, cap: float | None) -> list[AttentionLayerSpec]:
    """Layer 0 full attention, layer 1 windowed (Gemma 2 alternates them), both capped at ``cap``."""
    scale = head_dim**-0.5
    return [
        AttentionLayerSpec(0, num_heads, num_kv_heads, head_dim, scale, None, cap),
        AttentionLayerSpec(1, num_heads, num_kv_heads, head_dim, scale, WINDOW, cap),
    ]


def runner_view(num_heads: int, num_kv_heads: int, device: str) -> Any:
    """What the backends read of a model runner: device, head counts, the layers' windows."""
    config = type("ConfigView", (), {"layer_windows": (None, WINDOW)})
    return type(
        "RunnerView",
        (),
        {"device": torch.device(device), "num_heads": num_heads, "num_kv_heads": num_kv_heads, "model_config": config},
    )


def reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int, scale: float, cap: float | None, window: int | None
) -> torch.Tensor:
    """One request's new tokens ``q [n, H, D]`` over all its keys ``k``/``v`` ``[prefix + n, Hkv, D]``, in float64."""
    n, h = q.shape[0], q.shape[1]
    group = h // k.shape[1]
    kk, vv = k.double().repeat_interleave(group, dim=1), v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), kk) * scale
    if cap is not None:
        scores = torch.tanh(scores / cap) * cap
    pos = prefix + torch.arange(n, device=q.device)[:, None]
    key = torch.arange(k.shape[0], device=q.device)[None, :]
    allowed = key <= pos
    if window is not None:
        allowed &= pos - key < window
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv)


@dataclass
class _Request:
    row: int
    slots: list[int] = field(default_factory=list)
    # per layer: this request's keys and values so far, [tokens, Hkv, D]
    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)


@dataclass
class StepResult:
    """One layer of one step: the backend's rows, the capped reference, the uncapped one (float64)."""

    mode: ForwardMode
    layer: int
    got: torch.Tensor
    expected: torch.Tensor
    uncapped: torch.Tensor


class Scenario:
    """The pools and the requests' histories of one run of ``STEPS`` (page size 1, scattered slots)."""

    def __init__(
        self, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: str, seed: int, num_layers: int = 2
    ) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.device, self.dtype = device, dtype
        self.pool = MHATokenToKVPool(256, 1, dtype, num_layers, num_kv_heads, head_dim, device)
        self.req_pool = ReqToTokenPool(10, 64, device)
        self.free = (torch.randperm(255, generator=self.gen) + 1).tolist()  # slot 0 is the padding slot
        self.reqs: dict[str, _Request] = {}

    def randn(self, *shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=self.gen) * MAGNITUDE).to(self.dtype).to(self.device)

    def request(self, name: str) -> _Request:
        if name not in self.reqs:
            rows = self.req_pool.alloc(1)
            assert rows is not None
            req = _Request(rows[0])
            src = self.reqs.get(SHARING.get(name, ""))
            if src is not None:  # a radix hit: the same cached slots (and so the same keys)
                req.slots = src.slots[:SHARED]
                req.keys = [k[:SHARED] for k in src.keys]
                req.values = [v[:SHARED] for v in src.values]
                self.req_pool.write(req.row, 0, torch.tensor(req.slots, dtype=torch.int32))
            self.reqs[name] = req
        return self.reqs[name]

    def batch(self, mode: ForwardMode, work: list[tuple[str, int]]) -> ForwardBatch:
        """A ForwardBatch running ``n`` new tokens of each ``(request, n)``, their slots allocated."""
        prefix, locs = [], []
        for name, n in work:
            req = self.request(name)
            prefix.append(len(req.slots))
            new = [self.free.pop() for _ in range(n)]
            self.req_pool.write(req.row, len(req.slots), torch.tensor(new, dtype=torch.int32))
            req.slots = req.slots + new
            locs.extend(new)
        ext = [n for _, n in work]
        seq = [p + n for p, n in zip(prefix, ext)]

        def t(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=self.device)

        return ForwardBatch(
            forward_mode=mode,
            input_ids=t([0] * len(locs)),
            positions=t([p + i for p, n in zip(prefix, ext) for i in range(n)]),
            req_pool_indices=t([self.reqs[name].row for name, _ in work]),
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


def run_steps(
    backend: AttentionBackend,
    layers: list[AttentionLayerSpec],
    cap_for_reference: float | None,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    seed: int = 0,
) -> list[StepResult]:
    """``STEPS`` through ``backend`` with ``layers``; every layer's output of every step with its
    references (``cap_for_reference``: the cap the expected rows use)."""
    num_heads, num_kv_heads, head_dim = layers[0].num_heads, layers[0].num_kv_heads, layers[0].head_dim
    sc = Scenario(num_kv_heads, head_dim, dtype, device, seed)
    results = []
    for mode, work in STEPS:
        batch = sc.batch(mode, work)
        prefix = list(batch.prefix_lens_cpu)
        backend.init_forward_metadata(batch)
        for layer in layers:
            t = batch.num_tokens
            q = sc.randn(t, num_heads, head_dim)
            kv = sc.randn(t, 2 * num_kv_heads, head_dim)
            k, v = kv[:, :num_kv_heads], kv[:, num_kv_heads:]  # strided rows, as views of a fused qkv output
            got = backend.forward(q, k, v, layer, batch)
            expected, uncapped, start = [], [], 0
            for (name, n), p in zip(work, prefix):
                req = sc.reqs[name]
                lid = layer.layer_id
                if len(req.keys) <= lid:
                    req.keys.append(k[:0])
                    req.values.append(v[:0])
                req.keys[lid] = torch.cat([req.keys[lid][:p], k[start : start + n]])
                req.values[lid] = torch.cat([req.values[lid][:p], v[start : start + n]])
                args = (q[start : start + n], req.keys[lid], req.values[lid], p, layer.scaling)
                expected.append(reference(*args, cap_for_reference, layer.sliding_window))
                uncapped.append(reference(*args, None, layer.sliding_window))
                start += n
            results.append(StepResult(mode, layer.layer_id, got, torch.cat(expected), torch.cat(uncapped)))
    return results


def check(results: list[StepResult], tol: float) -> None:
    """Every step's rows within ``tol`` of their expected rows."""
    for r in results:
        where = f"{r.mode.name} layer {r.layer}"
        torch.testing.assert_close(r.got.double(), r.expected, atol=tol, rtol=tol, msg=lambda m: f"{where}: {m}")
