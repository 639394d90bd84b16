"""Tool calls parsed out of a reply's text, Hermes / Qwen style: each call a JSON object
``{"name": ..., "arguments": {...}}`` between ``<tool_call>`` and ``</tool_call>``.

One parser serves streamed and whole replies alike (a whole reply is fed at once), so the
streamed deltas add up to the non-streamed message:

- text outside calls is the message's content; whitespace that only separates it from a call
  is dropped (a reply without calls keeps its text exactly);
- a call whose object starts ``{"name": "<name>", "arguments": `` is announced (its id and
  name) as soon as that much has arrived, and its arguments stream as they are generated, up
  to the end of their JSON value (the arguments are the model's text, not re-serialised);
- any other call is read whole at ``</tool_call>`` (or at the end of the reply, where it was
  cut off): a JSON object with ``name`` and ``arguments`` (or ``parameters``) is a call, and
  anything else is given back as content, tags included.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

START, END = "<tool_call>", "</tool_call>"
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


@dataclass
class CallDelta:
    """What one feed adds to call ``index``: its id and name when it is new, argument text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def body(self) -> dict[str, object]:
        """The delta as a streamed ``tool_calls`` entry (vLLM's and OpenAI's shape)."""
        out: dict[str, object] = {"index": self.index}
        function: dict[str, str] = {"arguments": self.arguments}
        if self.id is not None:
            out |= {"id": self.id, "type": "function"}
            function = {"name": self.name or "", **function}
        return out | {"function": function}


@dataclass
class Release:
    """What a feed made final: content text and call deltas (one per call it touched)."""

    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def then(self, later: Release) -> Release:
        """This release followed by ``later`` (deltas of one call merged)."""
        self.content += later.content
        for d in later.calls:
            mine = self.call(d.index)
            if d.id is not None:
                mine.id, mine.name = d.id, d.name
            mine.arguments += d.arguments
        return self

    def call(self, index: int) -> CallDelta:
        if not self.calls or self.calls[-1].index != index:
            self.calls.append(CallDelta(index))
        return self.calls[-1]


@dataclass
class Call:
    id: str
    name: str
    arguments: str = ""


class _Value:
    """Finds where a JSON value ends, one character at a time (strings and nesting kept)."""

    def __init__(self) -> None:
        self.started = self.done = self.in_string = self.escaped = False
        self.depth = 0
        self.scalar = False

    def take(self, ch: str) -> bool:
        """Whether ``ch`` belongs to the value (False once it is complete)."""
        if self.done:
            return False
        if not self.started:
            if ch.isspace():
                return False
            self.started = True
            self.scalar = ch not in "{[\""
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.in_string = False
                self.done = self.depth == 0
            return True
        if self.scalar:
            if ch in ",}]" or ch.isspace():
                self.done = True
                return False
            return True
        if ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
            self.done = self.depth == 0
        return True


class ToolCallParser:
    """Feed a reply's text as it grows; each feed says what became final."""

    def __init__(self) -> None:
        self.calls: list[Call] = []
        self._buf = ""  # text not yet released
        self._in_call = False
        self._pending = ""  # trailing whitespace of the content, held back
        self._value: _Value | None = None  # the streamed call's arguments, once announced
        self._scanned = 0  # of the call's body, characters the value scanner has seen

    def feed(self, text: str) -> Release:
        out = Release()
        self._buf += text
        while self._step(out, final=False):
            pass
        return out

    def finish(self) -> Release:
        """The end of the reply: what is held back is released, a cut-off call read whole."""
        out = Release()
        while self._step(out, final=True):
            pass
        if self._in_call:
            self._close(out, self._buf, cut=True)
            self._buf, self._in_call = "", False
        self._content(out, self._buf, final=True)
        self._buf = ""
        return out

    def _step(self, out: Release, final: bool) -> bool:
        """Release what can be released; True when the state changed (step again)."""
        if not self._in_call:
            at = self._buf.find(START)
            if at < 0:
                keep = 0 if final else _partial_tag(self._buf, START)
                if not final:
                    self._content(out, self._buf[: len(self._buf) - keep], final=False)
                    self._buf = self._buf[len(self._buf) - keep:]
                return False
            self._content(out, self._buf[:at], final=False)
            self._pending = ""  # whitespace before a call only separates it
            self._buf = self._buf[at + len(START):]
            self._in_call, self._value, self._scanned = True, None, 0
            return True
        end = self._buf.find(END)
        body = self._buf if end < 0 else self._buf[:end]
        self._stream(out, body, limit=len(body) if end >= 0 or final
                     else len(body) - _partial_tag(body, END))
        if end < 0:
            return False
        self._close(out, body, cut=False)
        self._buf, self._in_call = self._buf[end + len(END):], False
        return True

    def _stream(self, out: Release, body: str, limit: int) -> None:
        """Announce the call once its head is there; pass on its arguments' new characters."""
        if self._value is None:
            head = _HEAD.match(body)
            if head is None:
                return
            name = _unquote(head.group(1))
            if name is None:
                return
            self._new_call(out, name)
            self._value, self._scanned = _Value(), head.end()
        call, delta = self.calls[-1], out.call(len(self.calls) - 1)
        while self._scanned < limit:
            ch = body[self._scanned]
            if not self._value.take(ch):
                if self._value.done:
                    break
            else:
                call.arguments += ch
                delta.arguments += ch
            self._scanned += 1
        if not delta.arguments and delta.id is None:
            out.calls.pop()

    def _close(self, out: Release, body: str, cut: bool) -> None:
        """A call's end (``</tool_call>``, or the reply's end where ``cut``): a call not
        announced is read whole."""
        if self._value is not None:  # announced and streamed already
            return
        parsed = _whole_call(body)
        if parsed is None:
            self._content(out, START + body + ("" if cut else END), final=False)
            return
        name, arguments = parsed
        self._new_call(out, name)
        self.calls[-1].arguments = arguments
        out.call(len(self.calls) - 1).arguments = arguments

    def _new_call(self, out: Release, name: str) -> None:
        self.calls.append(Call(f"chatcmpl-tool-{uuid.uuid4().hex}", name))
        delta = out.call(len(self.calls) - 1)
        delta.id, delta.name = self.calls[-1].id, name

    def _content(self, out: Release, text: str, final: bool) -> None:
        """Content text; its trailing whitespace waits for more text (or for the end, where a
        reply without calls keeps it)."""
        text, self._pending = self._pending + text, ""
        if final and not self.calls:
            out.content += text
            return
        kept = text.rstrip()
        out.content += kept
        if not final:
            self._pending = text[len(kept):]


def parse_tool_calls(text: str) -> tuple[str | None, list[Call]]:
    """A whole reply: its content (None when only calls) and its calls."""
    parser = ToolCallParser()
    content = parser.feed(text).content + parser.finish().content
    return (content or None) if parser.calls else content, parser.calls


def _partial_tag(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` could be the start of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def _unquote(raw: str) -> str | None:
    try:
        value = json.loads(f'"{raw}"')
    except ValueError:
        return None
    return value if isinstance(value, str) else None


def _whole_call(body: str) -> tuple[str, str] | None:
    """``(name, arguments as JSON text)`` of a call read whole, or None."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
