"""Attention with soft-capped logits (``AttentionLayerSpec.logit_softcap``, Gemma 2), in torch.

Why a path of its own: SDPA and the CPU's C kernels take the scaled scores straight into the
softmax; a soft-capped layer needs ``C * tanh(score / C)`` between the two. This module computes
the scores explicitly, exactly as transformers' eager Gemma 2 attention does: ``(q @ k^T) *
scaling``, then the cap, then the mask, then an fp32 softmax, then ``@ v``. Every torch path of
the attention backends (``torch_native``'s groups, the CPU backend's groups and its cascade's
two halves) calls ``softcapped_attention`` where a layer sets a cap; a layer without one never
comes here, so its results stay those of SDPA and the kernels bit for bit.

Memory: the fp32 scores of a long prompt would be ``[n, H, L, L]``; the queries are taken a run
of positions at a time so that one run's scores stay near ``_SCORE_BYTES``.
"""

from __future__ import annotations

import torch

# Bytes of fp32 scores per run of query positions (cache-friendly, and bounded for long prompts).
_SCORE_BYTES = 32 << 20


def cap_scores_(scores: torch.Tensor, cap: float) -> torch.Tensor:
    """In place: ``scores = cap * tanh(scores / cap)`` (the scores already scaled); returns ``scores``."""
    return scores.div_(cap).tanh_().mul_(cap)


def softcapped_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    cap: float,
    mask: torch.Tensor | None = None,
    is_causal: bool = False,
    with_lse: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``q [n, H, Lq, D]`` against ``k [n, Hkv, Lk, D]``, ``v [n, Hkv, Lk, Dv]`` (H a multiple of Hkv:
    query head h reads KV head h // (H / Hkv)), logits soft-capped at ``cap``.

    ``mask`` ``[n, 1, Lq or 1, Lk]``: bool (True: may attend) or an additive fp32 bias (0 / -inf, the
    one-token groups' ``key_bias``); ``is_causal``: query i sees keys j <= i (SDPA's ``is_causal``).
    Every query must see at least one key. Returns ``(out [n, H, Lq, Dv] in v's dtype, lse [n, H, Lq]
    fp32 of the capped logits or None)``: the log-sum-exp is what a cascade merges two key sets by.

    The GQA group is folded into the query axis (``[n, Hkv, group * Lq, D]``), so each KV head's keys
    are multiplied once for its whole group and never repeated in memory.
    """
    n, h, lq, d = q.shape
    hkv, lk, dv = k.shape[1], k.shape[2], v.shape[-1]
    if h % hkv:
        raise ValueError(f"{h} query heads are not a multiple of {hkv} KV heads")
    group = h // hkv
    out = torch.empty(n, h, lq, dv, dtype=v.dtype, device=q.device)
    lse = torch.empty(n, h, lq, dtype=torch.float32, device=q.device) if with_lse else None
    k_t = k.transpose(-1, -2)
    step = max(1, _SCORE_BYTES // max(1, 4 * n * h * lk))
    for start in range(0, lq, step):
        end = min(lq, start + step)
        rows = end - start
        qc = q[:, :, start:end].reshape(n, hkv, group * rows, d)  # row = head-in-group * rows + position
        scores = torch.matmul(qc, k_t).float().mul_(scale)  # [n, Hkv, group * rows, Lk], a fresh tensor
        cap_scores_(scores, cap)
        per_head = scores.view(n, hkv, group, rows, lk)
        if mask is not None:
            m = (mask if mask.shape[-2] == 1 else mask[..., start:end, :]).unsqueeze(1)  # [n, 1, 1, rows|1, Lk]
            if m.dtype == torch.bool:
                per_head.masked_fill_(~m, float("-inf"))
            else:
                per_head.add_(m)
        if is_causal:
            position = torch.arange(start, end, device=q.device)
            per_head.masked_fill_(torch.arange(lk, device=q.device)[None, :] > position[:, None], float("-inf"))
        if lse is not None:
            lse[:, :, start:end] = torch.logsumexp(per_head, dim=-1).view(n, h, rows)
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        out[:, :, start:end] = torch.matmul(probs, v).view(n, h, rows, dv)
    return out, lse
