"""Builds and loads the CPU kernels' shared library (``csrc/*.c``), one build per instruction-set level.

x86 hosts differ in what their vector units can do: some have AVX-512 and its BF16 dot
product, many only AVX2 and FMA. The kernels are written once, with AVX-512 paths behind
``#ifdef __AVX512F__`` (``__AVX512BF16__``, ...), AVX2 paths behind ``__AVX2__``/``__FMA__``
and plain C everywhere else, and compiled once per level:

- ``avx512bf16``: ``-march=x86-64-v4 -mavx512bf16 -mavx512vnni`` (AVX-512 F/BW/CD/DQ/VL plus the bf16
  and int8 dot products; every CPU with the first has the second);
- ``avx512``: ``-march=x86-64-v4``;
- ``avx2``: ``-march=x86-64-v3`` (AVX2, FMA, F16C, BMI);
- ``baseline``: the compiler's default target (plain C that the compiler may vectorise with SSE2).

On a CPU with AMX (``amx_tile`` and ``amx_bf16``) the ``avx512bf16`` build also runs the
pair-packed attention kernels' block products on AMX tiles; ``TINYSERVE_CPU_AMX=0`` keeps them
on AVX512-BF16 (``use_amx`` switches at run time, for tests).

The CPU's flags (``/proc/cpuinfo``) pick the best level it can run. ``TINYSERVE_CPU_ISA=<level>``
asks for a lower one (what an AVX2-only host would run, on a host with AVX-512); a level the
CPU cannot run is refused with a warning. ``TINYSERVE_CPU_KERNELS=0`` turns the kernels off:
``load()`` is then None and every caller keeps its torch path. Tests run the kernels of every
level the host can execute (``use_level``).

Why ctypes and not ``torch.utils.cpp_extension``: the kernels take raw pointers and strides
(the wrappers check every shape and dtype before a call), and a plain C library builds in about
a second with ``gcc`` alone, where an extension compiles torch's C++ headers (tens of seconds per
level) and needs ninja. Each wrapper module declares the signatures it calls (``declare``).

Builds go to ``<cache_root>/kernels/`` under a name keyed by the sources, the flags and the
compiler, written atomically, so each machine compiles each level once.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Iterator, Sequence

logger = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
COMMON_CFLAGS = (
    "-O3",
    "-fopenmp",
    "-fPIC",
    "-shared",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fassociative-math",
    "-fno-signed-zeros",
)
_X86_V3 = ("avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm")
_X86_V4 = _X86_V3 + ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")
# level -> (CPU flags it needs, compiler flags), best first
LEVELS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "avx512bf16": (
        _X86_V4 + ("avx512_bf16", "avx512_vnni"),
        ("-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni", "-mamx-tile", "-mamx-bf16"),
    ),
    "avx512": (_X86_V4, ("-march=x86-64-v4",)),
    "avx2": (_X86_V3, ("-march=x86-64-v3",)),
    "baseline": ((), ()),
}

_signatures: dict[str, tuple[list[Any], Any]] = {}
_override: list[str] = []  # use_level's stack


def declare(name: str, argtypes: Sequence[Any], restype: Any) -> None:
    """Record the C signature of ``name``; applied to every library loaded (now or later)."""
    _signatures[name] = (list(argtypes), restype)
    for lib in _loaded.values():
        if lib is not None:
            _apply(lib, name)


def _apply(lib: ctypes.CDLL, name: str) -> None:
    fn = getattr(lib, name)
    fn.argtypes, fn.restype = _signatures[name]


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


@functools.lru_cache(maxsize=None)
def host_levels() -> tuple[str, ...]:
    """The levels this CPU can run, best first (``baseline`` always; the others on x86-64 only)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return ("baseline",)
    flags = _cpu_flags()
    return tuple(name for name, (needs, _) in LEVELS.items() if set(needs) <= flags)


def level() -> str | None:
    """The level ``load()`` returns a build of, or None when the kernels are turned off."""
    if _disabled():
        return None
    return _override[-1] if _override else _default_level()


@functools.lru_cache(maxsize=None)
def _disabled() -> bool:
    return os.environ.get("TINYSERVE_CPU_KERNELS", "1") == "0"


@functools.lru_cache(maxsize=None)
def _default_level() -> str:
    best = host_levels()[0]
    asked = os.environ.get("TINYSERVE_CPU_ISA", "").strip().lower()
    if not asked or asked == "native":
        return best
    if asked not in LEVELS:
        logger.warning("TINYSERVE_CPU_ISA=%s is not one of %s: using %s", asked, ", ".join(LEVELS), best)
        return best
    if asked not in host_levels():
        logger.warning("TINYSERVE_CPU_ISA=%s: this CPU cannot run it; using %s", asked, best)
        return best
    return asked


def load() -> ctypes.CDLL | None:
    """The kernels' library at the selected level (built on first use), or None where it cannot be had."""
    name = level()
    if name is None:
        return None
    lib = _loaded.get(name, _missing)
    if lib is _missing:
        lib = _loaded[name] = _build_and_load(name)
    return lib


_missing: Any = object()
_loaded: dict[str, ctypes.CDLL | None] = {}


@contextlib.contextmanager
def use_level(name: str) -> Iterator[None]:
    """Within the block, ``load()`` returns the build of level ``name`` (one this CPU can run)."""
    if name not in host_levels():
        raise ValueError(f"this CPU cannot run the {name!r} kernels (it runs {', '.join(host_levels())})")
    _override.append(name)
    try:
        yield
    finally:
        _override.pop()


def reset() -> None:
    """Forget the selection and the loaded builds (they are rebuilt or reloaded on next use)."""
    _disabled.cache_clear()
    _default_level.cache_clear()
    _loaded.clear()


def sources() -> list[Path]:
    return sorted(CSRC.glob("*.c"))


def _build_and_load(name: str) -> ctypes.CDLL | None:
    compiler = shutil.which(os.environ.get("CC", "gcc"))
    if compiler is None:
        logger.info("no C compiler found: the CPU kernels' work runs as torch ops")
        return None
    from runtime.checkpoints.model_cache import cache_root

    srcs = sources()
    headers = sorted(CSRC.glob("*.h"))
    flags = (*COMMON_CFLAGS, *LEVELS[name][1])
    key = hashlib.sha256("\0".join([*(p.read_text() for p in srcs + headers), *flags, compiler]).encode()).hexdigest()
    path = cache_root() / "kernels" / f"cpu_kernels-{name}-{key[:16]}.so"
    try:
        if not path.exists():
            _build(compiler, flags, srcs, path)
            logger.info("compiled the CPU kernels (%s) into %s", name, path)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        logger.warning("CPU kernels (%s) unavailable (%s): using torch ops", name, detail)
        return None
    for fn_name in _signatures:
        _apply(lib, fn_name)
    lib.tinyserve_amx.argtypes, lib.tinyserve_amx.restype = [ctypes.c_int], ctypes.c_int
    lib.tinyserve_amx(1 if amx_available() and os.environ.get("TINYSERVE_CPU_AMX", "1") != "0" else 0)
    return lib


def amx_available() -> bool:
    """Whether this CPU has AMX tiles with bf16 products (the OS must still grant them)."""
    return {"amx_tile", "amx_bf16"} <= _cpu_flags() and "avx512bf16" in host_levels()


@contextlib.contextmanager
def use_amx(on: bool) -> Iterator[bool]:
    """Within the block the selected build uses AMX tiles (``on``, where the CPU has them and the
    OS grants them) or not; yields whether AMX is in use."""
    lib = load()
    if lib is None:
        yield False
        return
    before = lib.tinyserve_amx(-1) == 1
    lib.tinyserve_amx(1 if on and amx_available() else 0)
    try:
        yield lib.tinyserve_amx(-1) == 1
    finally:
        lib.tinyserve_amx(1 if before else 0)


def _build(compiler: str, flags: Sequence[str], srcs: Sequence[Path], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_out = Path(tmp) / out.name
        subprocess.run(
            [compiler, *flags, "-I", str(CSRC), "-o", str(tmp_out), *map(str, srcs), "-lm"],
            check=True,
            capture_output=True,
            text=True,
            timeout=300,
        )
        os.replace(tmp_out, out)  # atomic: a concurrent builder sees the old file or the whole new one
