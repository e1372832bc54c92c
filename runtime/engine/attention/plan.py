"""The torch-native attention plan: how one forward's requests are packed into padded groups.

Shared by every backend that runs this plan (``runtime.engine.attention.torch_native`` with SDPA,
``runtime.engine.cpu.attention`` with the CPU kernels) and by the windowed layers' plan
(``runtime.engine.attention.window_plan``), so that none of them reaches into another's privates.

Requests are packed into a few *groups*; within a group every request's queries are padded
to the group's longest extend and its keys to the group's longest sequence, so each layer
does (at most) one gather from the pool and one attention call per group:

- decode: one group holding every request (queries padded to 1, keys to the max seq len);
- extend / mixed: requests extending by one token (the decode part of a mixed batch) form
  one group; the others are grouped greedily, longest first (``pack_groups``), so that the
  padded work of a group stays within 2x its real work (a long prompt is never padded
  against many short ones). A typical prefill batch is a single group.

Masks are boolean (True = may attend): key ``j`` of a request is visible to its new token
``i`` when ``j < seq_len`` and ``j <= prefix_len + i``. Padded query rows may see key 0 so
no row is fully masked (which would give NaN); their outputs are discarded. Padded key
positions read the pool's padding slot 0. One-token groups use an fp32 additive key bias
instead (``key_bias``).

Ownership: a plan is made once per forward by the backend's ``init_forward_metadata``, hung
on ``ForwardBatch.attn_metadata`` and only read by the layers; it dies with the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeVar

import torch

# Padded work below this many (query, key) pairs is always acceptable in one group.
_GROUP_SLACK = 1 << 16
# A shared prefix shorter than this is not worth a separate cascade pass.
CASCADE_MIN_PREFIX = 32


@dataclass
class AttnGroup:
    """One padded attention call: ``n`` requests, ``q_len`` padded queries, ``kv_len`` padded keys.

    A backend with fast paths of its own plans a subclass carrying their extra fields
    (``runtime.engine.cpu.attention_plan.CpuAttnGroup``); everything here is what every backend reads.
    """

    q_index: torch.Tensor  # int64 [n, q_len]: packed-token row of each padded query (0 for padding)
    kv_loc: torch.Tensor  # int64 [n, kv_len]: KV-pool slot of each padded key (0 for padding)
    mask: (
        torch.Tensor | None
    )  # bool [n, 1, q_len, kv_len] (one-token groups: fp32 key bias [n, 1, 1, kv_len], key_bias); None: no mask
    out_tokens: torch.Tensor | None  # int64 [t]: packed rows this group produces; None = all rows in order
    out_rows: torch.Tensor | None  # int64 [t]: matching rows of the flattened [n * q_len] output
    one_token: bool = False  # every member has exactly one query: GQA folded into the query axis
    q_start: int | None = None  # queries are packed rows [q_start, q_start + n * q_len), unpadded
    kv_flat: torch.Tensor | None = None  # int64 [n * kv_len]: kv_loc flattened for index_select
    keys_are_new: bool = False  # no cached prefix, no padding: K/V are the new tokens (causal)
    # Extend groups (a backend with ``plan_cascade`` only): int64 [P] slots of a prefix every member
    # has cached (attended once, then merged); the rest of the plan (mask, kv_flat) covers the keys after it.
    shared_loc: torch.Tensor | None = None


G = TypeVar("G", bound=AttnGroup)


@dataclass
class TorchNativeMetadata:
    groups: list[AttnGroup]
    # Windowed layers' plans by window, made when the first such layer runs (window_plan).
    windowed: dict[int, list[AttnGroup]] = field(default_factory=dict)


def host_list(cached: list[int], tensor: torch.Tensor) -> list[int]:
    """The batch's host copy when the builder filled it, else one device->host copy."""
    return list(cached) if len(cached) == int(tensor.shape[0]) else [int(x) for x in tensor.tolist()]


def packed_starts(ext_lens: list[int]) -> list[int]:
    """Each request's first row among the batch's packed new tokens."""
    starts = [0] * len(ext_lens)
    for i in range(1, len(ext_lens)):
        starts[i] = starts[i - 1] + ext_lens[i - 1]
    return starts


def pack_groups(members: list[int], ext_lens: list[int], seq_lens: list[int]) -> list[list[int]]:
    """Greedy, longest sequence first: close a group when padding would more than double its work."""
    order = sorted(members, key=lambda i: (-seq_lens[i], -ext_lens[i]))
    groups: list[list[int]] = []
    current: list[int] = []
    real = max_q = max_k = 0
    for i in order:
        n_q, n_k = max(max_q, ext_lens[i]), max(max_k, seq_lens[i])
        new_real = real + ext_lens[i] * seq_lens[i]
        if current and (len(current) + 1) * n_q * n_k > 2 * new_real + _GROUP_SLACK:
            groups.append(current)
            current, real, n_q, n_k, new_real = [], 0, ext_lens[i], seq_lens[i], ext_lens[i] * seq_lens[i]
        current.append(i)
        real, max_q, max_k = new_real, n_q, n_k
    if current:
        groups.append(current)
    return groups


def one_token_group(
    kv_loc: torch.Tensor,
    valid: torch.Tensor,
    uniform: bool,
    members: list[int],
    starts: list[int] | None,
    in_order: bool,
    group_type: type[G],
) -> G:
    """A one-token group over the keys ``kv_loc`` (``valid`` marks the real ones; ``uniform``:
    every member has the same number, known on the host, so no mask). ``in_order``: the
    members are the whole batch in order (queries and outputs are the packed rows as they are).
    ``group_type``: the planning backend's group class."""
    device = kv_loc.device
    if in_order:
        q_index = torch.arange(len(members), dtype=torch.int64, device=device)[:, None]
        out_tokens = out_rows = None
    else:
        assert starts is not None
        out_tokens = torch.tensor([starts[i] for i in members], dtype=torch.int64, device=device)
        q_index = out_tokens[:, None]
        out_rows = torch.arange(len(members), dtype=torch.int64, device=device)
    mask = None if uniform else key_bias(valid[:, None, None, :])
    return group_type(
        q_index,
        kv_loc,
        mask,
        out_tokens,
        out_rows,
        one_token=True,
        q_start=0 if in_order else None,
        kv_flat=kv_loc.reshape(-1),
    )


def extend_outputs(
    q_index: torch.Tensor, q_valid: torch.Tensor, covers_all: bool
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(out_tokens, out_rows)`` of an extend group: its real queries' packed rows and their rows
    in the flattened ``[n * q_len]`` output, request by request; ``(None, None)`` when the group's
    output is every packed row in order."""
    if covers_all:
        return None, None
    n, q_len = q_index.shape
    rows = torch.arange(n * q_len, dtype=torch.int64, device=q_index.device).view(n, q_len)
    return q_index[q_valid], rows[q_valid]


def shared_prefix_length(kv_loc: torch.Tensor, limit: int) -> int:
    """How many of the first ``limit`` slots every row of ``kv_loc [n, L]`` has in common
    (one device->host sync: callers ask only once ``limit`` could reach ``CASCADE_MIN_PREFIX``)."""
    same = (kv_loc[:, :limit] == kv_loc[:1, :limit]).all(dim=0)
    differ = (~same).nonzero()
    return int(differ[0, 0]) if differ.numel() else limit


def common_cached_prefix(kv_loc: torch.Tensor, prefix_lens: list[int]) -> torch.Tensor | None:
    """int64 ``[P]`` slots that start every member's cached prefix (P >= CASCADE_MIN_PREFIX), else None.

    Only cached keys qualify (``P <= min(prefix_lens)``), so every new token of every
    member sees the whole shared part and the causal mask only concerns the rest.
    """
    limit = min(prefix_lens)
    if kv_loc.shape[0] < 2 or limit < CASCADE_MIN_PREFIX:
        return None
    p = shared_prefix_length(kv_loc, limit)
    return kv_loc[0, :p].contiguous() if p >= CASCADE_MIN_PREFIX else None


def length_mask(lens: list[int], width: int, device: torch.device) -> torch.Tensor | None:
    """Key bias ``[n, 1, 1, width]`` (see ``key_bias``): key j of request i is real when
    ``j < lens[i]``; None when all are."""
    if min(lens) == width:
        return None
    lens_t = torch.tensor(lens, dtype=torch.int64, device=device)
    return key_bias((torch.arange(width, device=device)[None, :] < lens_t[:, None])[:, None, None, :])


def key_bias(valid: torch.Tensor) -> torch.Tensor:
    """fp32 additive mask of one-token groups: 0 where ``valid`` (bool), -inf elsewhere.

    Built once per forward and added to every layer's scores (cheaper than a masked_fill
    per layer)."""
    return torch.zeros(valid.shape, dtype=torch.float32, device=valid.device).masked_fill_(~valid, float("-inf"))
