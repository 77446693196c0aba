#!/usr/bin/env bash
# Start a distmk module or script on N local ranks (one per GPU) with Open MPI's mpirun:
#   launch/mpirun.sh 2 distmk.generate --model tiny-llama --prompt-ids 1,2,3 --json
#   launch/mpirun.sh 8 benchmarks/decode.py --model llama-3-8b --json
# distmk.dist reads each rank's OMPI_COMM_WORLD_* variables; rank 0 picks the rendezvous port and sends it
# to the others over MPI (MASTER_ADDR defaults to 127.0.0.1, MASTER_PORT to that port). The variables the
# runtime reads (NVSHMEM_*, NCCL_*, TORCH_*, CUDA_VISIBLE_DEVICES, MASTER_ADDR/PORT, DISTMK_*, PYTHONPATH,
# OMP_NUM_THREADS) are exported to every rank with -x, so they also reach ranks on other hosts.
# MPIRUN_ARGS adds options of mpirun's own, e.g. "--oversubscribe" or "--bind-to none".
set -euo pipefail
source "$(dirname "$0")/env.sh"
parse_launch_args "$@"
options=(-np "$nproc")
[ "$(id -u)" -ne 0 ] || options+=(--allow-run-as-root)
for name in $(compgen -e); do
    case $name in
        NVSHMEM_*|NCCL_*|TORCH_*|CUDA_VISIBLE_DEVICES|MASTER_ADDR|MASTER_PORT|DISTMK_*|PYTHONPATH|PYTHONUNBUFFERED|OMP_NUM_THREADS)
            options+=(-x "$name") ;;
    esac
done
read -ra extra <<< "${MPIRUN_ARGS:-}"
exec mpirun "${options[@]}" "${extra[@]}" "$DISTMK_PYTHON" "${python_args[@]}"
