"""The command-line contract: python -m distmk.generate alone and under torchrun, python -m distmk.graph."""
import json
import sys

import pytest

from conftest import hf_greedy, run_cli, torchrun

ARGS = ["--prompt-ids", "1,2,3,4,5,6,7", "--max-new-tokens", "32", "--backend", "reference", "--device", "cpu",
        "--dtype", "float32", "--json"]


def only_json_line(stdout: str) -> dict:
    lines = [line for line in stdout.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected exactly one line on stdout (rank 0's JSON), got: {lines}"
    return json.loads(lines[0])


def generate_here(argv, capsys) -> tuple[int, str, str]:
    """generate's main in this process: (exit status, stdout, stderr)."""
    from distmk.generate import main
    try:
        code = main(argv)
    except SystemExit as exit_:         # argparse's
        code = exit_.code
    out, err = capsys.readouterr()
    return code, out, err


def test_generate_alone_is_tp1():
    proc = run_cli(sys.executable, "-m", "distmk.generate", "--model", "tiny-llama", *ARGS)
    assert proc.returncode == 0, proc.stderr
    out = only_json_line(proc.stdout)
    assert out["tp"] == 1 and out["tokens"] == hf_greedy("tiny-llama")[0]


@pytest.mark.parametrize("sampling", [["--temperature", "1e-40"], ["--temperature", "1", "--top-p", "1e-50"]])
def test_tiny_temperature_or_top_p_is_greedy(sampling, capsys):
    code, out, err = generate_here(["--model", "tiny-llama", *ARGS, *sampling], capsys)
    assert code == 0, err
    assert only_json_line(out)["tokens"] == hf_greedy("tiny-llama")[0]


def test_torchrun_tp2_preset_matches_transformers():
    proc = torchrun(2, "-m", "distmk.generate", "--model", "tiny-qwen3", *ARGS)
    assert proc.returncode == 0, proc.stderr
    out = only_json_line(proc.stdout)
    assert out["tp"] == 2
    assert out["tokens"] == hf_greedy("tiny-qwen3")[0]


def test_torchrun_tp2_checkpoint_dir_matches_transformers(saved_checkpoints):
    """A directory written by save_pretrained (tiny-llama's sharded, with an index), read slice by slice (every
    family's checkpoint at tp=2: test_transformers_parity.py test_tp2_checkpoint_dirs_match_transformers)."""
    proc = torchrun(2, "-m", "distmk.generate", "--model", saved_checkpoints["tiny-llama"], *ARGS)
    assert proc.returncode == 0, proc.stderr
    assert only_json_line(proc.stdout)["tokens"] == hf_greedy("tiny-llama")[0]


def test_generation_config_gives_the_default_sampling(generation_config_checkpoint, capsys):
    path, gen = generation_config_checkpoint
    runs = [generate_here(["--model", path, *ARGS, "--ignore-eos", "--sample-seed", "7", *extra], capsys)
            for extra in ([], ["--temperature", "0.6", "--top-p", "0.9", "--top-k", "20"], ["--temperature", "0"])]
    assert all(code == 0 for code, _, _ in runs), runs
    default, explicit, greedy = (only_json_line(out)["tokens"] for _, out, _ in runs)
    assert default == explicit != greedy == hf_greedy("tiny-llama")[0]


def test_a_vocabulary_under_256_ids_takes_prompt_ids(small_vocab_checkpoint, capsys):
    """No byte-level text for it, but token ids generate transformers' tokens; text is a clear error."""
    path, expected = small_vocab_checkpoint
    code, out, err = generate_here(["--model", path, *ARGS], capsys)
    assert code == 0, err
    assert only_json_line(out)["tokens"] == expected
    code, _, err = generate_here(["--model", path, "--prompt", "hi"], capsys)
    assert code == 2 and "Traceback" not in err
    assert "error: text needs a tokenizer: the byte-level one needs a vocabulary of >= 256 ids" in err


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
    (["--model", "tiny-llama", "--max-new-tokens", "0"], "argument --max-new-tokens: must be an integer >= 1, got 0"),
    (["--model", "tiny-llama", "--max-new-tokens", "5000"], "exceeds the context"),
    (["--model", "tiny-llama", "--temperature", "-1"], "argument --temperature: must be a finite number >= 0"),
    (["--model", "tiny-llama", "--batch", "4", "--step-batches", "2,8"], "step_batches [8] must lie in 1..4"),
])
def test_bad_input_is_a_clear_error(argv, message, capsys):
    """In this process (a process of its own: test_a_clear_error_ends_the_process_with_2)."""
    if "--prompt-ids" not in argv:
        argv = [*argv, "--prompt-ids", "1,2"]
    code, _, err = generate_here(argv, capsys)
    assert code == 2 and message in err and "Traceback" not in err, err


def test_a_clear_error_ends_the_process_with_2():
    proc = run_cli(sys.executable, "-m", "distmk.generate", "--model", "tiny-llama", "--prompt-ids", "1,99999")
    assert proc.returncode == 2 and "outside the vocabulary" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("program, argv, message", [
    ("generate", ["--temperature", "nan"], "argument --temperature: must be a finite number >= 0, got nan"),
    ("generate", ["--temperature", "inf"], "argument --temperature: must be a finite number >= 0, got inf"),
    ("generate", ["--top-p", "0"], "argument --top-p: must be a finite number > 0 and <= 1, got 0"),
    ("generate", ["--top-p", "1.5"], "argument --top-p: must be a finite number > 0 and <= 1, got 1.5"),
    ("generate", ["--top-k", "-1"], "argument --top-k: must be an integer >= 0, got -1"),
    ("generate", ["--seed", str(2 ** 64)], "argument --seed: must be an integer in 0..4294967295"),
    ("generate", ["--sample-seed", "-1"], "argument --sample-seed: must be an integer in 0..4294967295"),
    ("generate", ["--max-context", "0"], "argument --max-context: must be an integer >= 1, got 0"),
    ("generate", ["--workers", "0"], "argument --workers: must be an integer >= 1, got 0"),
    ("generate", ["--batch", "x"], "argument --batch: must be an integer >= 1, got 'x'"),
    ("generate", ["--timeout", "-1"], "argument --timeout: must be a finite number > 0, got -1"),
    ("serve", ["--port", "70000"], "argument --port: must be an integer in 0..65535, got 70000"),
    ("serve", ["--port", "-1"], "argument --port: must be an integer in 0..65535, got -1"),
    ("serve", ["--max-context", "-5"], "argument --max-context: must be an integer >= 1, got -5"),
    ("serve", ["--max-seqs", "0"], "argument --max-seqs: must be an integer >= 1, got 0"),
    ("serve", ["--max-batch", "4", "--max-seqs", "5"], "argument --max-seqs: must be at most --max-batch (4), got 5"),
    ("serve", ["--max-queue", "-1"], "argument --max-queue: must be an integer >= 0, got -1"),
    ("serve", ["--step-batches", "1,0"], "argument --step-batches: must be an integer >= 1, got 0"),
    ("serve", ["--api-key", ""], "argument --api-key: must not be empty"),
    ("graph", ["--tp", "0"], "argument --tp: must be an integer >= 1, got 0"),
])
def test_out_of_range_flags_are_refused_naming_the_flag(program, argv, message, capsys):
    """argparse refuses them before anything loads: exit 2 and an error line naming the flag."""
    if program == "generate":
        from distmk.generate import parse_args
        argv = [*argv, "--prompt-ids", "1"]
    elif program == "serve":
        from distmk.serve.__main__ import parse_args
    else:
        from distmk.graph.__main__ import main as parse_args
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--model", "tiny-llama", *argv])
    assert exit_.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"error: {message}" in error, error


def test_decode_benchmark_without_a_gpu_says_so():
    import torch
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    proc = run_cli(sys.executable, "benchmarks/decode.py", "--model", "tiny-llama", "--device", "cuda")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == "error: --device cuda: no CUDA device is visible"
    proc = run_cli(sys.executable, "benchmarks/decode.py", "--model", "tiny-llama", "--context", "0")
    assert proc.returncode == 2 and "error: argument --context: must be an integer >= 1, got 0" in proc.stderr
