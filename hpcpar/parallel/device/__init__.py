"""Where the arrays live and what a device is asked to do.

    backend        the array module (NumPy, CuPy, or the strict pretend device) and everything
                   device-specific: streams, events, copies to and from the host
    strict_arrays  the strict pretend device: NumPy arrays that must be moved to and from the
                   host explicitly, as CuPy's must (``HPCPAR_BACKEND=strict``)
    budget         the device budget: what a GPU would be asked to do (kernels, syncs,
                   uploads, allocations, peak bytes), counted on the strict device
    capture        what a step captured as a CUDA graph may do, checked on the CPU
    graphs         a step captured once and replayed: CUDA graphs and their checked stand-in
    dtypes         floating-point formats by name, bfloat16 included
    waits          bounded waits: the one way a rank waits on other ranks or on its GPU
"""

from ..exports import lazy_names

__getattr__, __dir__, __all__ = lazy_names(__name__, {
    ".backend": ("ArrayBackend", "select_backend"),
    ".budget": ("Budget",),
    ".graphs": ("StepGraph",),
    ".dtypes": ("bfloat16", "float_dtype"),
})
