"""Structured outputs: generation constrained to a JSON schema, a regex, a list of choices or
a grammar, with llguidance (docs/structured_outputs.md).

grammar.py: specs -> llguidance grammars and matchers (both processes); manager.py: the
engine's StructuredOutputManager (cache, per-sequence matchers, bitmasks); validator.py: the
API process's check of a request's grammar (off the event loop, cached, time-limited).
"""
