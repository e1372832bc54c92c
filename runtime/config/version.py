"""The tinyserve version that ``tinyserve --version`` prints.

The installed distribution's version (``pyproject.toml``'s, read through
importlib.metadata), else ``VERSION`` when the code runs from a checkout that was never
installed; tests/unit/runtime/config/test_args.py keeps the two equal.
"""

from __future__ import annotations

import importlib.metadata

VERSION = "0.1.0"


def package_version() -> str:
    try:
        return importlib.metadata.version("tinyserve")
    except importlib.metadata.PackageNotFoundError:
        return VERSION
