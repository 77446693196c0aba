"""How ranks reach each other: NVSHMEM symmetric memory for the megakernel (nvshmem.py), and the CPU
communicators of the reference executor and the tests (cpu.py)."""


def backend_comm(backend: str, launch):
    """The communicator of a rank whose process group is up: NVSHMEM symmetric memory for the megakernel
    (triton), torch.distributed for the reference executor."""
    if backend == "triton":
        from distmk.comm.nvshmem import NvshmemComm
        return NvshmemComm(launch)
    from distmk.comm.cpu import TorchDist
    return TorchDist()
