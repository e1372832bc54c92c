"""The "LoRA" flags (SGLang's names): many adapters over one base model. Their help text, their checks
and how ``--lora-paths`` entries read; ``ServerArgs`` (runtime.config.server_args) holds the values,
``runtime.engine.lora`` loads and applies adapters, ``scheduler_proc.lora_slots`` decides which
adapters a batch may hold."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, Sequence

from runtime.checkpoints.lora_targets import LORA_TARGET_MODULES
from runtime.config.flag_checks import positive

DEFAULT_MAX_LORAS_PER_BATCH = 8  # SGLang's default


class LoraFlags(Protocol):
    """The ``ServerArgs`` fields of this group (a protocol: no import of server_args here)."""

    enable_lora: bool | None
    lora_paths: list[str] | None
    max_loras_per_batch: int
    max_loaded_loras: int | None
    max_lora_rank: int | None
    lora_target_modules: list[str] | None
    is_embedding: bool


@dataclass(frozen=True)
class LoraRef:
    """One adapter to load: the name requests use, its PEFT folder and whether it keeps a slot for good."""

    name: str
    path: str
    pinned: bool = False


def parse_lora_path(entry: str) -> LoraRef:
    """One ``--lora-paths`` entry: ``name=path``, a bare path (named by itself, as SGLang does), or
    SGLang's JSON ``{"lora_name": ..., "lora_path": ..., "pinned": ...}``."""
    text = entry.strip()
    if text.startswith("{"):
        try:
            spec = json.loads(text)
            return LoraRef(str(spec["lora_name"]), str(spec["lora_path"]), bool(spec.get("pinned", False)))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"--lora-paths entry {entry!r}: want lora_name and lora_path ({exc})") from None
    name, sep, path = text.partition("=")
    if not sep:
        return LoraRef(text, text)
    if not name or not path:
        raise ValueError(f"--lora-paths entry {entry!r}: want NAME=PATH")
    return LoraRef(name, path)


def lora_refs(args: LoraFlags) -> list[LoraRef]:
    """The adapters ``--lora-paths`` names, in order."""
    return [parse_lora_path(entry) for entry in args.lora_paths or ()]


def lora_enabled(args: LoraFlags) -> bool:
    """--enable-lora, or implied by --lora-paths (SGLang's rule)."""
    return bool(args.enable_lora) or bool(args.lora_paths)


def add_lora_args(parser: argparse.ArgumentParser, defaults: LoraFlags) -> None:
    """The "LoRA" group; ``defaults`` is a default ``ServerArgs``."""
    g = parser.add_argument_group("LoRA adapters")
    g.add_argument(
        "--enable-lora",
        action="store_true",
        default=defaults.enable_lora,
        help="serve LoRA adapters over the base model, several in one batch (implied by --lora-paths); "
        "requests pick one with lora_path (or model 'BASE:ADAPTER' on the OpenAI routes)",
    )
    g.add_argument(
        "--lora-paths",
        nargs="*",
        default=defaults.lora_paths,
        metavar="NAME=PATH",
        help="PEFT adapter folders to load at start: NAME=PATH, a bare PATH (named by itself), or "
        '{"lora_name": ..., "lora_path": ..., "pinned": true}; more load at run time with '
        "POST /load_lora_adapter",
    )
    g.add_argument(
        "--max-loras-per-batch",
        type=int,
        default=defaults.max_loras_per_batch,
        help="adapter slots: the most adapters one batch uses (requests of another wait for a slot; "
        f"the base model needs none) (default {defaults.max_loras_per_batch})",
    )
    g.add_argument(
        "--max-loaded-loras",
        type=int,
        default=defaults.max_loaded_loras,
        help="most adapters kept loaded in memory; loading one more evicts the least recently used "
        "unpinned adapter that no request is using (default: no limit)",
    )
    g.add_argument(
        "--max-lora-rank",
        type=int,
        default=defaults.max_lora_rank,
        help="the largest rank an adapter may have (default: the largest of --lora-paths' adapters; "
        "needed to load adapters at run time when none is given at start)",
    )
    g.add_argument(
        "--lora-target-modules",
        nargs="*",
        default=defaults.lora_target_modules,
        metavar="MODULE",
        help="the projections adapters may target, or 'all' (default: those --lora-paths' adapters "
        f"target); names: {', '.join(LORA_TARGET_MODULES)}",
    )


def check_lora(args: LoraFlags) -> None:
    """The LoRA flags agree with each other (before any process starts)."""
    positive("--max-loras-per-batch", args.max_loras_per_batch)
    if args.max_loaded_loras is not None:
        positive("--max-loaded-loras", args.max_loaded_loras)
    if args.max_lora_rank is not None:
        positive("--max-lora-rank", args.max_lora_rank)
    if not lora_enabled(args):
        for flag, value in (
            ("--max-lora-rank", args.max_lora_rank),
            ("--lora-target-modules", args.lora_target_modules),
            ("--max-loaded-loras", args.max_loaded_loras),
        ):
            if value is not None:
                raise ValueError(f"{flag} applies to a LoRA server: add --enable-lora or --lora-paths")
        return
    if args.is_embedding:
        raise ValueError("--enable-lora serves generation: an embedding server (--is-embedding) takes no adapters")
    refs = lora_refs(args)
    names = [ref.name for ref in refs]
    duplicate = next((name for name in names if names.count(name) > 1), None)
    if duplicate is not None:
        raise ValueError(f"--lora-paths names {duplicate!r} twice")
    for ref in refs:
        if not Path(ref.path).is_dir():
            raise ValueError(f"--lora-paths: adapter {ref.name!r}: {ref.path} is not a folder")
    check_target_modules(args.lora_target_modules)
    pinned = sum(ref.pinned for ref in refs)
    if pinned >= args.max_loras_per_batch and pinned:
        raise ValueError(
            f"--lora-paths pins {pinned} adapters: at most --max-loras-per-batch - 1 "
            f"({args.max_loras_per_batch - 1}) may be pinned, so that other adapters can run"
        )
    if args.max_loaded_loras is not None and len(refs) > args.max_loaded_loras:
        raise ValueError(
            f"--lora-paths gives {len(refs)} adapters, more than --max-loaded-loras {args.max_loaded_loras}"
        )


def check_target_modules(modules: Sequence[str] | None) -> None:
    """Every name is a projection an adapter may target (or ``all``)."""
    for module in modules or ():
        if module != "all" and module not in LORA_TARGET_MODULES:
            raise ValueError(f"--lora-target-modules: {module!r} is not one of all, {', '.join(LORA_TARGET_MODULES)}")
