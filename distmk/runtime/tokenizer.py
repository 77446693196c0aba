"""Tokenizers: the checkpoint's own (transformers), or for presets a byte-level fallback where each UTF-8
byte is one token id (0..255), so text prompts work on random-weight models too."""
from __future__ import annotations

from distmk.errors import DistmkError


class ByteTokenizer:
    def __init__(self, vocab_size: int):
        if vocab_size < 256:
            raise DistmkError(f"byte-level tokenizer needs a vocabulary of >= 256 ids, model has {vocab_size}")

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    def __init__(self, path: str):
        from transformers import AutoTokenizer
        self.tok = AutoTokenizer.from_pretrained(path)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)


def load_tokenizer(path: str | None, vocab_size: int):
    return HFTokenizer(path) if path else ByteTokenizer(vocab_size)
