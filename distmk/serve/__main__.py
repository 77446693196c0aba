"""python -m distmk.serve: an OpenAI-compatible server (continuous batching) over the megakernel engine.

One process per tensor-parallel rank, alone or under torchrun / mpirun / srun. Every rank loads its
shard and steps the engine; rank 0 also serves HTTP and decides each step (see lockstep.py). SIGTERM or
SIGINT: rank 0 stops taking requests, gives running ones a few seconds, then tells the other ranks to
exit; every rank exits 0. A rank that dies: the others notice at their next exchange (or rank 0's next
heartbeat, or a follower's control timeout) and exit 1 saying so, without the collective clean-up that
would wait on the dead rank.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import ipaddress
import os
import signal
import socket
import sys
import threading

from tqdm import tqdm

from distmk.cli import add_engine_args, build_engine, open_comm, run_virtual_ranks, select_device
from distmk.dist import detect_launch
from distmk.errors import DistmkError
from distmk.flags import COUNT, NON_NEGATIVE, int_in
from distmk.runtime.batcher import PrefillInputs, StepInputs
from distmk.runtime.tokenizer import load_tokenizer
from distmk.serve.lockstep import Leader, control_group, follow
from distmk.serve.reasoning import PARSERS, think_token

GRACEFUL_S = 5.0          # what running requests get to finish after SIGTERM; then they end with an error
ENGINE_STOP_S = 10.0      # for the step under way and the shutdown message, after that
FOLLOWER_WAIT_S = 20.0    # a rank other than 0, signalled itself, waits this long for rank 0's shutdown


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m distmk.serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(p, "--max-batch", "rows (tokens) per engine step: one per running sequence, the rest "
                                      "prompt chunks; compiled once at start")
    p.add_argument("--max-seqs", type=COUNT, default=None,
                   help="sequences generating at once (default and at most: --max-batch); each has KV-cache "
                        "room for --max-context tokens")
    p.add_argument("--steps-per-launch", type=COUNT, default=1,
                   help="while every running stream decodes greedily and no request waits, run up to this many "
                        "steps back to back without the host between them; their tokens are sent together")
    p.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                   help="read every prompt whole (by default a prompt starts from the KV blocks of the longest "
                        "block-aligned prefix an earlier request wrote, as vLLM's automatic prefix caching)")
    p.add_argument("--trace-steps", metavar="FILE", default=None,
                   help="write a JSON line for every engine step and prefill chunk (rows, start and end), request "
                        "taken in and token hand-over to FILE: the timeline behind /metrics "
                        "(benchmarks/step_trace.py summarises it)")
    p.add_argument("--max-queue", type=NON_NEGATIVE, default=256,
                   help="requests waiting for a place in the batch; beyond: 429")
    p.add_argument("--reasoning-parser", choices=PARSERS, default=None,
                   help="chat replies' <think> ... </think> as the message's reasoning, apart from its content (vLLM's "
                        "names; both read the same tags)")
    p.add_argument("--served-model-name", default=None, help="the model name clients send (default: --model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int_in(0, 65535), default=8000,
                   help="0: any free port (the startup line says which)")
    p.add_argument("--api-key", type=_nonempty, default=os.environ.get("DISTMK_API_KEY") or None,
                   help="every route but /health needs 'Authorization: Bearer KEY' (default: $DISTMK_API_KEY, "
                        "which keeps the key out of the process list)")
    p.add_argument("--metrics-public", action="store_true", help="with --api-key: /metrics without the key")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level (info logs every request)")
    args = p.parse_args(argv)
    args.max_seqs = args.batch if args.max_seqs is None else args.max_seqs
    if args.max_seqs > args.batch:
        p.error(f"argument --max-seqs: must be at most --max-batch ({args.batch}), got {args.max_seqs}")
    return args


def _nonempty(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def main(argv=None) -> int:
    args = parse_args(argv)
    launch = detect_launch()
    comm = None
    try:
        sock = listen(args.host, args.port) if launch.rank == 0 else None   # a busy port fails before loading
        device = select_device(args, launch)
        if args.virtual_tp > 1:             # rank 0 serves from this, the main thread (signals)
            code = run_virtual_ranks(args, launch, lambda rank_launch, rank_comm: serve_rank(
                args, rank_launch, rank_comm, device, sock), lead_here=True)[0]
        else:
            comm = open_comm(args, launch)
            code = serve_rank(args, launch, comm, device, sock)
    except DistmkError as e:
        print(f"error: {e}", file=sys.stderr)
        code = 2
    if code != 0:
        # A peer may be gone or the ranks out of step: freeing NVSHMEM memory and tearing the process group
        # down are collectives that would wait on it.
        sys.stderr.flush()
        os._exit(code)
    if hasattr(comm, "close"):           # NVSHMEM: free symmetric memory and finalize, every rank together
        comm.close()
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


def serve_rank(args, launch, comm, device: str, sock) -> int:
    """This rank's engine, then rank 0 serves and the others follow it (virtual ranks on their own threads)."""
    engine = build_engine(args, launch, comm, device, progress=launch.rank == 0, max_seqs=args.max_seqs)
    group = control_group(comm) if launch.world > 1 else None
    if launch.rank == 0:
        return serve(args, launch, engine, Leader(engine, group), sock)
    if launch.launcher == "virtual":
        follow(engine, group)
        return 0
    return follow_rank_0(engine, group, launch.rank)


def warm_up(leader: Leader, engine) -> None:
    """A one-row step, then a full step of every step table, and prefill chunks before serving, so that
    compilation and the CUDA-graph captures (runtime/prefill.ChunkGraphs) happen now rather than in the first
    requests: a first chunk and a later one of each row bucket and of the largest length (every later chunk has
    the same bucket of keys), each as a prompt's last chunk, and those of the chunk size also as one that is not:
    a bucket left to first use costs its first prompt a chunk run op by op and then recorded, many times a replay.
    What the chunks write to the KV cache is free space: a sequence reads only positions that it, or the
    sequence whose cached prefix it starts from, wrote."""
    bs, context = engine.kv.block_size, engine.max_context
    for rows in tqdm(sorted({1, *engine.executors}), desc="compiling and warming up the step tables", leave=False):
        positions = [i % context for i in range(rows)]
        blocks = list(range(-(-(max(positions) + 1) // bs)))
        leader.run(StepInputs([0] * rows, positions, [blocks] * rows, needs_logits=True))
    largest = min(engine.prefill_chunk, context)
    graphs = engine.prefill_graphs

    def endings(tokens):
        """A chunk that ends its prompt (last: with its last row's logits) can have any length; one that does not
        has the largest, the chunk size (Batcher.plan_prefill)."""
        return (True, False) if tokens == largest else (True,)

    for tokens in ([s for s in graphs.rows if s <= largest] if graphs else []) + [largest]:
        if tokens > 1:                   # a chunk of one token would compile a stage for that length alone
            for last in endings(tokens):
                leader.prefill(PrefillInputs([0] * tokens, 0, list(range(-(-tokens // bs))), last=last))
    for rows in tqdm(graphs.rows if graphs else [], desc="capturing later prefill chunks' graphs", leave=False):
        tokens = min(rows, largest, context - 1)          # at the context's end, after position 0
        if 2 * tokens > rows:                             # still in this row bucket
            for last in endings(tokens):
                leader.prefill(PrefillInputs([0] * tokens, context - tokens, list(range(-(-context // bs))), last=last))


def listen(host: str, port: int) -> socket.socket:
    """The listening socket, bound here so that a busy port is a clear error and port 0 works. Made with
    the address's own protocol number (IPPROTO_TCP), without which asyncio leaves Nagle's algorithm on for
    the connections and every keep-alive response waits for a delayed ACK (~40 ms)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
        return sock
    except OSError as e:
        raise DistmkError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def serve(args, launch, engine, leader: Leader, sock: socket.socket) -> int:
    import uvicorn

    from distmk.serve.app import H11WithJSONErrors, Served, create_app
    from distmk.serve.metrics import Metrics, StepTrace
    from distmk.serve.scheduler import Scheduler

    # A signal during warm-up (compilation, graph capture) ends the server once the warm-up is done: the
    # other ranks are in the same steps, and leaving mid-way would strand them.
    trace = StepTrace(args.trace_steps) if args.trace_steps else None      # a bad path fails before warm-up
    early_exit = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda sig, _frame: early_exit.append(sig))
    warm_up(leader, engine)
    freeze_heap()
    if early_exit:
        leader.shutdown()
        print(f"distmk.serve: rank 0: stopped by {signal.Signals(early_exit[0]).name} during warm-up", file=sys.stderr)
        return 0
    scheduler = Scheduler(engine, leader, Metrics(engine.kv.num_blocks), args.max_seqs, args.steps_per_launch,
                          trace, args.prefix_cache)
    name = args.served_model_name or args.model
    tokenizer = load_tokenizer(engine.tokenizer_dir, engine.spec.vocab_size)
    served = Served(name, tokenizer, scheduler,
                    scheduler.metrics, engine.max_context, capacity=args.max_seqs + args.max_queue,
                    sampling_defaults=engine.spec.generation_defaults, vocab_size=engine.spec.vocab_size,
                    eos_token_ids=tuple(engine.spec.eos_token_id), api_key=args.api_key,
                    metrics_public=args.metrics_public, reasoning=args.reasoning_parser is not None,
                    think_token=think_token(tokenizer) if args.reasoning_parser else None)
    loop = None           # the event loop, once running

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            """A signal: uvicorn stops taking requests and waits for the running ones, which get GRACEFUL_S
            before they are ended with an error event (rather than cut off by uvicorn's own timeout)."""
            super().handle_exit(sig, frame)
            loop.call_soon_threadsafe(loop.call_later, GRACEFUL_S, served.abort_all, "the server is shutting down")

    server = Server(uvicorn.Config(create_app(served), http=H11WithJSONErrors, log_level=args.log_level,
                                   timeout_graceful_shutdown=GRACEFUL_S + 2))

    def request_exit(*_):
        server.should_exit = True

    # ours until uvicorn installs its own (the same, plus a second Ctrl-C forcing), which re-raises the
    # signal it handled to ours when it is done
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, request_exit)
    stopped = False

    async def run():
        nonlocal loop, stopped
        loop = asyncio.get_running_loop()
        scheduler.start(loop, on_death=request_exit)
        host, port = sock.getsockname()[:2]
        url = f"http://{f'[{host}]' if ':' in host else host}:{port}/v1"
        print(f"distmk.serve: {name} | tp {launch.world}, {args.backend} backend on {args.device}, "
              f"{str(engine.dtype).removeprefix('torch.')} | {engine.config.batch} rows per step "
              f"(tables of {', '.join(map(str, sorted(engine.executors)))}), "
              f"{args.max_seqs} sequences at once, context {engine.max_context}, queue {args.max_queue} | {url}"
              f"{' | API key required' if args.api_key else ''}", file=sys.stderr, flush=True)
        if not args.api_key and not ipaddress.ip_address(host).is_loopback:
            print(f"distmk.serve: warning: serving {host} without --api-key: anyone who reaches the port can use "
                  "the server", file=sys.stderr, flush=True)
        try:
            await server.serve(sockets=[sock])
        finally:       # while the event loop is open, so that the last step's tokens can still be handed over
            stopped = await loop.run_in_executor(None, scheduler.stop, ENGINE_STOP_S)

    asyncio.run(run())
    served.tokenizing.shutdown(wait=False, cancel_futures=True)
    served.compiling.shutdown(wait=False, cancel_futures=True)
    if scheduler.failure:
        print(f"distmk.serve: rank 0: exiting, the engine failed: {scheduler.failure}", file=sys.stderr)
        return 1
    if not stopped:
        print(f"distmk.serve: rank 0: exiting, the engine did not stop within {ENGINE_STOP_S} s (is a rank "
              "stuck?)", file=sys.stderr)
        return 1
    print("distmk.serve: rank 0: stopped", file=sys.stderr)
    return 0


class _Signalled(Exception):
    pass


def freeze_heap() -> None:
    """Move every object alive now (the model, its tables, the compilers' caches) out of the garbage
    collector's sight, as vLLM does after start-up: a full collection then scans only what serving allocates,
    instead of pausing every stream (and, in lockstep, every rank) for a walk over the whole heap."""
    gc.collect()
    gc.freeze()


def follow_rank_0(engine, group, rank: int) -> int:
    """Run the steps rank 0 sends, on a thread, while this one waits for the end: rank 0's shutdown
    message, a lost rank, or a signal (then rank 0, signalled too, should send the shutdown soon)."""
    freeze_heap()
    done, failure = threading.Event(), []

    def steps():
        try:
            follow(engine, group)
        except Exception as e:  # noqa: BLE001 - reported below, whatever it was
            failure.append(e)
        finally:
            done.set()

    threading.Thread(target=steps, name="distmk-lockstep", daemon=True).start()
    signalled = []

    def on_signal(sig, _frame):
        if not signalled:
            signalled.append(signal.Signals(sig).name)
            raise _Signalled

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    try:
        done.wait()
    except _Signalled:
        if not done.wait(FOLLOWER_WAIT_S):
            print(f"distmk.serve: rank {rank}: got {signalled[0]} but rank 0 sent no shutdown within "
                  f"{FOLLOWER_WAIT_S} s; exiting", file=sys.stderr)
            return 1
    if failure:
        print(f"distmk.serve: rank {rank}: exiting, {failure[0]}", file=sys.stderr)
        return 1
    print(f"distmk.serve: rank {rank}: stopped", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
