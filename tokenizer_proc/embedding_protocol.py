"""The request bodies of the embedding, reranking and scoring routes (tokenizer_proc/http/embedding_routes.py)
and their translation into the server's own ``GenerateReq``s; the replies are tokenizer_proc/embedding_reply.py.

- ``EmbeddingRequest``: OpenAI's ``POST /v1/embeddings`` (``input`` as a string, a list of strings, token
  ids or a list of them; ``encoding_format``; ``dimensions``; ``user`` ignored), with vLLM's extensions:
  ``messages`` (a conversation embedded through the chat template) and ``truncate_prompt_tokens``;
- ``EncodeRequest``: SGLang's ``POST /encode`` (its ``EmbeddingReqInput``: ``text`` or ``input_ids``,
  single or a batch; a batch of ``[query, document]`` pairs for a cross-encoder);
- ``RerankRequest``: ``POST /v1/rerank`` in the Cohere / Jina shape that vLLM and llama.cpp share
  (``query``, ``documents`` as strings or ``{"text": ...}``, ``top_n``, ``return_documents``);
- ``ScoreRequest``: SGLang's ``POST /v1/score`` on a generation server (the probability of
  ``label_token_ids`` as the next token after query + item).

Bodies are read as the other APIs' are (``LenientBody``): strict types, so a client's mistake is a 400
naming the field; unknown fields ignored with one warning; a known field that would change the answer
and is not served (images, LoRA) refused by name. Every input becomes one request of its own: the
requests of one call go in flight together, and continuous batching does the rest.
"""

from __future__ import annotations

import uuid
from typing import Any, ClassVar, Literal

from runtime.protocol.field_refs import FieldNames
from runtime.protocol.messages import GenerateReq
from tokenizer_proc.native_protocol import UNSUPPORTED_FIELDS
from tokenizer_proc.openai_protocol import BadRequest, ChatMessage, LenientBody

# OpenAI's limit on the inputs of one embeddings call.
MAX_EMBEDDING_INPUTS = 2048
# How a score is asked for: one greedy step, whose logprobs of the label tokens are the answer.
SCORE_SAMPLING = {"max_new_tokens": 1, "temperature": 0.0}


def names(mapping: dict[str, str]) -> FieldNames:
    """How a refusal of the shared request path names the fields of a body (server name -> the body's)."""
    return lambda ref: mapping.get(ref.name, ref.name)


class EmbeddingRequest(LenientBody):
    """OpenAI's embeddings body (and vLLM's chat form, ``messages`` instead of ``input``)."""

    body_name: ClassVar[str] = "/v1/embeddings"

    model: str
    input: str | list[str] | list[int] | list[list[int]] | None = None
    messages: list[ChatMessage] | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None  # accepted and ignored, as OpenAI's clients send it
    truncate_prompt_tokens: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    priority: int = 0

    @property
    def field(self) -> str:
        """The body's field the inputs came in (refusals name it)."""
        return "messages" if self.messages is not None else "input"

    @property
    def batch(self) -> bool:
        """Whether ``input`` is a list of inputs (refusals then name the one at fault by its index)."""
        given = self.input
        return isinstance(given, list) and bool(given) and not isinstance(given[0], int)

    def generate_reqs(self) -> list[GenerateReq]:
        """One embedding request per input, in the order of ``input``."""
        common: dict[str, Any] = {
            "embed": True,
            "truncate_prompt_tokens": self.truncate_prompt_tokens,
            "priority": self.priority,
        }
        if (self.input is None) == (self.messages is None):
            raise BadRequest("give exactly one of input, messages", "input")
        if self.messages is not None:
            if not self.messages:
                raise BadRequest("messages: the conversation is empty", "messages")
            messages = [m.as_dict(i) for i, m in enumerate(self.messages)]
            return [
                GenerateReq(
                    rid=uuid.uuid4().hex, messages=messages, chat_template_kwargs=self.chat_template_kwargs, **common
                )
            ]
        given = self.input
        assert given is not None
        if isinstance(given, str) or (given and isinstance(given[0], int)):
            inputs: list[Any] = [given]
        else:
            inputs = list(given)
        if not inputs:
            raise BadRequest("input: give at least one input", "input")
        if len(inputs) > MAX_EMBEDDING_INPUTS:
            raise BadRequest(f"input: at most {MAX_EMBEDDING_INPUTS} inputs per call, got {len(inputs)}", "input")
        return [
            GenerateReq(rid=uuid.uuid4().hex, **({"text": x} if isinstance(x, str) else {"input_ids": x}), **common)
            for x in inputs
        ]


class EncodeRequest(LenientBody):
    """SGLang's ``EmbeddingReqInput`` as JSON (the fields this server serves; ``sampling_params`` is
    accepted and ignored, as nothing is sampled)."""

    body_name: ClassVar[str] = "/encode"
    refused: ClassVar[dict[str, str]] = UNSUPPORTED_FIELDS

    text: str | list[str] | list[list[str]] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    rid: str | list[str] | None = None
    dimensions: int | None = None
    truncate_prompt_tokens: int | None = None
    priority: int | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    is_cross_encoder_request: bool = False  # SGLang's flag for a batch of pairs (the pairs say so here)

    def generate_reqs(self) -> tuple[list[GenerateReq], bool, str]:
        """The requests, whether the body was a batch (the reply is then a list), and the field they came in."""
        if (self.text is None) == (self.input_ids is None):
            raise BadRequest("give exactly one of text, input_ids", "text")
        field = "text" if self.text is not None else "input_ids"
        given: Any = self.text if self.text is not None else self.input_ids
        if given == []:
            raise BadRequest(f"{field}: the batch is empty", field)
        batch = isinstance(given, list) and not isinstance(given[0], int)
        items: list[Any] = list(given) if batch else [given]
        rids = self._rids(len(items), batch)
        common: dict[str, Any] = {
            "embed": True,
            "truncate_prompt_tokens": self.truncate_prompt_tokens,
            "priority": self.priority or 0,
        }
        reqs = []
        for i, item in enumerate(items):
            if isinstance(item, list) and item and isinstance(item[0], str):  # a cross-encoder's [query, document]
                if len(item) != 2:
                    raise BadRequest(f"text[{i}]: a pair is [query, document], got {len(item)} texts", "text")
                inputs: dict[str, Any] = {"text": item[0], "text_pair": item[1]}
            else:
                inputs = {field: item}
            reqs.append(GenerateReq(rid=rids[i], **inputs, **common))
        return reqs, batch, field

    def _rids(self, n: int, batch: bool) -> list[str]:
        """One rid per input: given, a batch's string rid as a prefix (SGLang's ``rid_i``), else new."""
        if self.rid is None:
            return [uuid.uuid4().hex for _ in range(n)]
        if isinstance(self.rid, str):
            return [f"{self.rid}_{i}" for i in range(n)] if batch else [self.rid]
        if not batch or len(self.rid) != n or len(set(self.rid)) != n:
            raise BadRequest("rid: a list of rids needs a batch, with one distinct rid per input", "rid")
        return list(self.rid)


class RerankDocument(LenientBody):
    """A document as Cohere's v1 API and Jina's take it: an object with its ``text``."""

    body_name: ClassVar[str] = "/v1/rerank document"

    text: str


class RerankRequest(LenientBody):
    """The rerank body of Cohere, Jina, vLLM and llama.cpp. ``top_n``: the best n results (None or 0:
    all, vLLM's convention); ``return_documents``: each result carries its document's text (on by
    default, as Jina's and vLLM's answers do)."""

    body_name: ClassVar[str] = "/v1/rerank"

    model: str | None = None
    query: str
    documents: list[str | RerankDocument]
    top_n: int | None = None
    return_documents: bool = True
    truncate_prompt_tokens: int | None = None
    priority: int = 0

    def texts(self) -> list[str]:
        """Each document's text, in the order given."""
        if not self.documents:
            raise BadRequest("documents: give at least one document", "documents")
        return [d if isinstance(d, str) else d.text for d in self.documents]

    def kept(self) -> int | None:
        """How many results the reply keeps (None: all)."""
        if self.top_n is not None and self.top_n < 0:
            raise BadRequest(f"top_n: must be >= 1 (or 0 for all), got {self.top_n}", "top_n")
        return self.top_n or None

    def generate_reqs(self) -> list[GenerateReq]:
        """One cross-encoder request per document: the pair (query, document)."""
        return [
            GenerateReq(
                rid=uuid.uuid4().hex,
                embed=True,
                text=self.query,
                text_pair=text,
                truncate_prompt_tokens=self.truncate_prompt_tokens,
                priority=self.priority,
            )
            for text in self.texts()
        ]


class ScoreRequest(LenientBody):
    """SGLang's scoring body: the probability of each of ``label_token_ids`` as the next token after each
    item joined to the query (``item_first``: item then query); text joins as text (SGLang's
    f"{query}{item}", tokenized whole), token ids as ids."""

    body_name: ClassVar[str] = "/v1/score"

    model: str | None = None
    query: str | list[int]
    items: str | list[str] | list[list[int]]
    label_token_ids: list[int]
    apply_softmax: bool = False
    item_first: bool = False
    priority: int = 0

    def item_list(self) -> list[Any]:
        items: list[Any] = [self.items] if isinstance(self.items, str) else list(self.items)
        if not items:
            raise BadRequest("items: give at least one item", "items")
        return items

    def generate_reqs(self) -> list[GenerateReq]:
        """One greedy one-token request per item, asking for the label tokens' logprobs."""
        if not self.label_token_ids:
            raise BadRequest("label_token_ids: give at least one token id", "label_token_ids")
        items = self.item_list()
        text = isinstance(self.query, str)
        if any(isinstance(item, str) != text for item in items):
            raise BadRequest("items: must be texts with a text query, token id lists with a token id query", "items")
        reqs = []
        for item in items:
            joined = item + self.query if self.item_first else self.query + item
            reqs.append(
                GenerateReq(
                    rid=uuid.uuid4().hex,
                    **({"text": joined} if text else {"input_ids": joined}),
                    sampling_params=dict(SCORE_SAMPLING),
                    token_ids_logprob=list(self.label_token_ids),
                    priority=self.priority,
                )
            )
        return reqs
