"""The OpenAI-compatible HTTP API, served by rank 0: /v1/models, /v1/completions, /v1/chat/completions,
/v1/responses (serve/responses.py) (streamed as server-sent events when asked), /health and /metrics.

Each request becomes a Sequence handed to the scheduler; its tokens come back on the event loop, are
decoded a piece at a time and cut at the first stop string. A request ends when its sequence does, or
when its client goes away (the sequence is cancelled and its KV blocks freed before the next step).
Requests beyond the running batch wait in a bounded queue; past it they are refused with 429.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import itertools
import json
import secrets
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import h11
from fastapi import Depends, FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from uvicorn.protocols.http.h11_impl import H11Protocol

import distmk
from distmk.errors import DistmkError
from distmk.runtime.batcher import Sequence
from distmk.runtime.sampling import TokenLogprob, resolve_sampling
from distmk.runtime.structured import Grammars
from distmk.runtime.tokenizer import IncrementalDecoder
from distmk.serve.protocol import (APIError, ChatRequest, CompletionRequest, DetokenizeRequest, OutputFormat,
                                   TokenizeRequest, parse_body)
from distmk.serve.reasoning import ReasoningReader, thinking_at_start
from distmk.serve.responses import ResponseShape, ResponsesRequest, in_responses_words
from distmk.serve.tools import ToolChoice, call_schema, format_or_call_schema

MAX_BODY_BYTES = 8 << 20
BEARER_CHALLENGE = {"WWW-Authenticate": "Bearer"}
REQUEST_BODIES = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatRequest,
                  "/v1/responses": ResponsesRequest, "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest}


@dataclass
class Served:
    """What the routes need: the model's name and limits, its tokenizer, the scheduler and the metrics."""
    model_name: str
    tokenizer: object
    scheduler: object
    metrics: object
    max_context: int
    capacity: int                        # requests running or queued at once; beyond: 429
    vocab_size: int                      # token ids at or past it are refused where a request names ids
    api_key: str | None = None           # when set, clients send it as "Authorization: Bearer <key>"
    metrics_public: bool = False         # /metrics without the key
    reasoning: bool = False              # chat replies' <think> ... </think> apart (--reasoning-parser)
    sampling_defaults: dict = field(default_factory=dict)     # the checkpoint's (ModelSpec.generation_defaults)
    eos_token_ids: tuple[int, ...] = ()          # the ids that end a sequence (a grammar's end: response_format)
    live: set = field(default_factory=set)      # their Generations
    created: int = field(default_factory=lambda: int(time.time()))
    # tokenizing, rendering chat templates and compiling grammars off the event loop (a long prompt or a large
    # schema takes a while), one call at a time (a Hugging Face tokenizer is not made for concurrent calls)
    tokenizing: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1, "tokenize"))

    @functools.cached_property
    def grammars(self) -> Grammars:
        """response_format's grammar compiler, made at its first use (xgrammar reads the whole vocabulary)."""
        return Grammars(self.tokenizer, self.vocab_size, self.eos_token_ids)

    def constraints(self, req, tools: ToolChoice | None, count: int) -> list:
        """Each of `count` sequences' Constraint: of a forced tool call, or else of what the reply is held to
        (req.output_format: response_format or structured_outputs), which tool_choice "auto" lets a call stand in
        for where it is JSON (None for neither). A forced call's reply is the call, no text for the format to hold:
        the OpenAI Agents SDK sends both where an agent with an output type must call a tool first, and an output
        type beside tools chosen "auto" where it may."""
        held = req.output_format()
        if tools is not None and tools.forced:
            held = OutputFormat("json_schema", call_schema(tools.offered, tools.named, tools.parallel), "tools", True)
        elif held is not None and tools is not None and tools.mode == "auto":      # or a call
            if held.kind not in ("json_object", "json_schema"):
                raise APIError(400, f"{held.param} holds the reply to text that is not a tool call; with tools, "
                                    "tool_choice 'none' (or a format of JSON, which a call may stand in for)",
                               param=held.param)
            held = held._replace(kind="json_schema", spec=format_or_call_schema(
                {"type": "object"} if held.spec is None else held.spec, tools.offered))
        if held is None:
            return [None] * count
        try:
            return [self.grammars.constraint(held.kind, held.spec, held.compact) for _ in range(count)]
        except DistmkError as e:
            raise APIError(400, str(e), param=held.param) from None

    async def off_loop(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.tokenizing, fn, *args)

    def check_admission(self, sequences: int = 1) -> None:
        """503 while the engine is down, 429 at capacity (a request of n choices takes n places): before any
        work on a request, and as it starts."""
        if not self.scheduler.alive:
            raise APIError(503, f"the engine is down: {self.scheduler.failure or 'stopping'}", type="server_error")
        if len(self.live) + sequences > self.capacity:
            raise APIError(429, f"the server is at capacity ({len(self.live)} sequences running or queued of "
                                f"{self.capacity}, {sequences} more asked); retry later", type="rate_limit_error",
                           code="rate_limit_exceeded",
                           headers={"Retry-After": "1"})

    def abort_all(self, message: str) -> None:
        """End every request still running with an error (at shutdown, once they had their grace time)."""
        for generation in list(self.live):
            generation.on_failure(message)


class StopStrings:
    """Cuts text at the first stop string to appear, holding back a tail that may be the start of one.

    Each stop string keeps its Knuth-Morris-Pratt state (how long a start of it the text ends with), so
    each character of the text is looked at once per stop string: linear in the text, however long the
    stop strings are. Of stop strings completed by the same character, the longest wins. The text sent ends
    before the stop string, or after it for those in `kept` (vLLM's include_stop_str_in_output)."""

    def __init__(self, stops: list[str], kept: frozenset[str] = frozenset()):
        self.stops, self.kept, self.pending = stops, kept, ""
        self.fallback = [_kmp_fallback(s) for s in stops]
        self.matched = [0] * len(stops)

    def feed(self, text: str, final: bool) -> tuple[str, bool]:
        """(text that is safe to send, whether a stop string was reached)."""
        for end, char in enumerate(text, 1):
            completed = ""
            for i, stop in enumerate(self.stops):
                k = self.matched[i]
                while k and stop[k] != char:
                    k = self.fallback[i][k - 1]
                if stop[k] == char:
                    k += 1
                if k == len(stop) and k > len(completed):
                    completed = stop
                self.matched[i] = k
            if completed:
                seen = self.pending + text[:end]          # the stop string lies in what is not sent yet
                self.pending = ""
                return (seen if completed in self.kept else seen[:len(seen) - len(completed)]), True
        seen = self.pending + text
        hold = 0 if final else max(self.matched, default=0)
        out, self.pending = seen[:len(seen) - hold], seen[len(seen) - hold:]
        return out, False


def _kmp_fallback(s: str) -> list[int]:
    """fallback[k - 1]: the longest proper prefix of s[:k] that is also a suffix of it."""
    fallback, k = [0] * len(s), 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = fallback[k - 1]
        if s[i] == s[k]:
            k += 1
        fallback[i] = k
    return fallback


class Aborted(Exception):
    """The request cannot finish: the engine failed or the server is shutting down (503), or something
    went wrong with this request alone (500)."""

    def __init__(self, message: str, status: int = 503):
        super().__init__(message)
        self.status = status

    def as_api_error(self) -> "APIError":
        return APIError(self.status, str(self), type="server_error")


@dataclass
class Piece:
    text: str
    token: int
    finish_reason: str | None
    logprob: TokenLogprob | None = None     # where the request asked for log-probabilities


class Generation:
    """One request's sequence, seen from the event loop. It is the scheduler's listener for it."""

    def __init__(self, served: Served, seq: Sequence, stops: list[str], arrived: float,
                 kept_stops: frozenset[str] = frozenset()):
        self.served, self.seq, self.arrived = served, seq, arrived
        self.queue: asyncio.Queue = asyncio.Queue()
        self.decoder = IncrementalDecoder(served.tokenizer)
        self.stop = StopStrings(stops, kept_stops)
        self.tokens: list[int] = []
        self.finish_reason: str | None = None
        self.last_token_at: float | None = None
        self.started = self.closed = False
        self.engine_done = False           # the engine finished the sequence (length or EOS)
        self.prompt_logprobs: list[TokenLogprob] | None = None     # of prompt[1:], with the first token

    def start(self) -> None:
        served = self.served
        served.check_admission()
        served.live.add(self)
        self.started = True
        served.metrics.prompt_tokens.inc(len(self.seq.prompt))
        served.scheduler.submit(self.seq, self)

    def on_token(self, token: int, finish_reason: str | None, logprob: TokenLogprob | None = None,
                 prompt_logprobs: list[TokenLogprob] | None = None) -> None:
        self.engine_done = finish_reason is not None
        if not self.closed:
            self.queue.put_nowait((token, finish_reason, logprob, prompt_logprobs))

    def on_failure(self, message: str, status: int = 503) -> None:
        if not self.closed:
            self.queue.put_nowait(Aborted(message, status))

    async def pieces(self):
        metrics = self.served.metrics
        while self.finish_reason is None:
            item = await self.queue.get()
            if isinstance(item, Aborted):
                self.finish_reason = "error"
                raise item
            token, finish_reason, logprob, prompt_logprobs = item
            self.prompt_logprobs = self.prompt_logprobs or prompt_logprobs
            now = time.monotonic()
            if self.last_token_at is None:
                metrics.ttft.observe(now - self.arrived)
            else:
                metrics.itl.observe(now - self.last_token_at)
            self.last_token_at = now
            metrics.generation_tokens.inc()
            self.tokens.append(token)
            try:
                text = self.decoder.push(token) + (self.decoder.flush() if finish_reason else "")
                stopped = False
                if len(self.tokens) >= self.seq.min_tokens:       # vLLM's: no stop string before min_tokens
                    text, stopped = self.stop.feed(text, final=finish_reason is not None)
            except Exception as e:  # noqa: BLE001 - decoding or stop strings failed for this request only
                self.finish_reason = "error"
                raise Aborted(f"decoding the output failed: {type(e).__name__}: {e}", status=500) from None
            if stopped and finish_reason is None:
                self.served.scheduler.cancel(self.seq)         # frees its KV blocks before the next step
            self.finish_reason = "stop" if stopped else finish_reason
            yield Piece(text, token, self.finish_reason, logprob)

    def close(self) -> None:
        """Whatever ended the request (its client left, a stop string, an abort): a sequence the engine
        has not finished is cancelled."""
        if self.closed or not self.started:
            return
        self.closed = True
        served = self.served
        served.live.discard(self)
        if not self.engine_done:
            served.scheduler.cancel(self.seq)
        served.metrics.finished.labels(self.finish_reason or "cancelled").inc()
        if self.finish_reason in ("stop", "length"):
            served.metrics.latency.observe(time.monotonic() - self.arrived)


class GenerationStream(StreamingResponse):
    """Server-sent events of a request's generations (one a choice); closes them however the response ends (a
    client that disconnects cancels the response task, which lands here)."""

    def __init__(self, generations: list[Generation], events):
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.generations = generations

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()       # its tasks end with it (a client that left: Starlette does not)
            for generation in self.generations:
                generation.close()


def create_app(served: Served) -> FastAPI:
    async def authorize(request: Request) -> None:
        """With an API key, every route but /health (and /metrics when public) needs it as a bearer token,
        compared in constant time."""
        path = request.url.path
        if served.api_key is None or path == "/health" or (path == "/metrics" and served.metrics_public):
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            raise APIError(401, "this server needs an API key: send it in an Authorization header as "
                                "'Authorization: Bearer <key>'", code="invalid_api_key", headers=BEARER_CHALLENGE)
        if not secrets.compare_digest(given.strip().encode(), served.api_key.encode()):
            raise APIError(401, "incorrect API key provided", code="invalid_api_key", headers=BEARER_CHALLENGE)

    app = FastAPI(title="distmk", version=distmk.__version__, redoc_url=None, dependencies=[Depends(authorize)])
    metrics = served.metrics

    def openapi() -> dict:
        """FastAPI's schema (/openapi.json, /docs), with the request bodies the routes parse themselves (strictly:
        protocol.py) as components."""
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for path, model in REQUEST_BODIES.items():
                body = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(body.pop("$defs", {}), **{model.__name__: body})
                schema["paths"][path]["post"]["requestBody"] = {"required": True, "content": {"application/json": {
                    "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi

    def count(request: Request, status: int) -> None:
        route = request.scope.get("route")
        metrics.requests.labels(route.path if route else "unmatched", str(status)).inc()

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        count(request, e.status)
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):
        """Starlette's 404 and 405 in OpenAI's shape, with their headers (a 405's Allow)."""
        return await api_error(request, APIError(e.status_code, f"{request.method} {request.url.path}: {e.detail}",
                                                 code=str(e.status_code), headers=e.headers))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception):
        count(request, 500)
        return JSONResponse(APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error").body(),
                            status_code=500)

    @app.get("/health")
    async def health():
        if not served.scheduler.alive:
            raise APIError(503, f"the engine is down: {served.scheduler.failure or 'stopped'}", type="server_error")
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def model_card() -> dict:
        return {"id": served.model_name, "object": "model", "created": served.created, "owned_by": "distmk",
                "max_model_len": served.max_context}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        check_model(model_id, param=None)
        return model_card()

    @app.post("/tokenize")
    async def tokenize(request: Request):
        """vLLM's: a prompt's token ids, or a conversation's as the chat template renders it for a reply."""
        req = await parse(request, TokenizeRequest)
        if req.prompt is None:
            tokens, _ = await render_chat(req)
        else:
            try:
                tokens = await served.off_loop(served.tokenizer.encode, req.prompt, req.add_special_tokens)
            except DistmkError as e:                 # this model takes token ids only
                raise APIError(400, str(e), param="prompt") from None
        count(request, 200)
        return {"count": len(tokens), "max_model_len": served.max_context, "tokens": tokens}

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        """vLLM's: what a client needs to tokenize as the server does (lm-eval's remote tokenizer reads it)."""
        return {**served.tokenizer.special_tokens(), "model_max_length": served.max_context,
                "tokenizer_class": type(served.tokenizer).__name__}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        """vLLM's: the text of token ids."""
        req = await parse(request, DetokenizeRequest)
        check_vocabulary(req.tokens, "tokens")
        count(request, 200)
        return {"prompt": await served.off_loop(served.tokenizer.decode, req.tokens)}

    def check_vocabulary(tokens: list[int], param: str, what: str = "token ids") -> None:
        bad = [t for t in tokens if t >= served.vocab_size]
        if bad:
            raise APIError(400, f"{what} {bad[:5]} are outside the vocabulary 0..{served.vocab_size - 1}",
                           param=param)

    async def parse(request: Request, schema):
        """The request's JSON body as `schema` has it, the model it names (where it names one) this one."""
        check_json_content(request)
        req = parse_body(schema, await read_body(request))
        if req.model is not None:
            check_model(req.model)
        return req

    async def accept(request: Request, schema):
        """The parsed request and when it arrived, once its model is known and there is room for it."""
        arrived = time.monotonic()
        req = await parse(request, schema)
        served.check_admission()
        return req, arrived

    @app.post("/v1/completions")
    async def completions(request: Request):
        req, arrived = await accept(request, CompletionRequest)
        if req.max_tokens == 0 and not req.echo:
            raise APIError(400, "max_tokens 0 needs echo: true (the reply is then the prompt alone)",
                           param="max_tokens")
        prompts = []
        for prompt in req.prompt:
            try:
                prompts.append(await served.off_loop(served.tokenizer.encode, prompt) if isinstance(prompt, str)
                               else prompt)
            except DistmkError as e:                 # this model takes token ids only
                raise APIError(400, str(e), param="prompt") from None
        texts = [p if isinstance(p, str) else None for p in req.prompt]     # what echo repeats of a text prompt
        return await respond(request, req, prompts, "prompt", req.max_tokens, [], arrived, chat=False,
                             prompt_texts=texts)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req, arrived = await accept(request, ChatRequest)
        return await answer_chat(request, req, arrived)

    @app.post("/v1/responses")
    async def responses(request: Request):
        """OpenAI's Responses API, answered as the chat request it amounts to (serve/responses.py)."""
        req, arrived = await accept(request, ResponsesRequest)
        try:
            return await answer_chat(request, req.as_chat(), arrived, ResponseShape(req, served.model_name), "input")
        except APIError as e:
            raise in_responses_words(e) from None

    async def answer_chat(request, req, arrived, shape=None, prompt_param="messages"):
        tools = ToolChoice.of(req)
        prompt, format_stops = await render_chat(req, tools.offered if tools else None, prompt_param)
        max_tokens = req.max_completion_tokens or req.max_tokens
        # where the template leaves a <think> open, the reply starts in its reasoning (the tail's raw bytes: a
        # tokenizer may take the tags for special tokens)
        thinking = thinking_at_start(b"".join(map(served.tokenizer.token_bytes, prompt[-16:])).decode(
            errors="replace")) if served.reasoning else None
        return await respond(request, req, [prompt], prompt_param, max_tokens, list(format_stops), arrived, chat=True,
                             tools=tools, shape=shape, thinking=thinking)

    async def render_chat(req, tools: list[dict] | None = None,
                          param: str = "messages") -> tuple[list[int], tuple[str, ...]]:
        """The request's conversation as the tokenizer renders it (its prompt, its format's stop strings). Its
        chat_template_kwargs may also set add_generation_prompt and continue_final_message, as vLLM merges them."""
        kwargs = dict(req.chat_template_kwargs or {})
        opens = kwargs.pop("add_generation_prompt", req.add_generation_prompt)
        continues = kwargs.pop("continue_final_message", req.continue_final_message)
        if opens and continues:
            raise APIError(400, "continue_final_message and add_generation_prompt cannot both be true",
                           param="chat_template_kwargs")
        render = functools.partial(served.tokenizer.render_chat, template_kwargs=kwargs, add_generation_prompt=opens,
                                   continue_final_message=continues)
        try:
            return await served.off_loop(render, [m.for_template() for m in req.messages], tools)
        except DistmkError as e:                     # this model takes token ids only
            raise APIError(400, str(e), param=param) from None
        except Exception as e:  # noqa: BLE001 - a chat template refuses a conversation by raising
            raise APIError(400, f"the chat template cannot render these messages: {e}", param=param) from None

    def check_model(name: str, param: str | None = "model") -> None:
        if name != served.model_name:
            raise APIError(404, f"the model '{name}' does not exist; this server serves '{served.model_name}'",
                           param=param, code="model_not_found")

    async def respond(request, req, prompts, prompt_param, max_tokens, format_stops, arrived, chat,
                      prompt_texts=None, tools=None, shape=None, thinking=None):
        """The reply to `prompts` (token ids; a completions request may batch several), n choices each, indexed
        prompt-major (prompt * n + choice) as OpenAI has them. max_tokens 0 (with echo): one token is generated
        and not shown. `shape`: the Responses API's (ResponseShape) of a chat reply; `thinking`: where a reasoning
        parser runs, whether the reply starts in its reasoning (serve/reasoning.py)."""
        if max_tokens is not None and req.min_tokens > max_tokens:
            raise APIError(400, f"min_tokens {req.min_tokens} is more than max_tokens {max_tokens}", param="min_tokens")
        for i, prompt in enumerate(prompts):
            at = f"{prompt_param}[{i}]" if len(prompts) > 1 else prompt_param
            room = served.max_context - len(prompt)
            if room < 1:
                raise APIError(400, f"the prompt has {len(prompt)} tokens, but the context holds "
                                    f"{served.max_context} including at least one generated token", param=at,
                               code="context_length_exceeded")
            for name, wanted in (("min_tokens", req.min_tokens), ("max_tokens", max_tokens)):
                if wanted is not None and wanted > room:
                    raise APIError(400, f"{name} {wanted} is more than the context has room for: {room} tokens after "
                                        f"the prompt's {len(prompt)} (context {served.max_context})",
                                   param=name, code="context_length_exceeded")
        top_k = None if req.top_k is None else max(req.top_k, 0)          # -1, as vLLM has it: no limit
        params = resolve_sampling(req.temperature, req.top_p, top_k, req.seed, defaults=served.sampling_defaults,
                                  greedy_default=False, presence_penalty=req.presence_penalty,
                                  frequency_penalty=req.frequency_penalty, repetition_penalty=req.repetition_penalty,
                                  logit_bias=req.logit_bias or None, min_p=req.min_p)
        choices = req.n * len(prompts)
        if choices > served.capacity:
            what = f"n {req.n}" + (f" of {len(prompts)} prompts ({choices} sequences)" if len(prompts) > 1 else "")
            raise APIError(400, f"{what} is more choices than the server runs or queues at once ({served.capacity})",
                           param="n")
        # the prompt's log-probabilities: completions' echo with logprobs, vLLM's prompt_logprobs
        asked = [k for k in (req.prompt_logprobs, None if chat or not req.echo else req.logprobs) if k is not None]
        constraints = iter(await served.off_loop(served.constraints, req, tools, req.n * len(prompts)))
        # choice i draws from seed + i: choice 0 is what the same request with n = 1 gets
        seqs = [Sequence(prompt, 1 if max_tokens == 0 else max_tokens or served.max_context - len(prompt),
                         params if params.seed is None or i == 0 else
                         dataclasses.replace(params, seed=(params.seed + i) % 2 ** 64),
                         stop_on_eos=not req.ignore_eos, stop_tokens=frozenset(req.stop_token_ids or ()),
                         min_tokens=req.min_tokens,
                         logprobs=((req.top_logprobs or 0) if req.logprobs else None) if chat else req.logprobs,
                         prompt_logprobs=max(asked) if asked else None, constraint=next(constraints))
                for prompt in prompts for i in range(req.n)]
        check_vocabulary(req.stop_token_ids or [], "stop_token_ids", "stop token ids")
        check_vocabulary(sorted(req.logit_bias or ()), "logit_bias", "logit_bias token ids")
        for i, prompt in enumerate(prompts):
            try:
                served.scheduler.check(seqs[i * req.n])
            except DistmkError as e:
                raise APIError(400, str(e), param=f"{prompt_param}[{i}]" if len(prompts) > 1 else prompt_param) \
                    from None
        served.check_admission(len(seqs))
        kept = frozenset(req.stop) if req.include_stop_str_in_output else frozenset()   # the caller's, not the format's
        generations = [Generation(served, seq, req.stop + format_stops, arrived, kept) for seq in seqs]
        try:
            for generation in generations:
                generation.start()
        except APIError:                        # the engine went down meanwhile: none of them stays
            for generation in generations:
                generation.close()
            raise
        reply = Reply(served, req, chat, prompts, prompt_texts, tools, thinking)
        if req.stream:
            count(request, 200)
            return GenerationStream(generations, reply.events(generations) if shape is None else
                                    _named_events(shape.events, reply.chunks(generations)))
        try:
            response = await reply.whole(generations, request)
        finally:
            for generation in generations:
                generation.close()
        if isinstance(response, dict):
            # JSON's types already: FastAPI would walk it again (jsonable_encoder), the most of a long prompt's
            # log-probabilities' time on the host
            response = JSONResponse(response if shape is None else shape.whole(response))
        count(request, response.status_code)
        return response

    return app


def check_json_content(request: Request) -> None:
    """A body whose Content-Type is not JSON gets 415 (as OpenAI answers); a body with none is read as JSON."""
    content_type = request.headers.get("content-type")
    if content_type is None:
        return
    media_type = content_type.partition(";")[0].strip().lower()
    if media_type != "application/json" and not media_type.endswith("+json"):
        raise APIError(415, f"the request body must be JSON (Content-Type: application/json), got Content-Type "
                            f"{content_type[:100]!r}", code="unsupported_media_type")


async def read_body(request: Request) -> bytes:
    if int(request.headers.get("content-length") or 0) > MAX_BODY_BYTES:
        raise APIError(413, f"the request body is over {MAX_BODY_BYTES} bytes")
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_BODY_BYTES:
                raise APIError(413, f"the request body is over {MAX_BODY_BYTES} bytes")
    except ClientDisconnect:            # nobody to answer; 499 (nginx's "client closed request") for the metrics
        raise APIError(499, "the client closed the connection before the end of the request body") from None
    return bytes(body)


class H11WithJSONErrors(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, answering a request it cannot parse (a bad request line or header, a
    broken chunked body, a bad Content-Length) in OpenAI's error shape rather than in plain text."""

    def send_400_response(self, msg: str) -> None:
        body = json.dumps(APIError(400, "the request is not valid HTTP/1.1").body()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body)),
                   (b"connection", b"close")]
        for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"), h11.Data(data=body),
                      h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()


async def _client_gone(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read, so receive() waits for it)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class Reply:
    """OpenAI's response shapes for one request: a whole completion, or its chunks as server-sent events. A
    completion with echo repeats its prompt before the output (and, with logprobs, the prompt's log-probabilities,
    the first token's null as OpenAI and vLLM give it); max_tokens 0 shows the prompt alone."""

    def __init__(self, served: Served, req, chat: bool, prompts: list[list[int]],
                 prompt_texts: list[str | None] | None = None, tools: ToolChoice | None = None,
                 thinking: bool | None = None):
        self.req, self.chat, self.prompts, self.tokenizer, self.tools = req, chat, prompts, served.tokenizer, tools
        self.thinking = thinking        # None: no reasoning parser; else whether the reply starts in its reasoning
        self.prompt_texts = prompt_texts or [None] * len(prompts)
        self.echo, self.hidden = not chat and req.echo, not chat and req.max_tokens == 0
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.head = {"id": self.id, "created": int(time.time()), "model": served.model_name}

    def text(self, token: int) -> str:
        """A token's text for log-probabilities: its bytes (tokenizer.token_bytes) as UTF-8, U+FFFD for a piece of
        a character."""
        return self.tokenizer.token_bytes(token).decode("utf-8", errors="replace")

    def logprobs(self, pieces: list[Piece], offset: int = 0) -> dict | None:
        """OpenAI's logprobs object of these tokens (None where the request did not ask): chat's list of
        {token, logprob, bytes, top_logprobs}, or completions' parallel lists (completion_logprobs)."""
        if not [p for p in pieces if p.logprob is not None]:
            return None
        if not self.chat:
            return self.completion_logprobs([(p.token, p.logprob) for p in pieces], offset)
        raw = self.tokenizer.token_bytes

        def entry(token, logprob):
            return {"token": self.text(token), "logprob": logprob, "bytes": list(raw(token))}
        return {"content": [{**entry(p.token, p.logprob.logprob),
                             "top_logprobs": [entry(t, v) for t, v in p.logprob.top]} for p in pieces]}

    def completion_logprobs(self, entries: list[tuple[int, TokenLogprob | None]], offset: int = 0) -> dict:
        """Completions' parallel lists of (token, its log-probability: None for a prompt's first token), whose
        top_logprobs hold the chosen token too (as vLLM's do) and whose text_offset counts the token texts before
        each from `offset`."""
        tokens = [self.text(token) for token, _ in entries]
        return {"tokens": tokens, "token_logprobs": [lp.logprob if lp else None for _, lp in entries],
                # the chosen token last: where another token reads the same, the chosen one's value shows
                "top_logprobs": [{self.text(t): v for t, v in (*lp.top, (token, lp.logprob))} if lp else None
                                 for token, lp in entries],
                "text_offset": list(itertools.accumulate(map(len, tokens[:-1]), initial=offset))}

    def prompt_entries(self, index: int, generation: Generation) -> list[tuple[int, TokenLogprob | None]]:
        """Choice `index`'s prompt tokens with their log-probabilities (the first has none)."""
        prompt = self.prompt(index)
        return [(prompt[0], None), *zip(prompt[1:], generation.prompt_logprobs or [])]

    def echo_text(self, index: int) -> str:
        """What echo puts before choice `index`'s output: the prompt's text (a text prompt as it was sent)."""
        text = self.prompt_texts[index // self.req.n]
        return self.tokenizer.decode(self.prompt(index)) if text is None else text

    def vllm_prompt_logprobs(self, index: int, generation: Generation) -> list:
        """vLLM's prompt_logprobs: null for the first token, then per prompt token {id: {logprob, rank,
        decoded_token}} of the token and the k most likely."""
        out = [None]
        for token, lp in self.prompt_entries(index, generation)[1:]:
            top = {t: (v, rank) for rank, (t, v) in enumerate(lp.top, 1)}
            top[token] = (lp.logprob, lp.rank)
            out.append({str(t): {"logprob": v, "rank": rank, "decoded_token": self.text(t)}
                        for t, (v, rank) in top.items()})
        return out

    def extras(self, index: int, generation: Generation) -> dict:
        """A choice's fields beyond OpenAI's: vLLM's prompt_logprobs where asked."""
        return {"prompt_logprobs": self.vllm_prompt_logprobs(index, generation)} \
            if self.req.prompt_logprobs is not None else {}

    def reasoning_reader(self) -> ReasoningReader | None:
        return None if self.thinking is None else ReasoningReader(self.thinking)

    def reasoning_fields(self, reasoning: str | None) -> dict:
        """A message's (or delta's) reasoning, as vLLM's `reasoning` and, for clients written before vLLM renamed
        it, `reasoning_content`; none without a reasoning parser or with include_reasoning false."""
        if self.thinking is None or not self.req.include_reasoning:
            return {}
        return {"reasoning": reasoning, "reasoning_content": reasoning}

    def usage(self, generations: list[Generation], sent: int | None = None) -> dict:
        """The request's usage; `sent`: the completion tokens streamed so far (a choice's pump may have taken more)."""
        if sent is None:
            sent = sum(len(generation.tokens) for generation in generations)
        n = 0 if self.hidden else sent
        prompt, choices = sum(map(len, self.prompts)), self.req.n
        # a prompt's tokens found in the prefix cache as it came (the fewest its choices found: the first choice
        # reads what no earlier request left, the others then start after it: runtime/batcher.py)
        cached = sum(min(g.seq.cached_tokens for g in generations[i:i + choices])
                     for i in range(0, len(generations), choices))
        return {"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def prompt(self, index: int) -> list[int]:
        """Choice `index`'s prompt (choices are prompt-major)."""
        return self.prompts[index // self.req.n]

    async def whole(self, generations: list[Generation], request: Request):
        """Every choice, once all are complete; a choice that fails fails the request, and a client that goes
        away stops them all."""
        collects = [asyncio.ensure_future(self._collect(generation)) for generation in generations]
        gone = asyncio.ensure_future(_client_gone(request))
        pending = set(collects)
        try:
            while pending:
                done, pending = await asyncio.wait(pending | {gone}, return_when=asyncio.FIRST_COMPLETED)
                pending.discard(gone)
                if gone in done or any(c.exception() for c in done if c is not gone):
                    break
        finally:                                # also where this handler is cancelled (at shutdown)
            gone.cancel()
            for collect in pending:
                collect.cancel()
        failed = [c.exception() for c in collects if c.done() and not c.cancelled() and c.exception()]
        if failed:
            raise failed[0].as_api_error() from None
        if pending:                             # nobody is listening: stop generating
            return Response(status_code=499)    # nginx's "client closed request", for the metrics only
        choices = []
        for index, (generation, collect) in enumerate(zip(generations, collects)):
            pieces = [] if self.hidden else collect.result()
            text, logprobs = "".join(piece.text for piece in pieces), self.logprobs(pieces)
            if self.echo:
                text = self.echo_text(index) + text
                if self.req.logprobs is not None:
                    logprobs = self.completion_logprobs(
                        self.prompt_entries(index, generation) + [(p.token, p.logprob) for p in pieces])
            choice = {"index": index, "logprobs": logprobs,
                      "finish_reason": "length" if self.hidden else generation.finish_reason}
            reasoning, thinking = None, self.reasoning_reader()
            if thinking is not None:            # the reasoning apart, the calls read out of the rest
                reasoning, text = thinking.read(text)
            reader = self.tools.reader() if self.tools else None
            calls = []
            if reader is not None:              # the calls read out of the reply, and the rest of its text
                text, calls = reader.read(text)
            message = {"role": "assistant", "content": text if text or not calls else None,
                       **self.reasoning_fields(reasoning or None)}
            if calls:
                message["tool_calls"], choice["finish_reason"] = calls, "tool_calls"
            choice.update({"message": message} if self.chat else {"text": text})
            if self.req.return_token_ids:
                choice.update(prompt_token_ids=self.prompt(index), token_ids=[p.token for p in pieces])
            choices.append({**choice, **self.extras(index, generation)})
        obj = "chat.completion" if self.chat else "text_completion"
        return {**self.head, "object": obj, "choices": choices, "usage": self.usage(generations)}

    @staticmethod
    async def _collect(generation: Generation) -> list[Piece]:
        return [piece async for piece in generation.pieces()]

    async def chunks(self, generations: list[Generation]):
        """One chunk per generated token of each choice, as they come (its text may be empty while a
        character or a possible stop string is incomplete), each with the usage so far where
        continuous_usage_stats asks (vLLM's), then the usage if asked. A choice that fails ends them with the
        error."""
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        first, offsets = [True] * len(generations), [0] * len(generations)
        sent = 0        # tokens streamed, for continuous_usage_stats
        readers = [self.tools.reader() if self.tools else None for _ in generations]
        thinkings = [self.reasoning_reader() for _ in generations]
        continuous_usage = self.req.stream_options is not None and self.req.stream_options.continuous_usage_stats
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, generation: Generation):
            try:
                async for piece in generation.pieces():
                    merged.put_nowait((index, piece))
            except Aborted as e:
                merged.put_nowait((index, e))
            except Exception as e:  # noqa: BLE001 - the stream ends with the error rather than a silent choice
                merged.put_nowait((index, Aborted(f"internal error: {type(e).__name__}: {e}", status=500)))
            finally:
                merged.put_nowait((index, None))

        pumps = [asyncio.ensure_future(pump(i, generation)) for i, generation in enumerate(generations)]
        try:
            running = len(generations)
            while running:
                index, piece = await merged.get()
                if piece is None:
                    running -= 1
                    continue
                if isinstance(piece, Aborted):
                    yield piece.as_api_error().body()
                    break
                generation = generations[index]
                extras = self.extras(index, generation) if first[index] else {}
                if first[index] and self.echo:
                    # the prompt comes first, as a chunk of its own (vLLM's prompt_logprobs with it)
                    text = self.echo_text(index)
                    logprobs = (self.completion_logprobs(self.prompt_entries(index, generation))
                                if self.req.logprobs is not None else None)
                    offsets[index] = len("".join(logprobs["tokens"])) if logprobs else 0
                    yield {**self.head, "object": obj, "choices": [{
                        "index": index, "text": text, "logprobs": logprobs, "finish_reason": None, **extras}]}
                    extras = {}
                if self.hidden:
                    piece = Piece("", piece.token, "length")
                logprobs = None if self.hidden else self.logprobs([piece], offsets[index])
                offsets[index] += len(logprobs["tokens"][0]) if logprobs and not self.chat else 0
                choice = {"index": index, "logprobs": logprobs, "finish_reason": piece.finish_reason}
                if self.chat:
                    text, reader, calls, reasoning = piece.text, readers[index], [], ""
                    if thinkings[index] is not None:        # the reasoning apart, the calls read out of the rest
                        reasoning, text = thinkings[index].feed(text)
                        if piece.finish_reason is not None:
                            more_reasoning, more_text = thinkings[index].finish()
                            reasoning, text = reasoning + more_reasoning, text + more_text
                    if reader is not None:      # content sent once it cannot be a call; the calls at the end
                        text = reader.feed(text)
                        if piece.finish_reason is not None:
                            rest, calls = reader.finish()
                            text += rest
                    choice["delta"] = {"role": "assistant", "content": text} if first[index] else {"content": text}
                    if reasoning:
                        choice["delta"].update(self.reasoning_fields(reasoning))
                    if calls:
                        choice["delta"]["tool_calls"] = [{"index": i, **call} for i, call in enumerate(calls)]
                        choice["finish_reason"] = "tool_calls"
                else:
                    choice["text"] = piece.text
                if self.req.return_token_ids:
                    choice["token_ids"] = [] if self.hidden else [piece.token]
                    if first[index]:
                        choice["prompt_token_ids"] = self.prompt(index)
                first[index] = False
                chunk = {**self.head, "object": obj, "choices": [{**choice, **extras}]}
                sent += 1
                if continuous_usage:
                    chunk["usage"] = self.usage(generations, sent)
                yield chunk
        finally:
            for task in pumps:
                task.cancel()
        if self.req.stream_options is not None and self.req.stream_options.include_usage:
            yield {**self.head, "object": obj, "choices": [], "usage": self.usage(generations)}

    async def events(self, generations: list[Generation]):
        """chunks as server-sent events, then [DONE]."""
        async with contextlib.aclosing(self.chunks(generations)) as chunks:
            async for chunk in chunks:
                yield _event(chunk)
        yield "data: [DONE]\n\n"


# characters that are no line break to SSE but are one to str.splitlines (which httpx's aiter_lines follows): a
# client reading lines that way would cut an event at a token holding one; JSON may escape them (json.dumps
# already escapes the rest, control characters). str.replace: translate takes a slow path on non-ASCII text.
_LINE_BREAKS = [(c, f"\\u{ord(c):04x}") for c in "\x85\u2028\u2029"]


def _event(obj: dict, name: str | None = None) -> str:
    text = json.dumps(obj, ensure_ascii=False)
    for char, escaped in _LINE_BREAKS:
        text = text.replace(char, escaped)
    return f"data: {text}\n\n" if name is None else f"event: {name}\ndata: {text}\n\n"


async def _named_events(translate, chunks):
    """The (name, object) pairs that `translate` makes of a reply's chunks as server-sent events, each named (the
    Responses API's); both generators closed with the stream."""
    async with contextlib.aclosing(chunks), contextlib.aclosing(translate(chunks)) as events:
        async for name, obj in events:
            yield _event(obj, name)
