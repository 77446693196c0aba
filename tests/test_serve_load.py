"""The serving load benchmark (benchmarks/serve_load.py) against a real distmk.serve on the CPU: one run,
the matrix of stream counts and prompt lengths with its JSON and PNG, and the features' costs."""
import json
import sys

import pytest

from conftest import MODEL, run_cli, serve_alone

MAX_BATCH = 8                     # rows per step: the 24-token prompts go through the prefill path


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = serve_alone(tmp_path_factory.mktemp("serve_load"), "load", "--max-batch", str(MAX_BATCH))
    try:
        yield srv.wait_ready()
    finally:
        srv.kill()


def load(server, *args):
    return run_cli(sys.executable, "benchmarks/serve_load.py", "--url", server.url, *args, timeout=240)


def check_run(run: dict, streams: int, requests: int, prompt_len: int, max_tokens: int) -> None:
    """Every request finished with max_tokens tokens, and every latency was measured."""
    assert (run["concurrency"], run["requests"], run["prompt_len"]) == (streams, requests, prompt_len)
    assert run["completed"] == requests and run["failed"] == 0 and run["errors"] == []
    assert run["output_tokens"] == requests * max_tokens
    for key in ("ttft_s", "itl_s"):
        assert 0 < run[key]["p50"] <= run[key]["p99"], run
    assert run["request_throughput_per_s"] > 0 and run["output_token_throughput_per_s"] > 0


def test_single_run(server, tmp_path):
    proc = load(server, "--concurrency", "2", "--requests", "3", "--max-tokens", "3", "--prompt-len", "5",
                "--out", str(tmp_path / "one.json"))
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result == json.loads((tmp_path / "one.json").read_text())
    assert result["model"] == MODEL and result["url"] == server.url
    check_run(result, streams=2, requests=3, prompt_len=5, max_tokens=3)


def test_matrix_writes_every_cell_and_a_png(server, tmp_path):
    out = tmp_path / "results" / "matrix.json"
    proc = load(server, "--matrix", "--streams", "1,2", "--prompt-lens", "5,24", "--rounds", "2",
                "--shared-prefix", "40", "--max-tokens", "4", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    matrix = json.loads(out.read_text())
    assert matrix == json.loads(proc.stdout)
    assert (matrix["model"], matrix["streams"], matrix["prompt_lens"], matrix["failed"]) == (MODEL, [1, 2], [5, 24], 0)
    cells = {(c["concurrency"], c["prompt_len"]): c for c in matrix["cells"]}
    assert list(cells) == [(1, 5), (1, 24), (1, 104), (2, 5), (2, 24), (2, 104)]
    for streams in (1, 2):      # 40 shared tokens, then 64 of each prompt's own: 2 blocks of 16 found cached
        shared = cells.pop((streams, 104))
        check_run(shared, streams, requests=2 * streams, prompt_len=104, max_tokens=4)
        assert (shared["shared_prefix"], shared["cached_tokens_mean"]) == (40, 32)
    for (streams, prompt_len), cell in cells.items():
        check_run(cell, streams, requests=2 * streams, prompt_len=prompt_len, max_tokens=4)
        server_side = cell["server"]                 # what the server's /metrics counted over the cell
        assert server_side["steps"] >= 4 and 1 <= server_side["rows_mean"] <= MAX_BATCH and server_side["step_ms_mean"] > 0
        # a 24-token prompt has more unread tokens than a step's rows: one prefill chunk each
        assert server_side["prefill_chunks"] == (2 * streams if prompt_len == 24 else 0)
        # the server's time to first token lies within the client's, request by request
        assert 0 < server_side["ttft_ms_mean"] <= cell["ttft_s"]["mean"] * 1e3
    assert (tmp_path / "results" / "matrix.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "2 streams, 24-token prompts: TTFT p50" in proc.stderr


def test_matrix_needs_an_output_and_sane_counts(server):
    proc = load(server, "--matrix")
    assert proc.returncode == 2 and "--matrix needs --out" in proc.stderr
    proc = load(server, "--matrix", "--out", "x.json", "--streams", "1,0")
    assert proc.returncode == 2 and "--streams" in proc.stderr and "'1,0'" in proc.stderr


def test_features_time_each_feature_beside_the_same_requests_without_it(server, tmp_path):
    out = tmp_path / "features.json"
    proc = load(server, "--features", "--rounds", "2", "--max-tokens", "6", "--prompt-lens", "24", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert result["failed"] == 0
    features = {f["feature"]: f for f in result["features"]}
    assert list(features) == ["json_schema", "prompt_logprobs"]
    schema, logprobs = features["json_schema"], features["prompt_logprobs"]
    assert schema["with"]["prompt_len"] == 256 and schema["with"]["completed"] == 2
    assert "response_format" in schema["fields"] and schema["plain"]["output_tokens"] == 2 * 6
    # the prompt's log-probabilities generate nothing shown (max_tokens 0); the plain prefill one token
    assert (logprobs["with"]["prompt_len"], logprobs["with"]["output_tokens"], logprobs["plain"]["output_tokens"]) \
        == (24, 0, 2)
    for feature in features.values():
        compared = feature["compared"]
        assert feature["ratio_p50"] == round(feature["with"][compared]["p50"] / feature["plain"][compared]["p50"], 3)
    assert "prompt_logprobs: latency p50" in proc.stderr
    proc = load(server, "--features", "--matrix", "--out", str(out))
    assert proc.returncode == 2 and "pick one" in proc.stderr
