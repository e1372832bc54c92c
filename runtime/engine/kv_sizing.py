"""How big the KV pool is, in the figures a user plans with: tokens, bytes, share of RAM, and
how many requests of the full context length it holds.

A leaf module (no torch): the model runner fills one ``KVPoolSize`` at start, logs its line and
hands it to the scheduler, whose ``server_info`` reports it as ``kv_pool``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class KVPoolSize:
    """The KV pool of one scheduler (one TP rank of one DP replica), as sized at start."""

    tokens: int  # the pool's capacity in tokens (--max-total-tokens, or from memory)
    context_len: int  # a request's longest context
    max_running_requests: int  # request slots (requests decoding at once)
    bytes_per_token: int | None = None  # budgeted memory per token (the pool plus its decode mirror's room)
    ram_bytes: int | None = None  # MemTotal on CPU; None where the pool is not in host RAM (cuda)
    kv_dtype: str | None = None  # the cache's format (--kv-cache-dtype resolved: bfloat16, int8, fp8_e4m3, ...)
    kv_bytes_per_token: int | None = None  # the pool's own bytes per token (K and V of every layer, no mirror)

    @property
    def bytes(self) -> int | None:
        """Memory the pool is budgeted (None where the runner did not say)."""
        return None if self.bytes_per_token is None else self.tokens * self.bytes_per_token

    @property
    def share_of_ram(self) -> float | None:
        """The pool's bytes over MemTotal (CPU only): what a user compares with the machine."""
        if self.ram_bytes is None or self.bytes is None or self.ram_bytes <= 0:
            return None
        return self.bytes / self.ram_bytes

    @property
    def full_length_requests(self) -> int:
        """Requests of ``context_len`` tokens the pool holds at once (the worst case of admission)."""
        return self.tokens // max(1, self.context_len)

    def info(self) -> dict[str, Any]:
        """``server_info``'s ``kv_pool``."""
        return {
            "tokens": self.tokens,
            "bytes": self.bytes,
            "share_of_ram": self.share_of_ram,
            "full_length_requests": self.full_length_requests,
            "context_len": self.context_len,
            "max_running_requests": self.max_running_requests,
            "kv_dtype": self.kv_dtype,
            "kv_bytes_per_token": self.kv_bytes_per_token,
        }

    def log_line(self) -> str:
        """``KV pool: N tokens (X GiB, Y% of RAM): F full-length requests of C tokens, S request slots``."""
        memory = []
        if self.bytes is not None:
            memory.append(f"{self.bytes / (1 << 30):.3f} GiB")
        if self.share_of_ram is not None:
            memory.append(f"{100 * self.share_of_ram:.1f}% of RAM")
        sized = f" ({', '.join(memory)})" if memory else ""
        return (
            f"KV pool: {self.tokens} tokens{sized}{format_note(self.kv_dtype, self.kv_bytes_per_token)}: "
            f"{self.full_length_requests} full-length requests of {self.context_len} tokens, "
            f"{self.max_running_requests} request slots"
        )


def format_note(kv_dtype: str | None, kv_bytes_per_token: int | None) -> str:
    """`` in int8, 20,160 bytes a token`` (empty where the runner did not say): the cache's format and
    what one token of it costs, for the start-up and ``ready:`` lines."""
    if kv_dtype is None:
        return ""
    cost = f", {kv_bytes_per_token:,} bytes a token" if kv_bytes_per_token is not None else ""
    return f" in {kv_dtype}{cost}"


def merge_kv_pools(pools: list[dict[str, Any]]) -> dict[str, Any]:
    """DP replicas' ``kv_pool`` as one: tokens, bytes, full-length requests and slots add up (each
    replica has its own pool and slots); shares of RAM add up too (the replicas share the host's
    RAM); the context length is every replica's."""
    merged: dict[str, Any] = {"context_len": pools[0]["context_len"] if pools else 0}
    # (every replica serves the same model with the same flags: one format, one cost a token)
    merged["kv_dtype"] = pools[0].get("kv_dtype") if pools else None
    merged["kv_bytes_per_token"] = pools[0].get("kv_bytes_per_token") if pools else None
    for key in ("tokens", "bytes", "share_of_ram", "full_length_requests", "max_running_requests"):
        values = [p.get(key) for p in pools]
        merged[key] = None if any(v is None for v in values) else sum(values)
    return merged


def merge_tp_ranks(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """One DP replica's TP ranks' ``kv_pool`` as one: each rank holds a slice of every token's KV
    heads, so the tokens, full-length requests and slots are any rank's (the first's) while the
    bytes and shares of RAM add up."""
    merged = dict(ranks[0])
    for key in ("bytes", "share_of_ram"):
        values = [r.get(key) for r in ranks]
        merged[key] = None if any(v is None for v in values) else sum(values)
    return merged


def host_kv_pool(replicas: dict[int, list[dict[str, Any]]]) -> dict[str, Any] | None:
    """What the schedulers of one host reserved, from each one's ``kv_pool`` by DP replica
    (``{dp_rank: [kv_pool of each TP rank on this host]}``): each replica's ranks merged
    (``merge_tp_ranks``), then the replicas (``merge_kv_pools``); None without any."""
    merged = [merge_tp_ranks(ranks) for _, ranks in sorted(replicas.items()) if ranks]
    return merge_kv_pools(merged) if merged else None


# What follows the client address on launch.py's ``ready:`` line (``ready_note``): a reader of the
# line takes the address as what comes before it (``launch.parse_ready_line``).
READY_NOTE_PREFIX = " (KV pool: "


def ready_note(pool: dict[str, Any] | None) -> str:
    """`` (KV pool: N tokens, X GiB, Y% of RAM: F full-length requests of C tokens)`` for the
    ``ready:`` line, so that whoever starts a server sees what it reserved without reading the
    log (the figures of ``KVPoolSize.log_line``, all of this host's schedulers together); empty
    without a pool."""
    if not pool or not pool.get("tokens"):
        return ""
    sized = [f"{pool['tokens']} tokens"]
    if pool.get("bytes") is not None:
        sized.append(f"{pool['bytes'] / (1 << 30):.2f} GiB")
    if pool.get("share_of_ram") is not None:
        sized.append(f"{100 * pool['share_of_ram']:.1f}% of RAM")
    return (
        f"{READY_NOTE_PREFIX}{', '.join(sized)}{format_note(pool.get('kv_dtype'), pool.get('kv_bytes_per_token'))}: "
        f"{pool['full_length_requests']} full-length requests of {pool['context_len']} tokens)"
    )


# A pool sized from memory must hold at least this many pages (else start-up fails with a hint).
MIN_POOL_PAGES = 16


def _size(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def check_weights_fit(weight_bytes: int, share_bytes: float, fraction: float, ranks: int) -> None:
    """RuntimeError, naming the bytes, when one scheduler's weights (estimated before they are loaded:
    ``weight_bytes``) take all of its memory share (``share_bytes``: ``fraction`` of the device's
    memory, split between ``ranks`` schedulers) and leave the KV pool nothing: the model cannot serve
    here, and saying so before a load of minutes that would end in the same refusal (or the OOM
    killer) is what a user needs."""
    if weight_bytes < share_bytes:
        return
    split = f", split between {ranks} schedulers" if ranks > 1 else ""
    raise RuntimeError(
        f"the model's weights need at least {_size(weight_bytes)} here, more than the "
        f"{_size(share_bytes)} ({fraction:.0%} of memory{split}) this scheduler may use for its weights "
        "and KV cache: keep them quantized (--quantization gguf), load them in bfloat16 (--dtype), split them "
        "over more ranks, or raise --mem-fraction-static"
    )


def kv_pool_tokens(
    *,
    per_token: int,
    budget_bytes: float,
    page_size: int,
    max_total_tokens: int | None = None,
    demand_tokens: int | None = None,
    warn_over_budget: bool = False,
    warn: Callable[..., Any] | None = None,
) -> int:
    """Tokens the KV pool holds, in whole pages.

    ``max_total_tokens`` (the flag) wins as it is (a warning where the device says so and it is
    over the budget). Otherwise the pool takes the memory budget, at most ``demand_tokens`` (what
    the expected work needs: there is no use holding memory for more), and fails where the budget
    holds fewer than ``MIN_POOL_PAGES`` pages.
    """
    budget_tokens = int(budget_bytes // per_token)
    if max_total_tokens is not None:
        if max_total_tokens <= 0:
            raise ValueError(f"max_total_tokens must be > 0, got {max_total_tokens}")
        if warn_over_budget and max_total_tokens > budget_tokens and warn is not None:
            warn("max_total_tokens %d exceeds the memory budget (%d tokens)", max_total_tokens, budget_tokens)
        tokens = max_total_tokens
    else:
        if budget_tokens < page_size * MIN_POOL_PAGES:
            raise RuntimeError(
                f"not enough memory for the KV cache: budget {budget_bytes / (1 << 20):.1f} MiB "
                f"({per_token} bytes per token); raise mem_fraction_static or set max_total_tokens"
            )
        tokens = budget_tokens if demand_tokens is None else min(budget_tokens, demand_tokens)
    return max(page_size, tokens // page_size * page_size)
