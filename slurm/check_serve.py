"""Check a running distmk server from outside: wait for GET /health, ask for one greedy completion
(POST /v1/completions), print both answers as one JSON line; exit 0 only if the answer holds a completion.

    python slurm/check_serve.py --url http://node01:8000 --model llama-3-8b

serve.sbatch runs it in CPU mode; it also checks a server started by hand.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True, help="the server's base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", required=True, help="the model name the server was started with")
    p.add_argument("--prompt", default="Hello")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--timeout", type=float, default=300, help="seconds the server may take to become healthy")
    p.add_argument("--server-pid", type=int, help="give up at once if this process (the server) exits")
    return p.parse_args(argv)


def alive(pid: int | None) -> bool:
    if pid is None:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_healthy(url: str, timeout: float, server_pid: int | None) -> int:
    """The status of the first GET /health that answers 200; raises if the time runs out or the server dies
    (the port is bound before loading, so while the server loads and compiles a poll waits up to 10 s)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive(server_pid):
            raise RuntimeError(f"the server (pid {server_pid}) exited before {url}/health answered")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=10) as response:
                if response.status == 200:
                    return response.status
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(1)
    raise RuntimeError(f"{url}/health did not answer 200 within {timeout:.0f} s")


def complete(url: str, model: str, prompt: str, max_tokens: int) -> dict:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.load(response)


def main(argv=None) -> int:
    args = parse_args(argv)
    url = args.url.rstrip("/")
    try:
        health = wait_healthy(url, args.timeout, args.server_pid)
        answer = complete(url, args.model, args.prompt, args.max_tokens)
    except urllib.error.HTTPError as e:
        print(f"serve check failed: {e}: {e.read().decode(errors='replace')[:1000]}", file=sys.stderr)
        return 1
    except (RuntimeError, urllib.error.URLError, ConnectionError, TimeoutError, ValueError) as e:
        print(f"serve check failed: {e}", file=sys.stderr)
        return 1
    print(json.dumps({"health": health, "completion": answer}), flush=True)
    choices = answer.get("choices") or [{}]
    if not isinstance(choices[0].get("text"), str):
        print("serve check failed: the answer has no choices[0].text", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
