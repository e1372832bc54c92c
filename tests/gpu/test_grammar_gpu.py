"""Constrained decoding's bitmask on a GPU: xgrammar's Triton kernel behind ``TritonOps`` against
the plain torch reference, with all rows and with a subset (rows left out stay as they were).

Compiled Triton is needed, so when this session set TRITON_INTERPRET=1 the test runs in a fresh
process without it.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.triton_interp import run_compiled_when_interpreting


@pytest.mark.parametrize("rows", [None, [0, 3, 5]])
@pytest.mark.parametrize("vocab", [1000, 49152])
def test_apply_token_bitmask_matches_torch(rows: list[int] | None, vocab: int) -> None:
    from runtime.engine.cuda.ops import TritonOps
    from runtime.engine.ops import get_ops
    from runtime.engine.ops.torch_ops import TorchOps

    ops = get_ops("cuda", torch.float32)
    assert isinstance(ops, TritonOps)
    gen = torch.Generator().manual_seed(vocab)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (8, words), dtype=torch.int32, generator=gen)
    logits = torch.randn(8, vocab, generator=gen)
    expected = logits.clone()
    TorchOps().apply_token_bitmask(expected, bitmask, rows)
    on_gpu = logits.cuda()
    ops.apply_token_bitmask(on_gpu, bitmask.cuda(), rows)
    assert torch.equal(on_gpu.cpu(), expected)


run_compiled_when_interpreting(globals(), __file__)
