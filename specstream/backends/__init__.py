"""Transfer backends: how KV bytes cross the host-device link (one module per device).

Importing this package registers the built-in backends ("cpu", "cuda") with `make_backend`;
the CUDA module touches no CUDA API until a backend is constructed.
"""

from __future__ import annotations

from specstream.backends.base import (
    D2H,
    H2D,
    TransferBackend,
    TransferError,
    TransferHandle,
    TransferRecord,
    available_backends,
    make_backend,
    register_backend,
)
from specstream.backends.cpu import CpuBackend, limit_compute_threads
from specstream.backends.cuda import CudaBackend

__all__ = [
    "D2H",
    "H2D",
    "CpuBackend",
    "CudaBackend",
    "TransferBackend",
    "TransferError",
    "TransferHandle",
    "TransferRecord",
    "available_backends",
    "limit_compute_threads",
    "make_backend",
    "register_backend",
]
