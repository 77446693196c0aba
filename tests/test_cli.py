"""The command-line contract: python -m distmk.generate alone and under torchrun, python -m distmk.graph."""
import json
import sys

import pytest

from conftest import TINY, hf_greedy, run_cli, torchrun

ARGS = ["--prompt-ids", "1,2,3,4,5,6,7", "--max-new-tokens", "32", "--backend", "reference", "--device", "cpu",
        "--dtype", "float32", "--json"]


def only_json_line(stdout: str) -> dict:
    lines = [line for line in stdout.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected exactly one line on stdout (rank 0's JSON), got: {lines}"
    return json.loads(lines[0])


def test_generate_alone_is_tp1():
    proc = run_cli(sys.executable, "-m", "distmk.generate", "--model", "tiny-llama", *ARGS)
    assert proc.returncode == 0, proc.stderr
    out = only_json_line(proc.stdout)
    assert out["tp"] == 1 and out["tokens"] == hf_greedy("tiny-llama")[0]


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-qwen2"])
def test_torchrun_tp2_preset_matches_transformers(name):
    proc = torchrun(2, "-m", "distmk.generate", "--model", name, *ARGS)
    assert proc.returncode == 0, proc.stderr
    out = only_json_line(proc.stdout)
    assert out["tp"] == 2
    assert out["tokens"] == hf_greedy(name)[0]


@pytest.mark.parametrize("name", TINY)
def test_torchrun_tp2_checkpoint_dir_matches_transformers(name, saved_checkpoints):
    """A directory written by save_pretrained (tiny-llama's sharded, with an index), read slice by slice."""
    proc = torchrun(2, "-m", "distmk.generate", "--model", saved_checkpoints[name], *ARGS)
    assert proc.returncode == 0, proc.stderr
    assert only_json_line(proc.stdout)["tokens"] == hf_greedy(name)[0]


def test_text_prompt_with_byte_fallback_tokenizer():
    proc = run_cli(sys.executable, "-m", "distmk.generate", "--model", "tiny-mistral", "--prompt", "Hello",
                   "--max-new-tokens", "4", "--json")
    assert proc.returncode == 0, proc.stderr
    out = only_json_line(proc.stdout)
    assert out["prompt_tokens"] == 5 and len(out["tokens"]) == 4 and isinstance(out["text"], str)


def test_graph_summary_for_8b_model():
    proc = run_cli(sys.executable, "-m", "distmk.graph", "--model", "llama-3-8b", "--tp", "2")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "rank 0/2: q heads 16, kv heads 4, intermediate 7168, vocab rows 64128" in out
    # one all-reduce tile per o_proj/down tile: 32 layers x 2 outputs x 4096/32 rows (auto tiles of 32 rows)
    assert "allreduce       8192" in out and "o_proj          4096" in out
    for line in ("critical path", "queue length", "events:"):
        assert line in out


@pytest.mark.parametrize("argv, message", [
    (["--model", "no-such-model"], "unknown model 'no-such-model'"),
    (["--model", "tiny-llama", "--prompt-ids", "1,x"], "--prompt-ids must be comma-separated integers"),
    (["--model", "tiny-llama", "--prompt-ids", "1,99999"], "outside the vocabulary"),
    (["--model", "tiny-llama", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--model", "tiny-llama", "--max-new-tokens", "5000"], "exceeds the context"),
    (["--model", "tiny-llama", "--temperature", "-1"], "temperature must be >= 0"),
])
def test_bad_input_is_a_clear_error(argv, message):
    if "--prompt-ids" not in argv:
        argv = [*argv, "--prompt-ids", "1,2"]
    proc = run_cli(sys.executable, "-m", "distmk.generate", *argv)
    assert proc.returncode == 2
    assert message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
