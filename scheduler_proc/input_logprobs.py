"""Prompt (input) token logprobs: what OpenAI's ``echo`` + ``logprobs`` and a loglikelihood
evaluation need, SGLang's ``logprob_start_len``.

A request asking for them (``return_logprob`` or ``token_ids_logprob``, and ``logprob_start_len``
s >= 0) gets, for each prompt token i in [s, len(prompt)), log_softmax(logits at position i - 1)[token i]
(None for i == 0, which has no position before it), and the same row's k best (``top_logprobs_num``)
and its logprobs at the request's ``token_ids_logprob`` ids. The logits at a prompt position exist only while the
prefill that computes that position runs, so:

* admission may not reuse cached KV past the first position still needed (``match_limit``):
  a second identical request computes its prompt again from there;
* the batch builder asks the model for logits at every position of the prefill from that one on
  (``plan_batch``: ``ForwardBatch.input_logprobs``), each row paired with the prompt token it
  predicts. A chunk's last position predicts the next chunk's first token, which the request
  already knows, so each chunk's logprobs are complete when its step ends: nothing is kept
  between chunks;
* when the step's results are in, ``take`` appends each request's values in batch order.

Batches without such a request carry no ``input_logprobs`` and compute the last row only.
State: the request's ``input_token_logprobs`` / ``input_top_logprobs`` / ``input_token_ids_logprobs``
(written only here; the first also counts the tokens done when only the last is sent) and
``input_logprobs_inflight`` (the rows of its prefill in flight; a prefilling request has no
other step in flight).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

from runtime.engine.forward_batch import InputLogprobRows
from runtime.engine.sampling.token_ids_logprob import TokenIdsIndex
from scheduler_proc.req import Req

if TYPE_CHECKING:
    from scheduler_proc.model_worker import StepResult


def wants(req: Req) -> bool:
    """Whether ``req`` asked for prompt logprobs."""
    return (
        req.return_logprob or req.top_logprobs_num > 0 or bool(req.token_ids_logprob)
    ) and req.logprob_start_len >= 0


def begin(req: Req) -> None:
    """A request arrives: token 0 has no logprob (None), so a start at 0 begins with it."""
    if wants(req) and req.logprob_start_len == 0 and not req.input_token_logprobs:
        req.input_token_logprobs.append([None, req.origin_input_ids[0]])
        if req.top_logprobs_num:
            req.input_top_logprobs.append(None)
        if req.token_ids_logprob:
            req.input_token_ids_logprobs.append(None)


def next_token(req: Req) -> int | None:
    """The first prompt token whose logprob ``req`` still lacks, or None (not asked, or all in)."""
    if not wants(req):
        return None
    t = req.logprob_start_len + len(req.input_token_logprobs)
    return t if t < len(req.origin_input_ids) else None


def match_limit(req: Req) -> int | None:
    """The longest cached prefix ``req`` may reuse (None: no limit): position t - 1, which gives
    the logprob of the first missing token t, must be computed by its prefill."""
    t = next_token(req)
    return None if t is None else t - 1


def _plan(req: Req, prefix_len: int, extend_len: int) -> tuple[int, list[int]]:
    """For a forward computing positions [prefix_len, prefix_len + extend_len) of ``req``: how many
    logit rows it needs before its last one, and the prompt token each prompt row predicts."""
    req.input_logprobs_inflight = 0
    t = next_token(req)
    if t is None:
        return 0, []
    last = prefix_len + extend_len - 1  # the last new position: its row is computed anyway
    first = t - 1
    assert first >= prefix_len, f"{req.rid}: prompt logprob position {first} is in the cached prefix ({prefix_len})"
    last_prompt = min(last, len(req.origin_input_ids) - 2)  # position L-1 predicts an output token
    if first > last_prompt:
        return 0, []
    req.input_logprobs_inflight = last_prompt - first + 1
    return last - first, req.origin_input_ids[first + 1 : last_prompt + 2]


def plan_batch(
    reqs: Sequence[Req], prefix_lens: Sequence[int], extend_lens: Sequence[int], device: torch.device
) -> InputLogprobRows | None:
    """The batch's ``input_logprobs`` (None when no request of it needs prompt rows now).

    Request i's tokens are packed after those of requests 0..i-1; its logit rows are a run of
    positions ending at its last new token, where it samples."""
    if not any(wants(r) for r in reqs):
        return None
    plans = [_plan(r, p, e) for r, p, e in zip(reqs, prefix_lens, extend_lens)]
    if not any(targets for _, targets in plans):
        return None
    logit_rows: list[int] = []
    sample_rows: list[int] = []
    prompt_rows: list[int] = []
    target_ids: list[int] = []
    offset = 0  # packed token index of the request's first new token
    for (extra, targets), extend_len in zip(plans, extend_lens):
        last = offset + extend_len - 1
        # Its prompt rows are the first of its run of rows (all of them for a chunk that is not
        # the prompt's last; all but the sampling one for the last).
        prompt_rows.extend(range(len(logit_rows), len(logit_rows) + len(targets)))
        target_ids.extend(targets)
        logit_rows.extend(range(last - extra, last + 1))
        sample_rows.append(len(logit_rows) - 1)
        offset += extend_len
    sizes = [len(logit_rows), len(sample_rows), len(prompt_rows)]
    both = torch.tensor(logit_rows + sample_rows + prompt_rows + target_ids, dtype=torch.int64, device=device)
    logits_t, sample_t, prompt_t, targets_t = torch.split(both, sizes + [len(target_ids)])
    # Each prompt row reports its request's token_ids_logprob (rows of requests naming none: nothing).
    named = TokenIdsIndex.build([r.token_ids_logprob for r in reqs], device, [len(t) for _, t in plans])
    return InputLogprobRows(
        logit_rows=logits_t, sample_rows=sample_t, prompt_rows=prompt_t, target_ids=targets_t, token_ids=named
    )


def take(reqs: Sequence[Req], result: "StepResult") -> None:
    """Append the finished step's prompt logprobs to the requests of its batch (in batch order)."""
    if result.input_logprobs is None:
        for req in reqs:
            req.input_logprobs_inflight = 0
        return
    offset = 0
    top = result.input_top_logprobs
    named = result.input_token_ids_logprobs
    for req in reqs:
        n, req.input_logprobs_inflight = req.input_logprobs_inflight, 0
        if not n:
            continue
        t = req.logprob_start_len + len(req.input_token_logprobs)
        values = result.input_logprobs[offset : offset + n]
        req.input_token_logprobs.extend([v, tok] for v, tok in zip(values, req.origin_input_ids[t : t + n]))
        if req.top_logprobs_num and top is not None:
            k = req.top_logprobs_num
            req.input_top_logprobs.extend(
                [[v, i] for v, i in zip(top[0][row][:k], top[1][row][:k])] for row in range(offset, offset + n)
            )
        if req.token_ids_logprob and named is not None:
            ids = req.token_ids_logprob
            req.input_token_ids_logprobs.extend(
                [[v, t] for v, t in zip(named[row], ids)] for row in range(offset, offset + n)
            )
        offset += n
