"""The Arrow bytes of a batch as a client receives it, for the bytes-served metric.

``RecordBatch.nbytes`` counts every buffer, but Arrow IPC (Flight's wire format) leaves out the
validity bitmap of an array with no nulls. A gather (``pc.take``) or a DataFusion filter gives
string and list columns an all-valid bitmap the loaded batches did not have, so the same rows
counted one bit per row and column more when read shuffled or filtered than in order, and more
than the client got. IPC also realigns the bitmaps it does send (validity with nulls, and a
boolean column's values) to their first row: a slice starting mid-byte spans a byte more in
memory than it sends.
"""

from __future__ import annotations

import pyarrow as pa


def sent_nbytes(batch: pa.RecordBatch | pa.Table) -> int:
    """``batch.nbytes`` less the bitmap bytes IPC does not send (validity bitmaps of arrays
    without nulls, and the byte a slice starting mid-byte spans beyond the realigned bitmaps); a
    table (a window of batches a node sends at once) is sent as its chunks."""
    if isinstance(batch, pa.Table):
        return sum(sent_nbytes(chunk) for chunk in batch.to_batches())
    return batch.nbytes - sum(_unsent_validity(column) for column in batch.columns)


def _unsent_validity(array: pa.Array) -> int:
    unsent = 0
    kind = array.type
    if pa.types.is_struct(kind):
        # nbytes leaves a struct's own bitmap out (it counts the fields, sliced to the struct).
        return sum(_unsent_validity(array.field(i)) for i in range(kind.num_fields))
    # nbytes counts a bitmap's bytes the rows span; IPC sends the rows' bits realigned to the
    # first byte (one byte less where a slice starts mid-byte).
    spanned = (array.offset + len(array) + 7) // 8 - array.offset // 8
    realigned = (len(array) + 7) // 8
    if array.buffers()[0] is not None:
        # The validity bitmap: none is sent without nulls.
        unsent += spanned - (realigned if array.null_count else 0)
    if pa.types.is_boolean(kind):
        unsent += spanned - realigned  # the values, a bitmap too
    if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_map(kind):
        if len(array):
            offsets = array.offsets
            first, last = offsets[0].as_py(), offsets[-1].as_py()
            unsent += _unsent_validity(array.values.slice(first, last - first))
    elif pa.types.is_fixed_size_list(kind):
        size = kind.list_size
        unsent += _unsent_validity(array.values.slice(array.offset * size, len(array) * size))
    return unsent
