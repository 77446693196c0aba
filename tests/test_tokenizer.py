"""Tokenizers: chat prompts (the checkpoint's template, else ChatML text) and text decoded a token at a time."""
import random

import pytest

from distmk.runtime.tokenizer import CHATML_END, ByteTokenizer, IncrementalDecoder, load_tokenizer

MESSAGES = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi there"}]
# Qwen3's closes an empty thought where the caller turns thinking off (chat_template_kwargs)
TEMPLATE = ("{% for m in messages %}<s>{{ m.role }}: {{ m.content }}</s>{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant:{% if enable_thinking is defined and not enable_thinking %}"
            "<think></think>{% endif %}{% endif %}")
# a template that shows tools, calls and their results, as Qwen's and Llama-3's do in their own formats
TOOLS_TEMPLATE = ("{% if tools %}<s>tools: {{ tools | map(attribute='function.name') | join(',') }}</s>{% endif %}"
                  "{% for m in messages %}<s>{{ m.role }}: {% for c in m.tool_calls or [] %}{{ c.function.name }}"
                  "({{ c.function.arguments.city }}){% endfor %}{{ m.content or '' }}</s>{% endfor %}"
                  "{% if add_generation_prompt %}<s>assistant:{% endif %}")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A small byte-level BPE tokenizer trained here and saved the way checkpoints ship one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["Hi there, how are you?", "Be terse. The capital of France is Paris."] * 20, trainer)
    path = tmp_path_factory.mktemp("tok")
    for name, template in (("with_template", TEMPLATE), ("without", None), ("with_tools", TOOLS_TEMPLATE)):
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
        fast.chat_template = template
        fast.save_pretrained(path / name)
    return path


def test_presets_render_chat_as_chatml_bytes():
    ids, stops = ByteTokenizer(512).render_chat(MESSAGES)
    assert bytes(ids).decode() == ("<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
                                   "<|im_start|>assistant\n")
    assert stops == (CHATML_END,)


def test_checkpoint_chat_template_is_used(hf_dir):
    from transformers import AutoTokenizer
    tok = load_tokenizer(str(hf_dir / "with_template"), 400)
    ids, stops = tok.render_chat(MESSAGES)
    reference = AutoTokenizer.from_pretrained(hf_dir / "with_template")
    assert ids == reference.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True,
                                                return_dict=True)["input_ids"]
    assert reference.decode(ids) == "<s>system: Be terse.</s><s>user: Hi there</s><s>assistant:"
    assert stops == ()
    ids, stops = load_tokenizer(str(hf_dir / "without"), 400).render_chat(MESSAGES)
    assert reference.decode(ids).endswith("<|im_start|>assistant\n") and stops == (CHATML_END,)


def test_chat_template_kwargs_reach_the_template(hf_dir):
    """vLLM's chat_template_kwargs are the template's variables (Qwen3's enable_thinking); ChatML reads none."""
    from transformers import AutoTokenizer
    reference = AutoTokenizer.from_pretrained(hf_dir / "with_template")
    tok = load_tokenizer(str(hf_dir / "with_template"), 400)
    for kwargs, ending in (({"enable_thinking": False}, "assistant:<think></think>"),
                           ({"enable_thinking": True}, "assistant:"), (None, "assistant:")):
        ids, _ = tok.render_chat(MESSAGES, None, kwargs)
        assert reference.decode(ids).endswith(ending), kwargs
    assert ByteTokenizer(512).render_chat(MESSAGES, None, {"enable_thinking": False}) == \
        ByteTokenizer(512).render_chat(MESSAGES)


def test_a_prefilled_reply_leaves_the_last_message_open(hf_dir):
    """continue_final_message (vLLM's, transformers'): the last message is left open for the reply to go on with it,
    and no reply turn is opened; add_generation_prompt false: the conversation as it stands."""
    from transformers import AutoTokenizer
    prefilled = MESSAGES + [{"role": "assistant", "content": "Sure, the"}]
    ids, _ = ByteTokenizer(512).render_chat(prefilled, add_generation_prompt=False, continue_final_message=True)
    assert bytes(ids).decode().endswith("<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\nSure, the")
    ids, _ = ByteTokenizer(512).render_chat(MESSAGES, add_generation_prompt=False)
    assert bytes(ids).decode().endswith("Hi there<|im_end|>\n")
    reference = AutoTokenizer.from_pretrained(hf_dir / "with_template")
    ids, _ = load_tokenizer(str(hf_dir / "with_template"), 400).render_chat(
        prefilled, add_generation_prompt=False, continue_final_message=True)
    assert reference.decode(ids).endswith("</s><s>assistant: Sure, the")


def test_a_checkpoint_template_gets_the_tools_and_the_calls(hf_dir):
    """Chat tools reach the checkpoint's template as transformers hands them over: the tool objects, an assistant's
    tool_calls with their arguments as a mapping (serve/protocol.py Message.for_template), a tool message."""
    from transformers import AutoTokenizer
    from distmk.serve.protocol import ChatRequest
    request = ChatRequest.model_validate({"model": "m", "messages": [
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                              "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "18 C"}],
        "tools": [{"type": "function", "function": {"name": name}} for name in ("weather", "time")]})
    tools = [t.model_dump(exclude_none=True) for t in request.tools]
    ids, _ = load_tokenizer(str(hf_dir / "with_tools"), 400).render_chat([m.for_template() for m in request.messages],
                                                                          tools)
    assert AutoTokenizer.from_pretrained(hf_dir / "with_tools").decode(ids) == (
        "<s>tools: weather,time</s><s>user: Hi there</s><s>assistant: weather(Paris)</s><s>tool: 18 C</s>"
        "<s>assistant:")


@pytest.mark.parametrize("which", ["bytes", "hf"])
def test_incremental_decoding_adds_up_to_decoding_everything(which, hf_dir):
    tok = ByteTokenizer(512) if which == "bytes" else load_tokenizer(str(hf_dir / "with_template"), 400)
    rng = random.Random(0)
    for _ in range(50):
        # bytes: split multi-byte characters, stray continuation bytes and ids past 255 (no text)
        ids = ([rng.choice([rng.randrange(512), *"é€😀a".encode()]) for _ in range(rng.randrange(1, 30))]
               if which == "bytes" else tok.encode("Hi there, how are you? é€😀")[:rng.randrange(1, 20)])
        decoder = IncrementalDecoder(tok)
        pieces = [decoder.push(t) for t in ids] + [decoder.flush()]
        assert "".join(pieces) == tok.decode(ids)
        assert not any(p.endswith("\ufffd") for p in pieces[:-1])      # incomplete characters wait


def test_token_bytes_are_what_a_token_adds(hf_dir, tmp_path):
    """A token's bytes, as log-probabilities list them: a byte-level BPE token's own (the pieces of a character
    split across tokens add up to it), a SentencePiece token's with its word-start space, a special token's
    none (decoding leaves it out: a reply that ends on its end of sequence joins to its text); the byte-level
    fallback's byte (none for an id past 255)."""
    tok = load_tokenizer(str(hf_dir / "with_template"), 400)
    text = "Hi there, é€😀 Paris"
    ids = tok.encode(text)
    assert any(tok.token_bytes(i).decode(errors="replace") == "\ufffd" for i in ids)    # a piece of a character
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode()
    eos = tok.tok.eos_token_id
    assert tok.token_bytes(eos) == b""
    assert b"".join(map(tok.token_bytes, ids + [eos])).decode() == tok.decode(ids + [eos])      # joins to the text
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    spm = Tokenizer(models.BPE())
    spm.pre_tokenizer = pre_tokenizers.Metaspace()
    spm.decoder = decoders.Metaspace()
    spm.train_from_iterator(["Hi there, how are you?"] * 20, trainers.BpeTrainer(vocab_size=100))
    PreTrainedTokenizerFast(tokenizer_object=spm).save_pretrained(tmp_path / "spm")
    spm = load_tokenizer(str(tmp_path / "spm"), 100)
    assert b"".join(spm.token_bytes(i) for i in spm.encode("Hi there you")) == b" Hi there you"
    assert [ByteTokenizer(512).token_bytes(i) for i in (97, 0xC3, 300)] == [b"a", b"\xc3", b""]
