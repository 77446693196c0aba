"""Chat tools (OpenAI's function calling). The tools a request offers go to the chat template. tool_choice
"required" or a named function holds the reply to the call's JSON by a grammar (runtime/structured.py): a list of
{"name", "parameters"} objects, or the named function's arguments. "auto" reads calls out of the model's own format:
Hermes' and Qwen's `<tool_call>{"name": ..., "arguments": ...}</tool_call>` blocks, or a reply that is one JSON
object {"name": ..., "parameters": ...} as Llama-3's template asks for (after an optional <|python_tag|>). "none"
leaves the reply as text."""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

CALL_OPEN, PYTHON_TAG = "<tool_call>", "<|python_tag|>"
HERMES_CALLS = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
LEADING_SPACE = re.compile(r"\s*")


@dataclass(frozen=True)
class ToolChoice:
    """A chat request's tools as its reply needs them: the offered tools (OpenAI's objects), and the choice."""
    offered: list[dict]
    mode: str                   # none, auto, required, or named (tool_choice names a function)
    named: str | None = None
    parallel: bool = True       # "required" may make several calls

    @classmethod
    def of(cls, req) -> ToolChoice | None:
        """None for a request without tools."""
        if not req.tools:
            return None
        named = req.tool_choice.function.name if req.tool_mode == "named" else None
        return cls([t.model_dump(exclude_none=True) for t in req.tools], req.tool_mode, named,
                   req.parallel_tool_calls is not False)

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "named")

    def reader(self) -> ToolReader | None:
        """What reads a reply's calls (None where tool_choice is none)."""
        names = {t["function"]["name"] for t in self.offered}
        return None if self.mode == "none" else ToolReader(names, self.named, self.forced)


def _parameters(tools: list[dict]) -> dict[str, dict]:
    return {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in tools}


def _calls(tools: list[dict]) -> list[dict]:
    """The schemas of one call of each offered function, {"name", "parameters"}, as a reply writes it."""
    return [{"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
             "properties": {"name": {"const": name}, "parameters": schema}}
            for name, schema in _parameters(tools).items()]


def call_schema(tools: list[dict], named: str | None, parallel: bool = True) -> dict:
    """The JSON schema a forced reply follows: the named function's arguments, or (tool_choice "required") a
    non-empty list of calls of the offered functions (one, where parallel calls are turned off)."""
    if named is not None:
        return _parameters(tools)[named]
    return {"type": "array", "minItems": 1, **({} if parallel else {"maxItems": 1}), "items": {"anyOf": _calls(tools)}}


def format_or_call_schema(schema: dict, tools: list[dict]) -> dict:
    """What a reply held to a JSON format follows where tool_choice "auto" lets it call a tool instead: the format's
    schema, or one call as a bare JSON object (which ToolReader reads as Llama-3's format)."""
    return {"anyOf": [schema, *_calls(tools)]}


def tool_call(name: str, arguments) -> dict:
    """One call as OpenAI's reply has it (arguments as a JSON string)."""
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def forced_calls(text: str, named: str | None) -> list[dict]:
    """The calls of a reply that its grammar held to call_schema (none if it ended before its JSON did)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return []
    return [tool_call(named, value)] if named is not None else [tool_call(c["name"], c["parameters"]) for c in value]


def parse_calls(text: str, names: set[str]) -> tuple[str | None, list[dict]]:
    """(content, calls) of a free reply: the text outside its calls (None if nothing is left) and the calls of
    offered functions it makes in either format; a reply with no well-formed call is all content."""
    calls = []
    for block in HERMES_CALLS.findall(text):
        call = _call(block, names, "arguments")
        if call is None:
            return text, []
        calls.append(call)
    if calls:
        content = HERMES_CALLS.sub("", text)
        return content if content.strip() else None, calls
    bare = text.strip().removeprefix(PYTHON_TAG).strip()
    call = _call(bare, names, "parameters") if bare.startswith("{") else None
    return (None, [call]) if call else (text, [])


def _call(text: str, names: set[str], arguments_key: str) -> dict | None:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    arguments = value.get(arguments_key, value.get("arguments", value.get("parameters", {})))
    return tool_call(value["name"], arguments) if isinstance(arguments, dict) else None


class ToolReader:
    """A reply's text as it streams, with the calls read out of it: `feed` returns the text that is content for
    sure (held back from where a call may start), `finish` the rest of the content and the calls."""

    def __init__(self, names: set[str], named: str | None = None, forced: bool = False):
        self.names, self.named, self.forced = names, named, forced
        self.text, self.sent = "", 0

    def feed(self, piece: str) -> str:
        self.text += piece
        if self.forced:
            return ""
        if not self.sent:       # nothing sent: the reply may be one bare JSON call (read past its leading spaces)
            first = LEADING_SPACE.match(self.text).end()
            start = self.text[first:first + len(PYTHON_TAG)]
            if start.startswith(("{", PYTHON_TAG)) or PYTHON_TAG.startswith(start):
                return ""
        held = self.text.find(CALL_OPEN, self.sent)
        if held < 0:        # a suffix that may begin "<tool_call>" waits for the next piece
            held = next((i for i in range(max(self.sent, len(self.text) - len(CALL_OPEN) + 1), len(self.text))
                         if CALL_OPEN.startswith(self.text[i:])), len(self.text))
        out, self.sent = self.text[self.sent:held], max(self.sent, held)
        return out

    def read(self, text: str) -> tuple[str, list[dict]]:
        """(content, calls) of a whole reply."""
        self.text, self.sent = text, 0
        return self.finish()

    def finish(self) -> tuple[str, list[dict]]:
        """(content not yet sent, calls) once the reply is complete."""
        if self.forced:
            calls = forced_calls(self.text, self.named)
            return ("", calls) if calls else (self.text, [])
        content, calls = parse_calls(self.text, self.names)
        # what was sent is text before any call: the content starts with it
        return (content or "")[self.sent:], calls
