"""Chat tools' parsing (serve/tools.py): the calls of a reply in Hermes' and Qwen's <tool_call> blocks or Llama-3's bare
JSON, read whole or as it streams (the same content and calls either way), and the schema a forced reply follows.
Through the server: test_serve.py."""
import json

import jsonschema
import pytest

from distmk.runtime.tokenizer import render_chatml
from distmk.serve.tools import ToolReader, call_schema, parse_calls

NAMES = {"get_weather", "add"}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
             "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "add", "parameters": {
             "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
             "required": ["a", "b"], "additionalProperties": False}}}]


def calls_of(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("text, content, calls", [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', None,
     [("get_weather", {"city": "Paris"})]),
    ('Let me look. <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>\n<tool_call>{"name": "get_weather", '
     '"arguments": {"city": "Oslo"}}</tool_call>', "Let me look. \n",
     [("add", {"a": 1}), ("get_weather", {"city": "Oslo"})]),
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}', None,
     [("get_weather", {"city": "Rome"})]),
    ('  {"name": "add", "parameters": {"a": 2, "b": 3}}', None, [("add", {"a": 2, "b": 3})]),
    ('{"name": "nope", "parameters": {}}', '{"name": "nope", "parameters": {}}', []),        # not an offered tool
    ('<tool_call>{"name": "add", "arguments": {"a": </tool_call>', '<tool_call>{"name": "add", "arguments": {"a": '
     '</tool_call>', []),                                                                    # not JSON: all text
    ("It is sunny, <tool or not.", "It is sunny, <tool or not.", []),
])
def test_calls_are_read_out_of_a_reply_whole_and_streamed(text, content, calls):
    assert (lambda c, k: (c, calls_of(k)))(*parse_calls(text, NAMES)) == (content, calls)
    for size in (1, 3, 7):                  # streamed in pieces: the content sent plus the rest, and the calls
        reader, sent = ToolReader(NAMES), ""
        for i in range(0, len(text), size):
            sent += reader.feed(text[i:i + size])
        rest, found = reader.finish()
        assert (sent + rest, calls_of(found)) == (content or "", calls)
    if calls:
        assert "<tool_call>" not in sent and "{" not in sent      # nothing of a call went out as content


def test_forced_replies_follow_the_call_schema():
    required = call_schema(TOOLS, None)
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "Lima"}},
                         {"name": "add", "parameters": {"a": 1, "b": 2}}], required)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_weather", "parameters": {}}], required)     # its required city
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([], required)
    assert call_schema(TOOLS, "get_weather") == TOOLS[0]["function"]["parameters"]
    assert call_schema(TOOLS, None, parallel=False)["maxItems"] == 1             # parallel_tool_calls: false
    reader = ToolReader(NAMES, "add", forced=True)
    assert reader.feed('{"a": 1}') == "" and calls_of(reader.finish()[1]) == [("add", {"a": 1})]
    reader = ToolReader(NAMES, None, forced=True)
    assert reader.read('[{"name": "add", "parameters"') == ('[{"name": "add", "parameters"', [])   # cut short


def test_chatml_renders_tools_calls_and_results_as_qwen_does():
    text = render_chatml([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
                          {"role": "assistant", "content": None, "tool_calls": [
                              {"id": "c1", "type": "function",
                               "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                          {"role": "tool", "content": "18 C", "tool_call_id": "c1"}], TOOLS)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n") and json.dumps(TOOLS[0]) in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n18 C\n</tool_response><|im_end|>\n'
            '<|im_start|>assistant\n') in text
