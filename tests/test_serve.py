"""distmk.serve for real: torchrun starts 2 CPU ranks (gloo), or one process serves alone, and the tests talk
HTTP to rank 0. (Fuzzing it: test_serve_fuzz.py.)"""
import asyncio
import concurrent.futures
import json
import os
import random
import re
import signal
import socket
import sys
import time

import httpx
import pytest

from conftest import (MODEL, PROMPT, SERVE_ON_CPU, Server, hf_generate, hf_greedy, hf_model, rank_pids,
                      serve_alone, torchrun)

ENGINE = ["--model", MODEL, *SERVE_ON_CPU]
MAX_SEQS, MAX_QUEUE = 8, 32                  # the main server: 8 running, 32 queued, then 429
CONTEXT = 1024                               # tiny-llama's


def serve_torchrun(tmp_path, name, *extra) -> Server:
    return Server(tmp_path, name, [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                   "--nproc-per-node=2", "-m", "distmk.serve", *ENGINE, "--port", "0", *extra])


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = serve_torchrun(tmp_path_factory.mktemp("serve"), "main", "--max-batch", "16",
                         "--max-seqs", str(MAX_SEQS), "--max-queue", str(MAX_QUEUE))
    try:
        yield srv.wait_ready()
    finally:
        srv.kill()


def post(server, path, body, **kw):
    return httpx.post(server.url + path, json=body, timeout=60, **kw)


def complete(server, prompt, max_tokens, stream=False, chat=False, **params):
    """(text, token ids, finish_reason) of one greedy request, streamed or not."""
    body = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True,
            "stream": stream, **params}
    body.update({"messages": prompt} if chat else {"prompt": prompt})
    path = "/v1/chat/completions" if chat else "/v1/completions"
    if not stream:
        r = post(server, path, body)
        assert r.status_code == 200, r.text
        out = r.json()
        choice = out["choices"][0]
        assert out["object"] == ("chat.completion" if chat else "text_completion")
        assert out["usage"]["completion_tokens"] == len(choice["token_ids"])
        return (choice["message"]["content"] if chat else choice["text"]), choice["token_ids"], choice["finish_reason"]
    chunks = sse_chunks(server, path, body)
    text = "".join(c["choices"][0]["delta"]["content"] if chat else c["choices"][0]["text"] for c in chunks)
    return text, [t for c in chunks for t in c["choices"][0]["token_ids"]], chunks[-1]["choices"][0]["finish_reason"]


def sse_chunks(server, path, body) -> list[dict]:
    with httpx.stream("POST", server.url + path, json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)
    return [json.loads(line[6:]) for line in lines[:-1]]


def metric(server, name: str, labels: str = "") -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    found = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def wait_for(condition, timeout=15.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_models_and_health(server):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    models = httpx.get(server.url + "/v1/models").json()
    assert models["data"][0]["id"] == MODEL and models["data"][0]["max_model_len"] == CONTEXT


def test_greedy_completion_equals_distmk_generate(server):
    ids = [1, 2, 3, 4, 5, 6, 7]
    proc = torchrun(2, "-m", "distmk.generate", "--model", MODEL, "--prompt-ids", ",".join(map(str, ids)),
                    "--max-new-tokens", "24", "--backend", "reference", "--device", "cpu", "--json")
    assert proc.returncode == 0, proc.stderr
    expected = json.loads(proc.stdout)
    for stream in (False, True):
        text, tokens, finish = complete(server, ids, 24, stream=stream)
        assert tokens == expected["tokens"] and text == expected["text"] and finish == "length"
    # a text prompt is its UTF-8 bytes for a preset, as distmk.generate --prompt encodes it
    assert complete(server, "Hello, wörld", 12) == complete(server, list("Hello, wörld".encode()), 12)


def test_long_prompt_prefilled_by_both_ranks_gives_transformers_tokens(server):
    """A prompt longer than a step's 16 rows is prefilled by matrix products on both ranks (the PREFILL message
    of serve/lockstep.py), then decoded: transformers' greedy tokens."""
    prompt = [(7 * i + 3) % 50 for i in range(40)]
    _, tokens, finish = complete(server, prompt, 16, ignore_eos=True)
    assert tokens == hf_greedy(MODEL, tuple(prompt), 16)[0] and finish == "length"


def test_chat_streamed_and_whole_agree(server):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    whole = complete(server, messages, 10, chat=True)
    chunks = sse_chunks(server, "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 10,
                                                         "temperature": 0, "stream": True, "return_token_ids": True,
                                                         "stream_options": {"include_usage": True}})
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[0]["object"] == "chat.completion.chunk" and len({c["id"] for c in chunks}) == 1
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 10
    text = "".join(c["choices"][0]["delta"]["content"] for c in chunks[:-1])
    assert (text, [t for c in chunks[:-1] for t in c["choices"][0]["token_ids"]]) == whole[:2]
    # the byte-level fallback renders ChatML: the same prompt as a completion gives the same reply
    chatml = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert complete(server, chatml, 10)[:2] == whole[:2]


def test_developer_role_and_names_in_chat(server):
    """OpenAI's developer role is the template's system role; a message's name is accepted (ChatML has no
    place for it)."""
    plain = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    named = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi", "name": "ada"}]
    assert complete(server, named, 8, chat=True) == complete(server, plain, 8, chat=True)


def test_logprobs_are_transformers_log_softmax(server):
    """Completions' logprobs (n alternatives, the chosen token among them) and chat's logprobs + top_logprobs:
    each token's log-probability and the most likely ones' are transformers' log-softmax of its logits (float32,
    the same weights), streamed and whole alike; top_logprobs needs logprobs, and at most 20 are listed."""
    import torch
    ids = [1, 2, 3, 4, 5, 6, 7]
    tokens, logits = hf_greedy(MODEL, tuple(ids), 6)
    want = torch.log_softmax(torch.as_tensor(logits).double(), dim=-1)
    top3 = want.topk(3, dim=-1).values.tolist()
    body = {"model": MODEL, "prompt": ids, "max_tokens": 6, "temperature": 0, "logprobs": 3, "ignore_eos": True,
            "return_token_ids": True}
    whole = post(server, "/v1/completions", body).json()["choices"][0]
    assert whole["token_ids"] == tokens
    lp = whole["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 6
    for i, token in enumerate(tokens):
        assert lp["token_logprobs"][i] == pytest.approx(want[i, token].item(), abs=1e-4)
        assert lp["token_logprobs"][i] == pytest.approx(top3[i][0], abs=1e-4)     # greedy: the most likely
        # keyed by text: the byte-level tokenizer's ids past 255 all read "" (one key), so values, not a count
        assert all(min(abs(v - t) for t in top3[i]) < 1e-4 for v in lp["top_logprobs"][i].values())
        assert lp["top_logprobs"][i][lp["tokens"][i]] == lp["token_logprobs"][i]       # the chosen one's own
        assert lp["text_offset"][i] == sum(map(len, lp["tokens"][:i]))
    chunks = sse_chunks(server, "/v1/completions", {**body, "stream": True})
    assert [c["choices"][0]["logprobs"]["token_logprobs"][0] for c in chunks] == lp["token_logprobs"]
    assert [c["choices"][0]["logprobs"]["text_offset"][0] for c in chunks] == lp["text_offset"]

    chatml = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    chat_tokens, chat_logits = hf_greedy(MODEL, tuple(chatml.encode()), 4)
    chat_want = torch.log_softmax(torch.as_tensor(chat_logits).double(), dim=-1)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0,
            "logprobs": True, "top_logprobs": 3, "ignore_eos": True, "return_token_ids": True}
    choice = post(server, "/v1/chat/completions", body).json()["choices"][0]
    assert choice["token_ids"] == chat_tokens
    content = choice["logprobs"]["content"]
    for i, (entry, token) in enumerate(zip(content, chat_tokens, strict=True)):
        assert entry["logprob"] == pytest.approx(chat_want[i, token].item(), abs=1e-4)
        assert entry["bytes"] == ([token] if token < 256 else [])          # the byte-level fallback's
        assert entry["token"] == bytes(entry["bytes"]).decode(errors="replace")
        assert [t["logprob"] for t in entry["top_logprobs"]] == pytest.approx(
            chat_want[i].topk(3).values.tolist(), abs=1e-4)
    streamed = sse_chunks(server, "/v1/chat/completions", {**body, "stream": True})
    streamed = [e for c in streamed for e in c["choices"][0]["logprobs"]["content"]]

    def flat(entries):
        """(tokens, values): the second request's prompt KV comes from the prefix cache, written by other step
        shapes, so its values agree to float32's rounding and its tokens exactly."""
        return ([(e["token"], e["bytes"], [t["token"] for t in e["top_logprobs"]]) for e in entries],
                [v for e in entries for v in (e["logprob"], *(t["logprob"] for t in e["top_logprobs"]))])
    assert flat(streamed)[0] == flat(content)[0] and flat(streamed)[1] == pytest.approx(flat(content)[1], abs=1e-5)
    plain = {k: v for k, v in body.items() if k != "top_logprobs"}
    assert post(server, "/v1/chat/completions", {**plain, "logprobs": False}).json()["choices"][0]["logprobs"] is None
    # logprobs alone: each token's own, no alternatives
    assert [e["top_logprobs"] for e in post(server, "/v1/chat/completions", plain).json()["choices"][0]["logprobs"]
            ["content"]] == [[]] * 4

    r = post(server, "/v1/chat/completions", {k: v for k, v in body.items() if k != "logprobs"})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "'top_logprobs': is only allowed when logprobs is true"
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "logprobs": 21})
    assert r.status_code == 400 and "'logprobs': Input should be less than or equal to 20" in r.text


def test_echo_logprobs_are_the_prompts_transformers_log_softmax(server):
    """Completions' echo with logprobs and max_tokens 0 or 1 (what lm-eval's loglikelihood and multiple-choice
    tasks send, batched as lists of token ids): the prompt's tokens with their log-probabilities, the first's
    null, each transformers' float32 log-softmax, through both ranks of the server; a 30-token prompt, most of it
    read by a prefill chunk that computes its positions' logits (every rank's vocabulary slice, gathered). With max_tokens 0 nothing else is shown; after it, the generated tokens as
    without echo. vLLM's prompt_logprobs give the same values; streamed, the prompt comes first."""
    import torch
    from conftest import hf_model
    from openai import OpenAI
    prompts = [[(7 * i + 3) % 50 for i in range(30)], [5, 9, 11, 2]]
    with torch.no_grad():
        want = [torch.log_softmax(hf_model(MODEL)(torch.tensor([p])).logits[0].double(), dim=-1) for p in prompts]
    client = OpenAI(base_url=server.url + "/v1", api_key="none")
    scored = client.completions.create(model=MODEL, prompt=prompts, max_tokens=0, echo=True, logprobs=2,
                                       temperature=0)
    assert scored.usage.completion_tokens == 0 and scored.usage.prompt_tokens == 34
    for prompt, ref, choice in zip(prompts, want, scored.choices, strict=True):
        lp = choice.logprobs
        assert choice.finish_reason == "length" and choice.text == bytes(prompt).decode()
        assert len(lp.tokens) == len(prompt) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        for j in range(1, len(prompt)):
            assert lp.token_logprobs[j] == pytest.approx(ref[j - 1, prompt[j]].item(), abs=1e-4)
            # keyed by text (the byte-level tokenizer's ids past 255 all read ""): the values are the top two's
            # or the chosen token's
            listed = [*ref[j - 1].topk(2).values.tolist(), ref[j - 1, prompt[j]].item()]
            assert all(min(abs(v - t) for t in listed) < 1e-4 for v in lp.top_logprobs[j].values())
    # lm-eval's own request: one token after the prompt, whose logprobs and text follow the prompt's
    after = client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=3, echo=True, logprobs=1,
                                      temperature=0, extra_body={"ignore_eos": True})
    alone = client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=3, logprobs=1, temperature=0,
                                      extra_body={"ignore_eos": True}).choices[0]
    choice = after.choices[0]
    assert choice.text == bytes(prompts[0]).decode() + alone.text
    assert choice.logprobs.token_logprobs[:30] == scored.choices[0].logprobs.token_logprobs
    assert choice.logprobs.token_logprobs[30:] == pytest.approx(alone.logprobs.token_logprobs, abs=1e-4)
    assert choice.logprobs.text_offset == [sum(map(len, choice.logprobs.tokens[:i])) for i in range(33)]
    chunks = sse_chunks(server, "/v1/completions", {"model": MODEL, "prompt": prompts[1], "max_tokens": 2,
                                                    "echo": True, "temperature": 0, "stream": True})
    assert chunks[0]["choices"][0]["text"] == bytes(prompts[1]).decode()
    whole = post(server, "/v1/completions", {"model": MODEL, "prompt": prompts[1], "max_tokens": 2, "echo": True,
                                             "temperature": 0}).json()["choices"][0]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["text"]
    vllm = post(server, "/v1/completions", {"model": MODEL, "prompt": prompts[1], "max_tokens": 1,
                                            "prompt_logprobs": 1}).json()["choices"][0]["prompt_logprobs"]
    assert vllm[0] is None and len(vllm) == 4
    for j in range(1, 4):
        entry = vllm[j][str(prompts[1][j])]
        assert entry["logprob"] == pytest.approx(want[1][j - 1, prompts[1][j]].item(), abs=1e-4)
        assert entry["rank"] == 1 + int((want[1][j - 1] > want[1][j - 1, prompts[1][j]] + 1e-6).sum())
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_n_choices_are_the_requests_of_seeds_one_apart(server):
    """n choices of a seeded request: choice i is what the request alone gets with seed + i (choice 0 the same
    request's with n = 1), streamed (chunks of the choices interleaved, each its own index) and whole alike, chat
    too, and the usage counts every choice's tokens once beside the prompt's."""
    body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 5, "temperature": 1.0, "seed": 11, "n": 3,
            "return_token_ids": True, "ignore_eos": True}
    out = post(server, "/v1/completions", body).json()
    alone = [post(server, "/v1/completions", {**body, "n": 1, "seed": 11 + i}).json()["choices"][0]
             for i in range(3)]
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert [(c["text"], c["token_ids"]) for c in out["choices"]] == [(c["text"], c["token_ids"]) for c in alone]
    assert len({tuple(c["token_ids"]) for c in alone}) == 3
    assert out["usage"] == {"prompt_tokens": 3, "completion_tokens": 15, "total_tokens": 18,
                            "prompt_tokens_details": {"cached_tokens": 0}}        # a prompt shorter than a block
    chunks = sse_chunks(server, "/v1/completions", {**body, "stream": True, "stream_options": {"include_usage": True}})
    streamed = {i: [t for c in chunks[:-1] if c["choices"][0]["index"] == i for t in c["choices"][0]["token_ids"]]
                for i in range(3)}
    assert streamed == {i: c["token_ids"] for i, c in enumerate(alone)} and chunks[-1]["usage"] == out["usage"]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "n": 2, "seed": 5,
            "return_token_ids": True, "ignore_eos": True}
    both = post(server, "/v1/chat/completions", chat).json()["choices"]
    second = post(server, "/v1/chat/completions", {**chat, "n": 1, "seed": 6}).json()["choices"][0]
    assert both[1]["token_ids"] == second["token_ids"] and both[1]["message"] == second["message"]
    unseeded = post(server, "/v1/completions", {k: v for k, v in body.items() if k != "seed"}).json()["choices"]
    assert len({tuple(c["token_ids"]) for c in unseeded}) == 3
    greedy = post(server, "/v1/completions", {**body, "temperature": 0, "n": 2}).json()["choices"]
    assert greedy[0]["token_ids"] == greedy[1]["token_ids"]


def test_penalties(server):
    """Greedy with vLLM's repetition_penalty: transformers' generate(repetition_penalty=...) tokens; OpenAI's
    presence and frequency penalties change what greedy decoding picks (and are refused out of [-2, 2])."""
    prompt = [1, 2, 3, 4, 5, 6, 7]
    want = hf_generate(hf_model(MODEL), prompt, 16, repetition_penalty=1.5)[0, len(prompt):].tolist()
    assert complete(server, prompt, 16, ignore_eos=True, repetition_penalty=1.5)[1] == want
    plain = complete(server, prompt, 16, ignore_eos=True)[1]
    assert complete(server, prompt, 16, ignore_eos=True, presence_penalty=2.0)[1] != plain
    assert complete(server, prompt, 16, ignore_eos=True, frequency_penalty=0.0, presence_penalty=0)[1] == plain
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "frequency_penalty": 2.5})
    assert r.status_code == 400 and "'frequency_penalty': Input should be less than or equal to 2" in r.text


def test_stop_token_ids_end_a_reply(server):
    """vLLM's stop_token_ids: the first of them to be generated ends the reply (it is the last token, finish_reason
    "stop"), ignore_eos or not; ids outside the vocabulary are refused."""
    prompt = [1, 2, 3, 4, 5, 6, 7]
    _, tokens, _ = complete(server, prompt, 16, ignore_eos=True)
    stop = next(t for i, t in enumerate(tokens) if i >= 3 and t not in tokens[:i])
    never = min(set(range(256)) - set(tokens))
    for stream in (False, True):
        _, got, finish = complete(server, prompt, 16, stream=stream, ignore_eos=True, stop_token_ids=[never, stop])
        assert got == tokens[:tokens.index(stop) + 1] and finish == "stop"
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "stop_token_ids": [5, 9999]})
    assert r.status_code == 400 and "stop token ids [9999] are outside the vocabulary" in r.text


def test_min_tokens_hold_back_stop_tokens_and_stop_strings(server):
    """vLLM's min_tokens: no end of sequence or stop token is chosen, and no stop string ends the reply, before the
    output holds that many tokens; until the first token that would have ended it the reply is the same."""
    prompt = [1, 2, 3, 4, 5, 6, 7]
    _, tokens, _ = complete(server, prompt, 16, ignore_eos=True)
    stop = next(t for i, t in enumerate(tokens) if i >= 3 and t not in tokens[:i])
    at = tokens.index(stop)
    words, word_tokens, _ = complete(server, "The quick brown fox", 40, ignore_eos=True)
    early = next(c for c in words if c.isprintable() and c != "\ufffd" and c not in words[-2:])
    assert complete(server, "The quick brown fox", 40, ignore_eos=True, stop=[early])[0] == words[:words.index(early)]
    for stream in (False, True):
        _, got, finish = complete(server, prompt, 16, stream=stream, stop_token_ids=[stop], min_tokens=at + 3)
        assert got[:at] == tokens[:at] and stop not in got[:at + 3] and len(got) >= at + 3, (got, tokens)
        assert finish == "stop" if got[-1] == stop else finish == "length"
        # a stop string in the text before the min_tokens-th token (a character the last token's, a byte of a
        # preset's, cannot hold) does not cut it
        assert complete(server, "The quick brown fox", 40, stream=stream, ignore_eos=True, min_tokens=40,
                        stop=[early])[:2] == (words, word_tokens)
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 4, "min_tokens": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens", r.text


def test_json_bodies_need_a_json_content_type(server):
    body = json.dumps({"model": MODEL, "prompt": [1, 2], "max_tokens": 2}).encode()
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        r = httpx.post(server.url + "/v1/completions", content=body, headers={"content-type": content_type})
        assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type", r.text
        assert content_type in r.json()["error"]["message"]
    for content_type in ("application/json; charset=utf-8", "Application/JSON", "application/vnd.api+json", None):
        headers = {"content-type": content_type} if content_type else {}
        r = httpx.post(server.url + "/v1/completions", content=body, headers=headers, timeout=30)
        assert r.status_code == 200, (content_type, r.text)


def test_stop_string_cuts_the_text(server):
    """The text ends before the first stop string (after it with include_stop_str_in_output), among as many as
    lm-eval sends."""
    prompt = "The quick brown fox"
    text, tokens, _ = complete(server, prompt, 40, ignore_eos=True)
    visible = [c for c in dict.fromkeys(text) if c.isprintable() and c != "\ufffd"]
    assert visible, f"no printable character to stop at in {text!r}"
    stop = visible[len(visible) // 2]
    # lm-eval's local-completions sends a task's stop strings and the end-of-sequence text: nine for HumanEval
    humaneval = ["\nclass", "\n#", "\nif", "\nprint", "\n```", "\n```\n\n", "<|eot_id|>", "</s>", "<|endoftext|>"]
    for stream in (False, True):
        cut, cut_tokens, finish = complete(server, prompt, 40, stream=stream, stop=[*humaneval, stop, "never-there"])
        assert finish == "stop" and cut == text[:text.index(stop)] and cut_tokens == tokens[:len(cut_tokens)]
        kept = complete(server, prompt, 40, stream=stream, stop=[stop], include_stop_str_in_output=True)
        assert kept == (text[:text.index(stop) + 1], cut_tokens, "stop")      # vLLM's include_stop_str_in_output


def test_seeded_sampling_is_reproducible(server):
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 12, "temperature": 1.0, "top_p": 0.9,
            "top_k": 50, "return_token_ids": True}
    runs = [post(server, "/v1/completions", {**body, "seed": s}).json()["choices"][0]["token_ids"]
            for s in (1, 1, 2)]
    assert runs[0] == runs[1] != runs[2]


@pytest.mark.parametrize("chat", [False, True])
def test_tiny_temperature_and_top_p_act_as_greedy(server, chat):
    """Temperatures and top_p down to the smallest double (which overflowed float32 and killed the engine), and
    min_p 1, which keeps the most likely token alone."""
    prompt = [{"role": "user", "content": "Hi"}] if chat else [1, 2, 3]
    greedy = complete(server, prompt, 6, chat=chat)
    for params in ({"temperature": 1e-50}, {"temperature": 1.0, "top_p": 1e-50},
                   {"temperature": 5e-324, "top_p": 5e-324}, {"temperature": 1.0, "min_p": 1.0}):
        for stream in (False, True):
            assert complete(server, prompt, 6, stream=stream, chat=chat, **params) == greedy, params
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_32_concurrent_clients_get_what_they_would_get_alone(server):
    rng = random.Random(3)
    jobs = [([rng.randrange(1, 500) for _ in range(rng.randrange(1, 20))], rng.randrange(2, 10)) for _ in range(8)]
    alone = [complete(server, prompt, n)[:2] for prompt, n in jobs]

    async def client(http, c):
        results = []
        for r in range(3):
            j = (c + r) % len(jobs)
            body = {"model": MODEL, "prompt": jobs[j][0], "max_tokens": jobs[j][1], "temperature": 0,
                    "return_token_ids": True, "stream": (c + r) % 2 == 1}
            if body["stream"]:
                text, tokens = "", []
                async with http.stream("POST", "/v1/completions", json=body) as resp:
                    assert resp.status_code == 200
                    async for line in resp.aiter_lines():
                        if line.startswith("data: {"):
                            choice = json.loads(line[6:])["choices"][0]
                            text, tokens = text + choice["text"], tokens + choice["token_ids"]
            else:
                resp = await http.post("/v1/completions", json=body)
                assert resp.status_code == 200, resp.text
                choice = resp.json()["choices"][0]
                text, tokens = choice["text"], choice["token_ids"]
            results.append((j, (text, tokens)))
        return results

    async def run_all():
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as http:
            return await asyncio.gather(*(client(http, c) for c in range(32)))

    results = [r for per_client in asyncio.run(run_all()) for r in per_client]
    assert len(results) == 96
    for j, got in results:
        assert got == alone[j]
    assert metric(server, "distmk_kv_cache_used_blocks") == 0


def test_chat_template_kwargs_are_taken_and_the_templates_own_parameters_refused(server):
    """vLLM's chat_template_kwargs on chat and /tokenize (a preset's ChatML reads none: the same prompt); those that
    would set what apply_chat_template sets itself are refused by name."""
    messages = [{"role": "user", "content": "Hi"}]
    plain = post(server, "/tokenize", {"messages": messages}).json()["tokens"]
    r = post(server, "/tokenize", {"messages": messages, "chat_template_kwargs": {"enable_thinking": False}})
    assert r.status_code == 200 and r.json()["tokens"] == plain
    body = {"model": MODEL, "messages": messages, "max_tokens": 2, "chat_template_kwargs": {"enable_thinking": False}}
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(plain), r.text
    r = post(server, "/v1/chat/completions", {**body, "reasoning_effort": "high"})    # a template variable too
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(plain), r.text
    for path, sent in (("/v1/chat/completions", body), ("/tokenize", {"messages": messages})):
        r = post(server, path, {**sent, "chat_template_kwargs": {"tokenize": True, "messages": []}})
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == "chat_template_kwargs", r.text
        assert "cannot set messages, tokenize" in error["message"]


def test_a_prefilled_reply_goes_on_from_the_last_message(server):
    """vLLM's continue_final_message with add_generation_prompt false: the prompt ends inside the assistant's message
    (a preset's ChatML, its bytes), chat and /tokenize alike; both true is refused."""
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Well,"}]
    open_ended = {"add_generation_prompt": False, "continue_final_message": True}
    tokens = post(server, "/tokenize", {"messages": messages, **open_ended}).json()["tokens"]
    assert bytes(tokens).decode().endswith("<|im_start|>assistant\nWell,")
    r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 2, **open_ended})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(tokens), r.text
    r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": messages, "continue_final_message": True})
    assert r.status_code == 400 and "cannot both be true" in r.json()["error"]["message"], r.text
    # chat_template_kwargs may set them too, as vLLM merges them
    assert post(server, "/tokenize", {"messages": messages, "chat_template_kwargs": open_ended}).json()["tokens"] \
        == tokens
    r = post(server, "/tokenize", {"messages": messages, "chat_template_kwargs": {"continue_final_message": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs", r.text


def test_openapi_models_tokenize_and_detokenize(server):
    """FastAPI's /openapi.json (with the request bodies) and /docs; a model by id, as the openai SDK's
    models.retrieve asks for it; vLLM's /tokenize and /detokenize; a 405 says which methods are allowed."""
    from openai import NotFoundError, OpenAI
    schema = httpx.get(server.url + "/openapi.json").json()
    body = schema["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/CompletionRequest"}
    assert {"prompt", "max_tokens", "stream_options"} <= set(schema["components"]["schemas"]["CompletionRequest"]
                                                             ["properties"])
    assert "/tokenize" in schema["paths"] and httpx.get(server.url + "/docs").status_code == 200
    client = OpenAI(base_url=server.url + "/v1", api_key="none")
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(NotFoundError):
        client.models.retrieve("gpt-4")
    tokens = httpx.post(server.url + "/tokenize", json={"model": MODEL, "prompt": "Hello",
                                                         "add_special_tokens": False}).json()
    assert tokens == {"count": 5, "max_model_len": CONTEXT, "tokens": list(b"Hello")}
    info = httpx.get(server.url + "/tokenizer_info").json()        # what lm-eval's remote tokenizer reads
    assert info["model_max_length"] == CONTEXT and info["eos_token"] is None
    chat = httpx.post(server.url + "/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert bytes(chat["tokens"]).decode().startswith("<|im_start|>user\nHi")
    assert httpx.post(server.url + "/detokenize", json={"tokens": list(b"Hello")}).json() == {"prompt": "Hello"}
    r = httpx.post(server.url + "/detokenize", json={"tokens": [1, 9999]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    r = httpx.post(server.url + "/tokenize", json={})
    assert r.status_code == 400 and "either prompt or messages" in r.json()["error"]["message"]
    r = httpx.get(server.url + "/v1/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST"


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(server):
    """vLLM's stream_options.continuous_usage_stats (guidellm sends it with every request): each chunk carries the
    usage so far, and include_usage still ends the stream with the whole."""
    from openai import OpenAI
    client = OpenAI(base_url=server.url + "/v1", api_key="none")
    chunks = list(client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=6, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"stream_options": {"include_usage": True,
                                                                           "continuous_usage_stats": True}}))
    assert [c.usage.completion_tokens for c in chunks] == [1, 2, 3, 4, 5, 6, 6]
    assert all(c.usage.prompt_tokens == 3 for c in chunks) and chunks[-1].choices == []


def test_streamed_text_with_unicode_line_separators_reads_line_by_line(server):
    """A token's text may hold U+0085, U+2028 or U+2029, which SSE does not break lines at but str.splitlines (and
    httpx's aiter_lines, with it) does: every event still reads as one line of JSON."""
    prompt = "one\u2028two\x85three\u2029four"
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": prompt, "echo": True, "max_tokens": 2, "temperature": 0, "stream": True}) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: {") for line in lines[:-1]), lines
    text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in lines[:-1])
    assert text.startswith(prompt)


def test_batched_prompts_give_each_prompts_own_choices(server):
    """A list of prompts in one completions request (OpenAI's, what lm-eval sends with batch_size > 1): each a
    sequence with n choices of its own, indexed prompt-major, equal to the prompt sent alone; usage over all of
    them; streamed and whole."""
    from openai import OpenAI
    client = OpenAI(base_url=server.url + "/v1", api_key="none")
    prompts = ["Hello", [1, 2, 3, 4], "World!"]
    alone = [client.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0).choices[0].text
             for p in prompts]
    whole = client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0, n=2)
    assert [c.index for c in whole.choices] == list(range(6))
    assert [c.text for c in whole.choices] == [text for text in alone for _ in range(2)]
    assert whole.usage.prompt_tokens == 5 + 4 + 6 and whole.usage.completion_tokens == 36
    streamed = [""] * 3
    for chunk in client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == alone
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": ["hi", [1, 9999]]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt[1]"


def test_a_prompt_whose_prefix_is_cached_starts_after_it_and_gets_transformers_tokens(server):
    """Automatic prefix caching through both ranks: a second prompt that shares a 100-token prefix with the first
    reads only what follows its 6 cached blocks of 16 (usage's prompt_tokens_details.cached_tokens, as OpenAI's,
    and /metrics' prefix-cache counters say so); both get transformers' greedy tokens. A request's n choices read
    their prompt once."""
    from openai import OpenAI
    client = OpenAI(base_url=server.url + "/v1", api_key="none")
    shared = [(13 * i + 5) % 200 + 20 for i in range(100)]
    hits, queries = metric(server, "distmk_prefix_cache_hits_total"), metric(server, "distmk_prefix_cache_queries_total")
    cached = []
    for suffix in ([1, 2, 3], [4, 5, 6, 7]):
        out = client.completions.create(model=MODEL, prompt=shared + suffix, max_tokens=8, temperature=0,
                                        extra_body={"ignore_eos": True, "return_token_ids": True})
        assert out.choices[0].token_ids == hf_greedy(MODEL, tuple(shared + suffix), 8)[0]
        cached.append(out.usage.prompt_tokens_details.cached_tokens)
    assert cached == [0, 96]
    assert metric(server, "distmk_prefix_cache_hits_total") - hits == 96
    assert metric(server, "distmk_prefix_cache_queries_total") - queries == 103 + 104
    # three choices of a new prompt: the first reads it, the other two start after its 6 blocks
    hits = metric(server, "distmk_prefix_cache_hits_total")
    prompt = [t + 1 for t in shared] + [9]
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, n=3,
                                    extra_body={"ignore_eos": True, "return_token_ids": True})
    assert [c.token_ids for c in out.choices] == [hf_greedy(MODEL, tuple(prompt), 4)[0]] * 3
    assert out.usage.prompt_tokens_details.cached_tokens == 0 and out.usage.prompt_tokens == 101
    assert metric(server, "distmk_prefix_cache_hits_total") - hits == 2 * 96


def test_vllm_prompt_truncation_allowed_tokens_and_token_ids_for_logprobs(server):
    """vLLM's truncate_prompt_tokens keeps a prompt's last N tokens (the reply and usage are those of the shorter
    prompt; -1: as many as leave room for max_tokens, so a prompt longer than the context still runs);
    allowed_token_ids are the only tokens drawn, greedy or sampled; return_tokens_as_token_ids names the
    log-probabilities' tokens by id."""
    prompt = [(7 * i) % 250 + 1 for i in range(40)]
    ask = {"model": MODEL, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    short = post(server, "/v1/completions", {**ask, "prompt": prompt[-6:]}).json()
    cut = post(server, "/v1/completions", {**ask, "prompt": prompt, "truncate_prompt_tokens": 6, "echo": True}).json()
    assert cut["choices"][0]["prompt_token_ids"] == prompt[-6:] and cut["usage"] == short["usage"]
    assert cut["choices"][0]["token_ids"] == short["choices"][0]["token_ids"]
    assert cut["choices"][0]["text"] == bytes(prompt[-6:]).decode(errors="replace") + short["choices"][0]["text"]
    long = post(server, "/v1/completions", {**ask, "prompt": prompt * 30, "truncate_prompt_tokens": -1})
    assert long.status_code == 200 and long.json()["usage"]["prompt_tokens"] == CONTEXT - 4, long.text
    for keep, max_tokens in ((CONTEXT, 4), (0, 4), (-1, CONTEXT)):
        refused = post(server, "/v1/completions", {**ask, "prompt": prompt, "truncate_prompt_tokens": keep,
                                                   "max_tokens": max_tokens})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "truncate_prompt_tokens"
    allowed = [5, 9, 77]
    for temperature in (0, 1):
        out = post(server, "/v1/chat/completions", {**ask, "max_tokens": 12, "temperature": temperature, "seed": 1,
                                                    "messages": [{"role": "user", "content": "Hi"}],
                                                    "allowed_token_ids": allowed}).json()
        assert set(out["choices"][0]["token_ids"]) <= set(allowed), out
    for extra in ({"allowed_token_ids": [10 ** 6]},                     # outside the vocabulary
                  {"allowed_token_ids": [5], "structured_outputs": {"choice": ["a"]}},     # the grammar chooses
                  {"allowed_token_ids": [5], "stop_token_ids": [5], "min_tokens": 2}):     # held back: none left
        refused = post(server, "/v1/completions", {**ask, "prompt": prompt, **extra})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "allowed_token_ids", extra
    out = post(server, "/v1/completions", {**ask, "prompt": prompt, "logprobs": 2,
                                           "return_tokens_as_token_ids": True}).json()["choices"][0]
    assert out["logprobs"]["tokens"] == [f"token_id:{t}" for t in out["token_ids"]]
    assert all(all(key.startswith("token_id:") for key in top) for top in out["logprobs"]["top_logprobs"])


def test_response_format_holds_the_reply_to_json_and_its_schema(server):
    """OpenAI's response_format through both ranks, with the openai SDK: json_schema on chat (greedy and sampled)
    gives JSON valid against the schema, json_object on completions an object, whatever the random-weight model's
    logits prefer; a schema that cannot compile is a 400 naming it."""
    import jsonschema
    from openai import BadRequestError, OpenAI
    from test_structured_output import PERSON
    client = OpenAI(base_url=server.url + "/v1", api_key="none")
    schema_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for temperature in (0, 1):
        out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Who?"}], seed=3,
                                             max_tokens=300, temperature=temperature, response_format=schema_format)
        assert out.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.choices[0].message.content), PERSON)
    out = client.completions.create(model=MODEL, prompt="JSON: ", max_tokens=300, temperature=0,
                                    extra_body={"response_format": {"type": "json_object"}})
    assert out.choices[0].finish_reason == "stop" and isinstance(json.loads(out.choices[0].text), dict)
    with pytest.raises(BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], response_format={
            "type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "nonsense"}}})
    assert refused.value.body["param"] == "response_format.json_schema.schema"


def test_structured_outputs_hold_the_reply_as_vllm_has_them(server):
    """vLLM's structured_outputs through both ranks, with the openai SDK's extra_body: a choice on chat, a regular
    expression on completions streamed, a grammar, a JSON schema given as its text (disable_any_whitespace: no
    spaces beyond the separators'), and its options beside a response_format; refused by name: two constraints, a
    constraint beside a response_format, a regular expression that cannot compile, a text format beside tools chosen
    "auto", and vLLM's guided_* parameters of before."""
    import jsonschema
    from openai import BadRequestError, OpenAI
    from test_structured_output import TEXT_FORMATS
    client = OpenAI(base_url=server.url + "/v1", api_key="none")
    chat = dict(model=MODEL, messages=[{"role": "user", "content": "Sentiment?"}], max_tokens=40, temperature=0)
    for kind, spec, holds in TEXT_FORMATS[:3]:
        out = client.chat.completions.create(**chat, extra_body={"structured_outputs": {kind: spec}}).choices[0]
        assert out.finish_reason == "stop" and holds(out.message.content), out.message.content
    kind, spec, holds = TEXT_FORMATS[0]
    chunks = client.completions.create(model=MODEL, prompt="Code: ", max_tokens=40, temperature=1, seed=5, stream=True,
                                       extra_body={"structured_outputs": {"regex": spec}})
    assert holds("".join(c.choices[0].text for c in chunks))
    flags = {"type": "object", "required": ["ok", "tag"], "properties": {"ok": {"type": "boolean"},
                                                                      "tag": {"enum": ["x", "y"]}}}
    out = client.chat.completions.create(**chat, extra_body={"structured_outputs": {
        "json": json.dumps(flags), "disable_any_whitespace": True}}).choices[0].message.content
    jsonschema.validate(json.loads(out), flags)
    assert json.dumps(json.loads(out)) == out          # json.dumps's separators, ", " and ": ", and no other space
    out = client.chat.completions.create(**{**chat, "max_tokens": 300}, response_format={"type": "json_object"},
                                         extra_body={"structured_outputs": {"disable_any_whitespace": True}})
    out = out.choices[0].message.content
    assert isinstance(json.loads(out), dict) and json.dumps(json.loads(out)) == out
    from test_tools import TOOLS
    for extra, param, message in [
            ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "regex and choice"),
            ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, None,
             "response_format and structured_outputs.regex both"),
            ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs.regex", "The parenthesis is not closed"),
            ({"structured_outputs": {"choice": ["a"]}, "tools": TOOLS}, "structured_outputs.choice", "tool_choice"),
            ({"guided_choice": ["a"]}, "guided_choice", "structured_outputs.choice")]:
        with pytest.raises(BadRequestError) as refused:
            client.chat.completions.create(**chat, extra_body=extra)
        assert refused.value.body["param"] == param and message in refused.value.body["message"]


def test_tools_required_and_named_are_calls_that_validate_streamed_and_whole(server):
    """Chat tools through both ranks with the openai SDK: tool_choice "required" and a named function give
    tool_calls (finish_reason "tool_calls") whose arguments validate against the function's parameters, whatever
    the random-weight model prefers, whole and streamed; the calls and their results go back into the history;
    "auto" answers with text where the model writes no call; a forced choice beside a response_format is the call
    (the format holds text, and a call has none)."""
    import jsonschema
    from openai import OpenAI
    from test_tools import TOOLS
    client = OpenAI(base_url=server.url + "/v1", api_key="none")
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    ask = dict(model=MODEL, messages=messages, tools=TOOLS, max_tokens=150, temperature=0)    # 850 prompt tokens
    parameters = {t["function"]["name"]: t["function"].get("parameters", {"type": "object"}) for t in TOOLS}
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        out = client.chat.completions.create(**ask, tool_choice=choice).choices[0]
        assert out.finish_reason == "tool_calls" and out.message.content is None and out.message.tool_calls
        for call in out.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), parameters[call.function.name])
        if isinstance(choice, dict):
            assert [c.function.name for c in out.message.tool_calls] == ["get_weather"]
        streamed = {}
        for chunk in client.chat.completions.create(**ask, tool_choice=choice, stream=True):
            delta = chunk.choices[0].delta
            for call in delta.tool_calls or ():
                streamed[call.index] = (call.function.name, call.function.arguments)
            assert not delta.content
        assert streamed == {i: (c.function.name, c.function.arguments) for i, c in enumerate(out.message.tool_calls)}
    history = messages + [out.message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": out.message.tool_calls[0].id, "content": "18 C"}]
    answer = client.chat.completions.create(model=MODEL, messages=history, max_tokens=8, temperature=0)
    assert answer.choices[0].finish_reason == "length"                # a byte tokenizer's prompt: no room for tools
    auto = client.chat.completions.create(**{**ask, "max_tokens": 8}).choices[0]
    assert auto.message.tool_calls is None and auto.finish_reason == "length" and auto.message.content
    both = client.chat.completions.create(**ask, tool_choice=choice, response_format={"type": "json_object"})
    assert both.choices[0].message.tool_calls[0].function.name == "get_weather"


def test_responses_api_answers_as_chat_does_whole_and_streamed(server):
    """OpenAI's Responses API through both ranks, with the openai SDK (what the OpenAI Agents SDK calls): a greedy
    reply is the chat completion's of the same conversation (instructions as its system message), its usage too;
    streamed, the events' deltas join to it and end with the same Response; include asks for the output's
    log-probabilities, the chat reply's."""
    from openai import OpenAI
    client = OpenAI(base_url=server.url + "/v1", api_key="none")
    ask = dict(model=MODEL, instructions="Be brief.", input=[{"role": "user", "content": "Hi"}], max_output_tokens=12,
               temperature=0)
    chat = client.chat.completions.create(model=MODEL, max_tokens=12, temperature=0, logprobs=True, top_logprobs=2,
                                          messages=[{"role": "system", "content": "Be brief."},
                                                    {"role": "user", "content": "Hi"}])
    whole = client.responses.create(**ask, include=["message.output_text.logprobs"], top_logprobs=2)
    status = "incomplete" if chat.choices[0].finish_reason == "length" else "completed"
    assert whole.object == "response" and whole.status == status and whole.store is False
    assert whole.output_text == chat.choices[0].message.content and [item.type for item in whole.output] == ["message"]
    assert whole.usage.input_tokens == chat.usage.prompt_tokens and whole.usage.output_tokens == 12
    def entries(logprobs):
        """(tokens, values) of log-probability entries."""
        tokens = [(lp.token, lp.bytes, [(t.token, t.bytes) for t in lp.top_logprobs]) for lp in logprobs]
        return tokens, [v for lp in logprobs for v in (lp.logprob, *(t.logprob for t in lp.top_logprobs))]
    (tokens, values), (chat_tokens, chat_values) = map(entries, (whole.output[0].content[0].logprobs,
                                                                 chat.choices[0].logprobs.content))
    # the second request reads the first one's cached prefix: the values to float32's error
    assert tokens == chat_tokens and values == pytest.approx(chat_values, abs=1e-5)
    if status == "incomplete":
        assert whole.incomplete_details.reason == "max_output_tokens"
    events = list(client.responses.create(**ask, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"] and kinds[-1] == f"response.{status}"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    final = events[-1].response
    assert final.output_text == whole.output_text and final.usage.output_tokens == 12
    assert final.model_dump(exclude={"id", "created_at", "output", "usage"}) == \
        whole.model_dump(exclude={"id", "created_at", "output", "usage"})
    # the SDK builds its objects without validating them: validated here, whole and every event, with what clients
    # send for "off" (the Agents SDK's tools: [] beside a run-wide tool_choice, reasoning's null effort, ...)
    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter
    off = {**ask, "tools": [], "tool_choice": "auto", "reasoning": {"effort": None}, "text": {"verbosity": "medium"},
           "prompt_cache_retention": "in_memory", "include": []}
    Response.model_validate(post(server, "/v1/responses", off).json())
    # what Codex-like clients send to a reasoning model: its effort (the chat template's), encrypted reasoning
    effort = Response.model_validate(post(server, "/v1/responses", {
        **off, "reasoning": {"effort": "low", "summary": "auto"}, "include": ["reasoning.encrypted_content"]}).json())
    assert effort.reasoning.effort == "low" and effort.output_text == whole.output_text
    with httpx.stream("POST", server.url + "/v1/responses", json={
            **off, "stream": True, "stream_options": {"include_obfuscation": True}}, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line]
    assert [line.partition(": ")[0] for line in lines] == ["event", "data"] * (len(lines) // 2)
    for name, data in zip(lines[::2], lines[1::2]):
        event = TypeAdapter(ResponseStreamEvent).validate_json(data[6:])
        assert event.type == name[7:]
    r = post(server, "/v1/responses", {**ask, "max_output_tokens": CONTEXT})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_output_tokens"


def test_responses_api_calls_functions_and_reads_their_outputs(server):
    """Function tools on the Responses API: tool_choice "required" gives function_call items whose arguments
    validate against the function's parameters, whole and streamed (the arguments' events hold them); the calls and
    their outputs go back as input items, as the Agents SDK sends them; text.format holds the text to a schema;
    what distmk does not do is refused by name."""
    import jsonschema
    from openai import BadRequestError, OpenAI
    from test_structured_output import PERSON
    from test_tools import TOOLS
    client = OpenAI(base_url=server.url + "/v1", api_key="none")
    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    parameters = {t["name"]: t["parameters"] for t in tools}
    ask = dict(model=MODEL, input="Weather in Paris?", tools=tools, tool_choice="required", max_output_tokens=150,
               temperature=0)
    out = client.responses.create(**ask)
    assert out.status == "completed" and out.output and {item.type for item in out.output} == {"function_call"}
    for call in out.output:
        jsonschema.validate(json.loads(call.arguments), parameters[call.name])
    events = list(client.responses.create(**ask, stream=True))
    streamed = [e.item for e in events if e.type == "response.output_item.done"]
    assert [(c.name, c.arguments) for c in streamed] == [(c.name, c.arguments) for c in out.output]
    assert [e.arguments for e in events if e.type == "response.function_call_arguments.done"] == \
        [c.arguments for c in out.output]
    named = client.responses.create(**{**ask, "tool_choice": {"type": "function", "name": "get_weather"}})
    assert [c.name for c in named.output] == ["get_weather"]
    history = [{"role": "user", "content": "Weather in Paris?"}, *[c.model_dump(exclude_none=True) for c in out.output],
               *[{"type": "function_call_output", "call_id": c.call_id, "output": "18 C"} for c in out.output]]
    answer = client.responses.create(model=MODEL, input=history, max_output_tokens=6, temperature=0)
    assert answer.status == "incomplete" and answer.output[0].type == "message"
    person_format = {"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}}
    person = client.responses.create(model=MODEL, input="Who?", max_output_tokens=300, temperature=0,
                                     text=person_format)
    assert person.status == "completed"
    jsonschema.validate(json.loads(person.output_text), PERSON)
    # an output type beside tools chosen "auto" (an agent's): the reply is the format's JSON or a call, either valid
    # (sampled: greedy, this random-weight model spends the little room the tools leave on the whitespace allowed)
    either = client.responses.create(**{**ask, "tool_choice": "auto", "temperature": 1, "max_output_tokens": 170},
                                     text=person_format, extra_body={"seed": 1})
    assert either.status == "completed" and either.output, either
    for item in either.output:
        if item.type == "function_call":
            jsonschema.validate(json.loads(item.arguments), parameters[item.name])
        else:
            jsonschema.validate(json.loads(item.content[0].text), PERSON)
    for extra, param in [({"previous_response_id": "resp_1"}, "previous_response_id"),
                         ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
                          "input[0].message.content"),
                         ({"input": [{"type": "web_search_call", "id": "ws_1", "status": "completed"}]}, "input[0]"),
                         ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
                         ({"tools": [{"type": "web_search"}]}, "tools[0]")]:
        with pytest.raises(BadRequestError) as refused:
            client.responses.create(**{**ask, **extra})
        assert refused.value.body["param"].startswith(param), (extra, refused.value.body)


@pytest.mark.parametrize("penalty", [5e-324, 1e-320, 1e308, 1.7976931348623157e308])
@pytest.mark.parametrize("temperature", [0, 1])
def test_extreme_repetition_penalties_get_an_answer(server, penalty, temperature):
    """Legal but extreme repetition penalties (the schema fuzzer's 500 was 5e-324): a reply, not a server error."""
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": [5, 6, 5, 6], "max_tokens": 4, "seed": 1,
                                         "temperature": temperature, "repetition_penalty": penalty})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text


def test_stop_token_ids_outside_the_vocabulary_name_their_parameter(server):
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "stop_token_ids": [9999]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop_token_ids"
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "logit_bias": {"9999": 1}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text


@pytest.mark.parametrize("chat", [False, True])
def test_logit_bias_bans_and_forces_tokens(server, chat):
    """OpenAI's logit_bias through both ranks, streamed and whole: -100 on the greedy first token leaves
    transformers' next most likely one; 100 on a token makes it every token of the reply."""
    import torch
    from conftest import hf_model
    prompt = [{"role": "user", "content": "Hi"}] if chat else [1, 2, 3]
    _, greedy, _ = complete(server, prompt, 4, chat=chat)
    for stream in (False, True):
        assert complete(server, prompt, 4, stream=stream, chat=chat, logit_bias={"42": 100})[1] == [42] * 4
        banned = complete(server, prompt, 1, stream=stream, chat=chat, logit_bias={str(greedy[0]): -100})[1]
        if not chat:
            with torch.no_grad():
                logits = hf_model(MODEL)(torch.tensor([prompt])).logits[0, -1]
            assert [greedy[0], banned[0]] == logits.topk(2).indices.tolist()
        assert banned[0] != greedy[0]


@pytest.mark.parametrize("body, status, says", [
    (b"{not json", 400, "not valid JSON"),
    ({"prompt": "hi"}, 400, "missing required parameter 'model'"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": -5}, 400, "'max_tokens'"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 5000}, 400, "more than the context has room for"),
    ({"model": MODEL, "prompt": list(range(1, 1100))}, 400, "the prompt has 1099 tokens"),
    ({"model": "gpt-4", "prompt": "hi"}, 404, "the model 'gpt-4' does not exist"),
    ({"model": MODEL, "prompt": "hi", "n": 0}, 400, "'n': Input should be greater than or equal to 1"),
    ({"model": MODEL, "prompt": "hi", "n": 41}, 400, "n 41 is more choices than the server runs or queues at once"),
    ({"model": MODEL, "prompt": "hi", "temperature": "0.5"}, 400, "'temperature': Input should be a valid number"),
    ({"model": MODEL, "prompt": "hi", "tools": []}, 400, "unsupported parameter 'tools'"),
    ({"model": MODEL, "prompt": "hi", "logit_bias": {"5": 1, "05": 2}}, 400, "'logit_bias': names token 5 twice"),
    ({"model": MODEL, "prompt": "hi", "logit_bias": {"9" * 5000: 1}}, 400, "is not a token id"),
    ({"model": MODEL, "prompt": [1, 9999]}, 400, "outside the vocabulary"),
    ({"model": MODEL, "prompt": "hi", "stop": "x" * 1_000_000}, 400,
     "'stop': takes strings of at most 1024 characters, got one of 1000000"),
    ({"model": MODEL, "prompt": "hi", "stream_options": {"include_usage": True}}, 400,
     "'stream_options': is only allowed when stream is true"),
])
def test_errors_say_what_is_wrong(server, body, status, says):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(server.url + "/v1/completions", content=content, timeout=30)
    assert r.status_code == status and says in r.json()["error"]["message"], r.text


def test_client_disconnect_frees_the_sequences(server):
    body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 900, "temperature": 0, "ignore_eos": True}
    cancelled = metric(server, "distmk_requests_finished_total", '{reason="cancelled"}')
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True, "n": 2},
                      timeout=60) as r:
        lines = r.iter_lines()
        for _ in range(3):
            assert next(line for line in lines if line).startswith("data: {")
        assert metric(server, "distmk_kv_cache_used_blocks") > 0
    wait_for(lambda: metric(server, "distmk_kv_cache_used_blocks") == 0, what="the stream's KV blocks to be freed")
    # a client of a whole (non-streamed) completion that hangs up is noticed too (both choices' sequences)
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        payload = json.dumps({**body, "n": 2}).encode()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
        wait_for(lambda: metric(server, "distmk_kv_cache_used_blocks") > 0, what="the request to start")
    wait_for(lambda: metric(server, "distmk_kv_cache_used_blocks") == 0, what="the hung-up request's KV blocks")
    assert metric(server, "distmk_requests_finished_total", '{reason="cancelled"}') == cancelled + 4


def test_beyond_the_queue_requests_get_429(server):
    body = {"model": MODEL, "prompt": [1, 2], "max_tokens": 500, "temperature": 0, "ignore_eos": True,
            "stream": True}

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=60,
                                     limits=httpx.Limits(max_connections=64)) as http:
            streams = [http.stream("POST", "/v1/completions", json=body) for _ in range(MAX_SEQS + MAX_QUEUE - 1)]
            opened = await asyncio.gather(*(s.__aenter__() for s in streams))
            assert all(r.status_code == 200 for r in opened)
            two = await http.post("/v1/completions", json={**body, "stream": False, "n": 2})   # one place left
            last = http.stream("POST", "/v1/completions", json=body)
            assert (await last.__aenter__()).status_code == 200
            extra = await http.post("/v1/completions", json={**body, "stream": False})
            for s in [*streams, last]:
                await s.__aexit__(None, None, None)
            return two, extra

    two, extra = asyncio.run(run())
    assert two.status_code == extra.status_code == 429 and extra.json()["error"]["code"] == "rate_limit_exceeded"
    wait_for(lambda: metric(server, "distmk_kv_cache_used_blocks") == 0, what="the abandoned streams to be freed")
    assert metric(server, "distmk_running_sequences") == 0 and metric(server, "distmk_waiting_sequences") == 0
    assert complete(server, [1, 2, 3], 3)[2] == "length"


def test_metrics_count_requests_tokens_and_latencies(server):
    text = httpx.get(server.url + "/metrics").text
    for name in ("distmk_requests_total", "distmk_generation_tokens_total", "distmk_prompt_tokens_total",
                 "distmk_time_to_first_token_seconds_bucket", "distmk_inter_token_latency_seconds_bucket",
                 "distmk_step_rows_bucket", "distmk_running_sequences", "distmk_kv_cache_usage_ratio",
                 "distmk_kv_cache_blocks", "distmk_prefix_cache_hits_total", "distmk_prefix_cache_queries_total"):
        assert f"\n{name}" in text, name
    names = ["distmk_generation_tokens_total", "distmk_prompt_tokens_total", "distmk_time_to_first_token_seconds_count",
             "distmk_inter_token_latency_seconds_count", "distmk_step_rows_count"]
    before = [metric(server, n) for n in names]
    ok = '{route="/v1/completions",status="200"}'
    requests = metric(server, "distmk_requests_total", ok)
    complete(server, [1, 2, 3], 4)
    after = [metric(server, n) for n in names]
    assert [a - b for a, b in zip(after, before)] == [4, 3, 1, 3, 4]      # a 3-token prompt fits in one step
    assert metric(server, "distmk_requests_total", ok) == requests + 1
    assert metric(server, "distmk_kv_cache_blocks") == MAX_SEQS * CONTEXT // 16


def test_sigterm_stops_every_rank_cleanly(tmp_path):
    """SIGTERM to the server (rank 0): a running stream gets its grace time, then ends with an error event
    and [DONE]; all ranks and torchrun exit 0. SIGTERM to torchrun (which passes it on to every rank): all
    ranks stop cleanly, and torchrun reports the signal it got itself (exit 1, by torchrun's own rule)."""
    servers = [serve_torchrun(tmp_path, "to_rank0"), serve_torchrun(tmp_path, "to_torchrun")]
    try:
        for srv in servers:
            srv.wait_ready()
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 900, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", servers[0].url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line).startswith("data: {")
            t0 = time.monotonic()
            os.kill(rank_pids(servers[0].proc.pid)[0], signal.SIGTERM)
            servers[1].proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]" and json.loads(rest[-2][6:])["error"]["message"] == "the server is shutting down"
        codes = [srv.wait_exit(timeout=30) for srv in servers]
        assert time.monotonic() - t0 < 30
        assert codes[0] == 0, servers[0].output()
        for srv in servers:
            out = srv.output()
            assert "rank 0: stopped" in out and "rank 1: stopped" in out, out
    finally:
        for srv in servers:
            srv.kill()


def test_a_rank_that_dies_is_noticed(tmp_path):
    """Two ranks started by hand (no launcher to clean up after them): kill one, the other says so and exits."""
    pairs = []
    for i in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        pairs.append([Server(tmp_path, f"pair{i}_rank{rank}", [sys.executable, "-m", "distmk.serve", *ENGINE,
                                                                "--port", "0"],
                             env={"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                                  "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"})
                      for rank in range(2)])
    try:
        for rank0, _ in pairs:
            rank0.wait_ready()
        pairs[0][1].kill()                            # rank 1 dies while the server is idle: the heartbeat notices
        pairs[1][0].kill()                            # rank 0 dies: rank 1's broadcast fails at once
        assert pairs[0][0].wait_exit(timeout=20) == 1
        assert pairs[1][1].wait_exit(timeout=20) == 1
        assert "rank 0: exiting, the engine failed: lost contact with another rank" in pairs[0][0].output()
        assert "rank 1: exiting, lost contact with another rank" in pairs[1][1].output()
    finally:
        for pair in pairs:
            for srv in pair:
                srv.kill()


def test_steps_per_launch_give_the_tokens_of_single_steps(tmp_path):
    """--steps-per-launch 4 at tp=2: two streams decoding together, and one alone, get transformers' tokens;
    a streamed reply still has a chunk per token and its finish reason on the last one only."""
    srv = serve_torchrun(tmp_path, "multi", "--max-batch", "4", "--steps-per-launch", "4")
    try:
        srv.wait_ready()
        jobs = [([1, 2, 3, 4, 5, 6, 7], 11), ([9, 8, 7], 6)]
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            together = list(pool.map(lambda job: complete(srv, job[0], job[1])[1], jobs))
        assert together == [hf_greedy(MODEL, tuple(p), n)[0] for p, n in jobs]
        body = {"model": MODEL, "prompt": jobs[0][0], "max_tokens": 11, "temperature": 0, "return_token_ids": True,
                "stream": True}
        chunks = sse_chunks(srv, "/v1/completions", body)
        assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == together[0]
        assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    finally:
        srv.kill()


def test_single_process_server(tmp_path):
    srv = serve_alone(tmp_path, "single", "--served-model-name", "tiny")
    try:
        srv.wait_ready()
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=30,
                       json={"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 5, r.text
        srv.proc.send_signal(signal.SIGINT)
        assert srv.wait_exit(timeout=30) == 0, srv.output()
        assert "rank 0: stopped" in srv.output()
    finally:
        srv.kill()


def test_virtual_ranks_server_gives_transformers_tokens(tmp_path):
    """--virtual-tp 2: both ranks in one process (threads), the plans sent to rank 1 over the communicator rather
    than gloo; a long prompt (prefill chunks on both ranks) and decode steps give transformers' tokens, and SIGINT
    stops it cleanly."""
    srv = serve_alone(tmp_path, "virtual", "--virtual-tp", "2", "--max-batch", "4", "--prefill-chunk", "16")
    try:
        srv.wait_ready()
        prompt = [(7 * i + 3) % 50 for i in range(40)]
        _, tokens, finish = complete(srv, prompt, 16, ignore_eos=True)
        assert tokens == hf_greedy(MODEL, tuple(prompt), 16)[0] and finish == "length"
        assert "tp 2" in srv.output()
        srv.proc.send_signal(signal.SIGINT)
        assert srv.wait_exit(timeout=30) == 0, srv.output()
    finally:
        srv.kill()


def test_step_trace_splits_each_streams_gaps_into_launches_prefill_and_host(tmp_path):
    """--trace-steps: a stream decoding while a 40-token prompt is prefilled in chunks of 16 gets tokens between
    the chunks, and has gaps with a chunk in them; benchmarks/step_trace.py counts every token gap of both
    streams once, and splits each request's time to its first token: the long prompt's holds its chunks."""
    trace = tmp_path / "steps.jsonl"
    srv = serve_alone(tmp_path, "trace", "--max-batch", "4", "--prefill-chunk", "16", "--trace-steps", str(trace))
    try:
        srv.wait_ready()
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            running = pool.submit(complete, srv, [1, 2, 3], 120, ignore_eos=True)
            time.sleep(0.3)
            long = pool.submit(complete, srv, [(7 * i + 3) % 50 for i in range(40)], 4, ignore_eos=True)
            outputs = [running.result()[1], long.result()[1]]
        srv.proc.send_signal(signal.SIGINT)
        assert srv.wait_exit(timeout=30) == 0, srv.output()
    finally:
        srv.kill()
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    from step_trace import summarise
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    prefill = [r for r in records if r["kind"] == "prefill"]
    # chunks of the prompt in order (some of it may go in as spare rows of decode steps instead)
    positions = [r["position"] for r in prefill]
    assert len(prefill) >= 2 and positions == sorted(set(positions)) and positions[0] == 0
    assert all(r["rows"] <= 16 for r in prefill) and sum(r["rows"] for r in prefill) <= 40
    assert all(r["start"] <= r["end"] for r in records if "start" in r)
    # the running stream (the first to get a token) got tokens while the prompt's chunks ran, not only after
    stream = next(r for r in records if r["kind"] == "tokens")["ids"][0]
    assert any(prefill[0]["end"] < r["time"] < prefill[-1]["start"] and stream in r["ids"]
               for r in records if r["kind"] == "tokens")
    out = summarise(records)
    gaps = out["gaps"]
    assert gaps["no prefill"]["count"] + gaps["prefill"]["count"] == sum(len(t) - 1 for t in outputs)
    assert gaps["prefill"]["count"] >= 1 and gaps["prefill"]["prefill_ms_p50"] > 0
    assert out["prefill_chunks"] == len(prefill) and set(out["prefill_ms_median_by_tokens"]) == {r["rows"] for r in prefill}
    requests = [r for r in records if r["kind"] == "request"]
    assert [r["prompt"] for r in requests] == [3, 40]
    assert all(r["arrived"] <= r["submitted"] <= r["time"] for r in requests)
    assert requests[1]["time"] < prefill[0]["start"]            # taken in, then its chunks
    first = out["first_token"]
    assert first["count"] == 2 and first["prefill_ms_p99"] >= sum(r["end"] - r["start"] for r in prefill) * 1e3 - 1e-3
    assert 0 < first["ttft_ms_p50"] <= first["ttft_ms_p99"] and first["admission_ms_p50"] >= 0


def test_warm_up_leaves_no_prefill_bucket_to_a_request():
    """ChunkGraphs captures a (rows, keys, last) bucket on first use, a capture a served prompt should not wait for.
    Without a GPU to capture on, the chunks warm_up runs are staged into their buckets, and every chunk a prompt
    can make (any length up to the chunk size, at any start) must land in one of them."""
    from distmk.runtime.engine import Engine
    from distmk.runtime.prefill import ChunkGraphs
    from distmk.serve.__main__ import warm_up
    engine = Engine(MODEL, max_context=CONTEXT, prefill_chunk=64)
    graphs = engine.prefill_graphs = ChunkGraphs(engine, 64)
    warmed = set()

    class StagingLeader:        # what rank 0's leader would run, up to ChunkGraphs.run's capture
        def run(self, step):
            pass

        def prefill(self, chunk):
            warmed.add((*graphs.stage(chunk.tokens, chunk.start, chunk.blocks), chunk.last))

    warm_up(StagingLeader(), engine)
    blocks = list(range(engine.kv.blocks_per_seq))
    # a prompt's last chunk has any length; one that is not its last, the chunk size (Batcher.plan_prefill)
    missing = {(*graphs.stage([0] * n, start, blocks), last) for start in range(CONTEXT) for n in range(2, 65)
               for last in (True, False) if start + n <= CONTEXT and (last or n == 64)} - warmed
    assert not missing, sorted(missing)


def test_api_key_guards_every_route_but_health(tmp_path):
    """--api-key, and DISTMK_API_KEY with --metrics-public: without the key, with another or in another
    scheme, a 401 in OpenAI's shape (streaming requests too); with it, the answer; /health needs none."""
    key = "sk-distmk-" + "7" * 24
    servers = {"flag": serve_alone(tmp_path, "key_flag", "--api-key", key),
               "env": serve_alone(tmp_path, "key_env", "--metrics-public", env={"DISTMK_API_KEY": key})}
    routes = [("GET", "/v1/models", None), ("GET", "/metrics", None),
              ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2}),
              ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2, "stream": True}),
              ("POST", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                "max_tokens": 2, "stream": True})]
    refused = [({}, "this server needs an API key"), ({"Authorization": "Bearer sk-other"}, "incorrect API key"),
               ({"Authorization": f"Basic {key}"}, "this server needs an API key")]
    try:
        for name, srv in servers.items():
            srv.wait_ready()
            assert "API key required" in srv.output()
            with httpx.Client(base_url=srv.url, timeout=60) as http:
                assert http.get("/health").json() == {"status": "ok"}
                for method, route, body in routes:
                    public = route == "/metrics" and name == "env"
                    for headers, says in refused:
                        r = http.request(method, route, json=body, headers=headers)
                        if public:
                            assert r.status_code == 200
                            continue
                        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", (route, r.text)
                        error = r.json()["error"]
                        assert error["message"].startswith(says) and error["code"] == "invalid_api_key"
                        assert set(error) == {"message", "type", "param", "code"}
                    r = http.request(method, route, json=body, headers={"Authorization": f"Bearer {key}"})
                    assert r.status_code == 200, (route, r.text)
                    if body and body.get("stream"):
                        assert r.headers["content-type"].startswith("text/event-stream")
                        assert r.text.rstrip().endswith("data: [DONE]")
    finally:
        for srv in servers.values():
            srv.kill()


def test_generation_config_eos_and_sampling_defaults(tmp_path, generation_config_checkpoint):
    """A checkpoint's generation_config.json: its eos ids end a reply where transformers' greedy output
    reaches one, and its temperature, top_p and top_k are what a request that leaves them out gets."""
    path, gen = generation_config_checkpoint
    srv = serve_alone(tmp_path, "gen", "--served-model-name", MODEL, model=path)
    try:
        srv.wait_ready()
        _, tokens, finish = complete(srv, PROMPT, 32)
        assert finish == "stop" and tokens[-1] in gen["eos_token_id"]
        assert tokens == hf_greedy("tiny-llama")[0][:len(tokens)] and len(tokens) < 32

        def sampled(**params):
            body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "seed": 7, "ignore_eos": True,
                    "return_token_ids": True, **params}
            r = post(srv, "/v1/completions", body)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["token_ids"]

        checkpoints = sampled(temperature=gen["temperature"], top_p=gen["top_p"], top_k=gen["top_k"])
        assert sampled() == checkpoints != sampled(temperature=1, top_p=1, top_k=-1)
        assert sampled(temperature=None, top_p=None) == checkpoints          # null: the default too
    finally:
        srv.kill()


def test_a_vocabulary_under_256_ids_serves_token_ids(tmp_path, small_vocab_checkpoint):
    path, expected = small_vocab_checkpoint
    srv = serve_alone(tmp_path, "small_vocab", "--served-model-name", MODEL, model=path)
    try:
        srv.wait_ready()
        assert complete(srv, PROMPT, 32)[1] == expected
        for route, body, param in (("/v1/completions", {"prompt": "hi"}, "prompt"),
                                   ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]},
                                    "messages")):
            r = post(srv, route, {"model": MODEL, **body})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
            assert r.json()["error"]["message"].startswith("text needs a tokenizer")
    finally:
        srv.kill()
