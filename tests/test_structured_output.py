"""Structured output (runtime/structured.py, xgrammar): whatever a random-weight model's logits prefer, a sequence
whose logits are masked by its grammar writes JSON that parses and validates against its schema, text that
matches its regular expression, one of its choices or a sentence of its grammar, greedy or sampled. The server's
response_format, structured_outputs and tools: test_serve.py."""
import json
import re

import jsonschema
import pytest

from distmk.errors import DistmkError
from distmk.graph import GraphConfig
from distmk.runtime.batcher import Batcher, Sequence
from distmk.runtime.engine import Engine
from distmk.runtime.sampling import SamplingParams
from distmk.runtime.structured import Grammars
from distmk.runtime.tokenizer import ByteTokenizer

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "pattern": "^[A-Za-z ]{1,12}$"},
                         "age": {"type": "integer", "minimum": 0},
                         "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
                         "admin": {"type": "boolean"}}}


@pytest.fixture(scope="module")
def engine():
    return Engine("tiny-llama", config=GraphConfig(batch=4, kv_splits=2, tile_rows=32, workers=3), max_context=256,
                  block_size=16, max_seqs=4)


@pytest.fixture(scope="module")
def grammars(engine):
    return Grammars(ByteTokenizer(engine.spec.vocab_size), engine.spec.vocab_size, engine.spec.eos_token_id)


def generate(engine, *seqs):
    batcher = Batcher(engine)
    for seq in seqs:
        batcher.submit(seq)
    while batcher.busy:
        batcher.step()
    return [bytes(t for t in seq.output if t < 256).decode(errors="replace") for seq in seqs]


def test_schema_constrained_output_parses_and_validates(engine, grammars):
    constrained = lambda params: Sequence(list(b"Who? "), 200, params, constraint=grammars.constraint("json_schema",
                                                                                                     PERSON))
    seqs = [constrained(SamplingParams()), *(constrained(SamplingParams(temperature=1.0, seed=s)) for s in (1, 2))]
    texts = generate(engine, *seqs)
    for seq, text in zip(seqs, texts):
        assert seq.finish_reason == "stop", (seq.finish_reason, text)
        jsonschema.validate(json.loads(text), PERSON)
    assert len(set(texts)) == 3
    unconstrained, = generate(engine, Sequence(list(b"Who? "), 20))
    with pytest.raises(json.JSONDecodeError):
        json.loads(unconstrained)


def test_json_object_output_is_an_object(engine, grammars):
    seq = Sequence(list(b"JSON: "), 200, constraint=grammars.constraint("json_object"))
    text, = generate(engine, seq)
    assert seq.finish_reason == "stop" and isinstance(json.loads(text), dict)


TEXT_FORMATS = [("regex", r"[a-z]{2,5}-\d{1,3}", lambda text: re.fullmatch(r"[a-z]{2,5}-\d{1,3}", text)),
                ("choice", ["positive", "negative", 'neutral "?"'],
                 lambda text: text in ("positive", "negative", 'neutral "?"')),
                ("grammar", 'root ::= "(" num ("," num){0,3} ")"\nnum ::= [0-9] [0-9]?',
                 lambda text: re.fullmatch(r"\(\d\d?(,\d\d?){0,3}\)", text)),
                ("grammar", 'start: "(" NUM ("," NUM)~0..3 ")"\nNUM: /[0-9]{1,2}/',
                 lambda text: re.fullmatch(r"\(\d\d?(,\d\d?){0,3}\)", text))]


@pytest.mark.parametrize("kind, spec, holds", TEXT_FORMATS, ids=["regex", "choice", "ebnf", "lark"])
def test_regex_choice_and_grammar_hold_the_text(engine, grammars, kind, spec, holds):
    """vLLM's structured_outputs beyond JSON: the text matches the regular expression in full, is one of the
    choices, is a sentence of the grammar (xgrammar's EBNF or Lark), greedy and sampled, and ends there."""
    seqs = [Sequence(list(b"Say: "), 60, params, constraint=grammars.constraint(kind, spec))
            for params in (SamplingParams(), SamplingParams(temperature=1.0, seed=1), SamplingParams(temperature=1.0,
                                                                                                      seed=2))]
    for seq, text in zip(seqs, generate(engine, *seqs)):
        assert seq.finish_reason == "stop" and holds(text), text


def test_a_schema_that_cannot_compile_says_why(grammars):
    with pytest.raises(DistmkError, match='the JSON schema cannot be compiled: Unsupported type "nonsense"$'):
        grammars.constraint("json_schema", {"type": "nonsense"})
    with pytest.raises(DistmkError, match="compiled: minLength 5 is greater than maxLength 2$"):
        grammars.constraint("json_schema", {"type": "string", "minLength": 5, "maxLength": 2})
    with pytest.raises(DistmkError, match="^the regular expression cannot be compiled: Regex parsing error at "
                                          "position 4: The parenthesis is not closed.$"):
        grammars.constraint("regex", "(ab")
    with pytest.raises(DistmkError, match='^the grammar cannot be compiled: EBNF parser error at line 1, column 10: '
                                          'Rule "num" is not defined$'):
        grammars.constraint("grammar", "root ::= num")
    with pytest.raises(DistmkError, match="^the grammar cannot be compiled: Lark error at line 1, column 8: unknown "
                                          "name 'num'$"):
        grammars.constraint("grammar", "start: num")
