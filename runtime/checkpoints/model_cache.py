"""The tinyserve cache folder, and building things into it once, atomically.

Everything tinyserve makes on first use and then reuses lives under one root: the embedded
tiny model, the benchmark checkpoints, prepared GGUF checkpoints and the CPU kernel
builds. ``build_once`` is the one way to fill a folder there, so a crash never leaves a
half-built folder and concurrent first uses end with one complete copy.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

logger = logging.getLogger(__name__)


def cache_root() -> Path:
    """``$TINYSERVE_CACHE``, else ``$XDG_CACHE_HOME/tinyserve``, else ``~/.cache/tinyserve``."""
    explicit = os.environ.get("TINYSERVE_CACHE")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "tinyserve"


def build_once(final: Path, build: Callable[[Path], object], what: str) -> Path:
    """``final`` built by ``build(tmp_dir)`` (its return value unused) on first use, atomically and
    safely under concurrency.

    The build goes to a temporary sibling folder that is renamed into place, so a crash
    never leaves a half-built folder and concurrent builders all end with one complete
    folder. An existing folder with a config.json is reused as is.
    """
    if (final / "config.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; a checkpoint is not secret
    try:
        logger.info("building %s into %s", what, final)
        build(tmp)
        try:
            if final.exists() and not any(final.iterdir()):
                final.rmdir()  # an empty folder the caller created for us
            os.rename(tmp, final)  # atomic; fails if another process got there first
        except OSError:
            if not (final / "config.json").is_file():
                raise
            logger.info("another process built %s first; using it", final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final
