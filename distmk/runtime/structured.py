"""Structured output with xgrammar (the grammar engine of vLLM and SGLang): a JSON schema, any JSON object, a
regular expression, a list of choices or a grammar, compiled once per spec for the served tokenizer (the compiler
caches what it compiled), and per sequence a Constraint that masks a row of logits to the tokens the grammar allows
next, where the logits are."""
from __future__ import annotations

import json
import re

import torch

from distmk.errors import DistmkError

EBNF_ROOT = re.compile(r"(?m)^\s*root\s*::=")      # an EBNF grammar's root rule (a Lark one has none)
MAX_WHITESPACE = 16         # characters of whitespace in a row where JSON allows it (an indented line's)
GRAMMAR_CACHE_BYTES = 512 << 20     # compiled grammars kept for their next request, least recently used out
SPEC_NAMES = {"json_object": "the JSON schema", "json_schema": "the JSON schema", "regex": "the regular expression",
              "choice": "the choices", "grammar": "the grammar"}      # as errors name them


class Grammars:
    """The grammar compiler of one tokenizer (runtime/tokenizer.py's): its vocabulary as xgrammar reads it, and the
    ids that end a sequence, which the grammar allows once its text is complete."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids):
        import xgrammar as xgr
        self.xgr, self.vocab_size = xgr, vocab_size
        stops = list(stop_token_ids) or None
        if hasattr(tokenizer, "tok"):                       # a checkpoint's own (transformers)
            info = xgr.TokenizerInfo.from_huggingface(tokenizer.tok, vocab_size=vocab_size, stop_token_ids=stops)
        else:                   # the byte-level fallback: id i < 256 is byte i, the ids past it have no text
            vocab = [tokenizer.token_bytes(i) for i in range(vocab_size)]
            info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=stops)
        self.compiler = xgr.GrammarCompiler(info, cache_limit_bytes=GRAMMAR_CACHE_BYTES)
        self.ends_by_token = stops is not None     # else the text's last character completes it

    def constraint(self, kind: str, spec=None, compact: bool = False) -> Constraint:
        """A sequence's constraint: any JSON object ("json_object"), JSON that validates against the schema `spec`
        ("json_schema"), text that matches the regular expression `spec` ("regex"), one of the strings of `spec`
        ("choice") or text of the grammar `spec` ("grammar": xgrammar's EBNF, with a `root ::= ...` rule, else
        Lark); compact: JSON without whitespace beyond one space after ':' and ',' (for JSON that is read, not
        shown). A spec xgrammar cannot compile raises DistmkError saying why."""
        # whitespace between tokens bounded: a model cannot spend its tokens on it (or loop in it)
        spacing = {"any_whitespace": False} if compact else {"max_whitespace_cnt": MAX_WHITESPACE}
        compile_as = {
            "json_object": lambda: self.compiler.compile_json_schema('{"type": "object"}', strict_mode=True, **spacing),
            "json_schema": lambda: self.compiler.compile_json_schema(json.dumps(spec), strict_mode=True, **spacing),
            "regex": lambda: self.compiler.compile_regex(spec),
            # each choice a string literal in JSON's escapes, which xgrammar's EBNF reads
            "choice": lambda: self.compiler.compile_grammar(
                "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in spec)),
            "grammar": lambda: (self.compiler.compile_grammar if EBNF_ROOT.search(spec) else
                                self.compiler.compile_lark)(spec),
        }
        try:
            compiled = compile_as[kind]()
        except Exception as e:  # noqa: BLE001 - xgrammar raises its own errors for a spec it cannot take
            # its message without the time and source line it starts with ("[18:02:22] /project/cpp/...cc:5082: ")
            why = re.sub(r"^\[[\d:]+\] \S+: ", "", str(e).strip().splitlines()[0])
            raise DistmkError(f"{SPEC_NAMES[kind]} cannot be compiled: {why}") from None
        return Constraint(self.xgr, compiled, self.vocab_size, self.ends_by_token)


class Constraint:
    """Where a sequence is in its grammar: which tokens may come next, and whether its text is complete."""

    def __init__(self, xgr, compiled, vocab_size: int, ends_by_token: bool = True):
        self.xgr = xgr
        self.matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=not ends_by_token)
        self.bitmask = xgr.allocate_token_bitmask(1, vocab_size)

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """A copy of a row of logits, -inf at every token the grammar does not allow next."""
        self.matcher.fill_next_token_bitmask(self.bitmask)
        masked = logits.float()[None].clone()
        self.xgr.apply_token_bitmask_inplace(masked, self.bitmask.to(masked.device))
        return masked[0]

    def accept(self, token: int) -> None:
        if not self.matcher.accept_token(token):
            raise DistmkError(f"token {token} does not follow the grammar")

    @property
    def complete(self) -> bool:
        """The grammar took its end (a stop token after complete text, or the text's last character for a model
        with no end-of-sequence token): nothing may follow."""
        return self.matcher.is_terminated()
