"""The torch-native plan of a windowed layer: each query sees only its last W keys.

A layer with ``sliding_window = W`` lets the query at position ``q`` attend to keys at
positions ``q - W < j <= q`` (transformers' sliding-window mask). The full-attention
plan of ``torch_native`` is no use there as it is: it reads every cached key. This plan
reads only each request's keys from ``max(0, first query position - W + 1)`` on, so a
decode step gathers at most W keys per request however long the sequence is, and the
tokens that slid out of every window are never read (their SWA slots may be gone).

Every group is masked explicitly (no ``keys_are_new``/``is_causal`` shortcut, no shared
prefix, no decode mirror): the groups are of the planning backend's ``group_type``, and the
CPU backend's fast paths that assume full causal attention see their fields
(``shared``/``mirror``/``shared_loc``) unset and take their generic masked path.

Slots: ``req_to_token`` holds full-pool slots. When the KV pool keeps windowed layers in a
pool of their own (``memory.swa_kv_pool.SWAKVPool``), the plan's slots are translated
into that pool's slots once per forward (``pool.translate_swa``).
"""

from __future__ import annotations

import torch

from runtime.engine.attention.plan import G, extend_outputs, one_token_group, pack_groups, packed_starts
from runtime.engine.forward_batch import ForwardBatch


def plan_window_groups(
    batch: ForwardBatch,
    window: int,
    seq_lens: list[int],
    ext_lens: list[int],
    prefix_lens: list[int],
    group_type: type[G],
) -> list[G]:
    """The groups (of ``group_type``) of one forward for layers of window ``window`` (see the module
    docstring)."""
    bs = len(seq_lens)
    starts = packed_starts(ext_lens)
    # Key range of each request: from the first key its first new token can see, to its end.
    key_start = [max(0, prefix_lens[i] - window + 1) for i in range(bs)]
    ones = [i for i in range(bs) if ext_lens[i] == 1]
    multi = [i for i in range(bs) if ext_lens[i] != 1]
    groups: list[G] = []
    if ones:
        groups.append(_one_token_group(batch, ones, starts, seq_lens, key_start, len(ones) == bs, group_type))
    key_lens = [seq_lens[i] - key_start[i] for i in range(bs)]
    for members in pack_groups(multi, ext_lens, key_lens):
        groups.append(
            _extend_group(batch, members, starts, ext_lens, prefix_lens, seq_lens, key_start, window, group_type)
        )
    return groups


def _window_slots(
    batch: ForwardBatch, members: list[int], key_start: list[int], seq_lens: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(kv_loc [n, L], valid [n, L])``: each member's slots from ``key_start`` to its end (0-padded)."""
    device = batch.req_pool_indices.device
    idx = torch.tensor(members, dtype=torch.int64, device=device)
    rows = batch.req_pool_indices.index_select(0, idx)
    first = torch.tensor([key_start[i] for i in members], dtype=torch.int64, device=device)
    lens = torch.tensor([seq_lens[i] - key_start[i] for i in members], dtype=torch.int64, device=device)
    width = max(seq_lens[i] - key_start[i] for i in members)
    j = torch.arange(width, dtype=torch.int64, device=device)[None, :]
    valid = j < lens[:, None]
    cols = torch.where(valid, first[:, None] + j, 0)
    kv_loc = batch.req_to_token_pool.req_to_token[rows[:, None], cols].to(torch.int64).masked_fill_(~valid, 0)
    translate = getattr(batch.token_to_kv_pool, "translate_swa", None)
    if translate is not None:
        kv_loc = translate(kv_loc)
    return kv_loc, valid


def _one_token_group(
    batch: ForwardBatch,
    members: list[int],
    starts: list[int],
    seq_lens: list[int],
    key_start: list[int],
    in_order: bool,
    group_type: type[G],
) -> G:
    # A one-token query sits at position seq_len - 1: it sees exactly the keys from key_start on.
    kv_loc, valid = _window_slots(batch, members, key_start, seq_lens)
    uniform = len({seq_lens[i] - key_start[i] for i in members}) == 1  # on the host: no device sync
    return one_token_group(kv_loc, valid, uniform, members, starts, in_order, group_type)


def _extend_group(
    batch: ForwardBatch,
    members: list[int],
    starts: list[int],
    ext_lens: list[int],
    prefix_lens: list[int],
    seq_lens: list[int],
    key_start: list[int],
    window: int,
    group_type: type[G],
) -> G:
    device = batch.req_pool_indices.device
    kv_loc, valid = _window_slots(batch, members, key_start, seq_lens)
    n, q_len = len(members), max(ext_lens[i] for i in members)
    ext = torch.tensor([ext_lens[i] for i in members], dtype=torch.int64, device=device)
    start = torch.tensor([starts[i] for i in members], dtype=torch.int64, device=device)
    # Query i of a member is at position prefix + i; key j at key_start + j.
    q_pos0 = torch.tensor([prefix_lens[i] - key_start[i] for i in members], dtype=torch.int64, device=device)
    qi = torch.arange(q_len, dtype=torch.int64, device=device)[None, :]
    q_valid = qi < ext[:, None]
    q_index = torch.where(q_valid, start[:, None] + qi, 0)
    kj = torch.arange(kv_loc.shape[1], dtype=torch.int64, device=device)[None, None, :]
    delta = (q_pos0[:, None] + qi)[:, :, None] - kj  # [n, q_len, L]: query position - key position
    mask = (delta >= 0) & (delta < window) & valid[:, None, :]
    mask[:, :, 0] |= ~q_valid  # padded query rows see key 0 only, to stay finite
    unpadded = all(ext_lens[i] == q_len for i in members)  # on the host: no device sync
    contiguous = unpadded and all(starts[m] == starts[members[0]] + j * q_len for j, m in enumerate(members))
    q_start = starts[members[0]] if contiguous else None
    covers_all = contiguous and q_start == 0 and n * q_len == sum(ext_lens)
    out_tokens, out_rows = extend_outputs(q_index, q_valid, covers_all)
    return group_type(q_index, kv_loc, mask[:, None], out_tokens, out_rows, q_start=q_start, kv_flat=kv_loc.reshape(-1))
