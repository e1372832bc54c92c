"""An embedding request (``GenerateReq.embed``) as the scheduler receives it: one prefill-only
``TokenizedGenerateReq`` with ``embed`` set and ``max_new_tokens`` 0, or a refusal that names the field.

The prompt is what the model was trained to embed, so it is tokenized as sentence-transformers and
the cross-encoders' own code do, never as a chat:

- ``text``: the tokenizer's call with its special tokens ([CLS] ... [SEP] for BERT, BOS for Llama);
- ``text`` + ``text_pair``: the tokenizer's pair encoding (a cross-encoder's query and document:
  [CLS] q [SEP] d [SEP]), with the token type ids the tokenizer returns (0 for the first text, 1 for
  the second) when it returns them;
- ``input_ids``: as given;
- ``messages``: the chat template (as SGLang and vLLM embed chat input), without a generation prompt
  unless ``chat_template_kwargs`` asks for one: no turn of the model follows an embedded conversation.

Length (``truncate_prompt_tokens``, vLLM's and SGLang's): ``k`` >= 1 keeps the first ``k`` tokens,
cut by the tokenizer's own truncation for a text, so that its closing special tokens stay (a BERT
input still ends in [SEP]; a pair is cut longest first); -1 cuts to the model's limit; None refuses
an input longer than the limit with ``too_long``, saying both lengths. Token ids and a rendered chat
are cut to their first ``k`` ids.

Nothing is sampled and no token comes out: sampling parameters are ignored, and logprobs, which
would need output tokens, are refused.
"""

from __future__ import annotations

import uuid
from typing import Any, Protocol, Sequence

from runtime.protocol.field_refs import FieldRef
from runtime.protocol.messages import GenerateReq, TokenizedGenerateReq
from runtime.protocol.sampling_params import SamplingParams
from tokenizer_proc.rejected import Rejected

# What a request of the kind the server does not serve is told (any front door: the request builder
# refuses it; the HTTP routes of the other kind say it before reading the inputs).
NOT_AN_EMBEDDING_SERVER = (
    "this server generates text; embeddings, reranking and encoding need a server started with "
    "--is-embedding and an embedding model"
)
AN_EMBEDDING_SERVER = (
    "this server serves embeddings (started with --is-embedding) and does not generate text: use "
    "/v1/embeddings, /encode or /v1/rerank, or start a server without --is-embedding to generate"
)
# An embedding request is prefilled only (the scheduler's contract for ``embed``).
EMBED_PARAMS = SamplingParams(max_new_tokens=0)


class InputLimits(Protocol):
    @property
    def max_req_input_len(self) -> int:
        """The longest prompt the scheduler admits, in tokens."""
        ...


class PromptTools(Protocol):
    """What building an embedding request borrows from the ``RequestBuilder``: its tokenizer, its limits,
    and the checks every prompt passes (so that both kinds of request are checked alike)."""

    tokenizer: Any

    @property
    def limits(self) -> InputLimits: ...

    def render_chat(
        self,
        messages: Sequence[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        template_kwargs: dict[str, Any] | None,
        add_special_tokens: bool = False,
        bounded: bool = True,
        generation_prompt: bool = True,
    ) -> list[int]: ...

    def check_text_size(self, text: str) -> None: ...

    def check_vocab(self, ids: list[int], field: str) -> None: ...


def embed_request(tools: PromptTools, req: GenerateReq, deadline: float | None) -> TokenizedGenerateReq:
    """The one scheduler request of the embedding request ``req`` (Rejected when it is malformed or too
    long); ``deadline``: the absolute one the builder computed."""
    given = [name for name in ("text", "input_ids", "messages") if getattr(req, name) is not None]
    if len(given) != 1:
        raise Rejected(
            "invalid_request", f"give exactly one of text, input_ids, messages (got {', '.join(given) or 'none'})"
        )
    if req.text_pair is not None and req.text is None:
        raise Rejected("invalid_request", "text_pair: goes with text, the pair's first text", "text_pair")
    _refuse_outputs(req)
    limit = tools.limits.max_req_input_len
    keep = kept_tokens(req.truncate_prompt_tokens, limit)
    token_type_ids: list[int] | None = None
    if req.text is not None:
        if not req.text:
            raise Rejected("invalid_request", "empty input: text is ''", "text")
        if keep is None:  # (with truncation the length is the tokenizer's to cut; the body's size bounds it)
            tools.check_text_size(req.text + (req.text_pair or ""))
        ids, token_type_ids = encode_text(tools.tokenizer, req.text, req.text_pair, keep)
    elif req.input_ids is not None:
        if not req.input_ids:
            raise Rejected("invalid_request", "empty input: input_ids is []", "input_ids")
        ids = list(req.input_ids if keep is None else req.input_ids[:keep])
    else:
        assert req.messages is not None
        if not req.messages:
            raise Rejected("invalid_request", "empty input: messages is []", "messages")
        ids = tools.render_chat(
            req.messages, req.tools, req.chat_template_kwargs, bounded=keep is None, generation_prompt=False
        )
        ids = ids if keep is None else ids[:keep]
    if len(ids) > limit:
        raise Rejected(
            "too_long",
            (
                f"the input has {len(ids)} tokens, more than the model's limit of {limit}; send a shorter one, or set ",
                FieldRef("truncate_prompt_tokens"),
                " to cut it",
            ),
            "prompt",
        )
    tools.check_vocab(ids, "input_ids")
    return TokenizedGenerateReq(
        rid=uuid.uuid4().hex,
        input_ids=ids,
        sampling_params=EMBED_PARAMS,
        stream=req.stream,
        deadline=deadline,
        priority=req.priority,
        embed=True,
        token_type_ids=token_type_ids,
    )


def kept_tokens(truncate: int | None, limit: int) -> int | None:
    """How many tokens ``truncate_prompt_tokens`` keeps (None: no cut; -1: the model's ``limit``)."""
    if truncate is None:
        return None
    if isinstance(truncate, bool) or not isinstance(truncate, int):
        raise Rejected(
            "invalid_request", f"truncate_prompt_tokens: must be an integer, got {truncate!r}", "truncate_prompt_tokens"
        )
    if truncate == -1:
        return limit
    if truncate < 1:
        raise Rejected(
            "invalid_request",
            f"truncate_prompt_tokens: must be -1 (the model's limit) or a number of tokens >= 1, got {truncate}",
            "truncate_prompt_tokens",
        )
    if truncate > limit:
        raise Rejected(
            "invalid_request",
            f"truncate_prompt_tokens: {truncate} is more than the model's limit of {limit} tokens "
            "(-1 cuts to the limit)",
            "truncate_prompt_tokens",
        )
    return truncate


def encode_text(tokenizer: Any, text: str, pair: str | None, keep: int | None) -> tuple[list[int], list[int] | None]:
    """A text (or a pair) as the tokenizer encodes it with its special tokens, cut by its own
    truncation to ``keep`` tokens: the ids, and the token type ids when the tokenizer has them."""
    fast = _untruncated_backend(tokenizer) if keep is None and pair != "" else None  # ("": transformers drops it)
    if fast is not None:  # the Rust tokenizer itself: a tenth of transformers' per-call cost
        encoding = fast.encode(text, pair, add_special_tokens=True)
        has_types = "token_type_ids" in getattr(tokenizer, "model_input_names", ())
        return list(encoding.ids), list(encoding.type_ids) if has_types else None
    kwargs: dict[str, Any] = {"add_special_tokens": True}
    if keep is not None:
        kwargs.update(truncation=True, max_length=keep)
    try:
        encoded = tokenizer(text, pair, **kwargs)
    except Exception as exc:  # the tokenizer's truncation cannot cut below its own special tokens
        if keep is None:
            raise
        raise Rejected(
            "invalid_request",
            f"truncate_prompt_tokens: the input cannot be cut to {keep} tokens: {exc}",
            "truncate_prompt_tokens",
        ) from None
    ids = list(encoded["input_ids"])
    if keep is not None and len(ids) > keep:
        raise Rejected(
            "invalid_request",
            f"truncate_prompt_tokens: the input cannot be cut to {keep} tokens: its special tokens alone take more",
            "truncate_prompt_tokens",
        )
    types = encoded.get("token_type_ids")
    return ids, None if types is None else list(types)


def _untruncated_backend(tokenizer: Any) -> Any | None:
    """A fast tokenizer's ``tokenizers.Tokenizer`` when it holds no truncation or padding (what
    transformers' call sets on it for a truncating call and leaves), else None: transformers' call
    then encodes (it adds nothing else for a text or a pair with special tokens)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.truncation is not None or backend.padding is not None:
        return None
    return backend


def _refuse_outputs(req: GenerateReq) -> None:
    """Logprobs belong to output tokens, and an embedding request has none."""
    asked = [
        name
        for name, value in (
            ("return_logprob", req.return_logprob),
            ("top_logprobs_num", req.top_logprobs_num),
            ("token_ids_logprob", req.token_ids_logprob),
            ("logprob_start_len", req.logprob_start_len != -1),
        )
        if value
    ]
    if asked:
        raise Rejected(
            "invalid_request",
            f"{asked[0]}: an embedding request has no output tokens to give logprobs for",
            asked[0],
        )
