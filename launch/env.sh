# Sourced by launch/*.sh and slurm/*.sbatch: the environment every distmk rank starts with.
# NVLink multicast stays off unless set beforehand: the H200 hosts we run on require it.
export NVSHMEM_DISABLE_NVLS=${NVSHMEM_DISABLE_NVLS:-1}
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
export TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}
export PYTHONUNBUFFERED=1
# the interpreter that has distmk installed (default: python3 on PATH, e.g. an activated virtualenv)
export DISTMK_PYTHON=${DISTMK_PYTHON:-python3}

# launch/*.sh's arguments, NPROC MODULE|SCRIPT.py [ARGS...]: sets nproc and python_args (python's own
# arguments: -m MODULE ARGS or SCRIPT.py ARGS), or prints the usage and exits
parse_launch_args() {
    if [ $# -lt 2 ]; then
        echo "usage: $0 NPROC MODULE|SCRIPT.py [ARGS...]" >&2
        exit 2
    fi
    nproc=$1
    local target=$2
    shift 2
    if [[ $target == *.py ]]; then python_args=("$target" "$@"); else python_args=(-m "$target" "$@"); fi
}
