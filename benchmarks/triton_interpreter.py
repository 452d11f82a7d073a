"""Triton's interpreter (``TRITON_INTERPRET=1``, how the kernels run on a CPU) made to round as a GPU does.

The interpreter turns float32 into bfloat16 by dropping the low bits; a GPU (and torch) rounds to nearest even. Checks
that compare a kernel's rounding points with torch's to the bit, or within a GPU's tolerance, run under
``bf16_rounded_to_nearest()``. Used by benchmarks/gpu_checks.py (its CPU rehearsal) and tests/_triton_kernels_worker.py.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch


@contextlib.contextmanager
def bf16_rounded_to_nearest():
    """The interpreter's float32 -> bfloat16 casts rounded to nearest even instead of truncated, while inside."""
    from triton.runtime import interpreter

    convert = interpreter._convert_float

    def rounded(data, input_dtype, output_dtype, rounding_mode):
        if input_dtype.primitive_bitwidth == 32 and output_dtype.name == "bf16":
            values = torch.from_numpy(np.ascontiguousarray(data).view(np.float32).copy())
            return values.bfloat16().view(torch.int16).numpy().view(np.uint16)
        return convert(data, input_dtype, output_dtype, rounding_mode)

    interpreter._convert_float = rounded
    try:
        yield
    finally:
        interpreter._convert_float = convert
