"""SGLang's native ``/generate`` body, as SGLang's own server takes it, translated into the server's
``GenerateReq``s (the reply's shape is tokenizer_proc/native_reply.py).

SGLang's clients send it: its frontend language (``sglang.lang``'s ``RuntimeEndpoint``), its Model
Gateway (``sglang-router``, which adds fields such as ``model``), RL loops. So the body is read the
way SGLang reads it:

- a single prompt or a batch (``text`` or ``input_ids``); the per-prompt fields (``sampling_params``,
  ``return_logprob``, ``logprob_start_len``, ``top_logprobs_num``, ``token_ids_logprob``) are one
  value for every prompt or a list with one per prompt; a batch's string ``rid`` is a prefix
  (``rid_0``, ``rid_1``, ...);
- a ``None`` sampling parameter means its default, and SGLang's own names are taken
  (``sampling_seed`` is ``seed``); one that would change the answer and that this server cannot
  honour (``structural_tag``, beam search, a watermark, custom logit processors) is a 400 naming it;
- fields this server does not know are ignored with one warning per name (routers and clients add
  their own), while the SGLang fields that would change the answer and are not served here
  (images, audio, hidden states, sessions) are a 400 naming the field.

Types stay strict (a string is never a number), so a client's mistake is a 400 naming the field.
The ZMQ client keeps its own strict ``GenerateReq`` (runtime/protocol/messages.py).
"""

from __future__ import annotations

import uuid
from typing import Any, ClassVar, TypeVar

from runtime.protocol.messages import GenerateReq
from tokenizer_proc.openai_protocol import BadRequest, LenientBody

T = TypeVar("T")

# SGLang request fields that change what is generated and that this server does not serve: refused
# when given a value, with why (ignoring them would answer a different question).
UNSUPPORTED_FIELDS: dict[str, str] = {
    "image_data": "image input is not supported: this server serves text models",
    "video_data": "video input is not supported: this server serves text models",
    "audio_data": "audio input is not supported: this server serves text models",
    "input_embeds": "input embeddings are not supported; send text or input_ids",
    "lora_id": "name the adapter with lora_path (the name it was loaded under)",
    "return_hidden_states": "hidden states are not returned by this server",
    "session_params": "sessions are not supported",
    "custom_logit_processor": "custom logit processors are not supported",
    "bootstrap_host": "prefill/decode disaggregation is not supported",
}
# SGLang sampling parameters with another name here.
SAMPLING_RENAMES = {"sampling_seed": "seed"}
# SGLang sampling parameters that change nothing here and are dropped: how often a stream sends
# (this server sends every step's text).
SAMPLING_IGNORED = frozenset({"stream_interval"})
# SGLang sampling parameters this server cannot honour, refused when set.
SAMPLING_UNSUPPORTED: dict[str, str] = {
    "structural_tag": "structural tags are not supported; use json_schema, regex or ebnf",
    "beam_width": "beam search is not supported",
    "watermark": "watermarking is not supported",
    "custom_params": "custom logit processor parameters are not supported",
}


class NativeGenerateReq(LenientBody):
    """SGLang's ``GenerateReqInput`` as JSON (the fields this server serves)."""

    body_name: ClassVar[str] = "/generate"
    refused: ClassVar[dict[str, str]] = UNSUPPORTED_FIELDS

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    stream: bool = False
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: int | list[int] | None = None  # prompt logprobs from this position on; -1: none
    top_logprobs_num: int | list[int] | None = None
    token_ids_logprob: list[int] | list[list[int]] | None = None  # these ids' logprobs at each position
    return_text_in_logprobs: bool = False  # each logprob entry carries its token's text (else null)
    rid: str | list[str] | None = None
    deadline_s: float | None = None  # server-side deadline, seconds from arrival (GenerateReq.deadline_s)
    priority: int | None = None  # larger first, with --enable-priority-scheduling (ignored without it)
    # the LoRA adapter of each prompt, by its loaded name (one for all, or a list; None: the base model)
    lora_path: str | list[str | None] | None = None

    def generate_reqs(self) -> tuple[list[GenerateReq], bool]:
        """The requests, and whether the body was a batch (the reply is then a list)."""
        prompts, field, batch = self._prompts()
        if batch and self.stream:
            raise BadRequest("stream takes a single prompt", "stream")
        n = len(prompts)
        rids = self._rids(n, batch)
        each_params = per_prompt(self.sampling_params, n, "sampling_params")
        params = [
            sampling_params(p, f"sampling_params[{i}]" if batch else "sampling_params")
            for i, p in enumerate(each_params)
        ]
        want_logprob = per_prompt(self.return_logprob, n, "return_logprob")
        starts = per_prompt(self.logprob_start_len, n, "logprob_start_len")
        tops = per_prompt(self.top_logprobs_num, n, "top_logprobs_num")
        id_lists = self._token_id_lists(n)
        adapters: list[str | None] = per_prompt(self.lora_path, n, "lora_path")  # type: ignore[arg-type]
        return [
            GenerateReq(
                rid=rids[i],
                sampling_params=params[i],
                stream=self.stream,
                return_logprob=bool(want_logprob[i]),
                top_logprobs_num=tops[i] or 0,
                logprob_start_len=-1 if (start := starts[i]) is None else start,
                token_ids_logprob=id_lists[i],
                deadline_s=self.deadline_s,
                priority=self.priority or 0,
                lora_path=adapters[i],
                **{field: prompts[i]},
            )
            for i in range(n)
        ], batch

    def _prompts(self) -> tuple[list[Any], str, bool]:
        """Each prompt, the field they came in, and whether it was a batch."""
        if (self.text is None) == (self.input_ids is None):
            raise BadRequest("give exactly one of text, input_ids", "text")
        if self.text is not None:
            batch = isinstance(self.text, list)
            prompts: list[Any] = list(self.text) if isinstance(self.text, list) else [self.text]
            field = "text"
        else:
            assert self.input_ids is not None
            batch = bool(self.input_ids) and isinstance(self.input_ids[0], list)
            prompts = list(self.input_ids) if batch else [self.input_ids]
            field = "input_ids"
        if not prompts:
            raise BadRequest(f"{field}: the batch is empty", field)
        return prompts, field, batch

    def _rids(self, n: int, batch: bool) -> list[str]:
        """One rid per prompt: given, a batch's string rid as a prefix (SGLang's ``rid_i``), else new."""
        if self.rid is None:
            rids = [uuid.uuid4().hex for _ in range(n)]
        elif isinstance(self.rid, str):
            rids = [f"{self.rid}_{i}" for i in range(n)] if batch else [self.rid]
        elif not batch or len(self.rid) != n:
            raise BadRequest("rid: a list of rids needs a batch, with one rid per prompt", "rid")
        else:
            rids = list(self.rid)
        if len(set(rids)) != len(rids):
            raise BadRequest("rid: the rids of a batch must differ", "rid")
        return rids

    def _token_id_lists(self, n: int) -> list[list[int] | None]:
        """``token_ids_logprob``: one list for every prompt, or a list of lists, one per prompt."""
        ids = self.token_ids_logprob
        if ids is None:
            return [None] * n
        lists = [one for one in ids if isinstance(one, list)]
        if lists:
            if len(lists) != n:
                raise BadRequest(f"token_ids_logprob: {len(lists)} lists for {n} prompts", "token_ids_logprob")
            return [list(one) for one in lists]
        flat = [one for one in ids if isinstance(one, int)]
        return [list(flat) for _ in range(n)]


def per_prompt(value: T | list[T] | None, n: int, name: str) -> list[T | None]:
    """A per-prompt field as one value per prompt: a single value (or None) applies to all of them;
    a list (its values' types checked by the model) has one per prompt."""
    if not isinstance(value, list):
        return [value] * n
    if len(value) != n:
        raise BadRequest(f"{name}: {len(value)} values for {n} prompts", name)
    return list(value)


def sampling_params(params: dict[str, Any] | None, where: str = "sampling_params") -> dict[str, Any] | None:
    """SGLang's sampling parameters in this server's names: None values dropped (the default),
    renamed and ignored names mapped, unsupported ones refused. Types and ranges are
    ``SamplingParams.from_dict``'s to check (it names the field)."""
    if params is None:
        return None
    out: dict[str, Any] = {}
    for name, value in params.items():
        if value is None or name in SAMPLING_IGNORED:
            continue
        if name in SAMPLING_UNSUPPORTED:
            raise BadRequest(f"{where}.{name}: {SAMPLING_UNSUPPORTED[name]}", name)
        out[SAMPLING_RENAMES.get(name, name)] = value
    return out
