"""Session-wide fixtures: tiny checkpoints are built once per test session, on first use."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Iterator

import pytest

# Make the repository root and tests/ importable however pytest was started.
_TESTS = Path(__file__).resolve().parent
for _p in (str(_TESTS.parent), str(_TESTS)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

# Test modules import helpers from server_fixtures before pytest loads it as their plugin.
pytest.register_assert_rewrite("server_fixtures")

from checkpoints import CHECKPOINT_NAMES, TinyCheckpoints  # noqa: E402


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> TinyCheckpoints:
    """Lazy builder: ``tiny_checkpoints.path(name)`` / ``.sharded(name)``, each built once."""
    return TinyCheckpoints(tmp_path_factory.mktemp("tiny_checkpoints"))


@pytest.fixture(scope="session")
def tiny_llama_path(tiny_checkpoints: TinyCheckpoints) -> Path:
    """The tiny Llama checkpoint folder (tokenizer included): the default for other tests."""
    return tiny_checkpoints.path("llama")


@pytest.fixture(scope="session", params=CHECKPOINT_NAMES)
def tiny_checkpoint(request: pytest.FixtureRequest, tiny_checkpoints: TinyCheckpoints) -> Iterator[tuple[str, Path]]:
    """``(name, folder)`` for each tiny architecture: llama, mistral, qwen2, qwen3, llama_tied_llama3."""
    yield request.param, tiny_checkpoints.path(request.param)


def _kernel_levels() -> tuple[str, ...]:
    from runtime.cpu import kernel_library

    return kernel_library.host_levels()


@pytest.fixture(params=_kernel_levels())
def kernel_level(request: pytest.FixtureRequest) -> Iterator[str]:
    """The CPU kernels' build of each instruction-set level this CPU runs (AVX-512 + BF16, AVX-512,
    AVX2, plain C): a test that uses it runs once per level (``pytest.mark.usefixtures``)."""
    from runtime.cpu import kernel_library

    with kernel_library.use_level(request.param):
        yield request.param


@pytest.fixture(params=[True, False], ids=["amx", "no-amx"])
def amx(request: pytest.FixtureRequest) -> Iterator[bool]:
    """The kernels that have an AMX path on AMX tiles (where the CPU has them and the build is
    avx512bf16) and without them; yields whether AMX is in use."""
    from runtime.cpu import kernel_library

    with kernel_library.use_amx(request.param) as used:
        assert used == (request.param and kernel_library.amx_available() and kernel_library.level() == "avx512bf16")
        yield used
