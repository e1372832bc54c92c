"""Speculative decoding (``--speculative-algorithm``): drafts proposed on the host, verified by the
target model in one forward per step (``ngram.py`` proposes, ``verify.py`` schedules and accepts)."""
