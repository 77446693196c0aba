"""How ranks reach each other: NVSHMEM symmetric memory for the megakernel (nvshmem.py), and the CPU
communicators of the reference executor and the tests (cpu.py)."""


def sum_in_rank_order(comm, partial):
    """Every rank's `partial` summed in rank order, so that every rank holds the same bits: the all-reduce of
    the reference's allreduce tasks and of the prefill path (runtime/prefill.py)."""
    if comm.world == 1:
        return partial
    parts = comm.gather(partial)
    total = parts[0].new_zeros(parts[0].shape)
    for part in parts:
        total += part
    return total


def backend_comm(backend: str, launch):
    """The communicator of a rank whose process group is up: NVSHMEM symmetric memory for the megakernel
    (triton), torch.distributed for the reference executor."""
    if backend == "triton":
        from distmk.comm.nvshmem import NvshmemComm
        return NvshmemComm(launch)
    from distmk.comm.cpu import TorchDist
    return TorchDist()
