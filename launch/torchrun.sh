#!/usr/bin/env bash
# Start a distmk module on N local ranks with torchrun:
#   launch/torchrun.sh N distmk.generate --model tiny-llama --prompt-ids 1,2,3 --json
# NVLink multicast stays off (NVSHMEM_DISABLE_NVLS, NCCL_NVLS_ENABLE): the H200 hosts we run on require it.
set -euo pipefail
if [ $# -lt 2 ]; then
    echo "usage: $0 NPROC MODULE [ARGS...]" >&2
    exit 2
fi
nproc=$1 module=$2
shift 2
export NVSHMEM_DISABLE_NVLS=${NVSHMEM_DISABLE_NVLS:-1} NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
export TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}
exec torchrun --standalone --nproc-per-node "$nproc" -m "$module" "$@"
