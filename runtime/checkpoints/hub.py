"""Hugging Face hub ids for ``--model-path`` / ``--tokenizer-path``.

``ORG/NAME`` (a string that names no local path) becomes a local snapshot folder
through ``huggingface_hub.snapshot_download``, once, in ``launch.py`` before any child
starts: every process then reads the same folder, and a failure is reported before
anything is spawned. Only what the loaders read is fetched (safetensors weights, JSON
configs, tokenizer files), never ``.bin``/``.pt`` pickles: tinyserve loads safetensors
only, so a repository without them is an error here rather than a slow download first.

``HF_HUB_OFFLINE=1``, ``HF_HUB_CACHE`` / ``HF_HOME`` and ``HF_TOKEN`` are
huggingface_hub's own and work as they do everywhere else.
"""

from __future__ import annotations

import glob
import os

# What the model loader and the tokenizer read; nothing else is downloaded.
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.tiktoken", "*.txt", "*.jinja"]


class HubError(RuntimeError):
    """A hub id that cannot be turned into a usable local folder; the message says why."""


def resolve_hub_path(repo_id: str, revision: str | None = None, need_weights: bool = True) -> str:
    """The local snapshot folder of ``repo_id`` at ``revision`` (downloaded when missing
    and the hub is reachable); HubError when offline and not cached, unknown, or without
    safetensors weights (``need_weights``)."""
    try:
        import huggingface_hub
        from huggingface_hub import constants, errors
    except ImportError:  # pragma: no cover - a declared dependency
        raise HubError(f"{repo_id!r} looks like a hub id, but huggingface_hub is not installed") from None
    where = f"{repo_id}" + (f" (revision {revision})" if revision else "")
    cache = constants.HF_HUB_CACHE
    try:
        path = huggingface_hub.snapshot_download(repo_id, revision=revision, allow_patterns=ALLOW_PATTERNS)
    except errors.LocalEntryNotFoundError as exc:
        if type(exc).__name__ == "IncompleteSnapshotError":  # huggingface_hub >= 1.x: a partial snapshot
            raise HubError(f"{where}: {exc}") from exc
        if constants.HF_HUB_OFFLINE:
            reason = "HF_HUB_OFFLINE is set"
        else:
            reason = "the hub could not be reached"
        raise HubError(
            f"{where} is not in the hub cache {cache} and {reason}; download it once with "
            f"network access (or give --model-path a local folder)"
        ) from exc
    except (errors.RepositoryNotFoundError, errors.RevisionNotFoundError, errors.GatedRepoError) as exc:
        raise HubError(f"{where}: {type(exc).__name__}: {str(exc).splitlines()[0]}") from exc
    except errors.HfHubHTTPError as exc:
        raise HubError(f"{where}: the hub answered {str(exc).splitlines()[0]}") from exc
    path = str(path)
    if need_weights and not glob.glob(os.path.join(path, "*.safetensors")):
        raise HubError(f"{where} has no *.safetensors weights in {path}; tinyserve loads safetensors only")
    return path
