"""Tokenizers: the checkpoint's own (transformers), or for presets a byte-level fallback where each UTF-8
byte is one token id (0..255), so text prompts work on random-weight models too. A model with fewer than
256 ids has no text without a tokenizer of its own: it takes token ids only.

Chat messages become a prompt through the checkpoint's chat template. Without one (every preset, and
checkpoints whose tokenizer has no template) they are rendered as ChatML text:

    <|im_start|>system\\nYou are terse.<|im_end|>\\n<|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\n

and "<|im_end|>" ends the reply (it is a stop string), as it does for models trained on that format. Tools go
into the system turn, calls and their results into the turns, as Qwen2.5's template (Hermes' format) writes them.
"""
from __future__ import annotations

import re

import json

from distmk.errors import DistmkError

CHATML_END = "<|im_end|>"


TOOLS_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def render_chatml(messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = True,
                  continue_final_message: bool = False) -> str:
    if tools:
        offered = TOOLS_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if messages and messages[0]["role"] == "system":
            messages = [{**messages[0], "content": f"{messages[0]['content']}\n\n{offered}"}, *messages[1:]]
        else:
            messages = [{"role": "system", "content": offered}, *messages]
    turns = []
    for m in messages:
        role, calls = m["role"], [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                                  for c in m.get("tool_calls") or ()]
        content = "\n".join([m["content"]] * bool(m["content"]) + [
            f"<tool_call>\n{json.dumps(call, ensure_ascii=False)}\n</tool_call>" for call in calls])
        if role == "tool":
            role, content = "user", f"<tool_response>\n{content}\n</tool_response>"
        turns.append(f"<|im_start|>{role}\n{content}{CHATML_END}\n")
    if continue_final_message:                  # the last message left open, for the reply to go on with it
        turns[-1] = turns[-1][:-len(CHATML_END) - 1]
    return "".join(turns) + "<|im_start|>assistant\n" * add_generation_prompt


class ByteTokenizer:
    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The text's UTF-8 bytes (there are no special tokens to add)."""
        if self.vocab_size < 256:
            raise DistmkError(f"text needs a tokenizer: the byte-level one needs a vocabulary of >= 256 ids and "
                              f"this model has {self.vocab_size}, with no tokenizer of its own; give token ids instead "
                              "(--prompt-ids; in the API a prompt that is a list of ids)")
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def special_tokens(self) -> dict:
        """Bytes have no bos, eos or pad token of their own (a preset's eos is an id: ModelSpec.eos_token_id)."""
        return {"bos_token": None, "eos_token": None, "pad_token": None}

    def token_bytes(self, token: int) -> bytes:
        """One token's bytes, as log-probabilities show them (an id past 255: none)."""
        return bytes([token]) if token < 256 else b""

    def render_chat(self, messages: list[dict], tools: list[dict] | None = None, template_kwargs: dict | None = None,
                    add_generation_prompt: bool = True,
                    continue_final_message: bool = False) -> tuple[list[int], tuple[str, ...]]:
        """The prompt of a conversation ([{"role", "content"}] with text content, and where they have them the
        assistant's tool_calls and the tool messages' tool_call_id) offering `tools` (OpenAI's tool objects), and
        the stop strings that end a reply in its format. template_kwargs: variables for a chat template (vLLM's
        chat_template_kwargs); ChatML's reads none. add_generation_prompt: the reply's turn opened after the
        messages; continue_final_message: the last message left open instead, for the reply to go on with it (both
        as transformers' apply_chat_template has them)."""
        return self.encode(render_chatml(messages, tools, add_generation_prompt, continue_final_message)), \
            (CHATML_END,)


class HFTokenizer:
    def __init__(self, path: str):
        from transformers import AutoTokenizer
        from transformers.convert_slow_tokenizer import bytes_to_unicode
        self.tok = AutoTokenizer.from_pretrained(path)
        self._byte_of = {char: byte for byte, char in bytes_to_unicode().items()}     # byte-level BPE's alphabet
        decoder = getattr(getattr(self.tok, "backend_tokenizer", None), "decoder", None)
        self._byte_level = type(decoder).__name__ == "ByteLevel"
        self._added = set(self.tok.added_tokens_decoder)     # special tokens: their text, not byte-mapped
        self._bytes: dict[int, bytes] = {}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens)

    def special_tokens(self) -> dict:
        """The texts of the tokenizer's bos, eos and pad tokens (None where it has none)."""
        return {name: getattr(self.tok, name) for name in ("bos_token", "eos_token", "pad_token")}

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def token_bytes(self, token: int) -> bytes:
        """One token's bytes, as log-probabilities show them: a byte-level BPE token's own bytes (a piece of a
        longer character too, which decoding it alone would turn into U+FFFD), a SentencePiece token's with its
        word-start space ("▁world": b" world") or its byte-fallback byte ("<0xE2>"), an added token's text, and
        none for a special token (an end of sequence), which decode leaves out: a reply's token bytes join to its
        text, as vLLM's do with skip_special_tokens."""
        if token not in self._bytes:
            piece = self.tok.convert_ids_to_tokens(token)
            if token in self._added or piece is None:
                raw = self.tok.decode([token], skip_special_tokens=True).encode()
            elif self._byte_level:
                raw = bytes(self._byte_of[c] for c in piece)
            elif re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", piece):
                raw = bytes([int(piece[3:5], 16)])
            else:
                raw = piece.replace("\u2581", " ").encode()
            self._bytes[token] = raw
        return self._bytes[token]

    def render_chat(self, messages: list[dict], tools: list[dict] | None = None, template_kwargs: dict | None = None,
                    add_generation_prompt: bool = True,
                    continue_final_message: bool = False) -> tuple[list[int], tuple[str, ...]]:
        if not self.tok.chat_template:
            return self.encode(render_chatml(messages, tools, add_generation_prompt, continue_final_message)), \
                (CHATML_END,)
        text = self.tok.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                            add_generation_prompt=add_generation_prompt,
                                            continue_final_message=continue_final_message, **(template_kwargs or {}))
        return self.tok.encode(text, add_special_tokens=False), ()    # the template writes BOS itself


def load_tokenizer(path: str | None, vocab_size: int):
    return HFTokenizer(path) if path else ByteTokenizer(vocab_size)


class IncrementalDecoder:
    """The text of a growing list of token ids, one piece per new token. Decodes only the ids since the
    last complete piece (not the whole output every token), and holds back text that ends in an
    incomplete character (a UTF-8 sequence split across tokens) until it completes or flush() is called."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.start = 0      # ids[start:done] decode to the text already returned, as context for the rest
        self.done = 0

    def push(self, token: int) -> str:
        self.ids.append(token)
        return self._advance(final=False)

    def flush(self) -> str:
        """The text still held back, at the end of the sequence."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        before = self.tokenizer.decode(self.ids[self.start:self.done])
        text = self.tokenizer.decode(self.ids[self.start:])
        if len(text) > len(before) and (final or not text.endswith("\ufffd")):
            self.start, self.done = self.done, len(self.ids)
            return text[len(before):]
        return ""
