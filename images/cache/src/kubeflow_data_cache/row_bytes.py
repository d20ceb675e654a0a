"""How many bytes each row of a column holds beyond a fixed width, read from its offsets alone.

A data node cuts served batches where their values pass SERVED_BATCH_MAX_BYTES (store.py): a
batch sized by the table's average row held 100 MiB of images where a few large ones sat
together, and Flight refuses a batch over 2 GiB. Only the variable part of a row varies: its
strings and binaries, and the values of its lists, at any depth (a struct of an image's bytes
and its path, as Hugging Face stores images; a list of strings; a map).

A column's variable bytes are a sum of *terms*. Each term maps a row ``r`` through a chain of
steps to a position in some nested buffer; the row holds ``width * (at(r + 1) - at(r))`` bytes
of it. A string column is one term: its offsets, width 1. A list of float32 is its offsets,
width 4. A list of strings goes through the list's offsets, then the strings' offsets (their
bytes between the first and last string of the row). A struct adds up its fields' terms; a
fixed-size list of k scales the row by k first. Nothing is copied: steps are views of the
arrays' offsets, and a row's bytes are computed only for the rows asked about.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from kubeflow_data_cache.offsets import is_string_or_binary, value_offsets

# Rows measured at a time for a column set's largest row (largest_row_bytes, on a node's first
# read of those columns): about 32 bytes a row of temporaries per step, so a whole column at once
# would be a spike the serving memory guard does not count (tens of MiB a million rows).
MEASURE_ROWS = 1 << 16


@dataclass(frozen=True)
class Scale:
    """A fixed-size list's step: row ``r`` of the list starts at child row ``base + k * r``."""

    k: int
    base: int


@dataclass(frozen=True)
class Term:
    steps: tuple  # np.ndarray (offsets, a view) or Scale, applied in order to row positions
    width: int  # bytes per position of the last step

    def at(self, positions: np.ndarray) -> np.ndarray:
        """Where ``positions`` (row boundaries) land in the last step's buffer, as int64."""
        out = positions
        for step in self.steps:
            out = step.base + step.k * out if isinstance(step, Scale) else step[out]
        return np.asarray(out, dtype=np.int64)

    def at_range(self, start: int, stop: int) -> np.ndarray:
        """``at(arange(start, stop + 1))``, the first step sliced rather than gathered."""
        first, rest = self.steps[0], Term(self.steps[1:], self.width)
        if isinstance(first, Scale):
            return rest.at(first.base + first.k * np.arange(start, stop + 1, dtype=np.int64))
        return rest.at(first[start : stop + 1])


def varies(t: pa.DataType) -> bool:
    """Whether rows of type ``t`` can differ in size (what terms() would find terms in)."""
    if is_string_or_binary(t):
        return True
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_map(t):
        return True
    if pa.types.is_fixed_size_list(t):
        return varies(t.value_type)
    if pa.types.is_struct(t):
        return any(varies(t.field(i).type) for i in range(t.num_fields))
    return False


def _row_width(t: pa.DataType) -> int:
    """The bytes every value of type ``t`` holds whatever its size, in its own buffers: a
    number's width, a boolean's bit (as a byte: a bound), a string's, binary's or list's offset
    (its values are terms of their own), a struct's fields, a fixed-size list's k values. Left
    out, a list of 50 one-character strings counted 50 of its 254 bytes a row, and batches of
    such rows passed their byte cap 5 times over."""
    if pa.types.is_struct(t):
        return sum(_row_width(t.field(i).type) for i in range(t.num_fields))
    if pa.types.is_fixed_size_list(t):
        return t.list_size * _row_width(t.value_type)
    if pa.types.is_dictionary(t):
        return 0
    if pa.types.is_large_string(t) or pa.types.is_large_binary(t) or pa.types.is_large_list(t):
        return 8
    if is_string_or_binary(t) or pa.types.is_list(t) or pa.types.is_map(t):
        return 4
    if pa.types.is_boolean(t):
        return 1
    try:
        bits = t.bit_width
    except ValueError:
        return 0
    return bits // 8 if bits % 8 == 0 else 0


def terms(arr: pa.Array) -> list[Term]:
    """The terms of ``arr``'s variable bytes (see the module docstring); [] where every row is
    one size. Dictionaries, unions and view types are not counted."""
    t = arr.type
    if is_string_or_binary(t):
        return [Term((value_offsets(arr),), 1)]
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_map(t):
        offsets = value_offsets(arr)
        # The child whole: the list's offsets index it directly (``values`` ignores the list's
        # slice). Each of a row's values holds the child's fixed width, and its own variable part.
        child = arr.values
        width = _row_width(child.type)
        counted = [Term((offsets,), width)] if width else []
        return counted + [Term((offsets, *term.steps), term.width) for term in terms(child)]
    if pa.types.is_fixed_size_list(t):
        step = Scale(t.list_size, arr.offset * t.list_size)
        return [Term((step, *child.steps), child.width) for child in terms(arr.values)]
    if pa.types.is_struct(t):
        return [term for i in range(t.num_fields) for term in terms(arr.field(i))]  # sliced to the struct's rows
    return []


def rows_bytes(column_terms: Sequence[Term], rows: np.ndarray) -> np.ndarray:
    """Each of ``rows``' variable bytes (int64)."""
    out = np.zeros(len(rows), dtype=np.int64)
    for term in column_terms:
        out += (term.at(rows + 1) - term.at(rows)) * term.width
    return out


def prefix_bytes(column_terms: Sequence[Term], start: int, stop: int) -> np.ndarray:
    """Variable bytes of rows ``[start, start + i)`` for i in 0..stop-start (int64, from 0)."""
    out = np.zeros(stop - start + 1, dtype=np.int64)
    for term in column_terms:
        bounds = term.at_range(start, stop)
        out += (bounds - bounds[0]) * term.width
    return out


def span_bytes(column_terms: Sequence[Term], start: int, stop: int) -> int:
    """Variable bytes of rows ``[start, stop)`` together."""
    ends = np.array([start, stop], dtype=np.int64)
    return sum(int(np.diff(term.at(ends))[0]) * term.width for term in column_terms)


def largest_row_bytes(column_terms: Sequence[Term], rows: int, step: int = MEASURE_ROWS) -> int:
    """The most variable bytes one of ``rows`` rows holds, measured ``step`` rows at a time."""
    largest = 0
    if not column_terms:
        return 0
    for lo in range(0, rows, step):
        hi = min(rows, lo + step)
        largest = max(largest, int(np.diff(prefix_bytes(column_terms, lo, hi)).max(initial=0)))
    return largest
