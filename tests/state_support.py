"""Shared pieces of the SequenceState tests (``test_state_reuse.py``, ``test_state_algebra.py``,
``test_state_persistence.py``): the prompts and a greedy continuous generator."""

from __future__ import annotations

from continuum import continuous, generate, samplers

PROMPTS = ["Once upon a time", "Le café 東京 🤗", "The dog"]


def greedy_c(model):
    return continuous(generate.text(model, samplers.greedy()))
