"""Communicators for GPU ranks (the CPU ones, used by the reference executor, are in distmk.reference.comm)."""


def backend_comm(backend: str, launch):
    """The communicator of a rank whose process group is up: NVSHMEM symmetric memory for the megakernel
    (triton), torch.distributed for the reference executor."""
    if backend == "triton":
        from distmk.comm.nvshmem import NvshmemComm
        return NvshmemComm(launch)
    from distmk.reference.comm import TorchDist
    return TorchDist()
