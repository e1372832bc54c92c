"""The sequence-classification heads of the encoders (cross-encoder rerankers): what turns a request's
first-token hidden state into its label scores (``CausalLM.classify``).

- BERT's (``BertForSequenceClassification``): the pooler (``pooler.dense`` then tanh), then the
  classifier (``classifier``); a plain ``BertModel``'s pooler is not loaded (embeddings pool the
  hidden states themselves).
- XLM-RoBERTa's (``XLMRobertaForSequenceClassification``): ``classifier.dense`` then tanh, then
  ``classifier.out_proj`` (its encoder has no pooler).

Both are small replicated linears (every TP rank holds them whole); the scores come back in fp32.
"""

from __future__ import annotations

import torch
from torch import nn

from runtime.engine.layers.linear import ReplicatedLinear
from runtime.engine.ops import DeviceOps


class ClassifierHead(nn.Module):
    """``out(tanh(dense(x)))`` over the pooled rows, in fp32 out; ``checkpoint_names_of_linears`` names
    the two linears as the family's checkpoints do."""

    # (the dense linear's, the output linear's) checkpoint prefix
    checkpoint_names_of_linears: tuple[str, str] = ("", "")

    def __init__(self, hidden_size: int, num_labels: int, dtype: torch.dtype, ops: DeviceOps) -> None:
        super().__init__()
        self.dense = ReplicatedLinear(hidden_size, hidden_size, bias=True, params_dtype=dtype, ops=ops)
        self.out_proj = ReplicatedLinear(hidden_size, num_labels, bias=True, params_dtype=dtype, ops=ops)

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        """``pooled [n, hidden]`` -> fp32 label scores ``[n, num_labels]``."""
        pooled = pooled.to(self.dense.weight.dtype)
        return self.out_proj(torch.tanh(self.dense(pooled))).float()

    def checkpoint_names(self) -> dict[str, str]:
        """Checkpoint tensor name -> this head's parameter name."""
        return {
            f"{prefix}.{leaf}": f"{ours}.{leaf}"
            for prefix, ours in zip(self.checkpoint_names_of_linears, ("dense", "out_proj"))
            for leaf in ("weight", "bias")
        }


class BertClassifierHead(ClassifierHead):
    checkpoint_names_of_linears = ("pooler.dense", "classifier")


class RobertaClassifierHead(ClassifierHead):
    checkpoint_names_of_linears = ("classifier.dense", "classifier.out_proj")
