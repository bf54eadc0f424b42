"""Chats on continuous states: messages rendered with the model's chat template (docs/chat.md).

* ``session``: :class:`Chat`, the messages plus a ``SequenceState``; each reply reconciles the state with the
  new rendering (longest common token prefix) and computes only the tokens after it;
* ``template``: the ``Renderer`` (the template's text, its end-of-turn marker, rendering to token ids);
* ``reasoning``: chats with reasoning models (template switches, earlier thoughts in the history);
* ``stream``: :class:`ChatStream`, a reply streamed chunk by chunk.

Example:
    >>> from continuum.chat import Chat
    >>> c = Chat(model, system="You are terse.").user("Hi").reply(text_gen, max_tokens=20)   # doctest: +SKIP
"""

from .session import Chat
from .stream import ChatStream

__all__ = ["Chat", "ChatStream"]
