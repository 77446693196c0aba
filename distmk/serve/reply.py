"""OpenAI's response shapes of a request's generations (serve/generation.py): a whole completion or chat
completion, or its chunks as server-sent events, with log-probabilities, echo, a reasoning parser's reasoning
(serve/reasoning.py) and the tool calls read out of the text (serve/tools.py)."""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
import uuid
from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.responses import Response

from distmk.runtime.sampling import TokenLogprob
from distmk.serve.generation import Aborted, Generation, Piece
from distmk.serve.reasoning import ReasoningReader
from distmk.serve.tools import ToolChoice

if TYPE_CHECKING:
    from distmk.serve.app import Served


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
        a character; or "token_id:N" (vLLM's return_tokens_as_token_ids, for callers that need the ids)."""
        if self.req.return_tokens_as_token_ids:
            return f"token_id:{token}"
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
                    shown = self.reasoning_fields(reasoning) if reasoning else {}
                    choice["delta"] = {"role": "assistant", **shown} if first[index] else shown
                    if text or not shown:       # a delta of reasoning alone has no content, as vLLM's
                        choice["delta"]["content"] = text
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


async def named_events(translate, chunks):
    """The (name, object) pairs that `translate` makes of a reply's chunks as server-sent events, each named (the
    Responses API's); both generators closed with the stream."""
    async with contextlib.aclosing(chunks), contextlib.aclosing(translate(chunks)) as events:
        async for name, obj in events:
            yield _event(obj, name)
