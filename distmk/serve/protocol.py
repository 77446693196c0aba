"""The OpenAI request bodies the server accepts, and its errors in OpenAI's shape.

Bodies are validated strictly: a wrong type is an error rather than coerced ("1" is not a number), and a
parameter the server does not implement is refused by name instead of silently ignored. A few that
clients send with neutral values by habit (best_of: 1, suffix: null) are accepted with exactly those values, and
what a client says about itself or asks of OpenAI's storage (ClientFields) is accepted and unused.
Log-probabilities as OpenAI has them: `logprobs` (completions: how many alternatives, 0..MAX_LOGPROBS; with `echo`,
the prompt's too, and max_tokens 0 asks for nothing more: what lm-eval's loglikelihood tasks send), `logprobs` and
`top_logprobs` (chat); `logit_bias` (token ids, as strings, to -100..100). Extensions shared with vLLM: top_k,
min_p, repetition_penalty, stop_token_ids, ignore_eos, min_tokens, return_token_ids, prompt_logprobs,
stream_options.continuous_usage_stats, include_stop_str_in_output, structured_outputs, truncate_prompt_tokens,
allowed_token_ids, return_tokens_as_token_ids, chat_template_kwargs, add_generation_prompt, continue_final_message,
include_reasoning; its /tokenize and /detokenize. max_tokens: null means as many as the
context has room for.
"""
from __future__ import annotations

import functools
import inspect
import json
from typing import Annotated, Any, Literal, NamedTuple

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, PlainValidator, ValidationError, field_validator,
                      model_validator)

MAX_STOP_STRINGS = 64           # OpenAI's are 4, vLLM's unbounded; lm-eval sends a task's own (and the EOS text)
MAX_STOP_TOKEN_IDS = 64
MAX_CHOICES = 128              # n, at most (also at most what the server runs or queues at once)
MAX_LOGPROBS = 20              # alternatives a token's log-probabilities may list (OpenAI's chat limit, vLLM's default)
MAX_STOP_CHARS = 1024          # per stop string: a longer one is refused rather than matched
MAX_LOGIT_BIAS = 300           # tokens one logit_bias may bias (its tensors are built every step)
MAX_METADATA = 16              # OpenAI's limit of a request's metadata pairs
MAX_SPEC_CHARS = 64 << 10     # a regex's or grammar's text, or one choice, at most: compiled before the request runs
MAX_FORMAT_CHOICES = 1024      # structured_outputs.choice's strings, at most
MAX_ALLOWED_TOKENS = 4096      # allowed_token_ids, at most (a tensor of them is built every step)


class APIError(Exception):
    """An error response: {"error": {"message", "type", "param", "code"}} with an HTTP status (and headers)."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _neutral(value):
    """A parameter distmk does not implement, accepted only with the value that means 'off'."""
    def check(v):
        if v not in (None, value) and v != {}:
            raise ValueError(f"is not supported; only {json.dumps(value)} (or leaving it out) is accepted")
        return v
    return AfterValidator(check)


def _prompts(v: Any) -> list[str | list[int]]:
    """A completions prompt as the list of prompts it holds: a string or a list of token ids is one, a list of
    either (OpenAI's batched prompts) each of them."""
    if isinstance(v, str) or _is_token_ids(v):
        return [v]
    if isinstance(v, list) and v and all(isinstance(p, str) or _is_token_ids(p) for p in v):
        return v
    raise ValueError("must be a string, a list of token ids, or a non-empty list of either")


def _is_token_ids(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)


def _stop_strings(v: Any) -> list[str]:
    stops = [v] if isinstance(v, str) else v
    if v is None:
        return []
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise ValueError("must be a string or a list of strings")
    if len(stops) > MAX_STOP_STRINGS or not all(stops):
        raise ValueError(f"takes at most {MAX_STOP_STRINGS} non-empty strings")
    longest = max(map(len, stops), default=0)
    if longest > MAX_STOP_CHARS:
        raise ValueError(f"takes strings of at most {MAX_STOP_CHARS} characters, got one of {longest}")
    return stops


def _logit_bias(v: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's logit_bias: token ids (JSON's keys are strings) to a bias from -100 to 100 added to their logits."""
    if v is None:
        return {}
    if len(v) > MAX_LOGIT_BIAS:
        raise ValueError(f"takes at most {MAX_LOGIT_BIAS} tokens, got {len(v)}")
    bias = {}
    for key, value in v.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 10):
            raise ValueError(f"maps token ids to biases; {json.dumps(key)} is not a token id")
        if not -100 <= value <= 100:
            raise ValueError(f"takes biases from -100 to 100, got {value} for token {key}")
        if int(key) in bias:
            raise ValueError(f"names token {int(key)} twice")
        bias[int(key)] = value
    return bias


@functools.cache
def template_parameters() -> frozenset[str]:
    """What chat_template_kwargs may not set: transformers' apply_chat_template's own parameters, and the
    conversation as the template reads it (messages); add_generation_prompt, continue_final_message and documents
    it may, as vLLM merges them."""
    from transformers import PreTrainedTokenizerBase
    signature = inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters
    own = frozenset(k for k, p in signature.items() if p.kind is not p.VAR_KEYWORD and k != "self")
    return own - {"add_generation_prompt", "continue_final_message", "documents"} | {"messages"}


def _template_kwargs(v: dict[str, Any] | None) -> dict[str, Any] | None:
    own = sorted(template_parameters() & set(v or ()))
    if own:
        raise ValueError(f"cannot set {', '.join(own)}: the server renders the conversation with its own")
    return v


def _one_ending(request):
    """A conversation either opens the reply's turn or leaves its last message open, as vLLM has it."""
    if request.continue_final_message and request.add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
    return request


def _text_content(v: Any) -> str:
    if isinstance(v, str):
        return v
    if (isinstance(v, list) and all(isinstance(p, dict) and p.get("type") == "text" and set(p) == {"type", "text"}
                                    and isinstance(p["text"], str) for p in v)):
        return "".join(p["text"] for p in v)
    raise ValueError('must be a string or a list of {"type": "text", "text": ...} parts (only text is supported)')


def _only_when(name: str, switch: str):
    """A validator of parameter `name`: given, it needs the parameter `switch` (declared before it) to be true,
    as OpenAI has it for stream_options and top_logprobs."""
    def check(v, info):
        if v is not None and info.data.get(switch) is not True:
            raise ValueError(f"is only allowed when {switch} is true")
        return v
    return field_validator(name)(check)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False    # vLLM's: every chunk carries the usage so far (guidellm sends it)


class JsonSchemaFormat(_Strict):
    name: str
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")      # {} (left out): any JSON value
    strict: bool | None = None          # distmk always holds the output to the schema


class ResponseFormat(_Strict):
    """OpenAI's response_format: the reply is JSON, an object (json_object) or valid against a schema."""
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is given with type 'json_schema', and only then")
        return self


Effort = Literal["none", "minimal", "low", "medium", "high"]       # OpenAI's reasoning efforts


class StructuredOutputs(_Strict):
    """vLLM's structured_outputs: the reply held to one of a JSON schema (`json`: the schema, or its JSON text), any
    JSON object (`json_object`), a regular expression, a list of strings (`choice`: exactly one of them) or a grammar
    (xgrammar's EBNF, `root ::= ...`, or Lark). disable_any_whitespace: JSON without whitespace beyond one space
    after ':' and ','. Without a constraint, its options go with the response_format."""
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = Field(None, max_length=MAX_SPEC_CHARS)
    choice: list[Annotated[str, Field(max_length=MAX_SPEC_CHARS)]] | None = Field(None, min_length=1,
                                                                                 max_length=MAX_FORMAT_CHOICES)
    grammar: str | None = Field(None, max_length=MAX_SPEC_CHARS)
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False     # always so: an object takes only the properties its schema names

    @field_validator("json_")
    @classmethod
    def _schema(cls, v):
        if isinstance(v, str):
            try:
                v = json.loads(v)
            except json.JSONDecodeError as e:
                raise ValueError(f"is neither a JSON schema nor its JSON text ({e})") from None
            if not isinstance(v, dict):
                raise ValueError("is JSON text, but not of a schema (an object)")
        return v

    @model_validator(mode="after")
    def _one_constraint(self):
        if len(self.constraints()) > 1:
            raise ValueError(f"gives {' and '.join(self.constraints())}: one constraint at most")
        return self

    def constraints(self) -> list[str]:
        given = {"json": self.json_, "regex": self.regex, "choice": self.choice, "grammar": self.grammar,
                 "json_object": self.json_object or None}
        return [name for name, v in given.items() if v is not None]


GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
"""vLLM's parameters before structured_outputs (removed in its 0.12), which clients still send"""


class OutputFormat(NamedTuple):
    """What a reply is held to (runtime/structured.py Grammars.constraint's kind and spec), and the parameter that
    asked for it."""
    kind: str
    spec: Any
    param: str
    compact: bool = False


class ClientFields(_Strict):
    """Accepted and unused: what clients send about themselves, or for OpenAI's storage and caching (nothing is
    stored here, and prefix caching needs no key)."""
    user: str | None = None                        # the caller's id for the operator's logs
    safety_identifier: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = Field(None, max_length=MAX_METADATA)
    service_tier: Literal["auto", "default"] | None = None
    prompt_cache_key: str | None = None


class SamplingKnobs(ClientFields):
    """How tokens are drawn, as every generating route takes it (/v1/responses too)."""
    model: str
    # left out or null: the checkpoint's default (generation_config.json), else OpenAI's (temperature 1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, description="-1 or 0: no limit")
    min_p: float | None = Field(None, ge=0, le=1)       # vLLM's; null: the checkpoint's, else 0
    seed: int | None = Field(None, ge=-(2 ** 63), lt=2 ** 64)
    repetition_penalty: float | None = Field(None, gt=0)    # vLLM's; null: the checkpoint's, else 1


class _Sampling(SamplingKnobs):
    stop: Annotated[list[str], PlainValidator(_stop_strings)] = []
    stream: bool = False
    stream_options: StreamOptions | None = None     # only with stream: true, as OpenAI has it
    n: int = Field(1, ge=1, le=MAX_CHOICES)         # choices, each a sequence of its own
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)    # vLLM's: no end of sequence, stop token or stop string before this many
    include_stop_str_in_output: bool = False    # vLLM's: the text ends after the stop string rather than before it
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    return_token_ids: bool = False
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: Annotated[dict[str, float] | None, AfterValidator(_logit_bias)] = None
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)    # vLLM's: the prompt's log-probabilities
    # vLLM's: the prompt's last N tokens only (-1: as many as leave room for max_tokens)
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    allowed_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(None, min_length=1,
                                                                       max_length=MAX_ALLOWED_TOKENS)  # vLLM's
    return_tokens_as_token_ids: bool = False    # vLLM's: log-probabilities name tokens "token_id:N", not by text
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None     # vLLM's

    _only_when_streaming = _only_when("stream_options", "stream")

    @model_validator(mode="after")
    def _one_format(self):
        if self.response_format is not None and self.response_format.type != "text" and \
                self.structured_outputs is not None and self.structured_outputs.constraints():
            raise ValueError(f"response_format and structured_outputs.{self.structured_outputs.constraints()[0]} both "
                             "hold the reply; give one")
        return self

    def output_format(self) -> OutputFormat | None:
        """What the reply is held to: the response_format, or structured_outputs' constraint (None: text)."""
        options = self.structured_outputs or StructuredOutputs()
        compact = options.disable_any_whitespace
        if self.response_format is not None and self.response_format.type == "json_object":
            return OutputFormat("json_object", None, "response_format", compact)
        if self.response_format is not None and self.response_format.type == "json_schema":
            return OutputFormat("json_schema", self.response_format.json_schema.schema_,
                                "response_format.json_schema.schema", compact)
        if not options.constraints():
            return None
        name = options.constraints()[0]
        if name == "json":
            return OutputFormat("json_schema", options.json_, "structured_outputs.json", compact)
        if name == "json_object":
            return OutputFormat("json_object", None, "structured_outputs.json_object", compact)
        return OutputFormat(name, getattr(options, name), f"structured_outputs.{name}")


class CompletionRequest(_Sampling):
    prompt: Annotated[list[str | list[int]], PlainValidator(_prompts)]
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False              # the prompt before the output, and its log-probabilities with logprobs
    best_of: Annotated[int | None, _neutral(1)] = None
    suffix: Annotated[str | None, _neutral(None)] = None




class FunctionCall(_Strict):
    name: str
    arguments: str                          # JSON text, as OpenAI sends it


class ToolCall(_Strict):
    id: str
    type: Literal["function"]
    function: FunctionCall


class Message(_Strict):
    role: Literal["developer", "system", "user", "assistant", "tool"]
    content: Annotated[str | None, PlainValidator(lambda v: None if v is None else _text_content(v))] = None
    name: str | None = None              # the participant's name, for chat templates that show it
    tool_calls: list[ToolCall] | None = None    # an assistant's calls, earlier in the conversation
    tool_call_id: str | None = None             # a tool message's: the call it answers

    @model_validator(mode="after")
    def _roles_fields(self):
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only an assistant message has tool_calls")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("a tool message has a tool_call_id, and only a tool message")
        if self.content is None and not self.tool_calls:
            raise ValueError("content is missing (only an assistant message with tool_calls may leave it out)")
        return self

    def for_template(self) -> dict:
        """The message as chat templates take it: OpenAI's developer role is the system role of the
        templates (and of ChatML); a call's arguments are a mapping, as transformers' templates read them."""
        message = {"role": "system" if self.role == "developer" else self.role, "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _arguments(c.function.arguments)}} for c in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message if self.name is None else {**message, "name": self.name}


def _arguments(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text                     # as it was sent: the template shows it so


class FunctionDefinition(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None     # a JSON schema of the arguments (none: any object)
    strict: bool | None = None                   # distmk holds forced calls to the schema always


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = Field(None, min_length=1)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None    # none given: auto with tools
    parallel_tool_calls: bool | None = None     # "required" may make several calls, a named choice one
    # vLLM's: variables for the chat template (Qwen3's enable_thinking), the reply's turn opened after the messages,
    # or the last message left open for the reply to go on with it (a prefilled reply)
    chat_template_kwargs: Annotated[dict[str, Any] | None, AfterValidator(_template_kwargs)] = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    include_reasoning: bool = True      # vLLM's: false leaves a reasoning parser's reasoning out of the reply
    # OpenAI's, passed to the chat template as vLLM does (the templates of the families distmk runs do not read it)
    reasoning_effort: Effort | None = None

    _check_ending = model_validator(mode="after")(_one_ending)

    _only_with_logprobs = _only_when("top_logprobs", "logprobs")

    @field_validator("tools")
    @classmethod
    def _distinct_names(cls, tools):
        names = [t.function.name for t in tools or ()]
        if len(set(names)) < len(names):
            raise ValueError("must have distinct function names")
        return tools

    @field_validator("tool_choice")
    @classmethod
    def _of_the_tools(cls, choice, info):
        names = [t.function.name for t in info.data.get("tools") or ()]
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"names the function '{choice.function.name}', which is not among the tools")
        if choice in ("auto", "required") and not names:
            raise ValueError(f"'{choice}' needs tools")
        return choice

    @property
    def tool_mode(self) -> str:
        """none, auto, required, or named (tool_choice names a function)."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or ("auto" if self.tools else "none")


class TokenizeRequest(_Strict):
    """vLLM's /tokenize: a prompt's token ids, or a conversation's as the chat template renders it."""
    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = Field(None, min_length=1)
    add_special_tokens: bool = True        # a prompt's: the tokenizer's own (a BOS); lm-eval asks for none
    chat_template_kwargs: Annotated[dict[str, Any] | None, AfterValidator(_template_kwargs)] = None   # messages'
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    _check_ending = model_validator(mode="after")(_one_ending)

    @model_validator(mode="after")
    def _one_of(self):
        if (self.messages is None) == (self.prompt is None):
            raise ValueError("give either prompt or messages")
        return self


class DetokenizeRequest(_Strict):
    """vLLM's /detokenize: the text of token ids."""
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


def parse_body(model: type[_Strict], body: bytes) -> _Strict:
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise _as_api_error(e) from None


def _as_api_error(e: ValidationError) -> APIError:
    first = e.errors(include_url=False)[0]
    kind, loc = first["type"], first["loc"]
    param = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".") or None
    if kind == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {first['ctx']['error']}")
    if kind == "model_type" and not loc:
        return APIError(400, "the request body must be a JSON object")
    if kind == "extra_forbidden":
        moved = f" (vLLM's structured_outputs.{GUIDED[param]} now)" if param in GUIDED else ""
        return APIError(400, f"unsupported parameter '{param}'{moved}", param=param, code="unsupported_parameter")
    if kind == "missing":
        return APIError(400, f"missing required parameter '{param}'", param=param)
    message = first["msg"].removeprefix("Value error, ")
    more = f" (and {e.error_count() - 1} more problem(s))" if e.error_count() > 1 else ""
    return APIError(400, f"{f'{param!r}: ' if param else ''}{message}{more}", param=param)
