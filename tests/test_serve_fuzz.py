"""Fuzzing a real server (tiny-llama, one process on the CPU) with requests from a seeded generator:
extreme numbers (1e-50, 1e308, -0.0, huge ints, NaN and Infinity literals), wrong types, huge strings,
nested junk, unknown fields, broken JSON, odd routes, methods and Content-Types, and raw malformed HTTP
over a socket. No request may get a 5xx or take over 5 s (the context is small, so a null max_tokens ends
soon too), every 4xx is OpenAI's error shape, a request known to be wrong gets a 4xx, and /health answers
after every one."""
import json
import random
import socket
import time
from dataclasses import dataclass

import httpx

from conftest import MODEL, serve_alone

SEED, COUNT = 14, 1200
CONTEXT = 64
SLOWEST_S = 5.0


@dataclass
class Case:
    what: str                        # the generator's name, for a failure's message
    expect: str                      # "4xx": known to be wrong; "200": known to be right; "any": either
    method: str = "POST"
    path: str = "/v1/completions"
    body: bytes = b""
    content_type: str | None = "application/json"
    raw: bytes | None = None         # bytes sent over a socket of its own instead
    answered: bool = True            # raw bytes the server waits on for ever (a body never finished): no answer


class Literal:
    """JSON text written as it is, which json.dumps cannot write: NaN, Infinity, 1e400, -0."""

    def __init__(self, text: str):
        self.text = text


def to_json(obj) -> bytes:
    literals = []

    def placeholder(literal: Literal) -> str:
        literals.append(literal.text)
        return f"@literal{len(literals) - 1}@"

    text = json.dumps(obj, default=placeholder)
    for i, literal in enumerate(literals):
        text = text.replace(f'"@literal{i}@"', literal, 1)
    return text.encode()


EXTREME = [0, -0.0, 1, -1, 2, 0.5, 1e-50, -1e-50, 5e-324, 1e-320, 0.9999999999999999, 1.0000000000000002, 1e308,
           -1e308, 1.7976931348623157e308, 10 ** 30, -10 ** 30, 2 ** 53 + 1, 2 ** 63 - 1, 2 ** 63, 2 ** 64 - 1, 2 ** 64,
           -2 ** 63, -2 ** 63 - 1, 10 ** 400, None, Literal("NaN"), Literal("Infinity"), Literal("-Infinity"),
           Literal("1e400"), Literal("-1e400"), Literal("1E-400"), Literal("-0"), Literal("0e0"), Literal("2.0e0")]
NUMERIC_FIELDS = ["temperature", "top_p", "top_k", "seed", "max_tokens", "n", "presence_penalty", "frequency_penalty"]
# field: extreme values that are legal for it
LEGAL_EXTREMES = {
    "temperature": [0, -0.0, 5e-324, 1e-320, 1e-50, 1e-38, 1e-6, 1e-5, 1.9999999999999998, 2, None],
    "top_p": [5e-324, 1e-320, 1e-50, 1e-9, 0.9999999999999999, 1, None],
    "top_k": [-1, 0, 1, 2, 10 ** 30, 2 ** 63, 2 ** 64 + 1, None],
    "min_p": [0, 5e-324, 0.5, 1, None],
    "min_tokens": [0, 1],
    "seed": [-2 ** 63, -1, 0, 2 ** 63, 2 ** 64 - 1, None],
    "max_tokens": [1, 1, 2, None],                    # null: to the end of the (small) context
    "presence_penalty": [0, -0.0, Literal("0e0")], "frequency_penalty": [0, Literal("-0")], "n": [1, Literal("1")],
    "logit_bias": [{"5": -100}, {"0": 100, "511": -100}, {"7": 5e-324}, {"007": 100}, {}, None],
    "store": [True, False], "metadata": [{}, {"k": "v"}], "service_tier": ["auto", "default"],    # accepted, unused
    "prompt_cache_key": ["k"], "safety_identifier": ["s"],
    "structured_outputs": [{"choice": ["a", ""]}, {"regex": "[0-9]{1,3}"}, {"grammar": 'root ::= "x" | "y"'},
                           {"json": "{}"}, {"json_object": True},
                           {"json_object": False, "disable_any_whitespace": True},
                           {"grammar": "start: /[a-z]+/"}, None],
    "truncate_prompt_tokens": [-1, 1, 5, None], "allowed_token_ids": [[5], [0, 511, 5], None],
    "return_tokens_as_token_ids": [True, False],
}

# field: values that are wrong for it (type, range, unsupported), so the request must be refused
WRONG = {
    "model": [1, None, [], "no-such-model"],
    "prompt": [5, {"a": 1}, [1.5], [[1], "a", 2], [["a"]], True, [], "", [1, 512], [-1], list(range(1, 100)),
               "x" * 100],
    "max_tokens": ["10", 1.5, True, -1, 0, 10 ** 9, CONTEXT],
    "temperature": ["hot", -0.1, 3, [0]],
    "top_p": [0, 1.5, "x"],
    "min_p": [-0.1, 1.5, "0.5"],
    "min_tokens": [-1, "1", 1.5, 10 ** 6], "include_stop_str_in_output": ["yes", 1],
    "top_k": [-2, 1.5, "5"],
    "seed": ["1", 2 ** 70, 1.5],
    "stop": [5, [1], ["a"] * 65, [""], {"s": 1}, "s" * 1025],
    "stream": ["yes", 1],
    "n": [0, "1", 1.5, 10 ** 6],
    "stream_options": ["x", {"foo": True}, {"include_usage": True}],
    "logprobs": [21, -1, "2", True], "echo": ["yes", 1],
    "presence_penalty": [3, "1", -2.5], "frequency_penalty": [2.5, "0"],
    "repetition_penalty": [0, -1, "1"], "stop_token_ids": [[-1], [1.5], "1", [10 ** 6], list(range(65))],
    "logit_bias": [{"x": 1}, {"5": 101}, {"-5": 1}, {"5": "1"}, [5], {str(10 ** 6): 1}, {"9" * 5000: 1},
                   {"5": 1, "05": 1}, {str(t): 1 for t in range(301)}],
    "best_of": [2], "suffix": ["end"], "metadata": [{"k": 1}, {str(i): "v" for i in range(17)}],
    "service_tier": ["flex"], "store": ["yes"],
    "tools": [[]], "frobnicate": [1],
    "response_format": ["json", {"type": "xml"}, {"type": "json_schema"}, {"type": "text", "json_schema": {"name": "x"}},
                        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}],
    "structured_outputs": ["x", {"regex": 5}, {"choice": []}, {"choice": "a"}, {"json": "[1]"}, {"json": "{"},
                           {"regex": "a", "grammar": 'root ::= "a"'}, {"structural_tag": "x"}, {"regex": "(a"},
                           {"grammar": "root ::= x"}, {"grammar": "start: x"},
                           {"json": {"type": "nonsense"}}],
    "guided_json": [{}], "guided_choice": [["a"]],
    "truncate_prompt_tokens": [-2, "5", 1.5, CONTEXT, 10 ** 30], "return_tokens_as_token_ids": ["yes", 1],
    "allowed_token_ids": [[], [-1], [10 ** 6], "5", [1.5], list(range(4097))],
}
WRONG_CHAT = {"messages": ["hi", [], [{"role": "bot", "content": "x"}], [{"role": "user"}],
                           [{"role": "user", "content": 5}], [{"content": "x"}],
                           [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
                           [{"role": "user", "content": "x", "name": 7}],
                           [{"role": "user", "content": "x" * 100}]],
              "max_completion_tokens": [0, "2"], "logprobs": ["yes", 1],
              "top_logprobs": [21, -1, 3],         # 3: valid only beside logprobs: true
              "tools": [[], [{"type": "function"}], [{"type": "function", "function": {"name": "a b"}}]],
              "tool_choice": ["always", "required", {"type": "function", "function": {"name": "missing"}}],
              "chat_template_kwargs": [{"tokenize": True}, {"messages": []}, "x", [1]],
              "continue_final_message": ["yes", True],      # True: beside add_generation_prompt's default, true
              "add_generation_prompt": ["no", 0], "include_reasoning": ["yes", 1, None],
              "reasoning_effort": ["max", 1]}
# the Responses API's fields: legal values (a 200; conversations that fit the small context), wrong ones (a 4xx)
LEGAL_RESPONSES = {
    "input": ["hi", [{"role": "user", "content": "hi"}],
              [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "hi"}]}],
              [{"type": "reasoning", "id": "rs_1", "summary": [],
                "content": [{"type": "reasoning_text", "text": "."}]},
               {"role": "user", "content": "hi"}]],
    "instructions": [None], "temperature": [0, 2, None], "top_p": [5e-324, 1], "store": [True, False],
    "metadata": [{}, {"k": "v"}], "text": [{"format": {"type": "text"}}, {"format": {"type": "json_object"}}],
    "top_logprobs": [0, 20], "include": [[], ["message.output_text.logprobs"], ["reasoning.encrypted_content"]],
    "truncation": ["disabled"], "reasoning": [{"effort": "high"}, {"effort": None, "summary": "auto"}],
    "tool_choice": ["none", "auto"], "parallel_tool_calls": [True, False], "prompt_cache_key": ["k"],
}
WRONG_RESPONSES = {
    "input": [5, [], [{"role": "user"}], [{"type": "reasoning"}], [{"role": "bot", "content": "x"}],
              [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}],
              [{"type": "function_call", "call_id": "c"}], "x" * 100],
    "max_output_tokens": [0, -1, "2", 10 ** 9], "temperature": [3, "x"], "previous_response_id": ["resp_1"],
    "background": [True], "truncation": ["auto"], "reasoning": [{"effort": "max"}, {"foo": 1}], "include": [["file_search"]],
    "tools": [[{"type": "web_search"}], [{"type": "function"}], [{"type": "function", "name": "a b"}]],
    "tool_choice": ["required", {"type": "function", "name": "missing"}, "always"],
    "text": [{"format": {"type": "json_schema"}}, {"format": {"type": "xml"}}, {"verbosity": "low"}],
    "metadata": [{"k": 1}, {str(i): "v" for i in range(17)}], "conversation": ["c"], "top_logprobs": [21],
    "max_tokens": [1], "messages": [[]], "frobnicate": [1],
}
UNKNOWN_NAMES = ["", " ", "__proto__", "constructor", "x" * 300, "é€😀", "max tokens", "Temperature", "prompt ",
                 "stream\u0000", "$where"]


def base_body(rng: random.Random, chat: bool) -> dict:
    body = {"model": MODEL, "max_tokens": rng.randint(1, 3)}
    body.update({"messages": [{"role": rng.choice(["user", "system", "developer"]), "content": "hi"}]} if chat
                else {"prompt": rng.choice(["hi", [1, 2, 3], ["hi"], [[5, 6]]])})
    return body


def junk(rng: random.Random, depth: int = 0):
    """A random JSON value: any type, nested a few levels."""
    kind = rng.randrange(9 if depth < 3 else 6)
    if kind == 0:
        return rng.choice([None, True, False])
    if kind == 1:
        return rng.choice(EXTREME)
    if kind == 2:
        return rng.choice(["", "x", "\u0000", "\ud7ff\ue000", "<|im_end|>", "😀" * 3, "\\", '"', "\n\r\t"])
    if kind == 3:
        return rng.randint(-10 ** 6, 10 ** 6)
    if kind == 4:
        return rng.random() * 10 ** rng.randint(-10, 10)
    if kind == 5:
        return "".join(chr(rng.randrange(32, 0x2FFF)) for _ in range(rng.randint(1, 20)))
    if kind in (6, 7):
        return [junk(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {rng.choice(["role", "content", "type", "text", "a", ""]): junk(rng, depth + 1)
            for _ in range(rng.randint(0, 4))}


def chat_or_completion(rng: random.Random) -> tuple[bool, str]:
    chat = rng.random() < 0.4
    return chat, "/v1/chat/completions" if chat else "/v1/completions"


def extreme_numbers(rng: random.Random) -> Case:
    """Extreme numbers in the numeric fields, legal or not: a 200 or a 4xx, never more."""
    chat, path = chat_or_completion(rng)
    body = base_body(rng, chat)
    for name in rng.sample(NUMERIC_FIELDS, rng.randint(1, 4)):
        body[name] = rng.choice(EXTREME)
    body["stream"] = rng.random() < 0.3
    return Case("extreme_numbers", "any", path=path, body=to_json(body))


def legal_extremes(rng: random.Random) -> Case:
    """The edges of every numeric range (the tiny temperatures and top_p that once killed the engine): a
    200 for each, streamed or not."""
    chat, path = chat_or_completion(rng)
    body = base_body(rng, chat)
    for name in rng.sample(sorted(LEGAL_EXTREMES), rng.randint(1, 4)):
        body[name] = rng.choice(LEGAL_EXTREMES[name])
    body["stream"] = rng.random() < 0.3
    return Case("legal_extremes", "200", path=path, body=to_json(body))


def wrong_values(rng: random.Random) -> Case:
    chat, path = chat_or_completion(rng)
    body = base_body(rng, chat)
    table = {**{k: v for k, v in WRONG.items() if k != "prompt"}, **WRONG_CHAT} if chat else WRONG
    for name in rng.sample(sorted(table), rng.randint(1, 3)):
        body[name] = rng.choice(table[name])
    return Case("wrong_values", "4xx", path=path, body=to_json(body))


def junk_values(rng: random.Random) -> Case:
    chat, path = chat_or_completion(rng)
    body = base_body(rng, chat)
    names = sorted({*WRONG, *WRONG_CHAT, "user", "ignore_eos", "return_token_ids"})
    for name in rng.sample(names, rng.randint(1, 3)):
        body[name] = junk(rng)
    return Case("junk_values", "any", path=path, body=to_json(body))


def huge_strings(rng: random.Random) -> Case:
    """Up to 2 MB in one place: a prompt, a stop string, the model name, a message, a name, a user."""
    chat, path = chat_or_completion(rng)
    body = base_body(rng, chat)
    huge = rng.choice("xé😀<") * (rng.choice([10 ** 3, 10 ** 4, 10 ** 5, 10 ** 6]) * rng.randint(1, 2))
    where = rng.choice(["stop", "model", "user", "text", "unknown"] + (["name"] if chat else ["ids"]))
    if where == "text":
        body.update({"messages": [{"role": "user", "content": huge}]} if chat else {"prompt": huge})
    elif where == "name":
        body["messages"][0]["name"] = huge
    elif where == "ids":
        body["prompt"] = [rng.randrange(512)] * len(huge)
    elif where == "unknown":
        body[huge[:rng.randint(1, len(huge))]] = huge
    else:
        body[where] = [huge] if where == "stop" and rng.random() < 0.5 else huge
    return Case("huge_strings", "any", path=path, body=to_json(body))


def unknown_fields(rng: random.Random) -> Case:
    chat, path = chat_or_completion(rng)
    body = base_body(rng, chat)
    for name in rng.sample(UNKNOWN_NAMES, rng.randint(1, 3)):
        body[name] = junk(rng)
    return Case("unknown_fields", "4xx", path=path, body=to_json(body))


def broken_json(rng: random.Random) -> Case:
    _, path = chat_or_completion(rng)
    text = to_json({"model": MODEL, "prompt": "hi", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
    depth = 10 ** rng.randint(1, 5)
    body = rng.choice([
        text[:rng.randrange(len(text) - 1)],                              # cut short
        rng.randbytes(rng.randint(1, 64)),                                # not text
        b"\xef\xbb\xbf" + text,                                           # a byte-order mark
        text.replace(b'"hi"', b'"\xff\xfe"'),                             # not UTF-8
        text[:-1] + b',}', text + b"x", b"", b" ", b"null", b"[]", b'"s"', b"1e400", b"NaN",
        text.replace(b'"model"', b"'model'"),                              # single quotes
        text[:-1] + b',"prompt":' + b"[" * depth + b"]" * depth + b"}",    # nested past any limit
        text[:-1] + b',"x":' + b'{"a":' * depth + b"1" + b"}" * depth + b"}",
        text.replace(b'"hi"', b'"\\ud800"'), text.replace(b'"hi"', b'"\\u12"'),  # lone surrogate, short escape
    ])
    return Case("broken_json", "4xx", path=path, body=body)


def odd_requests(rng: random.Random) -> Case:
    """Wrong methods and routes, queries, Content-Types that are JSON or not."""
    chat, path = chat_or_completion(rng)
    body = to_json(base_body(rng, chat))
    kind = rng.randrange(4)
    if kind == 0:
        method, route = rng.choice([("GET", path), ("PUT", path), ("DELETE", "/v1/models"), ("PATCH", "/health"),
                                    ("POST", "/v1/nothing"), ("POST", "/health"), ("GET", "/v1/completions/x"),
                                    ("POST", "/v1/models"), ("GET", "/%00"), ("GET", "/v1/%ff%fe"),
                                    ("GET", "/" + "a" * 5000), ("OPTIONS", path)])
        return Case("odd_requests", "4xx", method=method, path=route, body=body)
    if kind == 1:
        media = rng.choice(["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=b",
                            "application/xml", "json", "application/jsonx", ""])
        return Case("odd_requests", "4xx", path=path, body=body, content_type=media)
    if kind == 2:
        media = rng.choice(["application/json; charset=utf-8", "APPLICATION/JSON", "application/json;charset=UTF-8",
                            "application/problem+json", "application/json ;charset=utf-8", None])
        return Case("odd_requests", "200", path=path, body=body, content_type=media)
    query = rng.choice(["?stream=true", "?" + "&".join(f"k{i}=v" for i in range(200)), "?%zz", "?model=x#frag"])
    return Case("odd_requests", "200", path=path + query, body=body)


def raw_http(rng: random.Random) -> Case:
    """Bytes over a socket: bad request lines, headers, Content-Lengths and chunked bodies."""
    _, path = chat_or_completion(rng)
    body = to_json(base_body(rng, path.endswith("chat/completions")))
    head = f"POST {path} HTTP/1.1\r\nHost: fuzz\r\nConnection: close\r\nContent-Type: application/json\r\n".encode()

    health = b"GET /health HTTP/1.1\r\nHost: fuzz\r\nConnection: close\r\n"

    def with_length(length) -> bytes:
        return head + b"Content-Length: %s\r\n\r\n" % str(length).encode() + body

    cases = [
        (b"GARBAGE\r\n\r\n", "4xx", True), (b"\r\n\r\n", "4xx", True), (rng.randbytes(40) + b"\r\n\r\n", "4xx", True),
        (b"GET /health HTTP/1.1 extra\r\n\r\n", "4xx", True),
        (b"GET  /health  HTTP/1.1\r\nHost: x\r\n\r\n", "4xx", True),
        (b"GET /\xff HTTP/1.1\r\nHost: x\r\n\r\n", "4xx", True), (health + b"Host x\r\n\r\n", "4xx", True),
        (health + b"X: a\x00b\r\n\r\n", "4xx", True), (health + b"X: " + b"a" * 70000 + b"\r\n\r\n", "200", True),
        (health + b"X: a\r\n folded\r\n\r\n", "200", True),                          # h11 unfolds it
        (with_length("abc"), "4xx", True), (with_length(-1), "4xx", True), (with_length("+5"), "4xx", True),
        (with_length("1e3"), "4xx", True), (with_length(len(body) // 2), "4xx", True),
        (head + b"Content-Length: 5\r\nContent-Length: 6\r\n\r\n" + body, "4xx", True),
        (head + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n" + body + b"\r\n0\r\n\r\n", "4xx", True),
        (head + b"Transfer-Encoding: chunked\r\n\r\n%x\r\n" % (len(body) - 3) + body + b"\r\n0\r\n\r\n", "4xx", True),
        (head + b"Transfer-Encoding: gzip\r\n\r\n" + body, "4xx", True),
        (head + b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", "4xx", True),
        (head + b"Transfer-Encoding: chunked\r\n\r\n%x\r\n" % len(body) + body + b"\r\n0\r\n\r\n", "200", True),
        (with_length(len(body)), "200", True),
        (with_length(len(body) + 100), "any", False),                      # the rest of the body never comes
        (head + b"Transfer-Encoding: chunked\r\n\r\n%x\r\n" % (len(body) + 9) + body, "any", False),
    ]
    raw, expect, answered = rng.choice(cases)
    return Case("raw_http", expect, raw=raw, answered=answered)


def responses_api(rng: random.Random) -> Case:
    """/v1/responses with legal values (a 200, streamed or not), wrong ones (a 4xx) or junk (either)."""
    body = {"model": MODEL, "input": "hi", "max_output_tokens": rng.randint(1, 3), "stream": rng.random() < 0.3}
    kind = rng.randrange(3)
    table = LEGAL_RESPONSES if kind == 0 else WRONG_RESPONSES
    for name in rng.sample(sorted(table), rng.randint(1, 3)):
        body[name] = rng.choice(table[name]) if kind < 2 else junk(rng)
    return Case("responses_api", ["200", "4xx", "any"][kind], path="/v1/responses", body=to_json(body))


GENERATORS = [(responses_api, 8), (extreme_numbers, 15), (legal_extremes, 8), (wrong_values, 20), (junk_values, 10), (huge_strings, 4),
              (unknown_fields, 6), (broken_json, 10), (odd_requests, 8), (raw_http, 15)]


def fuzzed_cases(seed: int, count: int):
    rng = random.Random(seed)
    generators, weights = zip(*GENERATORS)
    for _ in range(count):
        yield rng.choices(generators, weights)[0](rng)


def send_raw(url: str, case: Case) -> tuple[int, bytes] | None:
    """(status, body) of the server's answer to raw bytes, skipping 100 Continue; None for a case the
    server cannot answer (its socket is closed at once)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=SLOWEST_S) as sock:
        sock.sendall(case.raw)
        if not case.answered:
            return None
        answer = b""
        while chunk := sock.recv(1 << 16):
            answer += chunk
    while answer.startswith(b"HTTP/1.1 100"):
        answer = answer.partition(b"\r\n\r\n")[2]
    head, _, body = answer.partition(b"\r\n\r\n")
    headers = dict(line.lower().partition(b":")[::2] for line in head.split(b"\r\n")[1:])
    if b"content-length" in headers:
        body = body[:int(headers[b"content-length"])]
    return int(head.split()[1]), body


def check_error_shape(body: bytes) -> None:
    """OpenAI's {"error": {"message", "type", "param", "code"}}."""
    reply = json.loads(body)
    error = reply["error"]
    assert set(reply) == {"error"} and set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str)
    assert error["param"] is None or isinstance(error["param"], str)
    assert error["code"] is None or isinstance(error["code"], str)


def test_fuzzed_requests_never_get_a_5xx_and_the_server_stays_healthy(tmp_path):
    # 8 worker queues: the reference executor's step costs a task at a time, and a legal request may generate to
    # the end of the context (max_tokens null: 62 tokens, 6-7 s on two cores with a table for 132 workers)
    srv = serve_alone(tmp_path, "fuzz", "--max-context", str(CONTEXT), "--max-seqs", "4", "--workers", "8")
    try:
        srv.wait_ready()
        sent = refused = 0
        with httpx.Client(base_url=srv.url, timeout=SLOWEST_S * 2) as http:
            for case in fuzzed_cases(SEED, COUNT):
                t0 = time.perf_counter()
                if case.raw is not None:
                    answer = send_raw(srv.url, case)
                else:
                    headers = {} if case.content_type is None else {"content-type": case.content_type}
                    r = http.request(case.method, case.path, content=case.body, headers=headers)
                    answer = r.status_code, r.content
                took = time.perf_counter() - t0
                sent += 1
                what = (case.what, case.raw[:200]) if case.raw else (case.what, case.method, case.path, case.body[:200])
                assert took < SLOWEST_S, (took, what)
                if answer is not None:
                    status, body = answer
                    assert status < 500, (status, body[:300], what)
                    assert {"4xx": status >= 400, "200": status == 200, "any": True}[case.expect], \
                        (status, body[:300], what)
                    if status >= 400:
                        refused += 1
                        check_error_shape(body)
                    elif case.raw is None and (b'data: {"error"' in body or b"event: error" in body):
                        raise AssertionError(f"a stream ended in an error: {body[-300:]!r}, {what}")
                health = http.get("/health")
                assert health.status_code == 200 and health.json() == {"status": "ok"}, (health.text, what)
        assert sent >= 1000 and 0 < refused < sent
        assert "Traceback" not in srv.output() and "Exception in ASGI" not in srv.output(), srv.output()[-3000:]
    finally:
        srv.kill()
