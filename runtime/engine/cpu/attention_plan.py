"""The CPU backend's part of the torch-native plan: what its fast paths add to each group.

``CpuAttnGroup`` is the group type ``runtime.engine.cpu.attention.CpuAttnBackend`` plans (every
group of its plans, windowed ones too, so its layers read these fields without asking):

- ``shared``: a one-token group whose members all start with the same KV slots (a shared
  prompt prefix from the radix cache) attends to that prefix once for the whole group
  (``SharedPrefix``, planned by ``plan_shared_prefix``);
- ``mirror``: a pure decode batch's plan of the dense decode-key copies
  (``MirrorPlan``, carried out by ``runtime.engine.cpu.decode_mirror``).

The generic plan (``runtime.engine.attention.plan``) knows nothing of either; both are None where
a fast path does not apply (extend groups, windowed layers), and the layers then take the
plain plan's path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.engine.attention.plan import CASCADE_MIN_PREFIX, AttnGroup, length_mask, shared_prefix_length


@dataclass
class SharedPrefix:
    """Cascade plan of a one-token group: ``loc`` keys common to every member, then each one's own."""

    loc: torch.Tensor  # int64 [P]: KV slots of the shared prefix
    suffix_loc: torch.Tensor  # int64 [n * Ls]: each member's remaining slots, padded with slot 0
    suffix_len: int  # Ls
    suffix_mask: torch.Tensor | None  # fp32 key bias [n, 1, 1, Ls] (key_bias; None: no padding)


@dataclass
class MirrorPlan:
    """How one decode forward's keys reach the mirror's dense copies."""

    rebuild: bool  # True: gather every key from the pool; False: append the new token only
    width: int  # W: own keys per request this step (the dense part's used width)
    prefix_len: int  # P: keys shared by every request ahead of the dense part (cascade); 0 if none
    own_flat: torch.Tensor | None  # rebuild: int64 [n * W] pool slots of each request's own keys (0-padded)
    prefix_loc: torch.Tensor | None  # rebuild: int64 [P] pool slots of the shared prefix
    append_pos: torch.Tensor | None  # append: int64 [n]: the new key's index in each request's row
    mask: torch.Tensor | None  # fp32 key bias [n, 1, 1, cap] (key_bias): 0 for each request's real keys
    # A verify step (speculative decoding): its n rows are every request's input token and drafts,
    # row i reading request kv_row[i]'s copies (int64 [n]); append_pos and mask are per row, each
    # token seeing its request's keys up to itself. None: row i is request i.
    kv_row: torch.Tensor | None = None
    # The step's new tokens' pool slots (out_cache_loc), one per row: a quantized mirror's appends
    # copy the rows the pool stored there (so the copies always hold the pool's bytes).
    new_loc: torch.Tensor | None = None


@dataclass
class CpuAttnGroup(AttnGroup):
    """An ``AttnGroup`` with the CPU backend's fast-path plans (None: the plain path)."""

    shared: SharedPrefix | None = None  # cascade plan (one-token groups only)
    mirror: MirrorPlan | None = None  # the dense-key plan (the one group of a pure decode batch)


def plan_shared_prefix(kv_loc: torch.Tensor, lens: list[int]) -> SharedPrefix | None:
    """The cascade plan when every member's first slots are the same (and long enough), else None."""
    n = kv_loc.shape[0]
    limit = min(lens) - 1  # every member keeps at least one key of its own
    if n < 2 or limit < CASCADE_MIN_PREFIX:
        return None
    p = shared_prefix_length(kv_loc, limit)
    if p < CASCADE_MIN_PREFIX:
        return None
    suffix_lens = [length - p for length in lens]
    ls = max(suffix_lens)
    suffix = kv_loc[:, p : p + ls].contiguous()
    return SharedPrefix(
        loc=kv_loc[0, :p].contiguous(),
        suffix_loc=suffix.reshape(-1),
        suffix_len=ls,
        suffix_mask=length_mask(suffix_lens, ls, kv_loc.device),
    )
