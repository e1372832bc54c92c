"""Token and paged KV-slot allocators: exact slots, exhaustion, paging rules, no double hand-out."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from memory.allocator import BaseTokenToKVPoolAllocator, PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator


def t(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def test_token_alloc_exact_slots_and_availability() -> None:
    a = TokenToKVPoolAllocator(8, "cpu", debug=True)
    assert a.size == 8 and a.available_size() == 8
    x = a.alloc(3)
    assert x is not None and x.dtype == torch.int64
    assert x.tolist() == [1, 2, 3]
    assert a.available_size() == 5
    assert a.alloc(5).tolist() == [4, 5, 6, 7, 8]  # type: ignore[union-attr]
    assert a.available_size() == 0


def test_token_alloc_none_on_exhaustion_without_state_change() -> None:
    a = TokenToKVPoolAllocator(4, "cpu", debug=True)
    assert a.alloc(3) is not None
    before = a.free_pages.tolist(), a.release_pages.tolist()
    assert a.alloc(2) is None
    assert (a.free_pages.tolist(), a.release_pages.tolist()) == before
    assert a.available_size() == 1
    assert a.alloc(1).tolist() == [4]  # type: ignore[union-attr]


def test_free_restores_and_reuses_freed_slots() -> None:
    a = TokenToKVPoolAllocator(4, "cpu", debug=True)
    x = a.alloc(4)
    assert x is not None
    a.free(x[1:3])
    assert a.available_size() == 2
    assert a.alloc(2).tolist() == [2, 3]  # type: ignore[union-attr]
    assert a.alloc(1) is None


def test_double_free_is_rejected_in_debug_mode() -> None:
    a = TokenToKVPoolAllocator(4, "cpu", debug=True)
    x = a.alloc(2)
    assert x is not None
    a.free(x)
    with pytest.raises(ValueError, match="double free"):
        a.free(x[:1])
    with pytest.raises(ValueError, match="outside"):
        a.free(t([0]))


def test_clear_makes_everything_free() -> None:
    for a in (TokenToKVPoolAllocator(6, "cpu"), PagedTokenToKVPoolAllocator(8, 4, "cpu")):
        a.alloc(4)
        a.clear()
        assert a.available_size() == a.size
        assert a.alloc(4).tolist()[0] == a.page_size  # type: ignore[union-attr]


def test_token_alloc_extend_and_decode_are_plain_allocs() -> None:
    a = TokenToKVPoolAllocator(8, "cpu", debug=True)
    out = a.alloc_extend(t([0, 2]), t([3, 4]), t([-1, 7]), 5)
    assert out.tolist() == [1, 2, 3, 4, 5]  # type: ignore[union-attr]
    assert a.alloc_decode(t([4, 5]), t([3, 5])).tolist() == [6, 7]  # type: ignore[union-attr]
    assert a.alloc_decode(t([5, 6]), t([6, 7])) is None
    assert a.available_size() == 1


def test_paged_alloc_whole_pages() -> None:
    a = PagedTokenToKVPoolAllocator(16, 4, "cpu", debug=True)
    assert a.size == 16 and a.available_size() == 16
    assert a.alloc(8).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]  # type: ignore[union-attr]
    with pytest.raises(ValueError):
        a.alloc(3)
    assert a.alloc(12) is None
    assert a.available_size() == 8


def test_paged_extend_continues_partial_page_then_new_pages() -> None:
    a = PagedTokenToKVPoolAllocator(32, 4, "cpu", debug=True)
    first = a.alloc(8)  # pages 1, 2: slots 4..11; the request stored 6 tokens, last at slot 9
    assert first is not None
    out = a.alloc_extend(t([6, 0, 4]), t([11, 3, 5]), t([9, -1, 7]), 9)
    # req0: positions 6,7 -> slots 10,11 (rest of page 2), positions 8..10 -> page 3
    # req1: positions 0..2 -> page 4; req2: prefix is page-aligned, position 4 -> page 5
    assert out.tolist() == [10, 11, 12, 13, 14, 16, 17, 18, 20]  # type: ignore[union-attr]
    assert a.available_size() == 32 - 4 * 5


def test_paged_extend_within_partial_page_takes_no_page() -> None:
    a = PagedTokenToKVPoolAllocator(8, 4, "cpu", debug=True)
    assert a.alloc(4) is not None
    out = a.alloc_extend(t([1]), t([4]), t([4]), 3)
    assert out.tolist() == [5, 6, 7]  # type: ignore[union-attr]
    assert a.available_size() == 4


def test_paged_extend_none_when_short_without_state_change() -> None:
    a = PagedTokenToKVPoolAllocator(8, 4, "cpu", debug=True)
    state = a.backup_state()
    assert a.alloc_extend(t([0, 0]), t([5, 4]), t([-1, -1]), 9) is None  # needs 3 pages, has 2
    assert a.backup_state() == state
    assert a.available_size() == 8


def test_paged_decode_takes_page_only_on_boundary() -> None:
    a = PagedTokenToKVPoolAllocator(16, 4, "cpu", debug=True)
    assert a.alloc(8) is not None  # pages 1, 2
    # seq_lens count the new token: 6 -> position 5 (inside page), 5 -> position 4 (new page)
    out = a.alloc_decode(t([6, 5, 4]), t([8, 7, 10]))
    assert out.tolist() == [9, 12, 11]  # type: ignore[union-attr]
    assert a.available_size() == 4
    assert a.alloc_decode(t([9, 9]), t([1, 2])) is None
    assert a.available_size() == 4
    assert a.alloc_decode(t([7]), t([9])).tolist() == [10]  # type: ignore[union-attr]
    assert a.available_size() == 4


def test_paged_free_several_tokens_of_one_page_frees_it_once() -> None:
    a = PagedTokenToKVPoolAllocator(16, 4, "cpu", debug=True)
    x = a.alloc(8)
    assert x is not None
    a.free(t([4, 5, 7, 9]))  # tokens of pages 1 and 2
    assert a.available_size() == 16
    assert sorted(a.release_pages.tolist()) == [1, 2]
    with pytest.raises(ValueError, match="double free"):
        a.free(t([6]))


def test_free_group_batches_frees_into_one() -> None:
    a = PagedTokenToKVPoolAllocator(16, 4, "cpu", debug=True)
    x = a.alloc(12)
    assert x is not None
    a.free_group_begin()
    a.free(x[:2])
    a.free(x[2:5])  # slot 8 shares page 2 with the next call
    a.free(x[5:6])
    assert a.available_size() == 4  # nothing returned until the group ends
    a.free_group_end()
    assert a.available_size() == 12
    assert sorted(a.release_pages.tolist()) == [1, 2]


def test_backup_restore() -> None:
    for a in (TokenToKVPoolAllocator(8, "cpu", debug=True), PagedTokenToKVPoolAllocator(16, 2, "cpu", debug=True)):
        x = a.alloc(4)
        assert x is not None
        state = a.backup_state()
        y = a.alloc(4)
        a.free(x)
        a.restore_state(state)
        assert a.available_size() == a.size - 4
        assert a.alloc(4).tolist() == y.tolist()  # type: ignore[union-attr]


def test_constructor_validation() -> None:
    with pytest.raises(ValueError):
        TokenToKVPoolAllocator(8, "cpu", page_size=4)
    with pytest.raises(ValueError):
        PagedTokenToKVPoolAllocator(2, 4, "cpu")
    assert PagedTokenToKVPoolAllocator(10, 4, "cpu").size == 8


def _pages_of(slots: list[int], p: int) -> set[int]:
    return {s // p for s in slots}


def _run_random_ops(a: BaseTokenToKVPoolAllocator, seed: int, n_ops: int) -> None:
    """Random alloc/alloc_extend/alloc_decode/free; checks ownership after every op."""
    rng = random.Random(seed)
    p = a.page_size
    used: set[int] = set()  # slots handed out and not freed
    owned_pages: set[int] = set()
    seqs: list[list[int]] = []  # each a request's slots in position order
    for _ in range(n_ops):
        op = rng.random()
        before = a.available_size()
        touched: list[int] = []
        if op < 0.3:
            out = a.alloc(rng.randint(0, 3) * p)
            new = [] if out is None else out.tolist()
            if out is not None:
                seqs.append(new)
                touched = [len(seqs) - 1]
        elif op < 0.5:
            grow = rng.sample(range(len(seqs)), k=min(len(seqs), rng.randint(0, 3)))
            fresh = rng.randint(0, 2)
            pre = [len(seqs[i]) for i in grow] + [0] * fresh
            ext = [rng.randint(1, 2 * p + 1) for _ in pre]
            last = [seqs[i][-1] if seqs[i] else -1 for i in grow] + [-1] * fresh
            out = a.alloc_extend(t(pre), t([x + e for x, e in zip(pre, ext)]), t(last), sum(ext))
            new = [] if out is None else out.tolist()
            if out is not None:
                pos = 0
                for j, e in enumerate(ext):
                    chunk = new[pos : pos + e]
                    pos += e
                    if j < len(grow):
                        seqs[grow[j]].extend(chunk)
                        touched.append(grow[j])
                    else:
                        seqs.append(chunk)
                        touched.append(len(seqs) - 1)
        elif op < 0.7:
            dec = [i for i in range(len(seqs)) if seqs[i]][: rng.randint(1, 4)]
            out = a.alloc_decode(t([len(seqs[i]) + 1 for i in dec]), t([seqs[i][-1] for i in dec]))
            new = [] if out is None else out.tolist()
            for i, s in zip(dec, new):
                seqs[i].append(s)
            touched = dec if new else []
        else:
            if not seqs:
                continue
            victim = seqs.pop(rng.randrange(len(seqs)))
            a.free(t(victim))
            used -= set(victim)
            gone = _pages_of(victim, p)
            owned_pages -= gone
            assert a.available_size() == before + len(gone) * p
            continue
        if new:
            assert 0 not in new
            assert all(p <= s < (a.num_pages + 1) * p for s in new)
            assert len(set(new)) == len(new), "handed out a slot twice in one call"
            assert not (set(new) & used), "handed out a slot that is still in use"
            used |= set(new)
            # Paged: a request's slot sits at offset (position % page_size) of a page only it owns.
            for i in touched:
                assert all(s % p == pos % p for pos, s in enumerate(seqs[i]))
            fresh_pages = _pages_of(new, p) - owned_pages
            owned_pages |= fresh_pages
            assert a.available_size() == before - len(fresh_pages) * p
        else:
            assert a.available_size() == before
        assert a.available_size() + len(owned_pages) * p == a.size


@settings(max_examples=5, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), page_size=st.sampled_from([1, 2, 4]), pages=st.integers(4, 40))
def test_random_ops_never_hand_out_a_slot_twice(seed: int, page_size: int, pages: int) -> None:
    a: BaseTokenToKVPoolAllocator
    if page_size == 1:
        a = TokenToKVPoolAllocator(pages, "cpu")
    else:
        a = PagedTokenToKVPoolAllocator(pages * page_size, page_size, "cpu")
    _run_random_ops(a, seed, 2_000)


@pytest.mark.parametrize("page_size", [1, 4])
def test_random_ops_debug_mode_detects_no_double_free(page_size: int) -> None:
    a: BaseTokenToKVPoolAllocator
    if page_size == 1:
        a = TokenToKVPoolAllocator(24, "cpu", debug=True)
    else:
        a = PagedTokenToKVPoolAllocator(24 * page_size, page_size, "cpu", debug=True)
    _run_random_ops(a, page_size, 2_000)
