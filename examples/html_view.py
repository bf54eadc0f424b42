#!/usr/bin/env python
"""Write the HTML views of a few states and of a chat to files, to open in a browser.

    python examples/html_view.py [--model PATH] [--out DIR]

Writes ``DIR/state.html`` (two prompts x two samples, continued with JSON: fast-forwarded tokens
underlined) and ``DIR/chat.html`` (two conversations whose final replies are shaded by their
log-probs), each a complete page around ``state.to_html()`` / ``chat_to_html(...)``. Without
``--model``, the ``stories260K`` fixture (see ``examples/demo.py``) or a tiny random model is used.
The screenshots in ``docs/img/`` come from these pages in headless Chromium::

    chromium --headless --screenshot=state.png --window-size=1100,700 file://$PWD/DIR/state.html
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

PAGE = ('<!doctype html><html><head><meta charset="utf-8"><title>{title}</title></head>'
        '<body style="margin:12px;background:#f6f7f9">{body}</body></html>')


def main(argv=None) -> int:
    from demo import load_local_model

    from continuum import continuous, generate, models, samplers
    from continuum.display import chat_to_html

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a local Hugging Face causal LM (default: the stories260K fixture)")
    ap.add_argument("--out", default="html_view", help="output folder (default: ./html_view)")
    args = ap.parse_args(argv)
    model = models.transformers(args.model) if args.model else load_local_model(print)[0]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = torch.Generator().manual_seed(0)

    story = continuous(generate.text(model, samplers.multinomial(2, temperature=0.9)))
    s = story(["Once upon a time, Lily found a <box>", "Tom & his dog"], max_tokens=24, rng=rng)
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
              "required": ["name", "age"]}
    card = continuous(generate.json(model, schema, samplers.multinomial(2), whitespace_pattern=""))
    s2 = card(s + "\nCard: ", max_tokens=48, rng=rng)
    (out / "state.html").write_text(PAGE.format(title="SequenceState", body=s2.to_html()))

    reply = continuous(generate.text(model, samplers.greedy()))
    chats = [[{"role": "user", "content": "Tell me about Lily."}], [{"role": "user", "content": "And Tom?"}]]
    prompts = ["User: Tell me about Lily.\nAssistant:", "User: And Tom?\nAssistant:"]
    r = reply(prompts, max_tokens=32, stop_at=".")
    for c, text in zip(chats, r.last_text):
        c.append({"role": "assistant", "content": text})
    (out / "chat.html").write_text(PAGE.format(title="chat", body=chat_to_html(chats, r)))
    print(f"wrote {out / 'state.html'} and {out / 'chat.html'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
