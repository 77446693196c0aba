"""A reasoning model's reply split as vLLM's reasoning parsers (`--reasoning-parser qwen3` or `deepseek_r1`) split
it: what the model writes between <think> and </think> is the message's `reasoning`, the rest its content (where
tool calls are read too). A reply starts in its reasoning where the prompt ends in an open <think> (DeepSeek-R1's
and Qwen3.5's templates write it there), or where it opens with <think> itself (Qwen3's); a reasoning that never
ends (max_tokens) is all reasoning. The tags are read in the text: a tokenizer that took them for special tokens
would leave them out of it (Qwen3's and DeepSeek-R1's do not). A format holds the reply once its reasoning is over
(ReasonFirst), as vLLM lets a reasoning model reason before a grammar holds its answer."""
from __future__ import annotations

START, END = "<think>", "</think>"
PARSERS = ("qwen3", "deepseek_r1")      # vLLM's names, which clients' launch scripts carry: one reader for both


def thinking_at_start(prompt_text: str) -> bool:
    """Whether a rendered prompt leaves a <think> open for the reply (its last <think> after its last </think>)."""
    return prompt_text.rfind(START) > prompt_text.rfind(END)


def think_token(tokenizer) -> int | None:
    """The token of <think>, where the tokenizer has one (Qwen3's, DeepSeek-R1's): a grammar lets it open a reply's
    reasoning (ReasonFirst)."""
    ids = tokenizer.encode(START, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None


def _partial_tail(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (and may become it with the next piece)."""
    return next((n for n in range(min(len(tag) - 1, len(text)), 0, -1) if tag.startswith(text[-n:])), 0)


class ReasoningReader:
    """A reply's text as it streams, split: `feed` returns the (reasoning, content) known so far, holding back an
    end that may be the start of a tag; `finish` what was held. Whitespace between </think> and the content (Qwen's
    "\\n\\n") is neither."""

    def __init__(self, thinking: bool):
        self.state = "reasoning" if thinking else "start"     # start: whether the reply opens with <think> is unknown
        self.held = ""

    def feed(self, piece: str) -> tuple[str, str]:
        text, self.held = self.held + piece, ""
        reasoning = ""
        while text:
            if self.state == "start":
                opening = text.lstrip()
                if opening.startswith(START):
                    text, self.state = opening[len(START):], "reasoning"
                elif START.startswith(opening):         # blank, or a beginning of <think>: not known yet
                    self.held = text
                    return reasoning, ""
                else:
                    self.state = "content"
            elif self.state == "reasoning":
                end = text.find(END)
                if end < 0:
                    keep = _partial_tail(text, END)
                    self.held = text[len(text) - keep:]
                    return reasoning + text[:len(text) - keep], ""
                reasoning, text, self.state = reasoning + text[:end], text[end + len(END):], "after"
            elif self.state == "after":
                text = text.lstrip()
                if text:
                    self.state = "content"
            else:
                return reasoning, text
        return reasoning, ""

    def finish(self) -> tuple[str, str]:
        held, self.held = self.held, ""
        return (held, "") if self.state == "reasoning" else ("", held)

    def read(self, text: str) -> tuple[str, str]:
        """(reasoning, content) of a whole reply."""
        reasoning, content = self.feed(text)
        more_reasoning, more_content = self.finish()
        return reasoning + more_reasoning, content + more_content


class ReasonFirst:
    """A grammar's Constraint (runtime/structured.py) that holds a reply once its reasoning is over: every token
    may come while it reasons, until its text holds </think>. A reply whose prompt left <think> open starts in its
    reasoning; else its first token is the grammar's, or the one token of <think> where the tokenizer has one
    (Qwen3's), which opens the reasoning."""

    def __init__(self, grammar, token_bytes, thinking: bool, think_token: int | None):
        self.grammar, self.token_bytes, self.think_token = grammar, token_bytes, think_token
        self.state = "reasoning" if thinking else "start"       # then "answer"
        self.tail = b""          # the reasoning's last bytes, where </think> is looked for

    def mask(self, logits):
        if self.state == "reasoning":
            return logits.float()
        masked = self.grammar.mask(logits)
        if self.state == "start" and self.think_token is not None:
            masked[self.think_token] = logits[self.think_token].float()
        return masked

    def accept(self, token: int) -> None:
        if self.state == "start":
            self.state = "reasoning" if token == self.think_token else "answer"
            if self.state == "reasoning":
                return
        if self.state == "reasoning":
            self.tail += self.token_bytes(token)
            if END.encode() in self.tail:
                self.state = "answer"
            self.tail = self.tail[-len(END):]
            return
        self.grammar.accept(token)

    @property
    def complete(self) -> bool:
        return self.state == "answer" and self.grammar.complete
