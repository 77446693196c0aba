"""How far a model's FP8 twin (--quantize fp8: 128 x 128 blocks, the layout of Qwen's FP8 checkpoints) moves its
logits from the bf16 model's: one token sequence, each position's logits from distmk's decode step of either model,
as served (the e4m3 products streamed by the megakernel with --stream-e4m3 1, the default here). Reports each
position's relative error (|fp8 - bf16| / |bf16|, L2 over the vocabulary), the KL divergence of the fp8 model's
next-token distribution from the bf16 one's, and the fraction of positions whose greedy tokens agree; one JSON.

    python benchmarks/fp8_accuracy.py --model llama-3-8b --positions 512 --out benchmarks/results/x.json

A preset's weights are random (seeded): its figures say what quantization does to those, not to a trained model's
(there the logits are sharper and top-1 agreement higher); a checkpoint directory gives the real figure. The
sequence is random tokens, `--batch` positions a step (each row one position of the same sequence, its KV written
as the rows before it wrote theirs).
"""
from __future__ import annotations

import argparse
import datetime
import gc
import sys

import torch

from distmk.cli import COUNT, add_kernel_args, kernel_options_of
from distmk.graph import GraphConfig
from distmk.runtime.engine import Engine

from decode import emit, git_commit


def sequence_logits(engine: Engine, tokens: list[int], batch: int) -> torch.Tensor:
    """[positions, vocab] float32 logits after each token of `tokens`, `batch` positions a step."""
    blocks = engine.kv.allocate([], len(tokens))
    logits = []
    for start in range(0, len(tokens), batch):
        chunk = tokens[start:start + batch]
        buf = engine.step(chunk, range(start, start + len(chunk)), [blocks] * len(chunk))
        logits.append(engine.full_logits(buf, len(chunk)).float())
    return torch.cat(logits)


def compare(fp8: torch.Tensor, bf16: torch.Tensor) -> dict:
    rel = (fp8 - bf16).norm(dim=-1) / bf16.norm(dim=-1)
    kl = torch.nn.functional.kl_div(fp8.log_softmax(-1), bf16.log_softmax(-1), log_target=True,
                                    reduction="none").sum(-1)
    return {"positions": len(rel), "top1_agreement": (fp8.argmax(-1) == bf16.argmax(-1)).float().mean().item(),
            "rel_err_median": rel.median().item(), "rel_err_max": rel.max().item(),
            "kl_mean": kl.mean().item(), "kl_max": kl.max().item()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="preset name or Hugging Face checkpoint directory (bf16)")
    p.add_argument("--positions", type=COUNT, default=512, help="tokens of the sequence")
    p.add_argument("--batch", type=COUNT, default=16, help="positions a step")
    p.add_argument("--seed", type=int, default=0, help="of the sequence and of a preset's weights")
    p.add_argument("--out", help="also write the JSON to this file")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu: the reference executor in float32 (a check of this script, not a figure)")
    add_kernel_args(p)
    args = p.parse_args(argv)
    on_gpu = args.device == "cuda"
    options = {"stream_e4m3": 1, **kernel_options_of(args)}
    tokens = None
    logits = {}
    for quantize in (None, "fp8"):          # one engine at a time: the GPU holds one model
        engine = Engine(args.model, backend="triton" if on_gpu else "reference", device=args.device,
                        dtype=torch.bfloat16 if on_gpu else torch.float32, seed=args.seed,
                        max_context=-(-args.positions // 16) * 16, config=GraphConfig(batch=args.batch),
                        quantize=quantize, kernel_options=options if quantize else kernel_options_of(args))
        if tokens is None:
            generator = torch.Generator().manual_seed(args.seed)
            tokens = torch.randint(engine.spec.vocab_size, (args.positions,), generator=generator).tolist()
        logits[quantize or "bf16"] = sequence_logits(engine, tokens, args.batch).cpu()
        e4m3 = sorted(engine.weights.fp8)
        kernel = getattr(engine.executor, "kernel_name", "reference")
        del engine
        gc.collect()
        if on_gpu:
            torch.cuda.empty_cache()
        print(f"[fp8_accuracy] {quantize or 'bf16'}: {kernel} kernel, e4m3 products {e4m3}", file=sys.stderr)
    result = {"model": args.model, "batch": args.batch, "seed": args.seed, "kernel": kernel, "e4m3_products": e4m3,
              **compare(logits["fp8"], logits["bf16"]),
              "gpu": torch.cuda.get_device_name() if on_gpu else None, "torch": torch.__version__,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join(["python", *sys.argv]), "distmk_commit": git_commit()}
    emit(result, False, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
