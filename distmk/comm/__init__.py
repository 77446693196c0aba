"""Communicators for GPU ranks (the CPU ones, used by the reference executor, are in distmk.reference.comm)."""
