"""A column of a metadata table (``data/metadata.py``) as a read-only sequence."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Callable

import numpy as np
import pyarrow as pa


class Column(Sequence):
    """One column as a read-only sequence; a Python value is made only when one is asked for."""

    def __init__(self, column: pa.ChunkedArray, convert: Callable | None = None):
        self._chunks = [chunk for chunk in column.chunks if len(chunk)]
        self._starts = np.cumsum([0] + [len(chunk) for chunk in self._chunks])
        self._convert = convert or (lambda value: value)

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        index = operator.index(index)
        index = index + len(self) if index < 0 else index
        if not 0 <= index < len(self):
            raise IndexError(f"row {index} outside 0..{len(self) - 1}")
        k = int(np.searchsorted(self._starts, index, side="right")) - 1
        return self._convert(self._chunks[k][index - int(self._starts[k])].as_py())

    def __iter__(self):
        for chunk in self._chunks:
            yield from map(self._convert, chunk.to_pylist())

    def __eq__(self, other):
        if not isinstance(other, (list, tuple, Column)):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    __hash__ = None

    def __repr__(self) -> str:
        return f"Column({self[:3]}{' ...' if len(self) > 3 else ''}, {len(self)} values)"
