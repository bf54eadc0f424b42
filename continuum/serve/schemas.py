"""Request bodies, validated with pydantic: unknown fields are ignored (as OpenAI's API does), wrong
types and impossible values are refused (400, naming the field). Types are strict: ``"5"`` is not
an int and ``true`` is not a number."""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["ChatCompletionRequest", "ChatMessage", "CompletionRequest", "Function", "ResponsesRequest", "Tool"]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)


class TextPart(_Body):
    type: str
    text: str | None = None


class FunctionCallSpec(_Body):
    name: str
    arguments: str = "{}"


class ToolCall(_Body):
    id: str = ""
    type: str = "function"
    function: FunctionCallSpec


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class Function(_Body):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: Function


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class JSONSchemaSpec(_Body):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaSpec | None = None


class StreamOptions(_Body):
    include_usage: bool = False


Stop = Union[str, list[str], None]  # noqa: UP007 - a runtime alias (Python 3.10 evaluates it)


class _Sampling(_Body):
    model: str
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=0)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    n: int = Field(default=1, ge=1, le=16)
    stop: Stop = None
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    # reasoning (docs/reasoning.md): the template's switches, a thought budget (extension), OpenAI's effort
    chat_template_kwargs: dict[str, Any] | None = None
    thinking_budget: int | None = Field(default=None, ge=0)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]  # texts, or token ids (what lm-eval sends)
    max_tokens: int | None = Field(default=16, ge=0)
    n: int = Field(default=1, ge=1, le=16)
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=20)
    stop: Stop = None


class InputItem(_Body):
    """A Responses input item: a message, a ``function_call`` (a replayed call) or a ``function_call_output``."""

    type: Literal["message", "function_call", "function_call_output"] | None = None
    role: Literal["system", "developer", "user", "assistant"] | None = None
    content: str | list[TextPart] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | None = None


class ResponsesTool(_Body):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesToolChoice(_Body):
    type: Literal["function"]
    name: str


class TextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    name: str = "response"
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_Body):
    format: TextFormat | None = None


class ReasoningConfig(_Body):
    effort: Literal["none", "minimal", "low", "medium", "high"] | None = None


class ResponsesRequest(_Sampling):
    input: str | list[InputItem]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    max_output_tokens: int | None = Field(default=None, ge=0)
    text: TextConfig | None = None
    tools: list[ResponsesTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | ResponsesToolChoice | None = None
    metadata: dict[str, str] | None = None
    reasoning: ReasoningConfig | None = None
    thinking_budget: int | None = Field(default=None, ge=0)
