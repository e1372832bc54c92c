"""The adapter slots on the device: every adapted linear's stacked matrices, and what an adapter writes there.

Which linears take adapters is read from the model itself: its ``checkpoint_targets`` name every
checkpoint projection (``model.layers.0.self_attn.q_proj``) and the parameter it loads into, so a
merged layer (q/k/v, gate/up) is found with the shard its projection fills, and a fused checkpoint
projection (Phi-3's ``qkv_proj``) as one part over all rows; no model class is named here. Each such
linear gets ``LoraWeights`` of ``slots`` slots at the pool's rank (``runtime.engine.ops.lora``) and a
``LinearLora`` that the linear adds in its forward.

An adapter is prepared once, when it is loaded (``prepare``): this rank's shard of each matrix
(the linear cuts it as it cuts its weight), the scaling folded into ``B``, zero-padded to the
pool's rank, in the model's dtype, kept in host memory; putting it in a slot is then two copies per
linear (``write``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from runtime.checkpoints.lora_targets import LORA_TARGET_MODULES
from runtime.engine.layers.linear import LinearBase
from runtime.engine.lora.adapter import LoraAdapter, LoraAdapterError
from runtime.engine.ops.lora import LinearLora, LoraContext, LoraWeights


@dataclass(frozen=True)
class PartRef:
    """Where a checkpoint projection's adapter goes: the linear, its part index and shard id."""

    linear_name: str
    part: int
    shard_id: object


@dataclass
class PreparedAdapter:
    """An adapter as this rank writes it into a slot: per adapted linear, ``a [P * R, K]`` and
    ``b [N, R]`` (host memory, the model's dtype), plus the leaf names it targets."""

    blocks: dict[str, tuple[torch.Tensor, torch.Tensor]]
    max_rank: int
    nbytes: int


def model_projections(model: nn.Module) -> dict[str, tuple[str, LinearBase, object]]:
    """Checkpoint projection name (without ``.weight``) -> (the linear's module name, the linear, shard
    id) for every projection an adapter may target (``LORA_TARGET_MODULES``)."""
    by_weight = {
        id(module.weight): (name, module) for name, module in model.named_modules() if isinstance(module, LinearBase)
    }
    targets = model.checkpoint_targets()  # type: ignore[operator]
    found: dict[str, tuple[str, LinearBase, object]] = {}
    for checkpoint_name, (param, shard_id) in targets.items():
        if not checkpoint_name.endswith(".weight") or id(param) not in by_weight:
            continue
        projection = checkpoint_name[: -len(".weight")]
        if projection.rpartition(".")[2] not in LORA_TARGET_MODULES:
            continue
        linear_name, linear = by_weight[id(param)]
        found[projection] = (linear_name, linear, shard_id)
    return found


class LoraPool:
    """``slots`` adapter slots over the model's adapted linears, at rank ``rank``.

    ``target_leaves``: the projection names adapters may target (``q_proj``...); every linear that
    holds one of them gets slot buffers, and its other projections zeros."""

    def __init__(
        self, model: nn.Module, slots: int, rank: int, target_leaves: set[str], dtype: torch.dtype, device: torch.device
    ) -> None:
        self.slots, self.rank, self.dtype, self.device = slots, rank, dtype, device
        self.context = LoraContext()
        projections = model_projections(model)
        leaves_known = {name.rpartition(".")[2] for name in projections}
        unknown = sorted(target_leaves - leaves_known)
        if unknown:
            raise LoraAdapterError(
                f"LoRA target modules {unknown} are not projections of this model (it has {sorted(leaves_known)})"
            )
        adapted = {
            linear_name for name, (linear_name, _, _) in projections.items() if name.rpartition(".")[2] in target_leaves
        }
        self.linears: dict[str, LinearBase] = {}
        self.parts: dict[str, PartRef] = {}  # checkpoint projection -> where its adapter goes
        self.target_leaves = set(target_leaves)
        for projection, (linear_name, linear, shard_id) in projections.items():
            if linear_name not in adapted:
                continue
            parts = linear.lora_parts()
            index = next((i for i, (shard, _, _) in enumerate(parts) if shard == shard_id), None)
            if index is None:  # a fused projection over a merged layer: one part, all its rows
                parts = [(None, 0, int(linear.weight.shape[0]))]
                index = 0
            if linear_name not in self.linears:
                self.linears[linear_name] = linear
                bounds = tuple([first for _, first, _ in parts] + [parts[-1][1] + parts[-1][2]])
                n, k = int(linear.weight.shape[0]), int(linear.weight.shape[1])
                weights = LoraWeights(
                    a=torch.zeros(slots, len(parts) * rank, k, dtype=dtype, device=device),
                    b=torch.zeros(slots, n, rank, dtype=dtype, device=device),
                    part_rows=bounds,
                )
                linear.lora = LinearLora(weights, self.context)
            self.parts[projection] = PartRef(linear_name, index, shard_id)

    def nbytes(self) -> int:
        """Device memory the slots take."""
        total = 0
        for linear in self.linears.values():
            assert linear.lora is not None
            for t in (linear.lora.weights.a, linear.lora.weights.b):
                total += t.numel() * t.element_size()
        return total

    def prepare(self, adapter: LoraAdapter) -> PreparedAdapter:
        """This rank's slot contents for ``adapter`` (``LoraAdapterError`` where the pool cannot hold it)."""
        if adapter.max_rank > self.rank:
            raise LoraAdapterError(
                f"{adapter.path}: rank {adapter.max_rank} is above the server's --max-lora-rank {self.rank}"
            )
        blocks: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for projection, module in adapter.modules.items():
            ref = self.parts.get(projection)
            if ref is None:
                leaf = projection.rpartition(".")[2]
                if leaf in LORA_TARGET_MODULES and leaf not in self.target_leaves:
                    targets = ", ".join(sorted(self.target_leaves))
                    why = f"{leaf} is not among the server's LoRA target modules ({targets})"
                else:  # (a name of a routed expert, the LM head, or another model's module)
                    why = "only this model's attention and dense MLP projections take adapters"
                raise LoraAdapterError(f"{adapter.path}: the adapter adapts {projection}, and {why}")
            linear = self.linears[ref.linear_name]
            assert linear.lora is not None
            weights = linear.lora.weights
            if ref.linear_name not in blocks:
                a_block = torch.zeros(weights.a.shape[1:], dtype=self.dtype)
                b_block = torch.zeros(weights.b.shape[1:], dtype=self.dtype)
                blocks[ref.linear_name] = (a_block, b_block)
            a_block, b_block = blocks[ref.linear_name]
            out_rows, in_cols = linear.lora_full_shape(ref.shard_id)  # (before the cut: a cut of more would fit)
            if module.a.shape[1] != in_cols or module.b.shape[0] != out_rows:
                raise LoraAdapterError(
                    f"{adapter.path}: {projection}: lora_A {tuple(module.a.shape)} / lora_B {tuple(module.b.shape)} "
                    f"do not fit the model's projection ({out_rows} x {in_cols}; another base model's adapter?)"
                )
            a, b = linear.shard_lora(module.a, module.b * module.scaling, ref.shard_id)
            lo, hi = weights.part_rows[ref.part], weights.part_rows[ref.part + 1]
            assert a.shape[1] == a_block.shape[1] and b.shape[0] == hi - lo, (projection, a.shape, b.shape)
            rank = module.rank
            first = ref.part * self.rank
            a_block[first : first + rank] = a.to(self.dtype)
            b_block[lo:hi, :rank] = b.to(self.dtype)
        nbytes = sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in blocks.values())
        return PreparedAdapter(blocks=blocks, max_rank=adapter.max_rank, nbytes=nbytes)

    def write(self, slot: int, adapter: PreparedAdapter) -> None:
        """Put ``adapter`` in ``slot`` (linears it does not adapt get zeros there)."""
        for name, linear in self.linears.items():
            assert linear.lora is not None
            weights = linear.lora.weights
            block = adapter.blocks.get(name)
            if block is None:
                weights.a[slot].zero_()
                weights.b[slot].zero_()
            else:
                weights.a[slot].copy_(block[0], non_blocking=True)
                weights.b[slot].copy_(block[1], non_blocking=True)
