"""A reasoning parser's split of a reply (serve/reasoning.py): the reader alone, streamed in any pieces, and a
server started with --reasoning-parser, whose random-weight model is held to a reply with a <think> block by
structured_outputs' regex."""
import asyncio
import json
import random

import httpx
import pytest
import torch

from conftest import MODEL, serve_alone
from distmk.runtime.structured import Grammars
from distmk.runtime.tokenizer import ByteTokenizer
from distmk.serve.reasoning import ReasonFirst, ReasoningReader, thinking_at_start
from distmk.serve.responses import ResponseShape, ResponsesRequest


@pytest.mark.parametrize("text, thinking, split", [
    ("<think>\nplan\n</think>\n\nanswer", False, ("\nplan\n", "answer")),     # Qwen3: the reply opens it
    ("plan</think>\n\nanswer", True, ("plan", "answer")),                     # DeepSeek-R1: the prompt opened it
    ("  <think>cut off by max_tokens", False, ("cut off by max_tokens", "")),
    ("answer <think>x</think>", False, ("", "answer <think>x</think>")),     # a tag later is content
    ("<thin", False, ("", "<thin")), ("\n", False, ("", "\n")), ("</th", True, ("</th", "")), ("", True, ("", ""))])
def test_a_reply_splits_into_its_reasoning_and_content(text, thinking, split):
    assert ReasoningReader(thinking).read(text) == split


def test_streamed_in_any_pieces_the_split_is_the_whole_reply_s():
    rng = random.Random(0)
    parts = ["<think>", "</think>", "ab", "\n", " ", "<th", "</th", "<", "x<thin", "k>", "</think", "think>"]
    for _ in range(3000):
        text, thinking = "".join(rng.choice(parts) for _ in range(rng.randint(0, 8))), rng.random() < 0.5
        reader, reasoning, content, start = ReasoningReader(thinking), "", "", 0
        for cut in sorted(rng.sample(range(len(text) + 1), rng.randint(0, min(5, len(text) + 1)))) + [len(text)]:
            more_reasoning, more_content = reader.feed(text[start:cut])
            reasoning, content, start = reasoning + more_reasoning, content + more_content, cut
        more_reasoning, more_content = reader.finish()
        whole = ReasoningReader(thinking).read(text)
        assert (reasoning + more_reasoning, content + more_content) == whole, (text, thinking)


def test_a_prompt_that_leaves_think_open_starts_the_reply_in_it():
    assert thinking_at_start("<|im_start|>assistant\n<think>\n")
    assert not thinking_at_start("<|im_start|>assistant\n<think>\n\n</think>\n\n")     # Qwen3, enable_thinking false
    assert not thinking_at_start("<|im_start|>assistant\n")


def test_a_format_holds_the_reply_once_its_reasoning_is_over():
    """ReasonFirst over a real grammar (xgrammar, the byte-level tokenizer: no single <think> token): every token
    may come while the reply reasons, the grammar's once its text holds </think>; a reply that does not start in
    its reasoning is the grammar's from its first token, unless it opens with the tokenizer's <think> token."""
    tokenizer, eos = ByteTokenizer(512), 257
    grammars = Grammars(tokenizer, 512, [eos])
    logits = torch.zeros(512)

    def allowed(constraint) -> set[int]:
        return set(torch.isfinite(constraint.mask(logits)).nonzero().flatten().tolist())

    reasoning = ReasonFirst(grammars.constraint("choice", ["yes", "no"]), tokenizer.token_bytes, True, None)
    for token in b"plan: say </th":
        assert len(allowed(reasoning)) == 512
        reasoning.accept(token)
    for token in b"ink>":
        reasoning.accept(token)
    assert allowed(reasoning) == {ord("y"), ord("n")} and not reasoning.complete
    for token in b"no":
        reasoning.accept(token)
    assert allowed(reasoning) == {eos}
    reasoning.accept(eos)
    assert reasoning.complete
    answer = ReasonFirst(grammars.constraint("choice", ["yes", "no"]), tokenizer.token_bytes, False, None)
    assert allowed(answer) == {ord("y"), ord("n")}
    opens = ReasonFirst(grammars.constraint("choice", ["yes", "no"]), tokenizer.token_bytes, False, 300)
    assert allowed(opens) == {ord("y"), ord("n"), 300}
    opens.accept(300)
    assert len(allowed(opens)) == 512


def test_reasoning_parser_server_gives_the_reasoning_apart_whole_and_streamed(tmp_path):
    """--reasoning-parser qwen3: the message's reasoning (and reasoning_content) is the <think> block, its content
    the rest, whole and as streamed deltas (a delta of reasoning alone has no content); a reply whose prompt leaves
    <think> open starts in it, a format beside it holding none of it; include_reasoning false leaves it out; a server
    without the flag gives the text as it is."""
    from openai import OpenAI
    srv, plain = serve_alone(tmp_path, "reasoning", "--reasoning-parser", "qwen3"), serve_alone(tmp_path, "plain")
    try:
        client = OpenAI(base_url=srv.wait_ready().url + "/v1", api_key="none")
        ask = dict(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=40, temperature=0,
                   extra_body={"structured_outputs": {"regex": "<think>[a-z]{3,6}</think>\n\n[a-z]{2,4}"}})
        message = client.chat.completions.create(**ask).choices[0].message
        reasoning, content = message.model_extra["reasoning"], message.content
        assert reasoning.isalpha() and content.isalpha() and message.model_extra["reasoning_content"] == reasoning
        streamed = {"reasoning": "", "reasoning_content": "", "content": ""}
        for chunk in client.chat.completions.create(**ask, stream=True):
            delta = chunk.choices[0].delta.model_dump(exclude_unset=True)
            assert not ("reasoning" in delta and "content" in delta and not delta["content"]), delta
            for key in streamed:
                streamed[key] += delta.get(key) or ""
        assert streamed == {"reasoning": reasoning, "reasoning_content": reasoning, "content": content}
        off = client.chat.completions.create(**{**ask, "extra_body": {**ask["extra_body"], "include_reasoning": False}})
        assert off.choices[0].message.content == content and "reasoning" not in off.choices[0].message.model_extra
        # a prefilled "<think>" left open: the reply starts in its reasoning (cut by max_tokens: all of it)
        opened = {"model": MODEL, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                  "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "<think>"}],
                  "continue_final_message": True, "add_generation_prompt": False}
        thought = httpx.post(srv.url + "/v1/chat/completions", json=opened, timeout=30).json()["choices"][0]
        held = httpx.post(srv.url + "/v1/chat/completions", timeout=30, json={
            **opened, "structured_outputs": {"choice": ["yes", "no"]}}).json()["choices"][0]
        assert held["message"] == thought["message"] and held["finish_reason"] == "length"     # free while it reasons
        body = {key: value for key, value in ask.items() if key != "extra_body"} | ask["extra_body"]
        as_responses(srv, body, reasoning, content)
        plain.wait_ready()
        r = httpx.post(plain.url + "/v1/chat/completions", json=body, timeout=30).json()
        assert r["choices"][0]["message"]["content"] == f"<think>{reasoning}</think>\n\n{content}"
        assert "reasoning" not in r["choices"][0]["message"], json.dumps(r)
        text = httpx.post(plain.url + "/v1/chat/completions", json=opened, timeout=30).json()["choices"][0]
        assert thought["message"]["reasoning"] == text["message"]["content"] and thought["message"]["content"] == ""
        assert thought["finish_reason"] == "length"
    finally:
        srv.kill()
        plain.kill()


def as_responses(srv, body: dict, reasoning: str, content: str) -> None:
    """The Responses API's shape (serve/responses.py) of the server's chat reply, whole and streamed: a reasoning
    item of reasoning_text, then the message, each valid as the openai SDK's types; and an earlier Response's
    reasoning item sent back as input is taken (and not shown to the model again)."""
    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter
    shape = ResponseShape(ResponsesRequest(model=MODEL, input="Hi"), MODEL)
    whole = Response.model_validate(shape.whole(httpx.post(srv.url + "/v1/chat/completions", json=body,
                                                           timeout=30).json()))
    assert [item.type for item in whole.output] == ["reasoning", "message"]
    assert whole.output[0].content[0].text == reasoning and whole.output_text == content
    with httpx.stream("POST", srv.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=30) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]

    async def replay():
        for chunk in chunks:
            yield chunk

    async def events():
        return [TypeAdapter(ResponseStreamEvent).validate_python(event) async for _, event in shape.events(replay())]
    streamed = asyncio.run(events())
    assert "".join(e.delta for e in streamed if e.type == "response.reasoning_text.delta") == reasoning
    assert "".join(e.delta for e in streamed if e.type == "response.output_text.delta") == content
    assert [(e.output_index, e.item.type) for e in streamed if e.type == "response.output_item.done"] == \
        [(0, "reasoning"), (1, "message")]
    assert streamed[-1].response.output_text == content
    again = httpx.post(srv.url + "/v1/responses", timeout=30, json={"model": MODEL, "max_output_tokens": 4, "input": [
        {"role": "user", "content": "Hi"}, *whole.model_dump(exclude_none=True)["output"],
        {"role": "user", "content": "And?"}]})
    assert again.status_code == 200, again.text
    without = httpx.post(srv.url + "/v1/responses", timeout=30, json={"model": MODEL, "max_output_tokens": 4, "input": [
        {"role": "user", "content": "Hi"}, *whole.model_dump(exclude_none=True)["output"][1:],
        {"role": "user", "content": "And?"}]})
    assert again.json()["usage"]["input_tokens"] == without.json()["usage"]["input_tokens"]     # not shown
