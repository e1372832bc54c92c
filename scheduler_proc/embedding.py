"""An embedding server's requests in the scheduler: prefilled, pooled, answered, never decoded.

The model runner gives each request of an embedding forward its part of the pooled vector
(``runtime.engine.pooling``); a prompt prefilled in chunks gets one part per chunk, added up here on
the request (``take_parts``) and finished into its ``embedding`` once its last chunk is in
(``finish``): the mean divided by the prompt's length, then normalised where the rule says.

The rule also decides what the scheduler may do with such prompts (``serving_args``): a rule that
reads hidden states of the prompt's first tokens (mean, cls) cannot take them from a cached prefix,
whose hidden states are gone, so the prefix cache is off; an encoder's tokens attend both ways, so
its prompt is never split into chunks either.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Sequence

import torch

from runtime.checkpoints.pooling import PoolingSpec
from runtime.config.args import ServerArgs
from scheduler_proc.model_worker import StepResult
from scheduler_proc.prefill_adder import PlannedExtend

logger = logging.getLogger(__name__)

EMBED_FINISH = {"type": "stop", "matched": None}


def serving_args(args: ServerArgs, pooling: PoolingSpec | None) -> ServerArgs:
    """``args`` as an embedding server with ``pooling`` must run (see the module docstring)."""
    if pooling is None:
        return args
    changes: dict[str, object] = {}
    if not pooling.reuses_prefixes and not args.disable_radix_cache:
        changes["disable_radix_cache"] = True
    if pooling.encoder and args.chunked_prefill_size:
        changes["chunked_prefill_size"] = None
    if changes:
        logger.info("embedding server (%s): %s", pooling.describe(), ", ".join(f"{k}={v}" for k, v in changes.items()))
    return dataclasses.replace(args, **changes) if changes else args  # type: ignore[arg-type]


def take_parts(items: Sequence[PlannedExtend], result: StepResult, pooling: PoolingSpec) -> None:
    """Add each embedding request's part of this forward (row i = ``items[i]``) to its running sum,
    and finish the vectors of those whose last chunk this was."""
    assert result.pooled is not None, "an embedding server's forward pools"
    for row, item in enumerate(items):
        req = item.req
        if not req.embed:
            continue
        part = result.pooled[row].to(torch.float64)
        if pooling.classifier or pooling.method == "last":
            req.pooled = part
        elif pooling.method == "cls":
            if item.prefix_len == 0:
                req.pooled = part
        else:
            req.pooled = part if req.pooled is None else req.pooled + part
        if not item.chunked:  # (every prompt token was pooled: mean and cls serve without cached prefixes)
            req.embedding = finish(req.pooled, len(req.origin_input_ids), pooling)


def finish(pooled: torch.Tensor | None, tokens: int, pooling: PoolingSpec) -> list[float]:
    """The reply's vector from the parts' sum over ``tokens`` prompt tokens."""
    assert pooled is not None, "an embedding request's forward gave no part"
    vector = pooled / tokens if pooling.method == "mean" and not pooling.classifier else pooled
    if pooling.normalize and not pooling.classifier:
        vector = vector / vector.norm().clamp_min(1e-12)
    return vector.to(torch.float32).tolist()
