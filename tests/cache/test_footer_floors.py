"""Footer floors: values that compress far better than the fixed factor (zero-padded tensors, long
distinct strings) are estimated by their uncompressed Parquet bytes, at any depth, and one file
that compresses better than the rest does not raise the others."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pytest
from pyiceberg.manifest import FileFormat

from kubeflow_data_cache.footer_floors import FOOTER_FILES, footer_expansions, footer_files, leaf_fields
from kubeflow_data_cache.plan import open_table, plan_table
from kubeflow_data_cache.sample import make_catalog
from tests.cache.conftest import held_and_estimated, table_in_files
from tests.conftest import LocalCache

TENSOR_BYTES = 4096


def _padded_tensors(rows: int, seed: int = 0) -> list[bytes]:
    """Each value its own (16 random bytes), the rest zeros: pyarrow's writer gives up on a
    dictionary and zstd compresses the plain pages ~190x."""
    rng = np.random.default_rng(seed)
    return [rng.bytes(16) + bytes(TENSOR_BYTES - 16) for _ in range(rows)]


def _column(kind: str, rows: int) -> pa.Array:
    values = _padded_tensors(rows)
    if kind == "struct":  # a tensor as Hugging Face and torch exports write it: bytes and shape
        shape = pa.array([[4, TENSOR_BYTES // 4]] * rows, pa.list_(pa.int32()))
        return pa.StructArray.from_arrays([pa.array(values, pa.binary()), shape], ["data", "shape"])
    if kind == "list":  # two tensors a row
        return pa.array([[v, v[::-1]] for v in values], pa.list_(pa.binary()))
    if kind == "map":
        return pa.array([[("t", v)] for v in values], pa.map_(pa.string(), pa.binary()))
    assert kind == "top level", kind
    return pa.array(values, pa.binary())


def _table(tmp_path, columns: dict[str, pa.Array], files: int = 1) -> str:
    rows = len(next(iter(columns.values())))
    return table_in_files(tmp_path, pa.table({"id": pa.array(range(rows), pa.int64()), **columns}), files)


@pytest.mark.parametrize("kind", ["top level", "struct", "list", "map"])
def test_compressible_tensors_are_estimated_at_what_a_node_holds_at_any_depth(tmp_path, kind):
    """The review's case: tensors compressed ~190x on disk were estimated at 2 MiB for 82 MiB
    held (the fixed factor of 4 over their compressed size), and the fit check passed tables
    far too large for the nodes."""
    held, estimated = held_and_estimated(_table(tmp_path, {"tensor": _column(kind, 5000)}, files=2))
    assert held["tensor"] <= estimated["tensor"] <= 1.3 * held["tensor"], (estimated, held)


def test_one_file_that_compresses_far_better_does_not_raise_the_others(tmp_path):
    """The floor is the least ratio of the files read: the padded file alone would put the random
    one at ~190x its size on disk, and refuse a table that fits."""
    rng = np.random.default_rng(3)
    catalog = make_catalog(str(tmp_path / "wh"), tmp_path / "c.db")
    catalog.create_namespace("s")
    schema = pa.schema([("id", pa.int64()), ("tensor", pa.binary())])
    table = catalog.create_table("s.t", schema=schema)
    for values in (_padded_tensors(4000), [rng.bytes(256) for _ in range(4000)]):
        table.append(pa.table({"id": np.arange(len(values)), "tensor": values}, schema=schema))
    location = catalog.load_table("s.t").metadata_location
    t = open_table(location)
    _, tasks = plan_table(t, location)
    (tensor_id,) = (f.field_id for f in t.schema().fields if f.name == "tensor")
    ratios = footer_expansions(t, tasks, {tensor_id})
    assert 0.9 <= ratios[tensor_id] < 1.1, ratios  # the random file's, not the padded one's ~190x
    held, estimated = held_and_estimated(location)
    assert estimated["tensor"] <= 4.5 * (256 + 4) * 4000 + 1.1 * 4 * 4000  # no more than the fixed factor's
    assert estimated["tensor"] < held["tensor"]  # the padded file is the load guard's to catch


def test_the_footers_read_are_the_largest_file_and_others_drawn_over_the_table():
    def task(size: int, rows: int = 10, file_format: FileFormat = FileFormat.PARQUET):
        return SimpleNamespace(
            file=SimpleNamespace(file_size_in_bytes=size, record_count=rows, file_format=file_format)
        )

    small = {f"f{i:03d}": task(100) for i in range(5)}
    others = {"empty": task(10**9, rows=0), "orc": task(10**9, file_format=FileFormat.ORC)}
    assert footer_files({**small, **others}) == sorted(small)  # every Parquet file with rows
    many = {f"f{i:03d}": task(100 + (i == 77) * 10**6) for i in range(200)}
    chosen = footer_files(many)
    assert len(chosen) == len(set(chosen)) == FOOTER_FILES and chosen[0] == "f077"
    assert footer_files(dict(reversed(many.items()))) == chosen  # the same files, however listed
    # Partitions that alternate in path order: a fixed stride read every file of one kind and
    # sized the other by its ratio (the review's table: 1 MiB of text estimated at 120 MiB).
    # Here 31 files, the largest an image: a stride of 2 over the other 30 read only text.
    alternating = {
        f"wh/day={i // 2:03d}/source={'text' if i % 2 else 'image'}/f.parquet": task(200 if i == 0 else 100)
        for i in range(31)
    }
    drawn = footer_files(alternating)[1:]  # besides the largest
    assert {path.split("source=")[1].split("/")[0] for path in drawn} == {"image", "text"}


def test_small_files_beside_one_that_compresses_far_better_are_not_raised_to_its_ratio(tmp_path):
    """Files where the leaf spans little on disk count in the least ratio too: left out, 100
    small files of random bytes were sized at the 190x of the tensor file beside them, and 17 MiB
    held was estimated at 296 MiB (a table that fits refused, advising 5 data nodes)."""
    rng = np.random.default_rng(5)
    catalog = make_catalog(str(tmp_path / "wh"), tmp_path / "c.db")
    catalog.create_namespace("s")
    schema = pa.schema([("id", pa.int64()), ("tensor", pa.binary())])
    table = catalog.create_table("s.t", schema=schema)
    table.append(pa.table({"id": np.arange(4000), "tensor": _padded_tensors(4000)}, schema=schema))
    for _ in range(20):  # ~10 KiB on disk each
        values = [rng.bytes(256) for _ in range(40)]
        table.append(pa.table({"id": np.arange(len(values)), "tensor": values}, schema=schema))
    held, estimated = held_and_estimated(catalog.load_table("s.t").metadata_location)
    assert estimated["tensor"] <= held["tensor"], (estimated, held)  # not raised: the guard's to catch


def test_leaf_columns_are_walked_in_the_footers_order():
    schema = pa.schema(
        [
            ("a", pa.int64()),
            ("s", pa.struct([("x", pa.binary()), ("l", pa.list_(pa.field("element", pa.string())))])),
            ("m", pa.map_(pa.string(), pa.struct([("y", pa.int32()), ("z", pa.binary())]))),
        ]
    )
    import pyarrow.parquet as pq

    sink = pa.BufferOutputStream()
    pq.write_table(schema.empty_table(), sink)
    footer = pq.ParquetFile(pa.BufferReader(sink.getvalue())).metadata
    paths = [footer.schema.column(j).path.split(".") for j in range(footer.num_columns)]
    assert [f.name for f in leaf_fields(schema)] == ["a", "x", "element", "key", "y", "z"]
    assert [p[-1] for p in paths] == ["a", "x", "element", "key", "y", "z"]


def test_a_table_of_compressible_tensors_too_large_is_refused_before_its_load(tmp_path):
    """Estimated at 4x their compressed size, 40,000 tensors of 4 KiB (156 MiB) passed the fit
    check for a node of 100 MiB, and its load ran into the memory guard; now the head refuses
    before any node reads a row, with the number of data nodes that fits."""
    location = _table(tmp_path, {"tensor": _column("struct", 40_000)}, files=8)
    cache = LocalCache(location, 1, args=("--memory-limit", "500Mi"))
    message = cache.wait_failure(timeout=120)
    assert cache.proc.returncode == 1
    assert "use at least" in message and "data nodes (--data-nodes " in message, message
    assert "stopped its load" not in message, message  # the guard's words: no load began
