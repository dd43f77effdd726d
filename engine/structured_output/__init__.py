"""Structured output with xgrammar: grammars compiled per constraint, the token mask applied before sampling, and
the waiting room where a constrained request waits for its grammar."""
