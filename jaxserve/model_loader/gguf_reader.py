"""``BoundedReader``: gguf's ``GGUFReader`` whose reads stop at the end of the file.

gguf's reader views the bytes a field or tensor needs as ``data[start:end]``, which is shorter
than asked for in a file cut short, and fails on numpy's view or reshape of it ("cannot reshape
array of size 66784 into shape (576,360)", "When changing to a larger dtype, its size must be a
divisor ..."). Here every read checks that its bytes are in the file first, so a truncated file
fails naming the tensor (or the header) that lies past its end. The reader has no public hook
for it: this overrides its read primitive ``_get`` and its tensor table's ``_build_tensors``
(as in gguf 0.19; test_ckpt_gguf_header.py checks the messages, so a gguf that changes them
fails there).
"""

from __future__ import annotations

import pathlib

import numpy as np
from gguf import GGUFReader


class _PastTheEnd(Exception):
    """A read of bytes ``start..end`` of a file that ends before ``end``."""

    def __init__(self, start: int, end: int):
        super().__init__(start, end)
        self.start, self.end = start, end


class BoundedReader(GGUFReader):
    """``GGUFReader(path)`` for a GGUF file.

    Raises:
      ValueError: "GGUF file X is truncated: tensor 'blk.N.name' needs bytes A..B, the file has
        C" (or "its header needs ..."); gguf's own errors for a file that is not GGUF.
    """

    def __init__(self, path: str | pathlib.Path):
        self.path = path
        try:
            super().__init__(str(path))
        except _PastTheEnd as e:
            raise self._truncated("its header", e) from None

    def _get(self, offset, dtype, count=1, override_order=None):
        end = int(offset) + np.dtype(dtype).itemsize * int(count)
        if end > self.data.size:
            raise _PastTheEnd(int(offset), end)
        return super()._get(offset, dtype, count, override_order)

    def _build_tensors(self, start_offs, fields):
        try:
            super()._build_tensors(start_offs, fields)
        except _PastTheEnd as e:
            # The read that failed is a tensor's: the one whose offset (a tensor-info field's
            # last part, from the data section's start) it began at.
            name = next(f.name for f in fields if start_offs + int(f.parts[-1][0]) == e.start)
            raise self._truncated(f"tensor {name!r}", e) from None

    def _truncated(self, what: str, e: _PastTheEnd) -> ValueError:
        return ValueError(f"GGUF file {self.path} is truncated: {what} needs bytes "
                          f"{e.start}..{e.end}, the file has {self.data.size}")
