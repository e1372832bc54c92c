"""The embedding forward: one vector per request of a batch, from the model's final hidden states.

An embedding server (``--is-embedding``) prefills only. A long prompt of a causal model may come in
chunks, so each forward gives each request its *part* of the pooled vector, which the scheduler adds
up (``scheduler_proc.embedding``): the last token's hidden state (``last``: the final chunk's counts),
the first token's (``cls``: the first chunk's), or the sum of the chunk's rows (``mean``: divided by
the prompt's length at the end). A cross-encoder's head scores its first token here, on the device:
an encoder never runs in chunks (``PoolingSpec.encoder``). Hidden states are computed only at the
rows the rule reads (every row for the mean, one per request otherwise).
"""

from __future__ import annotations

import torch

from runtime.checkpoints.pooling import PoolingSpec
from runtime.engine.attention.base import AttentionBackend
from runtime.engine.forward_batch import ForwardBatch
from runtime.engine.models.base import CausalLM
from runtime.engine.ops import LayerStack


def pooled_rows(batch: ForwardBatch, method: str) -> torch.Tensor:
    """The packed-token rows whose hidden states ``method`` reads."""
    if method == "last":
        return batch.last_token_indices()
    if method == "cls":
        return batch.extend_start_loc
    return torch.arange(batch.num_tokens, device=batch.input_ids.device)


def pooled_parts(
    model: CausalLM,
    batch: ForwardBatch,
    backend: AttentionBackend,
    spec: PoolingSpec,
    layer_stack: LayerStack | None = None,
) -> torch.Tensor:
    """fp32 ``[batch size, width]``: each request's part of its pooled vector from this forward (see
    the module docstring), or a classifier's label scores of its first token."""
    if not model.is_encoder:  # (an encoder's attention reads no KV: nothing to plan)
        backend.init_forward_metadata(batch)
    hidden = model.hidden_states(batch, backend, pooled_rows(batch, spec.method), layer_stack).float()
    if spec.classifier:
        scores = model.classify(hidden)
        assert scores is not None, f"{type(model).__name__} has no classification head"
        return scores.float()
    if spec.method != "mean":
        return hidden
    owner = torch.repeat_interleave(torch.arange(batch.batch_size, device=hidden.device), batch.extend_lens)
    sums = hidden.new_zeros((batch.batch_size, hidden.shape[1]))
    return sums.index_add_(0, owner, hidden)
