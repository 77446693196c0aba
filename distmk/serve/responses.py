"""OpenAI's Responses API (/v1/responses): what the OpenAI Agents SDK and newer OpenAI clients send by default,
served on the chat path. A request's input items become a conversation (instructions first, as a system message;
function calls and their outputs as the assistant's tool_calls and tool messages), its function tools, tool_choice
and text.format the chat request's tools, tool_choice and response_format; the chat reply comes back as a Response:
a reasoning item (a reasoning parser's), a message item (its output_text) and a function_call item per call, or,
streamed, the Responses API's events.
Nothing is stored: a Response says store false, and previous_response_id, conversation and background are
refused."""
from __future__ import annotations

import itertools
import json
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Discriminator, Field, Tag, ValidationError, model_validator

from distmk.serve.protocol import (MAX_LOGPROBS, APIError, ChatRequest, Effort, FunctionDefinition, SamplingKnobs,
                                   _as_api_error, _neutral, _Strict)


class TextPart(_Strict):
    """A message's text: input_text, or output_text where an earlier Response's message is sent back."""
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None    # an output_text's, sent back as it came: not read
    logprobs: list[Any] | None = None


def _parts(v: Any) -> Any:
    """Text given as a string is one input_text part."""
    return [{"type": "input_text", "text": v}] if isinstance(v, str) else v


Text = Annotated[list[TextPart], BeforeValidator(_parts)]


class _SentBack(_Strict):
    """An earlier Response's item may come back with its id and status: not read."""
    id: str | None = None
    status: str | None = None


class InputMessage(_SentBack):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Text
    phase: str | None = None

    @property
    def text(self) -> str:
        return "".join(p.text for p in self.content)


class FunctionCallItem(_SentBack):
    """A call the model made, sent back with the history."""
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutput(_SentBack):
    """The caller's result of a call."""
    type: Literal["function_call_output"]
    call_id: str
    output: Text


class ReasoningItem(_SentBack):
    """An earlier Response's reasoning, sent back with the history (as the Agents SDK does): not shown to the model
    again, as reasoning models' templates leave earlier turns' reasoning out."""
    type: Literal["reasoning"]
    summary: list[Any] = []
    content: list[Any] | None = None
    encrypted_content: str | None = None


class Reasoning(_Strict):
    """reasoning: its effort goes to the chat template (chat's reasoning_effort); summaries are not written."""
    effort: Effort | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None      # summary's earlier name


def _item_type(item: Any) -> str:
    """An input item's type (a message may leave it out)."""
    return item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", "message")


InputItem = Annotated[
    Annotated[InputMessage, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutput, Tag("function_call_output")] | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type, custom_error_type="input_item", custom_error_message=(
        "is not an input item distmk takes: a message of text, a function_call, a function_call_output or a "
        "reasoning item"))]


class FunctionTool(FunctionDefinition):
    type: Literal["function"]

    @model_validator(mode="before")
    @classmethod
    def _functions_only(cls, v):
        if isinstance(v, dict) and v.get("type") != "function":
            raise ValueError(f"is a tool of type {json.dumps(v.get('type'))}; distmk runs function tools only")
        return v


class NamedFunction(_Strict):
    type: Literal["function"]
    name: str


class TextFormat(_Strict):
    """text.format: plain text, a JSON object, or JSON valid against a schema."""
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Annotated[str | None, _neutral("medium")] = None


class StreamOptions(_Strict):
    include_obfuscation: bool | None = None     # the deltas' random padding, against length side channels: none here


class ResponsesRequest(SamplingKnobs):
    input: Annotated[list[InputItem], Field(min_length=1), BeforeValidator(     # a string is one user message
        lambda v: [{"role": "user", "content": v}] if isinstance(v, str) else v)]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool = False
    prompt_cache_retention: str | None = None   # unused, as ClientFields' prompt_cache_key
    truncation: Annotated[str | None, _neutral("disabled")] = None
    reasoning: Reasoning | None = None
    # the output text's log-probabilities; reasoning items' encrypted content (none: reasoning is given as text)
    include: list[Literal["message.output_text.logprobs", "reasoning.encrypted_content"]] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)     # with it: its tokens' likeliest alternatives
    previous_response_id: Annotated[str | None, _neutral(None)] = None
    conversation: Annotated[str | dict | None, _neutral(None)] = None
    background: Annotated[bool | None, _neutral(False)] = None
    max_tool_calls: Annotated[int | None, _neutral(None)] = None
    stream_options: StreamOptions | None = None

    def messages(self) -> list[dict]:
        """The conversation as chat messages: a function call joins the assistant message before it, or opens one."""
        messages = [] if self.instructions is None else [{"role": "system", "content": self.instructions}]
        for item in self.input:
            if isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                if messages and messages[-1]["role"] == "assistant":
                    messages[-1].setdefault("tool_calls", []).append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif isinstance(item, FunctionCallOutput):
                messages.append({"role": "tool", "tool_call_id": item.call_id,
                                 "content": "".join(p.text for p in item.output)})
            elif isinstance(item, InputMessage):
                messages.append({"role": item.role, "content": item.text})
        return messages

    def as_chat(self) -> ChatRequest:
        """The chat request that answers this one (streamed with its usage last, for the Response's)."""
        messages = self.messages()
        if not messages:
            raise APIError(400, "input holds no message, call or call output (reasoning items are not shown)",
                           param="input")
        body = {"messages": messages, "stream": self.stream, **self.model_dump(
            include={*SamplingKnobs.model_fields, "parallel_tool_calls"}, exclude_none=True)}
        if self.max_output_tokens is not None:
            body["max_completion_tokens"] = self.max_output_tokens
        if self.reasoning is not None and self.reasoning.effort is not None:
            body["reasoning_effort"] = self.reasoning.effort
        if "message.output_text.logprobs" in (self.include or ()):
            body.update(logprobs=True, top_logprobs=self.top_logprobs or 0)
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        if self.tools:
            body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                             for t in self.tools]
        if isinstance(self.tool_choice, NamedFunction):
            body["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None and (self.tools or self.tool_choice == "required"):
            body["tool_choice"] = self.tool_choice      # "auto" and "none" need no tools to choose among
        form = self.text.format if self.text else None
        if form is not None and form.type == "json_schema":
            if form.name is None:
                raise APIError(400, "text.format of type 'json_schema' needs a name", param="text.format.name")
            body["response_format"] = {"type": "json_schema", "json_schema": form.model_dump(
                include={"name", "description", "schema_", "strict"}, exclude_none=True, by_alias=True)}
        elif form is not None:
            body["response_format"] = {"type": form.type}
        try:
            return ChatRequest.model_validate(body)
        except ValidationError as e:            # what the chat request checks beyond this one's (the route renames)
            raise _as_api_error(e) from None


# chat's parameters (or their starts) that a Responses request names otherwise, for its errors
RESPONSES_PARAMS = (("response_format.json_schema.", "text.format."), ("response_format", "text.format"),
                    ("max_completion_tokens", "max_output_tokens"), ("max_tokens", "max_output_tokens"))


def in_responses_words(error: APIError) -> APIError:
    """An error of the chat request that answers a Responses request, its param as the Responses API names it (a
    message of the conversation: the input, whose items are not chat's messages one to one)."""
    param = error.param or ""
    if param.startswith("messages"):
        error.param = "input"
    for chat, ours in RESPONSES_PARAMS:
        if param.startswith(chat):
            error.param = ours + param[len(chat):]
            break
    return error


def _usage(chat_usage: dict | None) -> dict | None:
    """A chat completion's usage in the Responses API's words."""
    if chat_usage is None:
        return None
    return {"input_tokens": chat_usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": chat_usage["prompt_tokens_details"]["cached_tokens"],
                                     "cache_write_tokens": 0},
            "output_tokens": chat_usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat_usage["total_tokens"]}


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseShape:
    """A chat reply as the Response of `req`: whole (a chat.completion's dict) or as events (its chunks')."""

    def __init__(self, req: ResponsesRequest, model_name: str):
        self.req, self.model_name = req, model_name
        self.id, self.created = _item_id("resp"), int(time.time())

    def response(self, status: str, output: list[dict], usage: dict | None = None) -> dict:
        req = self.req
        form = req.text.format if req.text and req.text.format else None
        choice = req.tool_choice.model_dump() if isinstance(req.tool_choice, NamedFunction) else req.tool_choice
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
                "model": self.model_name, "output": output, "parallel_tool_calls": req.parallel_tool_calls is not False,
                "previous_response_id": None, "store": False,
                "reasoning": {"effort": req.reasoning and req.reasoning.effort, "summary": None},
                "temperature": req.temperature, "top_p": req.top_p,
                "text": {"format": form.model_dump(exclude_none=True, by_alias=True) if form else {"type": "text"}},
                "tool_choice": choice or "auto",
                "tools": [t.model_dump(exclude_none=True) for t in req.tools or ()], "truncation": "disabled",
                "usage": _usage(usage), "user": req.user, "metadata": req.metadata or {}}

    @staticmethod
    def text_part(text: str, logprobs: list[dict] | None = None) -> dict:
        """output_text, with its tokens' log-probabilities (chat's entries: token, logprob, bytes, top_logprobs)."""
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}

    @staticmethod
    def message(item_id: str, status: str, parts: list[dict]) -> dict:
        return {"type": "message", "id": item_id, "role": "assistant", "status": status, "content": parts}

    @staticmethod
    def reasoning(item_id: str, status: str, text: str | None) -> dict:
        """A reasoning parser's reasoning (serve/reasoning.py) as a reasoning item of reasoning_text."""
        parts = [] if text is None else [{"type": "reasoning_text", "text": text}]
        return {"type": "reasoning", "id": item_id, "summary": [], "content": parts, "status": status}

    @staticmethod
    def function_call(call: dict, arguments: str, status: str) -> dict:
        return {"type": "function_call", "id": _item_id("fc"), "call_id": call["id"],
                "name": call["function"]["name"], "arguments": arguments, "status": status}

    def whole(self, chat: dict) -> dict:
        """The Response of a chat completion (n = 1): a reasoning item where it has reasoning, a message item unless
        the reply is only calls, then a function_call item per call; incomplete where max_output_tokens cut it."""
        choice = chat["choices"][0]
        status = "incomplete" if choice["finish_reason"] == "length" else "completed"
        content, calls = choice["message"]["content"], choice["message"].get("tool_calls") or []
        logprobs = (choice.get("logprobs") or {}).get("content")
        reasoning = choice["message"].get("reasoning")
        cut = "incomplete" if status == "incomplete" and not content and not calls else "completed"   # inside it
        output = [] if reasoning is None else [self.reasoning(_item_id("rs"), cut, reasoning)]
        if content is not None:
            output.append(self.message(_item_id("msg"), status, [self.text_part(content, logprobs)]))
        output += [self.function_call(call, call["function"]["arguments"], "completed") for call in calls]
        return self.response(status, output, chat["usage"])

    async def events(self, chunks):
        """The Responses API's events, as (type, event) pairs, of a streamed chat reply's chunks: a reasoning
        parser's reasoning as reasoning_text deltas, then the message's text as output_text deltas as it comes (with
        the log-probabilities of its tokens where asked), the calls once the reply is complete, then the Response
        (response.completed, or response.incomplete); an error ends them with an error event and response.failed."""
        numbers = itertools.count()

        def event(kind: str, **fields) -> tuple[str, dict]:
            return kind, {"type": kind, "sequence_number": next(numbers), **fields}

        output = []                     # the items done
        message_id, text, opened, calls, usage, finish = _item_id("msg"), "", False, [], None, None
        logprobs, unsent = [], 0        # the tokens' entries, and how many no delta carried yet (held-back text)
        thought = {"item_id": _item_id("rs"), "output_index": 0, "content_index": 0}
        reasoning, thinking = "", False     # the reasoning so far; whether its item is open

        def reasoning_done(status: str) -> list[tuple[str, dict]]:
            part = {"type": "reasoning_text", "text": reasoning}
            output.append(self.reasoning(thought["item_id"], status, reasoning))
            return [event("response.reasoning_text.done", **thought, text=reasoning),
                    event("response.content_part.done", **thought, part=part),
                    event("response.output_item.done", output_index=0, item=output[-1])]

        yield event("response.created", response=self.response("in_progress", []))
        yield event("response.in_progress", response=self.response("in_progress", []))
        where = {"item_id": message_id, "output_index": 0, "content_index": 0}
        async for chunk in chunks:
            if "error" in chunk:
                error = chunk["error"]
                yield event("error", code=error["code"], message=error["message"], param=error["param"])
                failed = self.response("failed", [])
                failed["error"] = {"code": error["code"] or "server_error", "message": error["message"]}
                yield event("response.failed", response=failed)
                return
            if not chunk["choices"]:            # the usage, last
                usage = chunk["usage"]
                continue
            choice = chunk["choices"][0]
            piece, finish = choice["delta"].get("content") or "", choice["finish_reason"] or finish
            calls += choice["delta"].get("tool_calls") or []
            logprobs += (choice.get("logprobs") or {}).get("content") or []
            if choice["delta"].get("reasoning"):        # it comes before the content (serve/reasoning.py)
                if not thinking:
                    thinking = True
                    yield event("response.output_item.added", output_index=0,
                                item=self.reasoning(thought["item_id"], "in_progress", None))
                    yield event("response.content_part.added", **thought, part={"type": "reasoning_text", "text": ""})
                reasoning += choice["delta"]["reasoning"]
                yield event("response.reasoning_text.delta", **thought, delta=choice["delta"]["reasoning"])
            if thinking and (piece or finish is not None):
                thinking = False
                for done in reasoning_done("incomplete" if finish == "length" and not piece else "completed"):
                    yield done
                where["output_index"] = len(output)
            if not opened and (piece or (finish is not None and not calls)):    # a reply of no text has a message
                opened = True
                yield event("response.output_item.added", output_index=where["output_index"],
                            item=self.message(message_id, "in_progress", []))
                yield event("response.content_part.added", **where, part=self.text_part(""))
            if piece:
                text += piece
                yield event("response.output_text.delta", **where, delta=piece, logprobs=logprobs[unsent:])
                unsent = len(logprobs)
        status = "incomplete" if finish == "length" else "completed"
        if thinking:
            for done in reasoning_done(status):
                yield done
        if opened:
            part = self.text_part(text, logprobs)
            yield event("response.output_text.done", **where, text=text, logprobs=logprobs)
            yield event("response.content_part.done", **where, part=part)
            output.append(self.message(message_id, status, [part]))
            yield event("response.output_item.done", output_index=where["output_index"], item=output[-1])
        for call in calls:
            index, arguments = len(output), call["function"]["arguments"]
            item = self.function_call(call, "", "in_progress")
            yield event("response.output_item.added", output_index=index, item=item)
            where_call = {"item_id": item["id"], "output_index": index}
            yield event("response.function_call_arguments.delta", **where_call, delta=arguments)
            yield event("response.function_call_arguments.done", **where_call, arguments=arguments)
            output.append(item | {"arguments": arguments, "status": "completed"})
            yield event("response.output_item.done", output_index=index, item=output[-1])
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        yield event(kind, response=self.response(status, output, usage))
