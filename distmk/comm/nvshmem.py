"""NvshmemComm: GPU ranks that share NVSHMEM symmetric memory.

The megakernel's exchange tasks either store straight into peers' symmetric buffers through peer pointers
(nvshmem_ptr: every peer on this node, NVLink or PCIe P2P) and bump their event counters with system-scope
release atomics, or use NVSHMEM put-with-signal (any peer, across nodes too). Host-side gathers (sampling's logits) go over
torch.distributed. NVSHMEM is bootstrapped from a unique id that rank 0 creates and broadcasts: over
torch.distributed when it is up (torchrun, or mpirun/srun with MASTER_ADDR), else over mpi4py.
"""
from __future__ import annotations

import numpy as np
import torch

from distmk.errors import DistmkError


def _broadcast_bytes(data: np.ndarray, rank: int) -> None:
    import torch.distributed as dist
    if dist.is_initialized():
        on_device = dist.get_backend() == "nccl"
        t = torch.from_numpy(data.copy())
        t = t.cuda() if on_device else t
        dist.broadcast(t, 0)
        data[:] = t.cpu().numpy()
    else:
        from mpi4py import MPI
        data[:] = MPI.COMM_WORLD.bcast(data if rank == 0 else None, root=0)


class NvshmemComm:
    def __init__(self, launch):
        try:
            import nvshmem.core as nvshmem
            from cuda.core import Device
        except ImportError as e:
            raise DistmkError(f"the triton backend at tp>1 needs nvshmem4py (pip install -e '.[gpu]'): {e}") from None
        self.rank, self.world = launch.rank, launch.world
        # exchange transports the megakernel may use; "pointer" goes once a peer is not reachable by pointer
        self.transports = ("pointer", "nvshmem")
        self._nvshmem, self._tensors = nvshmem, []
        uid = nvshmem.get_unique_id(empty=launch.rank != 0)
        _broadcast_bytes(uid._data.view(np.int8), launch.rank)
        device = Device(launch.local_rank)
        device.set_current()
        nvshmem.init(device=device, uid=uid, rank=launch.rank, nranks=launch.world, initializer_method="uid")

    def gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        import torch.distributed as dist
        out = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(out, t.contiguous())
        return out

    def symmetric(self, shape, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
        from nvshmem.core.interop import torch as nvshmem_torch
        local = nvshmem_torch.tensor(tuple(shape), dtype=dtype)
        local.zero_()
        self._tensors.append(local)
        peers = []
        for pe in range(self.world):
            peer = nvshmem_torch.get_peer_tensor(local, pe)
            if peer is None:                  # another node: only put-with-signal reaches it
                self.transports = ("nvshmem",)
            peers.append(peer.data_ptr() if peer is not None else 0)
        return local, torch.tensor(peers, dtype=torch.int64, device=device)

    def barrier(self) -> None:
        torch.cuda.synchronize()
        self.gather(torch.zeros(1, device="cuda"))

    def close(self) -> None:
        """Free every symmetric tensor, then finalize: NVSHMEM hangs at exit otherwise."""
        from nvshmem.core.interop import torch as nvshmem_torch
        torch.cuda.synchronize()
        self.barrier()
        while self._tensors:
            nvshmem_torch.free_tensor(self._tensors.pop())
        self._nvshmem.finalize()
