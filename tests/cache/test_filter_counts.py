"""A new filter's count, asked for by every reader at once: counted once per node, its figures once.

Every rank asks for a new filter at the start of an epoch. Each of the head's misses sent its own
`count` to every data node, and each `count` rebuilt the matches' figures (full-column buffers):
24 readers at once took a data node 250 MiB past its memory limit.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight

from kubeflow_data_cache import filtering
from kubeflow_data_cache.filtering import FilterCache
from kubeflow_data_cache.protocol import ShardRequest
from kubeflow_data_cache.store import NodeStore

from .inprocess import cluster, wait_for  # noqa: F401 - cluster is a fixture

READERS = 12


def test_a_filters_figures_are_computed_once_with_its_matches(monkeypatch):
    batch = pa.record_batch({"id": pa.array(np.arange(10)), "x": pa.array([1.0, None] * 5)})
    store = NodeStore(batch.schema, [batch])
    expected = store.figures_of(np.arange(4))
    computed = []
    real = NodeStore.figures_of

    def counting(self, rows):
        computed.append(len(rows))
        return real(self, rows)

    monkeypatch.setattr(NodeStore, "figures_of", counting)
    cache = FilterCache(store)
    answers = [cache.matched("id < 4") for _ in range(5)]
    assert cache.rows("id < 4").tolist() == [0, 1, 2, 3]
    assert computed == [4]
    assert all(rows.tolist() == [0, 1, 2, 3] and figures == expected for rows, figures in answers)
    assert expected["null_counts"]["x"] == 2


def test_readers_asking_at_once_for_a_new_filter_send_one_count_to_each_node(cluster, small_table, monkeypatch):  # noqa: F811
    real = filtering.matching_rows

    def slow(store, predicate, *args, **kwargs):
        time.sleep(1.0)  # the count outlasts every reader's arrival: none finds it cached
        return real(store, predicate, *args, **kwargs)

    monkeypatch.setattr(filtering, "matching_rows", slow)
    head, _, node, _ = cluster(small_table.metadata_location)
    wait_for(lambda: head.lifecycle.state == "ready")
    descriptor = flight.FlightDescriptor.for_command(ShardRequest(filter="label <> 6").to_json())
    counts, errors, start = [], [], threading.Barrier(READERS)

    def read() -> None:
        start.wait(10)
        try:
            counts.append(flight.FlightClient(head.location).get_flight_info(descriptor).total_records)
        except Exception as err:  # reported below, with the others
            errors.append(err)

    threads = [threading.Thread(target=read) for _ in range(READERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    expected = sum(1 for label in small_table_labels(small_table) if label != 6)
    assert counts == [expected] * READERS
    asked = node.metrics.registry.get_sample_value(
        "data_cache_requests_total", {"method": "DoAction", "action": "count"}
    )
    assert asked == 1


def small_table_labels(small_table) -> list[int]:
    from kubeflow_data_cache.plan import open_table

    return open_table(small_table.metadata_location).scan(selected_fields=("label",)).to_arrow().column(0).to_pylist()


def test_the_head_keeps_a_filters_figures_summed_over_its_nodes_not_each_nodes_answer():
    """The head kept every node's answer whole, each column's figures once per node, for up to
    256 filters: 300 filters over 2,000 columns with nulls took a head of two nodes from 137 to
    264 MiB (about 1 GB, projected, with 16 nodes). What it needs is one sum per column."""
    import tracemalloc

    from kubeflow_data_cache.head import FilterCount

    columns = [f"c{i:04d}" for i in range(2000)]

    def answer(node: int) -> dict:
        return {
            "rows": 100 + node,
            "null_counts": {c: 1 + node % 2 for c in columns},
            "list_lengths": {"same": [4, 4], "ragged": [1, 2 + node]},
            "inner_list_lengths": {"nested": [[2, 2], None]},
        }

    answers = [answer(node) for node in range(16)]
    tracemalloc.start()
    try:
        kept = FilterCount.of(answers)
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert kept.rows == tuple(100 + node for node in range(16))
    assert kept.figures["null_counts"] == dict.fromkeys(columns, 24)
    assert kept.figures["list_lengths"] == {"ragged": [1, 17]}  # lengths that never differ say nothing
    assert kept.figures["inner_list_lengths"] == {}
    del answers  # the nodes' answers go; what is kept holds one figure per column
    assert held < 400_000, held  # the 16 answers: about 2.4 MB


def test_a_filtered_flight_info_is_answered_from_the_kept_count(cluster, small_table):  # noqa: F811
    from kubeflow_data_cache.head import FilterCount

    head, _, _, _ = cluster(small_table.metadata_location)
    wait_for(lambda: head.lifecycle.state == "ready")
    descriptor = flight.FlightDescriptor.for_command(ShardRequest(filter="label <> 6").to_json())
    first = flight.FlightClient(head.location).get_flight_info(descriptor)
    kept = head._filter_counts["label <> 6"]
    assert isinstance(kept, FilterCount) and sum(kept.rows) == first.total_records
    again = flight.FlightClient(head.location).get_flight_info(descriptor)
    assert (again.total_records, again.app_metadata) == (first.total_records, first.app_metadata)
