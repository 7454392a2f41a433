"""A tile product for Triton's CPU interpreter that computes each row the same way wherever it sits in the tile.

The interpreter's `tl.dot` is `np.matmul`, and BLAS handles a tile's rows in panels: a row at another offset (the
same request in another batch) can take a different microkernel, and its bits change on some CPUs (seen with
OpenBLAS on an AMD EPYC, not on the Intel machines before). A tensor-core tile computes every row alike, which is
what the batch-invariant kernels rely on; `np.einsum` without optimisation sums each output over K in one fixed
loop, so the interpreter's checks test the kernels' tiling, not the CPU's BLAS.
"""

from __future__ import annotations

import numpy as np


def use_row_invariant_dot() -> None:
    """Replace the interpreter's float dot (call after importing triton, with TRITON_INTERPRET=1)."""
    from triton.runtime import interpreter  # noqa: PLC0415

    builder = interpreter.InterpreterBuilder
    matmul_dot = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.primitive_bitwidth == 8 or b.dtype.primitive_bitwidth == 8:  # fp8 / int8: the interpreter's own
            return matmul_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        out = d.data.dtype
        product = np.einsum("...mk,...kn->...mn", a.data.astype(out), b.data.astype(out), optimize=False)
        return interpreter.TensorHandle(product + d.data, d.dtype.scalar)

    builder.create_dot = create_dot
