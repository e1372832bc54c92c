"""What the tests share: tiny checkpoints, the in-process harness, the stub model runner and
scheduler, server fixtures and the subprocess server handle, Triton-interpreter helpers."""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
"""The repository's root: the working directory of the subprocesses the tests start."""

PRODUCT_PACKAGES = ("runtime", "memory", "tokenizer_proc", "scheduler_proc", "detokenizer_proc")
"""The packages the wheel ships (with the top-level ``launch`` module)."""
