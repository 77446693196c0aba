"""The OpenAI-compatible HTTP API, served by rank 0: /v1/models, /v1/completions, /v1/chat/completions,
/v1/responses (serve/responses.py) (streamed as server-sent events when asked), /health and /metrics.

Each request is checked (serve/protocol.py) and becomes a Sequence handed to the scheduler; its tokens come back
on the event loop (serve/generation.py) and go out in OpenAI's shapes (serve/reply.py). A request ends when its
sequence does, or when its client goes away (the sequence is cancelled and its KV blocks freed before the next
step). Requests beyond the running batch wait in a bounded queue; past it they are refused with 429.
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import h11
from fastapi import Depends, FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from uvicorn.protocols.http.h11_impl import H11Protocol

import distmk
from distmk.errors import DistmkError
from distmk.runtime.batcher import Sequence
from distmk.runtime.sampling import resolve_sampling
from distmk.runtime.structured import Grammars
from distmk.serve.generation import Generation, GenerationStream
from distmk.serve.protocol import (APIError, ChatRequest, CompletionRequest, DetokenizeRequest, OutputFormat,
                                   TokenizeRequest, parse_body)
from distmk.serve.reasoning import ReasonFirst, thinking_at_start
from distmk.serve.reply import Reply, named_events
from distmk.serve.responses import ResponseShape, ResponsesRequest, in_responses_words
from distmk.serve.tools import ToolChoice, call_schema, format_or_call_schema

MAX_BODY_BYTES = 8 << 20
THINK_TAIL = 4096        # a prompt's last tokens in which a reasoning parser looks for an open <think>
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
    think_token: int | None = None       # with it: the token of <think>, where the tokenizer has one
    sampling_defaults: dict = field(default_factory=dict)     # the checkpoint's (ModelSpec.generation_defaults)
    eos_token_ids: tuple[int, ...] = ()          # the ids that end a sequence (and a grammar's text)
    live: set = field(default_factory=set)      # their Generations
    created: int = field(default_factory=lambda: int(time.time()))
    # tokenizing and rendering chat templates off the event loop (a long prompt takes a while), one call at a time
    # (a Hugging Face tokenizer is not made for concurrent calls); compiling grammars beside it (a large schema
    # takes a while too, and holds up no other request's prompt)
    tokenizing: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1, "tokenize"))
    compiling: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1, "grammar"))

    @functools.cached_property
    def grammars(self) -> Grammars:
        """The grammar compiler of formats and forced tool calls, made at its first use (xgrammar reads the whole
        vocabulary)."""
        return Grammars(self.tokenizer, self.vocab_size, self.eos_token_ids)

    def constraints(self, req, tools: ToolChoice | None, count: int, thinking: bool | None = None) -> list:
        """Each of `count` sequences' Constraint: of a forced tool call, or else of what the reply is held to
        (req.output_format: response_format or structured_outputs), which tool_choice "auto" lets a call stand in
        for where it is JSON (None for neither). A forced call's reply is the call, no text for the format to hold:
        the OpenAI Agents SDK sends both where an agent with an output type must call a tool first, and an output
        type beside tools chosen "auto" where it may. `thinking`: where a reasoning parser runs, whether the reply
        starts in its reasoning; the grammar then holds it once its reasoning is over (ReasonFirst)."""
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
            grammars = [self.grammars.constraint(held.kind, held.spec, held.compact) for _ in range(count)]
        except DistmkError as e:
            raise APIError(400, str(e), param=held.param) from None
        if thinking is None:
            return grammars
        return [ReasonFirst(grammar, self.tokenizer.token_bytes, thinking, self.think_token) for grammar in grammars]

    async def off_loop(self, fn, *args, pool: ThreadPoolExecutor | None = None):
        return await asyncio.get_running_loop().run_in_executor(pool or self.tokenizing, fn, *args)

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
        # where the template (or a prefilled reply) leaves a <think> open, the reply starts in its reasoning
        thinking = thinking_at_start(b"".join(map(served.tokenizer.token_bytes, prompt[-THINK_TAIL:])).decode(
            errors="replace")) if served.reasoning else None
        return await respond(request, req, [prompt], prompt_param, max_tokens, list(format_stops), arrived, chat=True,
                             tools=tools, shape=shape, thinking=thinking)

    async def render_chat(req, tools: list[dict] | None = None,
                          param: str = "messages") -> tuple[list[int], tuple[str, ...]]:
        """The request's conversation as the tokenizer renders it (its prompt, its format's stop strings). Its
        chat_template_kwargs may also set add_generation_prompt and continue_final_message, as vLLM merges them."""
        kwargs = dict(req.chat_template_kwargs or {})
        effort = getattr(req, "reasoning_effort", None)      # chat's (/tokenize has none)
        if effort is not None:
            kwargs.setdefault("reasoning_effort", effort)
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
        keep = req.truncate_prompt_tokens       # vLLM's: the prompt's last tokens only (-1: what leaves room)
        if keep == -1:
            keep = served.max_context - max(1, max_tokens or 0, req.min_tokens)
        if keep is not None and keep >= served.max_context:
            raise APIError(400, f"truncate_prompt_tokens {keep} leaves no room in the context ({served.max_context} "
                                "tokens) for a generated token", param="truncate_prompt_tokens")
        if keep is not None and keep < 1:
            raise APIError(400, f"truncate_prompt_tokens {req.truncate_prompt_tokens} keeps no prompt token "
                                f"(max_tokens {max_tokens}, context {served.max_context})",
                           param="truncate_prompt_tokens")
        if keep is not None and any(len(prompt) > keep for prompt in prompts):
            prompt_texts = None                 # echo shows the tokens kept
            prompts = [prompt[max(len(prompt) - keep, 0):] for prompt in prompts]
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
                                  logit_bias=req.logit_bias or None, min_p=req.min_p,
                                  allowed_tokens=req.allowed_token_ids)
        choices = req.n * len(prompts)
        if choices > served.capacity:
            what = f"n {req.n}" + (f" of {len(prompts)} prompts ({choices} sequences)" if len(prompts) > 1 else "")
            raise APIError(400, f"{what} is more choices than the server runs or queues at once ({served.capacity})",
                           param="n")
        # the prompt's log-probabilities: completions' echo with logprobs, vLLM's prompt_logprobs
        asked = [k for k in (req.prompt_logprobs, None if chat or not req.echo else req.logprobs) if k is not None]
        held = req.output_format() is not None or (tools is not None and tools.forced)    # by a grammar
        if held and req.allowed_token_ids:
            raise APIError(400, "allowed_token_ids cannot go with a format or a forced tool call, whose grammar "
                                "chooses the tokens allowed", param="allowed_token_ids")
        ends = set(req.stop_token_ids or ()) | (set() if req.ignore_eos else set(served.eos_token_ids))
        if req.allowed_token_ids and req.min_tokens and set(req.allowed_token_ids) <= ends:
            raise APIError(400, f"allowed_token_ids are all tokens that end the reply, which min_tokens "
                                f"{req.min_tokens} holds back", param="allowed_token_ids")
        constraints = iter(await served.off_loop(served.constraints, req, tools, req.n * len(prompts), thinking,
                                                 pool=served.compiling))
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
        check_vocabulary(req.allowed_token_ids or [], "allowed_token_ids", "allowed token ids")
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
                                    named_events(shape.events, reply.chunks(generations)))
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
