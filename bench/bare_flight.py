"""A bare pyarrow Flight server holding the same table: the ceiling any Flight server reaches here.

`python -m bench.bare_flight METADATA_LOC` reads the table with pyiceberg into memory, cut in
64K-row batches like a data node's DoGet, serves every DoGet with the whole table through
Flight's C++ writer, prints ``ready PORT`` and serves until stdin closes.
"""

from __future__ import annotations

import sys
import threading

import pyarrow as pa
import pyarrow.flight as flight
from pyiceberg.table import StaticTable

from kubeflow_data_cache.allocator import tune_glibc_malloc

BATCH_ROWS = 65536


class BareServer(flight.FlightServerBase):
    def __init__(self, table: pa.Table) -> None:
        super().__init__("grpc://127.0.0.1:0")
        self.table = pa.Table.from_batches(table.combine_chunks().to_batches(max_chunksize=BATCH_ROWS))

    def do_get(self, context, ticket):
        return flight.RecordBatchStream(self.table)


def main(argv: list[str]) -> int:
    tune_glibc_malloc()  # as a data node does: the comparison is about the servers' own work
    server = BareServer(StaticTable.from_metadata(argv[0]).scan().to_arrow())
    print(f"ready {server.port}", flush=True)
    threading.Thread(target=server.serve, daemon=True).start()
    sys.stdin.read()  # EOF from the parent ends the server
    server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
