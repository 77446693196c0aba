"""NVSHMEM device functions for Triton kernels, declared against libnvshmem_device.bc.

Pointers go in as int64 addresses of symmetric memory (NVSHMEM translates them for the target PE). A
kernel that calls any of these must be compiled with `extern_libs=extern_libs()` and its module initialised
with `init_module` before its first launch (nvshmem4py's cumodule_init), which `compile_for_nvshmem` does.
Signal operations and comparisons are nvshmem4py's enum values (`signal_constants`), never literals: the
numbers differ between documentation sources, and a wrong comparison code deadlocks.
"""
from __future__ import annotations

from triton.language import core

_I32, _I64, _U64 = core.dtype("int32"), core.dtype("int64"), core.dtype("uint64")


def _extern(name: str, arg_types: tuple, ret, args, _semantic):
    return core.extern_elementwise("", "", list(args), {arg_types: (name, ret)}, is_pure=False, _semantic=_semantic)


@core.extern
def my_pe(_semantic=None):
    return _extern("nvshmem_my_pe", (), _I32, [], _semantic)


@core.extern
def n_pes(_semantic=None):
    return _extern("nvshmem_n_pes", (), _I32, [], _semantic)


@core.extern
def putmem_block(dst, src, nbytes, pe, _semantic=None):
    """Copy nbytes to `pe` with the whole CTA; returns once src may be reused (not yet delivered)."""
    return _extern("nvshmemx_putmem_block", (_I64, _I64, _I64, _I32), _I32, [dst, src, nbytes, pe], _semantic)


@core.extern
def putmem_nbi_block(dst, src, nbytes, pe, _semantic=None):
    """Non-blocking putmem_block: completes at the next quiet."""
    return _extern("nvshmemx_putmem_nbi_block", (_I64, _I64, _I64, _I32), _I32, [dst, src, nbytes, pe], _semantic)


@core.extern
def putmem_warp(dst, src, nbytes, pe, _semantic=None):
    return _extern("nvshmemx_putmem_warp", (_I64, _I64, _I64, _I32), _I32, [dst, src, nbytes, pe], _semantic)


@core.extern
def putmem_signal_block(dst, src, nbytes, sig, value, op, pe, _semantic=None):
    """Copy nbytes to `pe`, then apply `op` (SIGNAL_SET / SIGNAL_ADD) with `value` to the uint64 at `sig`
    on `pe`: whoever sees the signal sees the data."""
    return _extern("nvshmemx_putmem_signal_block", (_I64, _I64, _I64, _I64, _U64, _I32, _I32), _I32,
                   [dst, src, nbytes, sig, value, op, pe], _semantic)


@core.extern
def putmem_signal_nbi_block(dst, src, nbytes, sig, value, op, pe, _semantic=None):
    return _extern("nvshmemx_putmem_signal_nbi_block", (_I64, _I64, _I64, _I64, _U64, _I32, _I32), _I32,
                   [dst, src, nbytes, sig, value, op, pe], _semantic)


@core.extern
def signal_wait_until(sig, cmp, value, _semantic=None):
    """Wait (unbounded: prefer the megakernel's bounded wait_event) until *sig `cmp` value."""
    return _extern("nvshmem_signal_wait_until", (_I64, _I32, _U64), _U64, [sig, cmp, value], _semantic)


@core.extern
def fence(_semantic=None):
    """Order this PE's earlier puts to each target before its later ones."""
    return _extern("nvshmem_fence", (), _I32, [], _semantic)


@core.extern
def quiet(_semantic=None):
    """Complete every outstanding put of this PE."""
    return _extern("nvshmem_quiet", (), _I32, [], _semantic)


def signal_constants() -> dict:
    """Compile-time constants for kernels: nvshmem4py's signal ops and comparisons."""
    import nvshmem.bindings as nvb
    return {"SIGNAL_SET": int(nvb.Signal_op.SIGNAL_SET), "SIGNAL_ADD": int(nvb.Signal_op.SIGNAL_ADD),
            "CMP_GE": int(nvb.Cmp_type.CMP_GE), "CMP_EQ": int(nvb.Cmp_type.CMP_EQ)}


def extern_libs() -> dict:
    import nvshmem.core as nvshmem
    return {"libnvshmem_device": nvshmem.find_device_bitcode_library()}


def compile_for_nvshmem(kernel, grid, **launch_args):
    """Compile `kernel` for these arguments (linking libnvshmem_device) and initialise its module for
    NVSHMEM, so that launches with the same arguments (and extern_libs) find it ready in Triton's cache."""
    import nvshmem.bindings as nvb
    launch_args.setdefault("extern_libs", extern_libs())
    compiled = kernel.warmup(grid=grid, **launch_args)
    compiled._init_handles()
    status = nvb.cumodule_init(int(compiled.module))
    if status != 0:
        from distmk.errors import DistmkError
        raise DistmkError(f"NVSHMEM could not initialise the compiled kernel {kernel.fn.__name__} (status {status})")
    return compiled
