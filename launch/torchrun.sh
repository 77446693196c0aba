#!/usr/bin/env bash
# Start a distmk module or script on N local ranks (one per GPU) with torchrun:
#   launch/torchrun.sh 2 distmk.generate --model tiny-llama --prompt-ids 1,2,3 --json
#   launch/torchrun.sh 8 benchmarks/decode.py --model llama-3-8b --json
# torchrun gives each rank RANK/WORLD_SIZE/LOCAL_RANK and a rendezvous on this host; the ranks inherit the
# environment, with launch/env.sh's defaults (NVLink multicast off).
set -euo pipefail
source "$(dirname "$0")/env.sh"
parse_launch_args "$@"
exec "$DISTMK_PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$nproc" "${python_args[@]}"
