"""Structured output for `serve`: a request's constraint (a JSON schema, a grammar, or its
tools) as the grammar the verifier decodes under, the tools told to the model, and a
tool call read back from the text.

A tool call is written as the Hermes format writes one, which the default pair's family
(and Qwen's) were trained on: `<tool_call>` then {"name": ..., "arguments": {...}} then
`</tool_call>`; several calls (where the client allows them: `parallel_tool_calls`) one
such block after another, a line apart. The grammar makes it so: with `tool_choice`
`required` or a named function the answer is calls, each's name one of the tools and its
arguments valid against that tool's parameters; with `auto`, either a text without
`<tool_call>` in it, or such a text (often none) then calls held to the same. So the
markup of a call is always read as a call, never returned as text. The tools are
described to the model in a system message: the default templates (llama.cpp's built-in
ones) have no place for them.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from typing import Any

from pydantic import ValidationError

from drafter.serve.chat_api import ChatCompletionRequest, NamedToolChoice, Tool, _Request
from drafter.serve.chat_responses import CalledFunction, ToolCall
from drafter.serve.errors import invalid_request
from server.shared.json_schemas import SCHEMA_MAPS, SCHEMAS, held_schema
from server.shared.protocol import MAX_GRAMMAR_CHARS, Grammar

log = logging.getLogger("drafter.serve")

OPEN, CLOSE = "<tool_call>\n", "\n</tool_call>"
OPENING, CLOSING = OPEN.strip(), CLOSE.strip()
# A text with no call's opening anywhere in it; and a text that ends at its first opening
# (llguidance's `&` and `~` on terminals: an opening with more than its line break after it
# is not the first).
TEXT = f"/(.|\\n)+/ & ~/(?s:.*){OPENING}(?s:.*)/"
OPENED = f"/(?s:.*){OPENING}\\n/ & ~/(?s:.*){OPENING}(?s:.){{2,}}/"
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}
# What a model's escape of half a pair (`\ud800`, valid JSON) decodes to: no UTF-8 can
# carry it, so no body or event with it could be written.
LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def request_grammar(request: _Request) -> Grammar | None:
    """The one constraint a request asks for, as the verifier's grammar (two: a 400)."""
    asked: list[tuple[str, Grammar]] = []
    if request.grammar:
        asked.append(("grammar", _grammar("grammar", "gbnf", request.grammar)))
    if request.json_schema is not None:
        asked.append(("json_schema", _grammar("json_schema", "json_schema", request.json_schema)))
    if isinstance(request, ChatCompletionRequest):
        form = request.response_format
        if form is not None and form.type != "text":
            schema = form.json_schema.schema_ if form.json_schema is not None else None
            source = schema or {"type": "object"}  # json_object: any object
            asked.append(("response_format", _grammar("response_format", "json_schema", source)))
        if request.calls_tools:
            asked.append(("tools", tool_grammar(request)))
    if len(asked) > 1:
        names = ", ".join(name for name, _ in asked)
        raise invalid_request(f"one constraint at a time: {names}", param=asked[1][0])
    return asked[0][1] if asked else None


def _grammar(field: str, kind: str, source: str | dict) -> Grammar:
    try:
        return Grammar(kind=kind, source=source)  # type: ignore[arg-type]
    except ValidationError as exc:
        reason = exc.errors()[0]["msg"].removeprefix("Value error, ")
        raise invalid_request(f"{field}: {reason}", param=field) from None


def tool_grammar(request: ChatCompletionRequest) -> Grammar:
    tools = request.tools or []
    choice = request.tool_choice
    if isinstance(choice, NamedToolChoice):
        tools = [t for t in tools if t.function.name == choice.function.name]
    # Measured before anything is built from them: the grammar holds every schema whole.
    size = sum(len(json.dumps(t.function.parameters or NO_ARGUMENTS)) for t in tools)
    if size > MAX_GRAMMAR_CHARS:
        raise invalid_request(
            f"tools: their parameters' schemas are {size} characters; a grammar of calls "
            f"holds at most {MAX_GRAMMAR_CHARS}",
            param="tools",
        )
    calls = {"anyOf": [_call_schema(tool, f"/anyOf/{i}") for i, tool in enumerate(tools)]}
    # Held as a `json_schema` grammar's schema is (server/shared/json_schemas.py): a tool's
    # parameters are as closed, and as bounded in whitespace, as a response format's.
    lines = [f"call: %json {json.dumps(held_schema(calls))}"]
    ending = f"call {json.dumps(CLOSE)}"
    if request.parallel_tool_calls is not False:
        lines.append(f"more: ({json.dumps(chr(10) + OPEN)} {ending})*")
        ending += " more"
    if choice in (None, "auto"):
        # The text before a call and the call's opening are one terminal: a text alone
        # before it would take the opening in (llguidance's lexemes are greedy).
        lines += [f"start: TEXT | OPENED {ending}", f"TEXT: {TEXT}", f"OPENED: {OPENED}"]
    else:
        lines.append(f"start: {json.dumps(OPEN)} {ending}")
    lark = "\n".join(lines)
    return _grammar("tools", "lark", lark)


def _call_schema(tool: Tool, at: str) -> dict[str, Any]:
    """A call to `tool`, as the schema placed at `at` (a JSON pointer) in the grammar's."""
    arguments = f"{at}/properties/arguments"
    return {
        "type": "object",
        "properties": {
            "name": {"const": tool.function.name},
            "arguments": rebased(tool.function.parameters or NO_ARGUMENTS, arguments),
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def rebased(schema: Any, at: str) -> Any:
    """`schema` as it reads placed at `at` (a JSON pointer) inside another document: each
    `$ref` to a place in it ("#", "#/$defs/City") points there again, so that it resolves
    to what it did in the schema alone (and two tools' `$defs` of one name stay apart). A
    copy, made level by level without recursion: parameters nest as deep as a body may."""
    holder: dict[Any, Any] = {"schema": schema}
    todo: list[tuple[Any, Any]] = [(holder, "schema")]
    while todo:
        parent, key = todo.pop()
        if not isinstance(parent[key], dict):
            continue  # true or false: a schema without refs
        node = parent[key] = dict(parent[key])
        for word, value in node.items():
            if word == "$ref" and isinstance(value, str) and (value == "#" or value[:2] == "#/"):
                node[word] = f"#{at}{value[1:]}"
            elif word in SCHEMA_MAPS and isinstance(value, dict):
                node[word] = dict(value)
                todo += [(node[word], name) for name in value]
            elif word in SCHEMAS and isinstance(value, list):
                node[word] = list(value)
                todo += [(node[word], i) for i in range(len(value))]
            elif word in SCHEMAS:
                todo.append((node, word))
    return holder["schema"]


def tools_message(tools: list[Tool]) -> str:
    """What the model is told of the tools, in the system message."""
    listed = [
        {"type": "function", "function": t.function.model_dump(exclude_none=True)} for t in tools
    ]
    return (
        "You may call one of these functions to answer. To call one, reply with only "
        f'{OPEN}{{"name": <function name>, "arguments": <its arguments as JSON>}}{CLOSE}\n'
        f"<tools>\n{json.dumps(listed)}\n</tools>"
    )


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """The text before the answer's calls, and the calls (each with its own id); the text
    whole where it makes none. A call the token limit cut off (or nested past what json
    reads) is dropped, the calls before it stand: a call's markup is never text."""
    at = text.find(OPENING)
    if at < 0:
        return text, []
    calls, decoder, end = [], json.JSONDecoder(), at
    while text.startswith(OPENING, end):
        try:
            called, end = decoder.raw_decode(text, _skip_space(text, end + len(OPENING)))
            name, arguments = _unicode(called["name"]), _arguments(called["arguments"])
        except (ValueError, KeyError, TypeError, RecursionError):  # cut, or nested too deep
            break
        end = _skip_space(text, end)
        if not text.startswith(CLOSING, end):
            break
        end = _skip_space(text, end + len(CLOSING))
        function = CalledFunction(name=name, arguments=arguments)
        calls.append(ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", function=function))
    return text[:at].rstrip(), calls


def _unicode(name: Any) -> str:
    if not isinstance(name, str):
        raise TypeError("a call's name is a string")
    return LONE_SURROGATE.sub("\ufffd", name)


def _arguments(value: Any) -> str:
    """A call's arguments as JSON text, each lone surrogate the model escaped into them
    written as U+FFFD (as a byte that is not UTF-8 is in its text): every API's body and
    events, which carry them as text (chat, Responses) or as JSON (Messages), stay Unicode."""
    text = json.dumps(value, ensure_ascii=False)  # a lone surrogate left as it is, not escaped
    if LONE_SURROGATE.search(text) is not None:
        log.warning("a tool call's arguments held a lone surrogate: written as U+FFFD")
        value = json.loads(LONE_SURROGATE.sub("\ufffd", text))  # only inside its strings
    return json.dumps(value)


def _skip_space(text: str, at: int) -> int:
    return len(text) - len(text[at:].lstrip())


class CallSniffer:
    """A stream's text while it may still come to a tool call: let through up to where a
    call's opening may be forming (and the whitespace before it, which a call drops),
    held from there; once the opening has come, the rest is the calls."""

    def __init__(self) -> None:
        self._held = ""
        self.calling = False  # the opening has come

    def feed(self, text: str) -> str:
        """What can go out now."""
        self._held += text
        if self.calling:
            return ""
        at = self._held.find(OPENING)
        if at >= 0:
            self.calling = True
            out, self._held = self._held[:at].rstrip(), self._held[at:]
            return out
        keep = len(self._held) - _partial_opening(self._held)
        keep = len(self._held[:keep].rstrip())
        out, self._held = self._held[:keep], self._held[keep:]
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """At the end: the text still held, or the calls it made."""
        held, self._held = self._held, ""
        if not self.calling:
            return held, []
        return "", parse_tool_calls(held)[1]


def _partial_opening(text: str) -> int:
    """How long the end of `text` that may begin a call's opening is."""
    for n in range(min(len(OPENING) - 1, len(text)), 0, -1):
        if OPENING.startswith(text[-n:]):
            return n
    return 0
