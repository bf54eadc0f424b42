"""Text UTF-8 cannot encode (lone surrogates) is a clear error naming the argument and the position (issue 18).

Every text that reaches a tokenizer passes ``check_encodable`` (tokenizers would raise an opaque
``TypeError: TextEncodeInput must be Union[...]``). After the error nothing has changed: the state
and the generator give what they give without the failed call (checked against a fresh run).
"""

from __future__ import annotations

import pytest

from continuum import SequenceState, continuous, generate, samplers
from continuum.errors import ContinuumError, UnencodableTextError

from conftest import check_unchanged, snapshot

BAD = "\ud800abc"  # a lone surrogate at position 0
LATE = "héllo \udc80!"  # ... at position 6


def _raises(fn, argument_part: str, position: int):
    with pytest.raises(UnencodableTextError) as info:
        fn()
    err = info.value
    assert isinstance(err, ContinuumError) and isinstance(err, ValueError)
    assert argument_part in str(err) and f"character {position}" in str(err)
    assert "encode('utf-8', 'replace').decode()" in str(err)
    assert err.position == position
    return err


def test_prompts(model):
    gen = generate.text(model, samplers.greedy())
    _raises(lambda: gen(BAD, max_tokens=2), "prompt cannot", 0)
    _raises(lambda: gen(["fine", LATE], max_tokens=2), "prompt 1 of the list", 6)
    _raises(lambda: SequenceState.from_prompts(model, LATE), "prompt", 6)
    _raises(lambda: gen.stream(BAD, max_tokens=2), "prompt", 0)
    # the generator is untouched: the cleaned text generates what a fresh generator gives
    clean = BAD.encode("utf-8", "replace").decode()
    assert gen(clean, max_tokens=3) == generate.text(model, samplers.greedy())(clean, max_tokens=3)


def test_state_plus_text_and_text_plus_state(model):
    state = continuous(generate.text(model, samplers.greedy()))(["one", "two"], max_tokens=2)
    before = snapshot(state)
    _raises(lambda: state + LATE, "the text added to the state", 6)
    _raises(lambda: state + ["ok", BAD], "item 1 of the list", 0)
    _raises(lambda: LATE + state, "the text put before the state", 6)
    check_unchanged(state, before)
    assert list(state + " x") == [t + " x" for t in before["texts"]]


def test_choices_stop_strings_and_negative_prompts(model):
    _raises(lambda: generate.choice(model, ["yes", LATE]), "choice option 1 of the list", 6)
    _raises(lambda: generate.choice(model, ["yes", BAD], method="greedy"), "choice option 1", 0)
    gen = generate.text(model, samplers.greedy())
    _raises(lambda: gen("hi", max_tokens=2, stop_at=BAD), "stop_at", 0)
    _raises(lambda: gen("hi", max_tokens=2, stop_at=[".", LATE]), "stop_at 1 of the list", 6)
    state = SequenceState.from_prompts(model, ["hi"])
    before = snapshot(state)
    _raises(lambda: continuous(gen)(state, max_tokens=2, stop_at=BAD), "stop_at", 0)
    check_unchanged(state, before)
    _raises(lambda: generate.text(model, guidance_scale=2.0, negative_prompt=LATE), "negative_prompt", 6)
    _raises(lambda: generate.text(model, guidance_scale=2.0, negative_prompt=["x", BAD]),
            "negative_prompt 1 of the list", 0)


def test_patterns_and_grammars(model):
    _raises(lambda: generate.regex(model, "a" + BAD), "the regex", 1)
    _raises(lambda: generate.cfg(model, 'start: "' + BAD + '"'), "the grammar", 8)
