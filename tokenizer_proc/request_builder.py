"""Turn a client's ``GenerateReq`` into scheduler requests, or reject it with a reason.

Every check a client can fail lives here, so that the rejection (code + message
naming the problem) is decided in one place and nothing malformed ever reaches the
scheduler: the scheduler trusts what it receives.

A server serves one kind of request: generation, or, started with ``--is-embedding``, embeddings
(``GenerateReq.embed``: prefilled and answered with the pooled vector, or a cross-encoder's scores).
A request of the other kind is refused here, whichever front door it came through, with a message
that says what the server serves. An embedding request is built in tokenizer_proc/embedding_build.py.
"""

from __future__ import annotations

import hmac
import math
import time
import uuid
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import msgspec

from runtime.protocol.field_refs import FieldRef
from runtime.protocol.messages import DetokenizeReq, GenerateReq, TokenizedGenerateReq, TokenizeReq
from runtime.protocol.sampling_params import SamplingParams, SamplingParamsError
from tokenizer_proc.embedding_build import AN_EMBEDDING_SERVER, NOT_AN_EMBEDDING_SERVER, embed_request
from tokenizer_proc.limits import MAX_STOP_STR_CHARS, MAX_STOP_STRS, max_prompt_bytes
from tokenizer_proc.lora_names import LoraNames, check_adapter
from tokenizer_proc.rejected import Rejected as Rejected  # (its home is rejected.py; imported from here too)

# apply_chat_template arguments a client's chat_template_kwargs may not override: they decide
# what the call returns or which messages and tools it renders, which the server owns.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "tools",
        "documents",
        "tokenize",
        "return_dict",
        "return_tensors",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "chat_template",
        "padding",
        "truncation",
        "max_length",
    }
)
MAX_N = 64  # parallel samples per request: a bound, so one request cannot flood the queue
# token_ids_logprob: ids per request, a bound on the [rows, ids] gather every logit row of it pays for.
MAX_TOKEN_IDS_LOGPROB = 1024


# A priority is a signed 64-bit integer: it must fit the scheduler's msgpack frame.
PRIORITY_RANGE = (-(2**63), 2**63 - 1)


def _check_priority(priority: int) -> None:
    """Refuse a priority the scheduler's frame cannot carry (an HTTP body may hold any integer)."""
    low, high = PRIORITY_RANGE
    if not low <= priority <= high:
        raise Rejected("invalid_request", f"priority: must be a 64-bit signed integer, got {priority}", "priority")


@dataclass(frozen=True)
class ModelLimits:
    """What the scheduler reported when it became ready."""

    vocab_size: int
    context_len: int
    max_req_input_len: int
    max_total_tokens: int


def check_api_key(expected: str | None, given: str | None) -> None:
    if expected is None:
        return
    if given is None or not hmac.compare_digest(given.encode(), expected.encode()):
        raise Rejected("unauthorized", "invalid or missing api key")


class RequestBuilder:
    """Validates and tokenizes generate requests (owns no state besides the tokenizer)."""

    def __init__(
        self,
        tokenizer: Any,
        limits: ModelLimits,
        grammar_backend: str = "xgrammar",
        request_timeout: float | None = None,
        sampling_defaults: Mapping[str, Any] | None = None,
        is_embedding: bool = False,
        lora: LoraNames | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.lora = lora  # the LoRA adapters requests may name (None: a server without --enable-lora)
        self.is_embedding = is_embedding  # --is-embedding: embedding requests only, else generation only
        self.limits = limits
        self.grammar_backend = grammar_backend  # "none": constrained requests are refused
        self.request_timeout = request_timeout  # --request-timeout: the deadline of requests without deadline_s
        self.max_prompt_bytes = max_prompt_bytes(limits.max_req_input_len)
        # The model's sampling defaults (tokenizer_proc/sampling_defaults.py), checked at start-up: for
        # the fields a request leaves unset, so the scheduler receives complete params.
        self.sampling_defaults = dict(sampling_defaults or {})

    def build(self, req: GenerateReq, arrived: float | None = None) -> list[TokenizedGenerateReq]:
        """One scheduler request per sample (``n`` of them, with fresh internal rids). ``arrived``
        (``time.monotonic()`` when the request reached the front door; default now) starts its deadline.
        An embedding request is one scheduler request (``embed_request``)."""
        self._check_kind(req)
        deadline = self._deadline(req, time.monotonic() if arrived is None else arrived)
        if req.embed:
            _check_priority(req.priority)
            if req.lora_path is not None:
                raise Rejected("invalid_request", "lora_path: an embedding request takes no adapter", "lora_path")
            return [embed_request(self, req, deadline)]
        lora_name = check_adapter(self.lora, req.lora_path)
        for name in ("text_pair", "truncate_prompt_tokens"):
            if getattr(req, name) is not None:
                raise Rejected("invalid_request", f"{name}: applies to an embedding request (embed) only", name)
        params = self._sampling_params(req)
        input_ids = self._input_ids(req)
        self._check_ids(input_ids)
        explicit = "max_new_tokens" in (req.sampling_params or {}) and not req.fit_max_tokens
        params = self._fit_context(len(input_ids), params, explicit=explicit)
        top_logprobs_num = max(req.top_logprobs_num, params.top_logprobs_num)
        return_logprob = req.return_logprob or top_logprobs_num > 0
        token_ids_logprob = self._token_ids_logprob(req.token_ids_logprob)
        # Checked even when unused; without return_logprob (or token_ids_logprob, which comes with or
        # without it) the scheduler is not asked for them.
        logprob_start_len = self._logprob_start_len(req.logprob_start_len, len(input_ids))
        logprob_start_len = logprob_start_len if return_logprob or token_ids_logprob else -1
        _check_priority(req.priority)
        out = []
        for i in range(params.n):
            sub = msgspec.structs.replace(
                params, n=1, seed=_nth_seed(params.seed, i), top_logprobs_num=top_logprobs_num
            )
            out.append(
                TokenizedGenerateReq(
                    rid=uuid.uuid4().hex,
                    input_ids=input_ids,
                    sampling_params=sub,
                    stream=req.stream,
                    return_logprob=return_logprob,
                    top_logprobs_num=top_logprobs_num,
                    logprob_start_len=logprob_start_len,
                    token_ids_logprob=token_ids_logprob,
                    deadline=deadline,
                    priority=req.priority,
                    lora_name=lora_name,
                )
            )
        return out

    def tokenize(self, req: TokenizeReq) -> list[int]:
        """A prompt's token ids as ``build`` would serve them (a chat rendered by the same template with
        the same checks), without the serving limits: a prompt longer than the server admits is counted,
        not refused, since finding that out is what a client counts tokens for."""
        given = [name for name in ("text", "messages") if getattr(req, name) is not None]
        if len(given) != 1:
            raise Rejected("invalid_request", f"give exactly one of text, messages (got {', '.join(given) or 'none'})")
        if req.text is not None:
            return list(self.tokenizer.encode(req.text, add_special_tokens=req.add_special_tokens is not False))
        assert req.messages is not None
        if not req.messages:
            raise Rejected("invalid_request", "empty prompt: messages is []")
        return self.render_chat(
            req.messages,
            req.tools,
            req.chat_template_kwargs,
            add_special_tokens=bool(req.add_special_tokens),
            bounded=False,
        )

    def detokenize(self, req: DetokenizeReq) -> str:
        """Token ids of the vocabulary back to text (``/detokenize``)."""
        self.check_vocab(req.tokens, "tokens")
        return str(self.tokenizer.decode(req.tokens, skip_special_tokens=req.skip_special_tokens))

    def _check_kind(self, req: GenerateReq) -> None:
        """A generation request on an embedding server, or an embedding request on a generation
        server, is refused with what the server serves."""
        if req.embed and not self.is_embedding:
            raise Rejected("invalid_request", NOT_AN_EMBEDDING_SERVER, "embed")
        if self.is_embedding and not req.embed:
            raise Rejected("invalid_request", AN_EMBEDDING_SERVER)

    def _deadline(self, req: GenerateReq, arrived: float) -> float | None:
        """The absolute deadline (time.monotonic()) the scheduler enforces: ``deadline_s`` after
        arrival, else ``--request-timeout``, else none."""
        seconds = req.deadline_s
        if seconds is not None and (isinstance(seconds, bool) or not 0 < seconds < math.inf):
            raise Rejected(
                "invalid_request", f"deadline_s must be a number of seconds > 0, got {seconds!r}", "deadline_s"
            )
        seconds = seconds if seconds is not None else self.request_timeout
        return None if seconds is None else arrived + seconds

    # ------------------------------------------------------------------ pieces

    def _sampling_params(self, req: GenerateReq) -> SamplingParams:
        given = req.sampling_params
        if self.sampling_defaults and (given is None or isinstance(given, dict)):
            given = {**self.sampling_defaults, **(given or {})}  # the request's own values win
        try:
            params = SamplingParams.from_dict(given)
            _check_stop_strs(params.stop_strs)
            params.validate(self.limits.vocab_size)
        except SamplingParamsError as exc:
            raise Rejected("invalid_request", exc.parts, exc.field) from None
        self._check_constraint(params)
        if params.n > MAX_N:
            raise Rejected("invalid_request", (FieldRef("n", True), f": must be <= {MAX_N}, got {params.n}"), "n")
        if req.top_logprobs_num < 0:
            raise Rejected(
                "invalid_request",
                (FieldRef("top_logprobs_num"), f": must be >= 0, got {req.top_logprobs_num}"),
                "top_logprobs_num",
            )
        if req.top_logprobs_num > self.limits.vocab_size:
            raise Rejected(
                "invalid_request",
                (FieldRef("top_logprobs_num"), f": must be <= vocab size {self.limits.vocab_size}"),
                "top_logprobs_num",
            )
        return params

    def _check_constraint(self, params: SamplingParams) -> None:
        """A grammar that does not parse is refused here, before the request is queued (the
        scheduler compiles it against the vocabulary later, off its loop)."""
        constraint = params.constraint
        if constraint is None:
            return
        kind, text = constraint
        if self.grammar_backend == "none":
            raise Rejected(
                "invalid_request",
                (FieldRef(kind, True), ": constrained decoding is off on this server (--grammar-backend none)"),
                kind,
            )
        from runtime.text.grammar import GrammarError, check_constraint  # xgrammar: only for constrained requests

        try:
            check_constraint(kind, text)
        except GrammarError as exc:
            raise Rejected("invalid_request", (FieldRef(exc.kind, True), f": {exc.reason}"), kind) from None

    def _input_ids(self, req: GenerateReq) -> list[int]:
        given = [name for name in ("text", "input_ids", "messages") if getattr(req, name) is not None]
        if len(given) != 1:
            raise Rejected(
                "invalid_request", f"give exactly one of text, input_ids, messages (got {', '.join(given) or 'none'})"
            )
        if req.text is not None:
            if not req.text:
                raise Rejected("invalid_request", "empty prompt: text is ''")
            self.check_text_size(req.text)
            return list(self.tokenizer.encode(req.text))
        if req.input_ids is not None:
            if not req.input_ids:
                raise Rejected("invalid_request", "empty prompt: input_ids is []")
            return req.input_ids
        assert req.messages is not None
        if not req.messages:
            raise Rejected("invalid_request", "empty prompt: messages is []")
        return self.render_chat(req.messages, req.tools, req.chat_template_kwargs)

    def render_chat(
        self,
        messages: Sequence[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        template_kwargs: dict[str, Any] | None,
        add_special_tokens: bool = False,
        bounded: bool = True,
        generation_prompt: bool = True,
    ) -> list[int]:
        """The chat rendered by the model's template and tokenized (the template writes its own special
        tokens); ``bounded``: a text longer than a servable prompt is refused before it is tokenized;
        ``generation_prompt``: the default of the template's ``add_generation_prompt`` (off to embed a
        conversation: no turn of the model follows)."""
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise Rejected("invalid_request", "messages: the model's tokenizer has no chat template")
        for i, m in enumerate(messages):
            if not isinstance(m.get("role"), str) or "content" not in m:
                raise Rejected("invalid_request", f"messages[{i}]: needs a string 'role' and a 'content'")
        kwargs = dict(template_kwargs or {})
        reserved = sorted(RESERVED_TEMPLATE_KWARGS.intersection(kwargs))
        if reserved:
            raise Rejected(
                "invalid_request",
                f"chat_template_kwargs: {', '.join(reserved)} cannot be set this way",
                "chat_template_kwargs",
            )
        kwargs.setdefault("add_generation_prompt", generation_prompt)
        try:
            text = self.tokenizer.apply_chat_template(list(messages), tools=tools, tokenize=False, **kwargs)
        except Exception as exc:  # template errors are the client's message structure
            raise Rejected("invalid_request", f"messages: chat template failed: {exc}") from None
        if bounded:
            self.check_text_size(text)
        ids = list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        if not ids:
            raise Rejected("invalid_request", "empty prompt: the rendered chat is empty")
        return ids

    def check_text_size(self, text: str) -> None:
        """A text too long in bytes to be a prompt the server admits is refused before it is
        tokenized (that would take the tokenizer's time and memory for nothing)."""
        # Characters are never more than bytes: the cheap bound first, the UTF-8 length after.
        if len(text) > self.max_prompt_bytes or len(text.encode("utf-8", "surrogatepass")) > self.max_prompt_bytes:
            raise Rejected(
                "too_long",
                f"the prompt has more than {self.max_prompt_bytes} bytes, more than a "
                f"prompt of at most {self.limits.max_req_input_len} tokens can have",
                "prompt",
            )

    def _check_ids(self, ids: list[int]) -> None:
        if len(ids) > self.limits.max_req_input_len:  # first: it bounds the vocabulary scan
            raise Rejected(
                "too_long",
                f"the prompt has {len(ids)} tokens; the maximum is {self.limits.max_req_input_len}",
                "prompt",
            )
        self.check_vocab(ids, "input_ids")

    def check_vocab(self, ids: list[int], field: str) -> None:
        vocab = self.limits.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise Rejected("invalid_request", f"{field}: token id {bad} is outside the vocabulary [0, {vocab})", field)

    def _token_ids_logprob(self, ids: list[int] | None) -> list[int] | None:
        """SGLang's token_ids_logprob: at most ``MAX_TOKEN_IDS_LOGPROB`` ids of the vocabulary (an empty
        list is none, as in SGLang). A front door that built the request itself (HTTP) may hand any
        JSON value here, so the type is checked too."""
        if ids is None:
            return None
        if not isinstance(ids, list):
            raise Rejected(
                "invalid_request", "token_ids_logprob: must be a list of token ids (integers)", "token_ids_logprob"
            )
        if len(ids) > MAX_TOKEN_IDS_LOGPROB:
            raise Rejected(
                "invalid_request",
                f"token_ids_logprob: at most {MAX_TOKEN_IDS_LOGPROB} token ids, got {len(ids)}",
                "token_ids_logprob",
            )
        vocab = self.limits.vocab_size
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int):
                raise Rejected(
                    "invalid_request", f"token_ids_logprob: token ids are integers, got {t!r}", "token_ids_logprob"
                )
            if not 0 <= t < vocab:
                raise Rejected(
                    "invalid_request",
                    f"token_ids_logprob: token id {t} is outside the vocabulary [0, {vocab})",
                    "token_ids_logprob",
                )
        return list(ids) or None

    @staticmethod
    def _logprob_start_len(start: int, prompt_len: int) -> int:
        """Prompt logprobs start at a prompt position (-1: none): one past the prompt would be none too,
        which the client did not mean."""
        if not -1 <= start < prompt_len:
            raise Rejected(
                "invalid_request",
                f"logprob_start_len: must be -1 (none) or a prompt position in [0, {prompt_len}), got {start}",
                "logprob_start_len",
            )
        return start

    def _fit_context(self, n: int, params: SamplingParams, explicit: bool) -> SamplingParams:
        """Prompt + output must fit the context: an explicit max_new_tokens that does not
        is rejected (as SGLang and vLLM do); the default one is shortened to fit."""
        room = self.limits.context_len - n
        if params.max_new_tokens <= room:
            return params
        if explicit:
            raise Rejected(
                "too_long",
                (
                    f"prompt ({n} tokens) + ",
                    FieldRef("max_new_tokens"),
                    f" ({params.max_new_tokens}) = {n + params.max_new_tokens} exceeds the context length "
                    f"{self.limits.context_len}",
                ),
                "max_new_tokens",
            )
        return msgspec.structs.replace(params, max_new_tokens=room, min_new_tokens=min(params.min_new_tokens, room))


def _check_stop_strs(stops: list[str]) -> None:
    """A bounded number of bounded stop strings: the scheduler tests every one after each token."""
    if len(stops) > MAX_STOP_STRS:
        raise SamplingParamsError("stop", f"at most {MAX_STOP_STRS} stop strings, got {len(stops)}")
    longest = max(stops, key=len, default="")
    if len(longest) > MAX_STOP_STR_CHARS:
        raise SamplingParamsError(
            "stop", f"a stop string may have at most {MAX_STOP_STR_CHARS} characters, got one of {len(longest)}"
        )


def _nth_seed(seed: int | None, i: int) -> int | None:
    """Distinct seeds for the samples of one request (the same seed would repeat a sample)."""
    if seed is None or i == 0:
        return seed
    return seed + i if seed + i < 2**64 else seed - i
