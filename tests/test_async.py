"""asyncio: ``await g.acall(...)`` and ``async for chunk in g.astream(...)`` give what the blocking calls give.

Every generator kind (plain, choice, continuous) and chat replies, ``asyncio.gather`` of many calls
against the same calls run one after another, and closing a stream early (``break``, ``aclose``, a
cancelled task): the decoding loop leaves and the model then generates exactly what it did before.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from continuum import SequenceState, continuous, generate, samplers
from continuum.chat import Chat
from continuum.programs.aio import to_thread

from conftest import fixture_path

PROMPTS = ["Once upon a time", "The quick brown fox", "Le café est", "Numbers: 0 1 2", "She said", "Review: great"]


def run(coro):
    return asyncio.run(coro)


def same_state(a: SequenceState, b: SequenceState) -> bool:
    return (list(a) == list(b) and a.token_ids.tolist() == b.token_ids.tolist()
            and torch.allclose(a.weights, b.weights, atol=1e-4, rtol=0) and a.value == b.value)


def test_acall_equals_the_blocking_call_for_every_generator_kind(model):
    text = generate.text(model, samplers.greedy())
    sampled = generate.text(model, samplers.multinomial(2))
    choice = generate.choice(model, [" yes", " no", " maybe"], samplers.greedy())
    regex = generate.regex(model, r"[0-9]{2}", samplers.greedy())
    text_c = continuous(text)

    assert run(text.acall(PROMPTS[0], max_tokens=5)) == text(PROMPTS[0], max_tokens=5)
    assert run(text.acall(PROMPTS[:3], 4, ".")) == text(PROMPTS[:3], 4, ".")
    rng = lambda: torch.Generator().manual_seed(3)  # noqa: E731
    assert run(sampled.acall(PROMPTS[1], max_tokens=4, rng=rng())) == sampled(PROMPTS[1], max_tokens=4, rng=rng())
    assert run(choice.acall(PROMPTS[:2])) == choice(PROMPTS[:2])
    assert run(regex.acall(PROMPTS[3], max_tokens=4)) == regex(PROMPTS[3], max_tokens=4)
    s = text_c(PROMPTS[0], max_tokens=3)
    assert same_state(run(text_c.acall(s + " and", max_tokens=4)), text_c(s + " and", max_tokens=4))


def test_acall_raises_what_the_call_raises(gpt2_model):
    from continuum.errors import GeneratorArgumentError

    gen = generate.text(gpt2_model, samplers.greedy())
    with pytest.raises(GeneratorArgumentError, match="max_tokens"):
        run(gen.acall(PROMPTS[0], max_tokens=-1))


def test_gather_of_many_acalls_equals_sequential_calls(gpt2_model):
    gen = generate.text(gpt2_model, samplers.multinomial(temperature=1.3))
    text_c = continuous(generate.text(gpt2_model, samplers.greedy()))

    def rng(i):
        return torch.Generator().manual_seed(i)

    async def many():
        plain = [gen.acall(p, max_tokens=3 + i % 4, rng=rng(i)) for i, p in enumerate(PROMPTS * 2)]
        states = [text_c.acall(p, max_tokens=5) for p in PROMPTS]
        return await asyncio.gather(*plain), await asyncio.gather(*states)

    plain, states = run(many())
    assert plain == [gen(p, max_tokens=3 + i % 4, rng=rng(i)) for i, p in enumerate(PROMPTS * 2)]
    assert all(same_state(a, text_c(p, max_tokens=5)) for a, p in zip(states, PROMPTS))


def test_astream_yields_the_blocking_stream_chunks(model):
    gen = generate.text(model, samplers.greedy())
    text_c = continuous(gen)

    async def collect(stream):
        return [c async for c in stream], stream

    chunks, stream = run(collect(gen.astream(PROMPTS[:2], max_tokens=6)))
    sync = gen.stream(PROMPTS[:2], max_tokens=6)
    assert chunks == list(sync) and stream.result == sync.result == gen(PROMPTS[:2], max_tokens=6)
    chunks, stream = run(collect(text_c.astream(PROMPTS[0], max_tokens=6)))
    assert "".join(chunks) == gen(PROMPTS[0], max_tokens=6)
    assert same_state(stream.state, text_c(PROMPTS[0], max_tokens=6))


def test_astream_error_is_raised_in_the_event_loop(gpt2_model):
    from continuum.errors import GeneratorArgumentError

    gen = generate.text(gpt2_model, samplers.greedy())

    async def consume():  # the loop checks stop_at when it starts: on the worker thread
        async for _ in gen.astream(PROMPTS[0], max_tokens=3, stop_at=[""]):
            pass

    with pytest.raises(GeneratorArgumentError, match="stop_at"):
        list(gen.stream(PROMPTS[0], max_tokens=3, stop_at=[""]))
    with pytest.raises(GeneratorArgumentError, match="stop_at"):
        run(consume())


def _settled(model, wait: float = 0.3, within: float = 15.0) -> bool:
    """A quiet window of ``wait`` seconds (no forward on ``model``) began within ``within`` seconds
    (a loaded machine may take a while to schedule the worker's last step)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        calls = model.forward_calls
        time.sleep(wait)
        if model.forward_calls == calls:
            return True
    return False


def test_closing_an_astream_early_stops_the_loop_and_leaves_the_model_usable(gpt2_model):
    gen = generate.text(gpt2_model, samplers.greedy())
    before = gen(PROMPTS[:2], max_tokens=8)

    async def break_early():  # break, then the dropped stream is closed
        got = []
        async for chunk in gen.astream(PROMPTS[0], max_tokens=200):
            got.append(chunk)
            break
        await asyncio.sleep(0.2)
        return got

    async def aclose_early():
        stream = gen.astream(PROMPTS[1], max_tokens=200)
        async with stream:
            async for _ in stream:
                break
        return stream

    c0 = gpt2_model.forward_calls
    gen(PROMPTS[0], max_tokens=200)
    full = gpt2_model.forward_calls - c0  # the forwards of a stream run to its end
    assert full > 100
    c0 = gpt2_model.forward_calls
    assert len(run(break_early())) == 1
    assert _settled(gpt2_model)
    assert gpt2_model.forward_calls - c0 < full // 2  # the dropped stream stopped
    c0 = gpt2_model.forward_calls
    stream = run(aclose_early())
    assert _settled(gpt2_model, 0.1, within=0.15)  # aclose waited for the loop to leave
    assert gpt2_model.forward_calls - c0 < full // 2
    with pytest.raises(RuntimeError, match="not finished"):
        _ = stream.state
    assert gen(PROMPTS[:2], max_tokens=8) == before


def test_cancelling_the_task_stops_the_call(gpt2_model):
    gen = generate.text(gpt2_model, samplers.greedy())
    before = gen(PROMPTS[0], max_tokens=8)

    def forever():
        while True:
            gen(PROMPTS[0], max_tokens=50)

    async def cancel_soon():
        task = asyncio.ensure_future(to_thread(forever))
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(cancel_soon())
    assert _settled(gpt2_model)  # the worker left at its next decoding step (it never ends by itself)
    assert gen(PROMPTS[0], max_tokens=8) == before


def test_cancelling_tasks_of_a_joint_call_drops_their_rows_and_stops_it_once_all_are_cancelled(gpt2_model):
    """Gathered greedy acalls run as one joint call (programs/aio._Tick): a task cancelled alone gets its
    CancelledError at once and the others their own results; cancelling every task stops the joint call itself."""
    gen = generate.text(gpt2_model, samplers.greedy())
    solo = [gen(p, max_tokens=12) for p in PROMPTS[:4]]

    async def one_cancelled():
        tasks = [asyncio.ensure_future(gen.acall(p, max_tokens=12)) for p in PROMPTS[:4]]
        await asyncio.sleep(0)
        tasks[1].cancel()
        return await asyncio.gather(*tasks, return_exceptions=True)

    got = run(one_cancelled())
    assert isinstance(got[1], asyncio.CancelledError)
    assert [got[i] for i in (0, 2, 3)] == [solo[i] for i in (0, 2, 3)]

    async def all_cancelled():
        tasks = [asyncio.ensure_future(gen.acall(p, max_tokens=100_000)) for p in PROMPTS[:4]]
        await asyncio.sleep(0.3)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return gpt2_model.forward_calls

    at_cancel = run(all_cancelled())
    assert _settled(gpt2_model)
    assert gpt2_model.forward_calls - at_cancel <= 3  # the joint call left at its next step, not at the context's end


def test_chat_areply_and_astream_reply(gpt2_model):
    template = fixture_path("chat_templates", "smollm2.jinja").read_text()
    gen = generate.text(gpt2_model, samplers.greedy())
    chat = Chat(gpt2_model, "Be brief.", template=template).user("Hello there")
    sync = chat.reply(gen, max_tokens=6)
    assert run(chat.areply(gen, max_tokens=6)).messages == sync.messages

    async def stream():
        s = chat.astream_reply(gen, max_tokens=6)
        return "".join([c async for c in s]), s.chat

    text, new = run(stream())
    assert new.messages == sync.messages and text == sync.messages[-1]["content"]
