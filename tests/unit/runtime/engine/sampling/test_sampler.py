"""Sampler: greedy/argmax, distribution of draws, truncation, penalties, min_new_tokens,
per-request seeds independent of the batch, and logprobs of the raw logits."""

from __future__ import annotations

import random
from collections import Counter
from typing import Sequence

import pytest
import torch

from runtime.engine.sampling import penalties as pen
from runtime.engine.sampling.batch_info import SamplingBatchInfo
from runtime.engine.sampling.sampler import Sampler
from runtime.protocol.sampling_params import SamplingParams

CHI2_DF7_P001 = 24.322  # chi-square critical value, 7 degrees of freedom, p = 0.001
CHI2_CRIT_P001 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 7: CHI2_DF7_P001}

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.requires_cuda)]


def make_info(
    params: Sequence[SamplingParams],
    vocab: int,
    prompts: Sequence[Sequence[int]] | None = None,
    outputs: Sequence[Sequence[int]] | None = None,
    eos: Sequence[int] = (),
    device: str = "cpu",
) -> SamplingBatchInfo:
    bs = len(params)
    return SamplingBatchInfo.from_requests(
        list(params),
        list(prompts) if prompts is not None else [[] for _ in range(bs)],
        list(outputs) if outputs is not None else [[] for _ in range(bs)],
        vocab,
        list(eos),
        device,
    )


def seeded_sampler(seed: int = 0) -> Sampler:
    return Sampler(generator=torch.Generator().manual_seed(seed))


def chi_square(samples: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson chi-square of ``samples`` against ``probs`` over tokens with mass; (stat, df)."""
    n = samples.numel()
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    support = probs > 0
    assert counts[~support].sum() == 0, "samples outside the support"
    expected = probs[support].double() * n
    stat = float(((counts[support] - expected) ** 2 / expected).sum())
    return stat, int(support.sum()) - 1


# ---- greedy ---------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_temperature_zero_and_top_k_one_are_argmax(device: str) -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 97, device=device)
    sampler = Sampler()
    for p in (SamplingParams(temperature=0.0), SamplingParams(top_k=1, temperature=1.3)):
        out = sampler(logits, make_info([p] * 6, 97, device=device))
        assert torch.equal(out.next_token_ids, logits.argmax(-1))
        assert out.next_token_ids.dtype == torch.int64
    # Greedy rows mixed with sampled rows stay exact argmax.
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=2.0),
        SamplingParams(top_k=1),
        SamplingParams(top_p=0.5, seed=3),
        SamplingParams(temperature=0.0, top_p=0.1, min_p=0.9),
        SamplingParams(),
    ]
    out = sampler(logits, make_info(params, 97, device=device))
    for row in (0, 2, 4):
        assert out.next_token_ids[row] == logits[row].argmax()


def test_half_precision_logits_and_caller_buffer_untouched() -> None:
    torch.manual_seed(1)
    logits = torch.randn(4, 50).to(torch.bfloat16)
    before = logits.clone()
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.5, frequency_penalty=1.0)] * 4
    out = seeded_sampler()(logits, make_info(params, 50, outputs=[[1, 2, 3]] * 4, prompts=[[4]] * 4))
    assert torch.equal(logits, before)
    assert out.next_token_ids.shape == (4,)


def test_padded_vocab_columns_never_sampled() -> None:
    logits = torch.zeros(3, 12)
    logits[:, 10:] = 100.0  # LM-head padding past vocab_size=10
    params = [SamplingParams(temperature=0.0), SamplingParams(), SamplingParams(top_k=3)]
    out = seeded_sampler()(logits, make_info(params, 10), return_logprob=True)
    assert (out.next_token_ids < 10).all()
    assert torch.allclose(out.logprobs, torch.full((3,), -torch.log(torch.tensor(10.0)).item()))


def test_empty_batch() -> None:
    out = Sampler()(torch.zeros(0, 8), make_info([], 8), return_logprob=True, top_logprobs_num=2)
    assert out.next_token_ids.shape == (0,)
    assert out.logprobs is not None and out.logprobs.shape == (0,)


# ---- distribution -----------------------------------------------------------------------

TOY_LOGITS = torch.tensor([1.5, 0.2, -0.7, 2.0, 0.0, -1.5, 0.9, 0.4])
N_DRAWS = 20_000


def draw(params: SamplingParams, logits: torch.Tensor = TOY_LOGITS, seed: int = 0) -> torch.Tensor:
    """N_DRAWS independent samples: one batch of N_DRAWS identical rows."""
    batch = logits.unsqueeze(0).expand(N_DRAWS, -1).contiguous()
    info = make_info([params] * N_DRAWS, logits.numel())
    return seeded_sampler(seed)(batch, info).next_token_ids


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_frequencies_match_softmax(temperature: float) -> None:
    samples = draw(SamplingParams(temperature=temperature))
    stat, df = chi_square(samples, torch.softmax(TOY_LOGITS / temperature, -1))
    assert df == 7
    assert stat < CHI2_DF7_P001, stat


def test_seeded_rows_also_match_softmax() -> None:
    """Per-row generators (seed, step) must be proper Exp(1) streams too."""
    n = 4000
    params = [SamplingParams(seed=s) for s in range(n)]
    batch = TOY_LOGITS.unsqueeze(0).expand(n, -1).contiguous()
    samples = Sampler()(batch, make_info(params, 8)).next_token_ids
    stat, df = chi_square(samples, torch.softmax(TOY_LOGITS, -1))
    assert stat < CHI2_CRIT_P001[df], stat


def _expected_truncated(keep: list[int], logits: torch.Tensor = TOY_LOGITS) -> torch.Tensor:
    probs = torch.softmax(logits, -1)
    mask = torch.zeros_like(probs, dtype=torch.bool)
    mask[keep] = True
    probs = probs * mask
    return probs / probs.sum()


def test_top_k_truncation() -> None:
    # Sorted by probability: 3 (2.0), 0 (1.5), 6 (0.9), 7 (0.4), 1, 4, 2, 5.
    samples = draw(SamplingParams(top_k=3))
    assert set(samples.tolist()) == {3, 0, 6}
    stat, df = chi_square(samples, _expected_truncated([3, 0, 6]))
    assert stat < CHI2_CRIT_P001[df], stat


def test_top_p_truncation() -> None:
    probs = torch.softmax(TOY_LOGITS, -1)
    order = probs.argsort(descending=True)
    # top_p halfway between the mass of the top 3 and the top 4 tokens keeps exactly 4.
    mass3, mass4 = probs[order[:3]].sum().item(), probs[order[:4]].sum().item()
    top_p = (mass3 + mass4) / 2
    samples = draw(SamplingParams(top_p=top_p))
    keep = order[:4].tolist()
    assert set(samples.tolist()) == set(keep)
    stat, df = chi_square(samples, _expected_truncated(keep))
    assert stat < CHI2_CRIT_P001[df], stat


def test_min_p_truncation() -> None:
    probs = torch.softmax(TOY_LOGITS, -1)
    min_p = 0.4  # keep tokens with prob >= 0.4 * max prob
    keep = [i for i in range(8) if probs[i] >= min_p * probs.max()]
    samples = draw(SamplingParams(min_p=min_p))
    assert set(samples.tolist()) == set(keep)
    stat, df = chi_square(samples, _expected_truncated(keep))
    assert stat < CHI2_CRIT_P001[df], stat


def test_truncation_matches_transformers_warpers() -> None:
    """Kept set equals HF's TopK -> TopP -> MinP chain (top_p on the top_k-renormalised mass)."""
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    rng = random.Random(0)
    torch.manual_seed(0)
    vocab, bs = 40, 64
    logits = torch.randn(bs, vocab) * 2
    params = []
    for _ in range(bs):
        params.append(
            SamplingParams(
                temperature=rng.choice([0.5, 1.0, 1.7]),
                top_k=rng.choice([-1, 1, 2, 5, 20, 60]),
                top_p=rng.choice([1.0, 0.3, 0.6, 0.9]),
                min_p=rng.choice([0.0, 0.05, 0.3]),
            )
        )
    # Many draws per row: every token the sampler produces must be in HF's kept set, and
    # (with these draws) every kept token of non-trivial mass shows up.
    reps = 300
    batch = logits.repeat(reps, 1)
    samples = seeded_sampler(1)(batch, make_info(params * reps, vocab)).next_token_ids.view(reps, bs)
    for i, p in enumerate(params):
        scores = (logits[i : i + 1] / p.temperature).clone()
        if p.top_k != -1:
            scores = TopKLogitsWarper(top_k=p.top_k)(None, scores)
        if p.top_p < 1.0:
            scores = TopPLogitsWarper(top_p=p.top_p)(None, scores)
        if p.min_p > 0:
            scores = MinPLogitsWarper(min_p=p.min_p)(None, scores)
        kept = set(torch.nonzero(scores[0] > float("-inf")).flatten().tolist())
        got = set(samples[:, i].tolist())
        assert got <= kept, (i, p, got - kept)
        probs = torch.softmax(scores[0], -1)
        likely = {t for t in kept if probs[t] > 0.05}
        assert likely <= got, (i, p, likely - got)


# ---- per-request seeds ------------------------------------------------------------------


def _run_steps(seeded_row: int, others: list[SamplingParams], steps: int, torch_seed: int, device: str) -> list[int]:
    """Decode ``steps`` steps of one seeded request placed at ``seeded_row`` among ``others``."""
    vocab = 64
    target = SamplingParams(seed=1234, temperature=1.0, top_p=0.97, top_k=50)
    target_logits = torch.Generator().manual_seed(7)
    torch.manual_seed(torch_seed)  # the shared (unseeded) draws differ between runs
    sampler = Sampler()
    params = list(others)
    params.insert(seeded_row, target)
    outputs: list[list[int]] = [[] for _ in params]
    prompts = [[1, 2, 3] for _ in params]
    produced = []
    for _ in range(steps):
        logits = torch.randn(len(params), vocab) * 3  # other rows: arbitrary
        logits[seeded_row] = torch.randn(vocab, generator=target_logits) * 0.5
        info = SamplingBatchInfo.from_requests(params, prompts, outputs, vocab, [0], device)
        ids = sampler(logits.to(device), info).next_token_ids.tolist()
        for out, t in zip(outputs, ids):
            out.append(t)
        produced.append(ids[seeded_row])
    return produced


@pytest.mark.parametrize("device", DEVICES)
def test_seed_reproducible_across_batch_compositions(device: str) -> None:
    steps = 8
    alone = _run_steps(0, [], steps, torch_seed=0, device=device)
    others_a = [
        SamplingParams(),
        SamplingParams(temperature=0.0),
        SamplingParams(seed=99, top_k=3),
        SamplingParams(top_p=0.5, min_p=0.1, repetition_penalty=1.2),
    ]
    others_b = [
        SamplingParams(seed=1234, temperature=0.3),  # same seed, other params
        SamplingParams(frequency_penalty=1.0, presence_penalty=-0.5),
        SamplingParams(),
        SamplingParams(temperature=0.0, top_k=1),
        SamplingParams(seed=5),
        SamplingParams(top_k=2),
    ]
    in_batch_first = _run_steps(0, others_a, steps, torch_seed=1, device=device)
    in_batch_middle = _run_steps(3, others_b, steps, torch_seed=2, device=device)
    assert alone == in_batch_first == in_batch_middle
    assert len(set(alone)) > 1, "the seeded request should actually be sampling"


def test_different_seeds_and_steps_give_different_noise() -> None:
    vocab = 256
    logits = torch.zeros(2, vocab)  # uniform: the token is decided by the noise alone
    params = [SamplingParams(seed=1), SamplingParams(seed=2)]
    a = Sampler()(logits, make_info(params, vocab)).next_token_ids.tolist()
    assert a[0] != a[1]
    later = Sampler()(logits, make_info(params, vocab, outputs=[[5], [5]])).next_token_ids.tolist()
    assert later != a


# ---- penalties --------------------------------------------------------------------------


def test_penalties_match_hand_computation() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 1.0, 3.0]])
    prompt, output = [0, 1], [2, 2, 3]
    sampler = Sampler()

    def penalized(p: SamplingParams) -> list[float]:
        info = make_info([p], 6, prompts=[prompt], outputs=[output])
        return sampler.penalized_logits(logits, info)[0].tolist()

    # Repetition 2.0 over prompt + output {0, 1, 2, 3}: positive / 2, negative * 2.
    assert penalized(SamplingParams(repetition_penalty=2.0)) == [1.0, -2.0, 0.25, -1.0, 1.0, 3.0]
    # Frequency 0.5 over output only: counts {2: 2, 3: 1}; prompt tokens 0, 1 untouched.
    assert penalized(SamplingParams(frequency_penalty=0.5)) == [2.0, -1.0, -0.5, -1.0, 1.0, 3.0]
    # Presence 0.25 over output only.
    assert penalized(SamplingParams(presence_penalty=0.25)) == [2.0, -1.0, 0.25, -0.75, 1.0, 3.0]
    # All three: repetition first, then frequency + presence.
    both = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    assert penalized(both) == [1.0, -2.0, -1.0, -1.75, 1.0, 3.0]
    # None: identity.
    assert penalized(SamplingParams()) == logits[0].tolist()


def test_repetition_penalty_matches_transformers() -> None:
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    torch.manual_seed(3)
    vocab = 30
    logits = torch.randn(3, vocab)
    prompts = [[1, 2, 2, 7], [0], [29, 3]]
    outputs = [[7, 8], [5, 5, 5], []]
    params = [SamplingParams(repetition_penalty=r) for r in (1.3, 0.7, 2.0)]
    got = Sampler().penalized_logits(logits, make_info(params, vocab, prompts, outputs))
    for i in range(3):
        ids = torch.tensor([prompts[i] + outputs[i]])
        want = RepetitionPenaltyLogitsProcessor(penalty=params[i].repetition_penalty)(ids, logits[i : i + 1].clone())
        torch.testing.assert_close(got[i : i + 1], want)


def test_penalties_only_touch_rows_that_asked() -> None:
    torch.manual_seed(4)
    logits = torch.randn(4, 10)
    params = [
        SamplingParams(),
        SamplingParams(repetition_penalty=1.5),
        SamplingParams(),
        SamplingParams(frequency_penalty=1.0),
    ]
    hist = [[1, 2, 3]] * 4
    got = Sampler().penalized_logits(logits, make_info(params, 10, hist, hist))
    assert torch.equal(got[0], logits[0]) and torch.equal(got[2], logits[2])
    assert not torch.equal(got[1], logits[1]) and not torch.equal(got[3], logits[3])
    assert torch.equal(got[3, 4:], logits[3, 4:])


def test_penalty_changes_greedy_choice() -> None:
    logits = torch.tensor([[0.0, 5.0, 4.0, 1.0]])
    hist = [[1, 1, 1]]
    p = SamplingParams(temperature=0.0, frequency_penalty=1.0)
    assert Sampler()(logits, make_info([p], 4, [[]], hist)).next_token_ids.tolist() == [2]


def test_token_counts_vectorised_equal_python_counts() -> None:
    rng = random.Random(5)
    vocab = 50
    lists = [[rng.randrange(vocab) for _ in range(rng.randrange(0, 40))] for _ in range(17)]
    counts = pen.token_counts(lists, vocab, torch.device("cpu"))
    seen = pen.token_presence(lists[:8], vocab, torch.device("cpu"), lists[8:16])
    for i, toks in enumerate(lists):
        want = torch.zeros(vocab)
        for t, c in Counter(toks).items():
            want[t] = c
        assert torch.equal(counts[i], want)
    for i in range(8):
        want_seen = torch.zeros(vocab, dtype=torch.bool)
        want_seen[lists[i] + lists[8 + i]] = True
        assert torch.equal(seen[i], want_seen)


# ---- min_new_tokens ---------------------------------------------------------------------


def test_min_new_tokens_suppresses_eos_and_stop_ids() -> None:
    vocab, eos, stop_id = 6, 0, 1
    logits = torch.tensor([[9.0, 8.0, 7.0, 0.0, 0.0, 0.0]])
    p = SamplingParams(temperature=0.0, min_new_tokens=3, stop_token_ids=[stop_id])
    got = []
    for n_out in range(5):
        info = make_info([p], vocab, outputs=[[4] * n_out], eos=[eos])
        got.append(Sampler()(logits, info).next_token_ids.item())
    assert got == [2, 2, 2, eos, eos]

    # ignore_eos: EOS cannot stop the request, so only the stop id is suppressed.
    q = SamplingParams(temperature=0.0, min_new_tokens=3, stop_token_ids=[stop_id], ignore_eos=True)
    info = make_info([q], vocab, outputs=[[4]], eos=[eos])
    assert Sampler()(logits, info).next_token_ids.item() == eos
    masked = Sampler().penalized_logits(logits, info)[0]
    assert masked[stop_id] == float("-inf") and masked[eos] == 9.0


def test_min_new_tokens_holds_for_sampled_rows() -> None:
    vocab, n = 5, 2000
    logits = torch.tensor([3.0, 3.0, 0.0, 0.0, 0.0]).expand(n, -1).contiguous()
    params = [SamplingParams(min_new_tokens=2, stop_token_ids=[1])] * n
    info = make_info(params, vocab, outputs=[[3]] * n, eos=[0])
    samples = seeded_sampler()(logits, info).next_token_ids
    assert not ((samples == 0) | (samples == 1)).any()
    # Once reached, EOS and the stop id are back.
    info = make_info(params, vocab, outputs=[[3, 3]] * n, eos=[0])
    samples = seeded_sampler()(logits, info).next_token_ids
    assert (samples == 0).any() and (samples == 1).any()


def test_min_new_tokens_gives_way_to_a_complete_grammar() -> None:
    """A constrained row whose grammar allows only EOS samples EOS before min_new_tokens (its
    output is complete); one whose grammar allows more still has EOS suppressed, and so does
    an unconstrained row."""
    vocab, eos = 6, 2  # not 0: the argmax of a row of -inf is token 0
    logits = torch.tensor([[9.0, 8.0, 7.0, 1.0, 0.0, 0.0]]).expand(3, -1).contiguous()
    params = [SamplingParams(temperature=0.0, min_new_tokens=3)] * 2 + [SamplingParams(min_new_tokens=3)]
    bitmask = torch.tensor([[1 << eos], [(1 << eos) | (1 << 3)], [0]], dtype=torch.int32)
    for rows in ([0, 1], None):  # a batch with an unconstrained row, and one of constrained rows only
        n = 3 if rows else 2
        info = SamplingBatchInfo.from_requests(
            params[:n], [[]] * n, [[4]] * n, vocab, [eos], "cpu", vocab_mask=bitmask[:n], vocab_mask_rows=rows
        )
        got = seeded_sampler()(logits[:n], info).next_token_ids.tolist()
        assert got[:2] == [eos, 3]
        if rows:
            assert got[2] != eos


# ---- logit_bias ---------------------------------------------------------------------------


def biased(token: int, value: float, **kw: object) -> SamplingParams:
    return SamplingParams(logit_bias={str(token): value}, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("device", DEVICES)
def test_plus_100_bias_wins_greedy_and_sampling(device: str) -> None:
    torch.manual_seed(11)
    vocab, n = 50, 400
    row = torch.randn(vocab) * 2
    target = int(row.argmin())  # the least likely token of the row
    logits = row.expand(n, -1).contiguous().to(device)
    greedy = Sampler()(logits[:1], make_info([biased(target, 100, temperature=0.0)], vocab, device=device))
    assert greedy.next_token_ids.tolist() == [target]
    # Sampled rows at temperature 1: unseeded ones (one shared draw) and one seed per row.
    params = [biased(target, 100, temperature=1.0, seed=None if i % 2 else i) for i in range(n)]
    for seed in range(3):
        out = seeded_sampler(seed)(logits, make_info(params, vocab, device=device))
        assert (out.next_token_ids == target).all()
    # Without the bias the same rows rarely pick it: the test can fail.
    plain = seeded_sampler(0)(logits, make_info([SamplingParams(temperature=1.0)] * n, vocab, device=device))
    assert (plain.next_token_ids != target).float().mean() > 0.9


@pytest.mark.parametrize("device", DEVICES)
def test_minus_100_on_the_argmax_gives_the_second_best(device: str) -> None:
    torch.manual_seed(12)
    vocab = 64
    logits = (torch.randn(5, vocab) * 3).to(device)
    top2 = logits.topk(2, dim=-1).indices.tolist()
    params = [biased(best, -100, temperature=0.0) for best, _ in top2]
    out = Sampler()(logits, make_info(params, vocab, device=device))
    assert out.next_token_ids.tolist() == [second for _, second in top2]


@pytest.mark.parametrize("device", DEVICES)
def test_unbiased_rows_are_exactly_as_without_bias(device: str) -> None:
    """A biased row changes nothing for the others: their adjusted logits are bit-equal, and so
    are their tokens (greedy, seeded, and unseeded ones drawing from the same shared noise)."""
    torch.manual_seed(13)
    vocab = 80
    logits = torch.randn(4, vocab, device=device)
    others = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=5), SamplingParams(top_k=9)]
    target = int(logits[0].argmin())
    with_bias = make_info([biased(target, 100, temperature=1.0), *others], vocab, device=device)
    without = make_info([SamplingParams(temperature=1.0), *others], vocab, device=device)
    sampler = Sampler()
    assert torch.equal(sampler.penalized_logits(logits, with_bias)[1:], sampler.penalized_logits(logits, without)[1:])
    for seed in range(5):
        a = seeded_sampler(seed)(logits, with_bias).next_token_ids.tolist()
        b = seeded_sampler(seed)(logits, without).next_token_ids.tolist()
        assert a[0] == target and a[1:] == b[1:]
    # Rows without a bias build no bias tensors: an unbiased batch pays nothing.
    assert without.logit_bias is None and with_bias.logit_bias is not None
    assert with_bias.logit_bias.rows.tolist() == [0] and with_bias.logit_bias.token_ids.tolist() == [target]


def test_bias_cannot_reopen_a_token_the_grammar_bans() -> None:
    vocab = 20
    logits = torch.zeros(300, vocab)
    allowed = [3, 7, 11]
    bitmask = torch.tensor([[sum(1 << t for t in allowed)]], dtype=torch.int32).expand(300, -1).contiguous()
    banned = 5
    for temperature in (0.0, 1.0):
        params = [SamplingParams(logit_bias={str(banned): 100.0, "7": 3.0}, temperature=temperature)] * 300
        info = SamplingBatchInfo.from_requests(params, [[]] * 300, [[]] * 300, vocab, [], "cpu", vocab_mask=bitmask)
        ids = seeded_sampler()(logits, info).next_token_ids
        assert set(ids.tolist()) <= set(allowed)
        if temperature == 0.0:  # the bias still ranks the allowed tokens
            assert set(ids.tolist()) == {7}


def test_bias_comes_before_penalties_and_min_new_tokens() -> None:
    vocab, eos = 10, 2
    logits = torch.zeros(2, vocab)
    logits[:, 3] = 1.0
    # Repetition penalty 2 on a seen token: (1 + 3) / 2 = 2 (bias first), not 1 / 2 + 3 = 3.5.
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=2.0, logit_bias={"3": 3.0}),
        SamplingParams(temperature=0.0, min_new_tokens=2, logit_bias={str(eos): 100.0}),
    ]
    info = make_info(params, vocab, prompts=[[3], [1]], outputs=[[], []], eos=[eos])
    adjusted = Sampler().penalized_logits(logits, info)
    assert adjusted[0, 3].item() == pytest.approx(2.0)
    # +100 on EOS cannot end a request before min_new_tokens.
    assert adjusted[1, eos].item() == float("-inf")
    assert Sampler()(logits, info).next_token_ids.tolist() == [3, 3]


def test_bias_keeps_logprobs_raw_and_drops_ids_past_the_vocab() -> None:
    torch.manual_seed(14)
    vocab = 30
    logits = torch.randn(2, vocab + 2)  # two columns of LM-head padding
    logits[:, vocab:] = 50.0
    target = int(logits[0, :vocab].argmin())
    # Unvalidated params may name an id past the vocabulary: it is dropped, never indexed.
    params = [
        SamplingParams(temperature=0.0, logit_bias={str(target): 100.0, str(vocab + 1): 100.0}),
        SamplingParams(temperature=0.0, logit_bias={str(vocab): 100.0}),
    ]
    info = make_info(params, vocab)
    out = Sampler()(logits, info, return_logprob=True, top_logprobs_num=2)
    raw = torch.log_softmax(logits[:, :vocab], dim=-1)
    assert out.next_token_ids.tolist() == [target, int(raw[1].argmax())]
    assert out.logprobs is not None and out.top_logprobs is not None
    torch.testing.assert_close(out.logprobs, raw.gather(1, out.next_token_ids[:, None]).squeeze(1))
    torch.testing.assert_close(out.top_logprobs[0], raw.topk(2, dim=-1).values)


# ---- logprobs ---------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_are_raw_log_softmax(device: str) -> None:
    torch.manual_seed(6)
    vocab = 40
    logits = (torch.randn(5, vocab) * 2).to(device=device, dtype=torch.bfloat16)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.5, repetition_penalty=1.5),
        SamplingParams(top_k=3, frequency_penalty=2.0),
        SamplingParams(top_p=0.5, seed=1),
        SamplingParams(min_p=0.2, presence_penalty=1.0),
    ]
    hist = [[1, 2, 3, 4]] * 5
    info = make_info(params, vocab, hist, hist, device=device)
    out = Sampler()(logits, info, return_logprob=True, top_logprobs_num=4)
    raw = torch.log_softmax(logits.float(), dim=-1)
    assert out.logprobs is not None and out.logprobs.dtype == torch.float32
    torch.testing.assert_close(out.logprobs, raw.gather(1, out.next_token_ids[:, None]).squeeze(1))
    assert out.top_logprobs is not None
    values, ids = out.top_logprobs
    assert values.shape == ids.shape == (5, 4)
    assert (values[:, :-1] >= values[:, 1:]).all()
    torch.testing.assert_close(values, raw.topk(4, dim=-1).values)
    torch.testing.assert_close(raw.gather(1, ids), values)


def test_batch_top_logprobs_num_is_the_max() -> None:
    params = [SamplingParams(top_logprobs_num=k) for k in (0, 3, 1)]
    assert make_info(params, 9).top_logprobs_num == 3
    assert make_info([SamplingParams()], 9).top_logprobs_num == 0


def test_no_logprobs_unless_asked() -> None:
    out = Sampler()(torch.randn(2, 9), make_info([SamplingParams()] * 2, 9))
    assert out.logprobs is None and out.top_logprobs is None
    out = Sampler()(torch.randn(2, 9), make_info([SamplingParams()] * 2, 9), top_logprobs_num=3)
    assert out.logprobs is None and out.top_logprobs is not None


@pytest.mark.parametrize("device", DEVICES)
def test_token_ids_logprobs_are_raw_log_softmax_at_each_rows_own_ids(device: str) -> None:
    """SGLang's token_ids_logprob: each row's ids (any length, repeats allowed, none at all), gathered
    from the raw logits' log_softmax whatever penalties, bias, min_new_tokens or temperature do to the
    sampled distribution; the only thing asked, it still leaves the all-greedy fast path."""
    torch.manual_seed(8)
    vocab = 40
    logits = (torch.randn(4, vocab + 2) * 2).to(device=device)
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.5),
        SamplingParams(temperature=0.7, logit_bias={"3": -100.0}, seed=2),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, min_new_tokens=2, stop_token_ids=[7]),
    ]
    named: list[list[int] | None] = [[3, 7, 3], None, [vocab - 1], [7, 0, 12, 39, 5]]
    hist = [[1, 2, 3]] * 4
    info = SamplingBatchInfo.from_requests(params, hist, hist, vocab, [0], device, token_ids_logprob=named)
    out = Sampler()(logits, info)
    raw = torch.log_softmax(logits[:, :vocab].float(), dim=-1)
    assert out.logprobs is None and out.top_logprobs is None
    assert out.token_ids_logprobs is not None and tuple(out.token_ids_logprobs.shape) == (4, 5)
    for row, ids in enumerate(named):
        got = out.token_ids_logprobs[row, : len(ids or ())]
        torch.testing.assert_close(got, raw[row, ids or []])
    greedy = [SamplingParams(temperature=0.0)] * 2
    info = SamplingBatchInfo.from_requests(greedy, [[]] * 2, [[]] * 2, vocab, [], device, token_ids_logprob=[None, [2]])
    out = Sampler()(logits[:2], info)
    assert out.token_ids_logprobs is not None
    torch.testing.assert_close(out.token_ids_logprobs[1, 0], raw[1, 2])
    plain = SamplingBatchInfo.from_requests(greedy, [[]] * 2, [[]] * 2, vocab, [], device, token_ids_logprob=[None, []])
    assert plain.token_ids_logprob is None and Sampler()(logits[:2], plain).token_ids_logprobs is None
