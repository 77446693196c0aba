"""Shared test helpers: the Hugging Face twin of a preset and its greedy output, tiny checkpoints, and
distmk.serve processes on the CPU."""
import dataclasses
import functools
import json
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest
import torch

from distmk.comm.cpu import VIRTUAL_RANKS_ENV
from distmk.graph import GraphConfig
from distmk.models.presets import preset
from distmk.models.spec import ModelSpec
from distmk.models.weights import RandomWeights

TINY = ["tiny-llama", "tiny-qwen3", "tiny-qwen2", "tiny-mistral"]
TINY_MOE = ["tiny-qwen3-moe", "tiny-mixtral"]
PROMPT = [1, 2, 3, 4, 5, 6, 7]
# Small tiles so that every row-parallel output and the lm_head are cut into several tiles.
SMALL = GraphConfig(batch=4, kv_splits=3, tile_rows=32, lm_tile_rows=48, workers=5)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# virtual ranks (tests/test_gpu.py) need CUDA set up for them before it starts (comm/cpu.py VIRTUAL_RANKS_ENV)
os.environ.update(VIRTUAL_RANKS_ENV)
sys.path.insert(0, os.path.join(REPO, "benchmarks"))     # the benchmark harness and probes, as tests import them
MODEL = "tiny-llama"                         # what the server tests serve
SERVE_ON_CPU = ["--backend", "reference", "--device", "cpu", "--log-level", "warning"]


def hf_model(name: str | ModelSpec, weights_device: str = "cpu"):
    """transformers' own model class for a preset or spec (on the CPU), holding distmk's seeded random
    weights for it as drawn on `weights_device` (CPU and CUDA generators draw different numbers)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    spec = preset(name) if isinstance(name, str) else name
    if spec.moe_layers:
        return hf_model_from_files(spec, weights_device)
    cfg = spec.to_hf_config()
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg),
                                             dtype=torch.float32)
    weights = {k: v.cpu() for k, v in RandomWeights(spec, device=weights_device).state_dict().items()}
    result = model.load_state_dict(weights, strict=False)
    assert set(result.missing_keys) <= {"lm_head.weight"} and not result.unexpected_keys, result
    if spec.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model.eval()


def hf_model_from_files(spec: ModelSpec, weights_device: str = "cpu", weights: dict | None = None):
    """transformers' model of `spec` read by from_pretrained from distmk's random weights (or `weights`, by
    checkpoint name) written under their checkpoint names: transformers >= 5 holds a layer's experts fused
    ([experts, ...] parameters), and fuses a checkpoint's per-expert tensors itself as it loads them."""
    import tempfile
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM
    with tempfile.TemporaryDirectory() as path:
        weights = weights if weights is not None else RandomWeights(spec, device=weights_device).state_dict()
        save_file({k: v.cpu().contiguous() for k, v in weights.items()}, os.path.join(path, "model.safetensors"))
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(spec.to_hf_config(), f)
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_generate(model, prompt, new_tokens: int, **kw):
    """transformers' greedy generate of one prompt. The attention mask is explicit: without one,
    transformers masks every prompt id equal to pad_token_id."""
    ids = torch.tensor([list(prompt)])
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                              pad_token_id=0, **kw)


@functools.lru_cache(maxsize=None)
def hf_greedy(name: str, prompt: tuple = tuple(PROMPT), new_tokens: int = 32, weights_device: str = "cpu"):
    """(tokens, [new_tokens, vocab] logits) of transformers' greedy generate, eos ignored."""
    out = hf_generate(hf_model(name, weights_device), prompt, new_tokens, output_logits=True,
                      return_dict_in_generate=True, eos_token_id=None)
    return out.sequences[0, len(prompt):].tolist(), torch.stack(out.logits)[:, 0]


def run_cli(*args, timeout=300, env=None):
    """Run a command from the repository root; returns CompletedProcess. Its Python imports this checkout's
    distmk (scripts under benchmarks/ too), whichever checkout is installed."""
    python_path = os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": python_path, **(env or {})}
    return subprocess.run(list(args), cwd=REPO, capture_output=True, text=True, timeout=timeout, env=full_env)


def torchrun(nproc: int, *args, **kw):
    return run_cli(sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc-per-node={nproc}", *args, **kw)


@pytest.fixture(scope="session")
def saved_checkpoints(tmp_path_factory):
    """Each tiny preset written by transformers' save_pretrained (the first one sharded with an index)."""
    root = tmp_path_factory.mktemp("ckpt")
    paths = {}
    for i, name in enumerate(TINY):
        path = root / name
        hf_model(name).save_pretrained(path, max_shard_size="200KB" if i == 0 else "1GB")
        paths[name] = str(path)
    return paths


@pytest.fixture(scope="session")
def generation_config_checkpoint(tmp_path_factory):
    """tiny-llama saved with a generation_config.json as Llama-3 instruct checkpoints ship one: eos ids only
    there (config.json has none), as a list, one of them the 6th token of transformers' greedy output; and
    sampling defaults. Returns (path, that generation config)."""
    tokens = hf_greedy("tiny-llama")[0]
    stop_at = next(i for i in range(5, len(tokens)) if tokens[i] not in tokens[:i])
    unused = max(set(range(preset("tiny-llama").vocab_size)) - set(tokens))
    gen = {"eos_token_id": [unused, tokens[stop_at]], "do_sample": True, "temperature": 0.6, "top_p": 0.9,
           "top_k": 20}
    path = tmp_path_factory.mktemp("gen") / "tiny-llama"
    hf_model("tiny-llama").save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps(gen))
    return str(path), gen


@pytest.fixture(scope="session")
def small_vocab_checkpoint(tmp_path_factory):
    """tiny-llama with a vocabulary of 200 ids (too few for the byte-level tokenizer) and no tokenizer,
    saved by transformers. Returns (path, transformers' greedy tokens after PROMPT)."""
    model = hf_model(dataclasses.replace(preset("tiny-llama"), vocab_size=200))
    path = tmp_path_factory.mktemp("vocab") / "small-vocab"
    model.save_pretrained(path)
    return str(path), hf_generate(model, PROMPT, 32)[0, len(PROMPT):].tolist()


class Server:
    """A server process (torchrun or a plain python) in a process group of its own, logging to a file."""

    def __init__(self, tmp_path, name, argv, env=None):
        self.log_path = tmp_path / f"{name}.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(argv, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                                     start_new_session=True)
        self.url = None

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout=90.0) -> "Server":
        """Until the startup line names the URL and /health answers 200."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"server exited with {self.proc.returncode}:\n{self.output()}"
            found = re.search(r"(http://127\.0\.0\.1:\d+)/v1", self.output())
            if found:
                try:
                    if httpx.get(found.group(1) + "/health", timeout=5).status_code == 200:
                        self.url = found.group(1)
                        return self
                except httpx.TransportError:
                    pass
            time.sleep(0.2)
        raise AssertionError(f"server not healthy within {timeout} s:\n{self.output()}")

    def wait_exit(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def kill(self) -> None:
        """torchrun starts each rank in a session of its own, so its ranks are killed one by one."""
        if self.proc.poll() is None:
            ranks = rank_pids(self.proc.pid).values()
            os.killpg(self.proc.pid, signal.SIGKILL)
            for pid in ranks:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self.proc.wait()
        self.log.close()



def serve_alone(tmp_path, name, *extra, model=MODEL, env=None) -> Server:
    """One distmk.serve process (tp 1) on the CPU, on a free port."""
    return Server(tmp_path, name, [sys.executable, "-m", "distmk.serve", "--model", model, *SERVE_ON_CPU,
                                   "--port", "0", *extra], env=env)


def rank_pids(launcher_pid: int) -> dict[int, int]:
    """{rank: pid} of torchrun's worker processes, from their environment."""
    ranks = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != launcher_pid:
                continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
        except (FileNotFoundError, ProcessLookupError):
            continue
        if b"RANK" in env:
            ranks[int(env[b"RANK"])] = int(pid)
    return ranks
