"""Agent libraries, unchanged, against ``continuum serve`` (issue 35): pydantic-ai and the OpenAI Agents SDK
(the ``agents`` test extra) and instructor (the ``instructor`` extra: not installable beside the newest
``openai``, see pyproject.toml). Each test skips when its library is absent.

What a tiny random model can show: a tool whose argument is a nested pydantic model gets a call the
library's own validation accepts; an agent with a tool AND an output type ends in a valid call or a
schema-valid answer (the library parses it), never free text. The libraries are the references: they
validate with pydantic and raise on anything else ("Invalid JSON when parsing model output", retries
exhausted, an "incomplete" response).
"""

from __future__ import annotations

from typing import Literal

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("openai")

from pydantic import BaseModel

from serve_support import Adopt, Pet

MODEL = "tiny"
SETTINGS = {"max_tokens": 80, "temperature": 0.0}


class Card(BaseModel):
    mood: Literal["happy", "sad"]
    ok: bool


# ---------------------------------------------------------------- pydantic-ai
def _pydantic_ai_models(server):
    pytest.importorskip("pydantic_ai")
    from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider

    provider = OpenAIProvider(base_url=server.url, api_key=server.client().api_key)
    return {"chat": OpenAIChatModel(MODEL, provider=provider), "responses": OpenAIResponsesModel(MODEL, provider=provider)}


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_pydantic_ai_nested_output_tool(server, api):
    pytest.importorskip("pydantic_ai")
    from pydantic_ai import Agent

    agent = Agent(_pydantic_ai_models(server)[api], output_type=Adopt, retries=0)  # the default: an output tool
    result = agent.run_sync("Adopt a pet", model_settings=SETTINGS)
    assert isinstance(result.output, Adopt)


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_pydantic_ai_tool_plus_native_output(server, api):
    pytest.importorskip("pydantic_ai")
    from pydantic_ai import Agent, NativeOutput
    from pydantic_ai.exceptions import UsageLimitExceeded
    from pydantic_ai.usage import UsageLimits

    calls: list[str] = []
    agent = Agent(_pydantic_ai_models(server)[api], output_type=NativeOutput(Card), retries=0)

    @agent.tool_plain
    def get_time(tz: Literal["UTC", "CET"]) -> str:
        """The time in a time zone."""
        calls.append(tz)
        return "12:00"

    try:  # every request ends in a call (validated by pydantic-ai before the tool runs) or a Card
        result = agent.run_sync("A card, or the time", model_settings=SETTINGS, usage_limits=UsageLimits(request_limit=3))
    except UsageLimitExceeded:
        assert len(calls) == 3  # three valid calls in a row: the model's choice, never free text
        return
    assert isinstance(result.output, Card)


# ---------------------------------------------------------------- the OpenAI Agents SDK
def _agents_model(server, api):
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=server.url, api_key=server.client().api_key, max_retries=0)
    if api == "chat":
        return agents.OpenAIChatCompletionsModel(model=MODEL, openai_client=client)
    return agents.OpenAIResponsesModel(model=MODEL, openai_client=client)


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_agents_sdk_function_tool_with_a_model_argument(server, api):
    agents = pytest.importorskip("agents")

    model = _agents_model(server, api)
    got: list[Adopt] = []

    @agents.function_tool
    def adopt(request: Adopt) -> str:
        """Adopt a pet."""
        got.append(request)
        return "adopted"

    agent = agents.Agent(name="a", model=model, tools=[adopt], tool_use_behavior="stop_on_first_tool",
                         model_settings=agents.ModelSettings(tool_choice="required", max_tokens=80, temperature=0))
    result = agents.Runner.run_sync(agent, "Adopt a pet", max_turns=2)
    assert result.final_output == "adopted" and isinstance(got[0], Adopt)


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_agents_sdk_tool_plus_output_type(server, api):
    agents = pytest.importorskip("agents")

    model = _agents_model(server, api)

    @agents.function_tool
    def get_time(tz: Literal["UTC", "CET"]) -> str:
        """The time in a time zone."""
        return f"12:00 {tz}"

    agent = agents.Agent(name="a", model=model, tools=[get_time], output_type=Card, tool_use_behavior="stop_on_first_tool",
                         model_settings=agents.ModelSettings(max_tokens=80, temperature=0))
    result = agents.Runner.run_sync(agent, "A card, or the time", max_turns=2)
    assert isinstance(result.final_output, Card) or result.final_output in ("12:00 UTC", "12:00 CET")


# ---------------------------------------------------------------- instructor
def test_instructor_tools_mode_nested_model(server):
    instructor = pytest.importorskip("instructor")

    client = instructor.from_openai(server.client(), mode=instructor.Mode.TOOLS)
    out = client.chat.completions.create(model=MODEL, response_model=Adopt, max_retries=0, max_tokens=80, temperature=0,
                                         messages=[{"role": "user", "content": "Adopt a pet"}])
    assert isinstance(out, Adopt)
    pets = client.chat.completions.create_iterable(model=MODEL, response_model=Pet, max_retries=0, max_tokens=120,
                                                   temperature=0, messages=[{"role": "user", "content": "Two pets"}])
    assert all(isinstance(p, Pet) for p in pets)
