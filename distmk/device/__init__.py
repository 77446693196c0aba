"""Device code below the task types: the tl helpers (primitives), the all-reduce's push (exchange), the Gluon
weight ring's pieces (ring) and the NVSHMEM externs (nvshmem) that tasks/ and kernels/ are written with. It imports
nothing of distmk above it."""
