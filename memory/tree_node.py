"""TreeNode: one edge of a prefix tree, shared by every tree variant (radix, SWA, host tier).

Its own module so that the request protocol (``memory.req_state``: a request's cache handle
names the node it locks) and the trees can both import it without importing each other.
"""

from __future__ import annotations

import torch

# A child's key in its parent: the first token of its edge (page size 1) or the first page of
# tokens, paired with the edge's ``extra_key`` when it has one.
TokenKey = int | tuple[int, ...]
ChildKey = TokenKey | tuple[str, TokenKey]


class TreeNode:
    """One edge of the radix tree: a run of tokens (``key``) and their KV slots (``value``).

    Every variant of the tree uses this one node class (the tree owns all of its fields):

    - ``value``: the tokens' device KV slots. None only in a ``HiRadixCache`` node whose KV
      is in the host tier alone; every other tree's nodes always have them.
    - ``host_value``: the tokens' host KV slots (``HiRadixCache`` only; None: no host copy).
    - ``swa_tombstone``: the tokens gave their SWA slots back (``SWARadixCache`` only).
    """

    __slots__ = (
        "id",
        "key",
        "value",
        "parent",
        "children",
        "lock_ref",
        "last_access_time",
        "hit_count",
        "extra_key",
        "host_value",
        "swa_tombstone",
    )

    def __init__(
        self, node_id: int, key: list[int], value: torch.Tensor | None, parent: TreeNode | None, extra_key: str | None
    ) -> None:
        self.id = node_id
        self.key = key
        self.value = value
        self.parent = parent
        self.children: dict[ChildKey, TreeNode] = {}
        self.lock_ref = 0
        self.last_access_time = 0
        self.hit_count = 0
        self.extra_key = extra_key
        self.host_value: torch.Tensor | None = None
        self.swa_tombstone = False

    def device_value(self) -> torch.Tensor:
        """``value`` where the tree guarantees device slots (every tree but a host-only HiRadixCache node)."""
        assert self.value is not None, f"{self!r} has no device slots"
        return self.value

    def host_slots(self) -> torch.Tensor:
        """``host_value`` where the tree guarantees a host copy (a HiRadixCache node being copied, or host-only)."""
        assert self.host_value is not None, f"{self!r} has no host slots"
        return self.host_value

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, len={len(self.key)}, lock_ref={self.lock_ref}, children={len(self.children)})"
