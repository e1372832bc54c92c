"""Constrained decoding: the request's JSON schema, regex or EBNF grammar, through xgrammar.

- ``check_constraint``: does a constraint parse at all (the tokenizer process refuses a
  request whose grammar does not, before anything is queued; no vocabulary needed).
- ``GrammarBackend``: one per scheduler process: the served vocabulary as xgrammar's
  ``TokenizerInfo``, a bounded cache of compiled grammars, and the compile itself (which
  the scheduler runs on a worker thread: ``scheduler_proc.grammar_queue``).
- ``RequestGrammar``: one request's matcher: fills its row of the step's token bitmask,
  accepts each sampled token, says when the grammar is complete, and which tokens the
  grammar forces next (jump-forward).
"""

from runtime.text.grammar.backend import GrammarBackend, GrammarError, check_constraint
from runtime.text.grammar.matcher import RequestGrammar, allocate_bitmask, fill_bitmask

__all__ = ["GrammarBackend", "GrammarError", "RequestGrammar", "allocate_bitmask", "check_constraint", "fill_bitmask"]
