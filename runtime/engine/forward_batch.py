"""ForwardBatch: everything one model forward needs, on the model's device.

Built by the scheduler (or by tests) and read by the model and the attention
backend. Tokens of all requests are packed back to back (no padding): request i
owns ``input_ids[extend_start_loc[i] : extend_start_loc[i] + extend_lens[i]]``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from memory.kv_pool import MHATokenToKVPool
    from memory.req_to_token_pool import ReqToTokenPool
    from runtime.engine.sampling.token_ids_logprob import TokenIdsIndex


class ForwardMode(enum.IntEnum):
    EXTEND = 1  # prefill of new tokens, possibly after a cached prefix
    DECODE = 2  # exactly one new token per request
    MIXED = 3  # extend requests and decode requests (extend_len 1) in one batch
    # Speculative verification: each request's last token plus its drafts (extend_len 1 + drafts,
    # causal after its KV); logits at, and a sample from, every token (scheduler_proc/spec).
    VERIFY = 4

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE

    def is_extend(self) -> bool:
        """MIXED and VERIFY run through the extend path: a decode request is an extend of length 1.
        (So the one-call CPU decode stack, the decode mirror and CUDA graphs, which take decode
        batches only, step aside for a verify batch.)"""
        return self in (ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.VERIFY)


@dataclass
class InputLogprobRows:
    """Prompt logprobs a batch computes (SGLang's input logprobs), laid out by the scheduler's
    batch builder; absent (None) from every batch where no request asks for them, which then
    computes logits at each request's last new token only.

    The model computes logits at ``logit_rows`` of the packed token axis (per request: a run of
    positions ending at its last new token). Row ``sample_rows[i]`` of those logits is where
    request i samples; rows ``prompt_rows`` give the logprob of ``target_ids`` (the prompt token
    after each such position). The tensors are the batch's, on its device. ``token_ids``, when a
    request of the batch names ids (SGLang's ``token_ids_logprob``), has one row per prompt row.
    """

    logit_rows: torch.Tensor  # int64 [R]: packed token indices whose logits are computed
    sample_rows: torch.Tensor  # int64 [bs]: row of the computed logits each request samples from
    prompt_rows: torch.Tensor  # int64 [m]: rows of the computed logits that give prompt logprobs
    target_ids: torch.Tensor  # int64 [m]: the prompt token each of those rows predicts
    token_ids: "TokenIdsIndex | None" = None  # [m, width]: the ids whose logprob each prompt row reports


@dataclass
class LoraBatch:
    """Multi-LoRA: which adapter slot each request of a batch uses (-1: the base model), and the adapters
    (by load id) to write into slots before its forward; decided by the scheduler
    (``scheduler_proc.lora_slots``), carried out by the model runner (``runtime.engine.lora.manager``)."""

    slots: list[int]
    loads: list[tuple[int, str]]


@dataclass
class ForwardBatch:
    forward_mode: ForwardMode
    input_ids: torch.Tensor  # int64 [num_tokens]
    positions: torch.Tensor  # int64 [num_tokens]: absolute position of each token
    req_pool_indices: torch.Tensor  # int64 [bs]: row of each request in req_to_token
    seq_lens: torch.Tensor  # int64 [bs]: total tokens of the request after this forward
    prefix_lens: torch.Tensor  # int64 [bs]: tokens already in the KV pool before this forward
    extend_lens: torch.Tensor  # int64 [bs]: new tokens this forward (1 in decode)
    out_cache_loc: torch.Tensor  # int64 [num_tokens]: KV slot for each new token
    req_to_token_pool: "ReqToTokenPool"
    token_to_kv_pool: "MHATokenToKVPool"
    # Host copies, so backends can plan without a device sync.
    seq_lens_cpu: list[int] = field(default_factory=list)
    prefix_lens_cpu: list[int] = field(default_factory=list)
    extend_lens_cpu: list[int] = field(default_factory=list)
    # Logits are computed only where a token is sampled; None means the last token of each request.
    sampling_info: Any = None  # runtime.engine.sampling.sampler.SamplingBatchInfo
    return_logprob: bool = False
    top_logprobs_num: int = 0  # max over the batch; 0 = none
    input_logprobs: InputLogprobRows | None = None  # prompt logprobs: extend batches that ask only
    # bool [bs]: which requests' extend tokens rotate with a LongRoPE model's long factors (the
    # scheduler's per-request choice, scheduler_proc.long_rope: a chunk's seq_lens may not reach the
    # switch that the request's whole sequence is past); None: by seq_lens. Extend and mixed batches.
    long_rope: torch.Tensor | None = None
    # int64 [num_tokens]: each token's segment (BERT's token types: 0 for a pair's first text, 1 for
    # its second) for an encoder with a token-type table; None: every token's is 0.
    token_type_ids: torch.Tensor | None = None
    # Multi-LoRA: the requests' adapter slots; None where no request of the batch uses an adapter.
    lora: LoraBatch | None = None
    # Filled by the attention backend's init_forward_metadata.
    attn_metadata: Any = None

    @property
    def batch_size(self) -> int:
        return int(self.req_pool_indices.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def extend_start_loc(self) -> torch.Tensor:
        """Offset of each request's first new token in the packed token axis."""
        return torch.cumsum(self.extend_lens, 0) - self.extend_lens

    def last_token_indices(self) -> torch.Tensor:
        """Index in the packed token axis of each request's last new token (where it samples)."""
        return torch.cumsum(self.extend_lens, 0) - 1

    def logit_rows(self) -> torch.Tensor:
        """Index in the packed token axis of every row whose logits the model computes: the last
        new token of each request, plus the prompt positions of ``input_logprobs`` if any; every
        token of a verify batch (each is sampled)."""
        if self.forward_mode == ForwardMode.VERIFY:
            return torch.arange(self.num_tokens, device=self.input_ids.device)
        if self.input_logprobs is None:
            return self.last_token_indices()
        return self.input_logprobs.logit_rows
