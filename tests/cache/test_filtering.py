"""filtering.py: a filter is one SQL predicate over the table's columns, and nothing more."""

import numpy as np
import pyarrow as pa
import pytest

from kubeflow_data_cache.errors import BadRequestError
from kubeflow_data_cache.filtering import ROW_COLUMN, FilterCache, matching_rows
from kubeflow_data_cache.store import NodeStore


@pytest.fixture(scope="module")
def store():
    schema = pa.schema([("id", pa.int64()), ("name", pa.string())])
    batches = [
        pa.record_batch(
            [pa.array(np.arange(start, start + 5)), pa.array([f"r{i})" for i in range(start, start + 5)])],
            schema=schema,
        )
        for start in (0, 5)
    ]
    return NodeStore(schema, batches)


@pytest.mark.parametrize(
    ("predicate", "rows"),
    [
        ("id < 3", [0, 1, 2]),
        ("id >= 8 OR name = 'r1)'", [1, 8, 9]),  # a parenthesis inside a string literal is data
        ("(id = 2) AND (name LIKE 'r%')", [2]),
        ("id IN (4, 6)", [4, 6]),
        # Folded to an empty plan by the optimizer: no rows, not a refusal.
        ("id IS NULL", []),
        ("false", []),
        ("id = NULL", []),
        # A function's name inside a string literal is data, not a call.
        ("name = 'r1)' OR name LIKE '%random()%'", [1]),
    ],
)
def test_predicates_select_their_rows(store, predicate, rows):
    assert matching_rows(store, predicate).tolist() == rows


@pytest.mark.parametrize(
    "predicate",
    [
        "id < 5) UNION ALL SELECT 0 WHERE (0 = 0",  # would serve row 0 twice, and rows that are not there
        "id < 3) UNION ALL SELECT __dc_row FROM data WHERE (id < 2",
        "id < 2; DROP TABLE data",
        f"{ROW_COLUMN} < 3",  # the internal row number is not a column of the table
        "id IN (SELECT 1)",  # subqueries become joins: unbounded work for one request
        "EXISTS (SELECT 1)",
        "random() < 0.5",  # a different row set on every evaluation: shards would overlap
        "id < 3 AND UUID() <> ''",
    ],
)
def test_anything_but_one_predicate_over_the_columns_is_refused(store, predicate):
    with pytest.raises(BadRequestError, match="invalid filter"):
        matching_rows(store, predicate)


@pytest.fixture(scope="module")
def mixed_case_store():
    """Iceberg column names keep their case and may hold spaces; SQL folds unquoted names."""
    schema = pa.schema([("id", pa.int64()), ("Score", pa.int64()), ("my col", pa.int64())])
    batch = pa.record_batch([pa.array([0, 1, 2, 3]), pa.array([10, 95, 99, 5]), pa.array([1, 2, 1, 2])], schema=schema)
    return NodeStore(schema, [batch])


@pytest.mark.parametrize(
    ("predicate", "rows"),
    [("id < 2", [0, 1]), ('"Score" > 90', [1, 2]), ('"my col" = 1 AND "Score" < 50', [0])],
)
def test_filters_work_on_tables_with_mixed_case_and_spaced_column_names(mixed_case_store, predicate, rows):
    assert matching_rows(mixed_case_store, predicate).tolist() == rows


def test_an_unquoted_mixed_case_name_is_refused_with_the_quoting_rule(mixed_case_store):
    with pytest.raises(BadRequestError, match=r"double-quote names with capitals or spaces"):
        matching_rows(mixed_case_store, "Score > 90")


def test_the_filter_cache_stays_within_its_byte_budget(store):
    """Matches are 8 bytes a row outside the memory check: many distinct filters must not pile up."""
    cache = FilterCache(store)
    cache.budget = 3 * 8 * 10  # room for three all-matching filters of this 10-row store
    for k in range(6):
        assert cache.rows(f"id >= -{k}").tolist() == list(range(10))
    assert cache.nbytes <= cache.budget
    # The newest stays even alone over the budget: readers are streaming it.
    cache.budget = 1
    assert cache.rows("id >= -100").tolist() == list(range(10))
    assert cache.nbytes == 80


def test_concurrent_requests_for_a_new_filter_match_it_once(store, monkeypatch):
    """Every reader of a new filter asks at once (and the head retries a slow count): one pass."""
    import threading
    from concurrent.futures import Future

    from kubeflow_data_cache import filtering

    calls, waiting = [], []
    asked = threading.Condition()  # each thread that is matching, or waiting for another's match
    release = threading.Event()

    def slow_match(s, predicate):
        with asked:
            calls.append(predicate)
            asked.notify_all()
        release.wait(10)
        return np.array([1, 2], dtype=np.int64)

    class WatchedFuture(Future):
        def result(self, timeout=None):
            with asked:
                waiting.append(1)
                asked.notify_all()
            return super().result(timeout)

    monkeypatch.setattr(filtering, "matching_rows", slow_match)
    monkeypatch.setattr(filtering, "Future", WatchedFuture)
    cache = FilterCache(store)
    results = []
    threads = [threading.Thread(target=lambda: results.append(cache.rows("id < 3").tolist())) for _ in range(4)]
    for t in threads:
        t.start()
    # Released only once every thread is past the cache's lookup: a thread that came late would
    # find the result cached and hide a missing dedupe.
    with asked:
        assert asked.wait_for(lambda: len(calls) + len(waiting) == 4, timeout=10), (
            f"not every thread asked for the filter within 10s: {len(calls)} matching, {len(waiting)} waiting"
        )
    release.set()
    for t in threads:
        t.join(10)
    assert calls == ["id < 3"] and results == [[1, 2]] * 4


@pytest.mark.parametrize(
    ("predicate", "cause"),
    [
        # DataFusion names the failing step first ("Optimizer rule ... failed", "type_coercion")
        # and the cause after "caused by": the message keeps the cause.
        ("id > 'abc'", "Cannot cast string 'abc' to value of Int64 type"),
        ("id > TIME '01:02:05'", "Cannot infer common argument type"),
        ("nosuch > 1", "No field named nosuch"),
    ],
)
def test_a_refused_filter_says_what_is_wrong_with_it(store, predicate, cause):
    with pytest.raises(BadRequestError, match="invalid filter") as refused:
        matching_rows(store, predicate)
    assert cause in str(refused.value)
    assert ".." not in str(refused.value)


def test_a_node_without_rows_checks_the_filter_all_the_same():
    """An empty table (or a node holding none of it) refuses a filter that does not parse, names
    no column or calls what is not allowed, as a loaded one does (errors in the values, such as a
    division by zero, need rows to show)."""
    empty = NodeStore(pa.schema([("id", pa.int64()), ("name", pa.string())]), [])
    assert matching_rows(empty, "id < 3 AND name = 'x'").tolist() == []
    for predicate in ("nosuch > 1", "id >", "id IN (SELECT 1)", "random() < 0.5", "id > 'abc'"):
        with pytest.raises(BadRequestError, match="invalid filter"):
            matching_rows(empty, predicate)


@pytest.mark.parametrize(
    ("predicate", "refusal"),
    [
        # 12,000 ORs overflowed DataFusion's stack: the node died (SIGSEGV) on a count.
        (" OR ".join(f"id = {i}" for i in range(12_000)), "characters, more than 65536"),
        # Planning grows with the chain: 512 additions took 1.5 s, 5,000 did not finish in 2 min.
        (
            "id" + " + id" * 1000 + " > 0",
            "has 1001 operators (keywords such as IS, IN, WHEN and CAST count too), more than 128",
        ),
        (" OR ".join(f"id = {i}" for i in range(70)), "has 139 operators"),
        # Values far larger than the rows: repeat() took a node to 22 GB, then an abort.
        ("length(repeat(name, 100000000)) > 0", "repeat() can make values far larger than the rows"),
        ("length(lpad(name, 1000000000)) > 0", "lpad() can make values far larger"),
        # Nested, each of these multiplies a value's length: seven regexp_replace of an empty
        # pattern (a 247-character filter) took 100 rows from 70 to 269 MiB.
        ("length(regexp_replace(name, '', 'xxxx', 'g')) > 0", "regexp_replace() can make values far larger"),
        ("length(replace(name, '', 'xxxx')) > 0", "replace() can make values far larger"),
        ("length(encode(name, 'hex')) > 0", "encode() can make values far larger"),
        # Comments hid a chain of additions from the count (/* ' */ read as the start of a quote).
        ("/* ' */ id" + " + id" * 1000 + " > 0 /* ' */", "holds a comment"),
        ("id = 1 -- and then", "holds a comment"),
        ("id = $$1$$", "holds a $"),
        # E'...' escapes its quote with a backslash: read as '...', '\'' hid the ORs between two.
        ("name = E'\\'' OR " + " OR ".join(f"id = {i}" for i in range(70)) + " OR name = E'\\''", "has 143 operators"),
        # Keywords are operators too: 1,500 IS TRUE (no symbol at all) killed the node (SIGSEGV);
        # a CASE of 1,000 arms held every node for 35 s, 600 took 10 s to plan.
        ("id > 1" + " IS TRUE" * 1500, "has 1501 operators (keywords such as IS, IN, WHEN and CAST count too)"),
        ("CASE " + " ".join(f"WHEN id IN ({i}) THEN true" for i in range(600)) + " ELSE false END", "has 1201"),
        ("id" + "::BIGINT" * 200 + " > 1", "has 201 operators"),
        # At the parser's recursion limit, 50 nested CAST(...) (800 characters) backtracked for minutes.
        ("CAST(" * 50 + "id" + " AS BIGINT)" * 50 + " > 1", "nests parentheses 50 deep, more than 32"),
        ("(" * 5000 + "id > 1" + ")" * 5000, "nests parentheses 5000 deep"),
    ],
)
def test_a_filter_too_costly_for_a_node_is_refused(store, predicate, refusal):
    with pytest.raises(BadRequestError) as refused:
        matching_rows(store, predicate)
    assert refusal in str(refused.value)
    assert len(str(refused.value)) < 400  # names the problem, not the whole filter


@pytest.mark.parametrize(
    ("predicate", "rows"),
    [
        (" OR ".join(f"id = {i}" for i in range(64)), list(range(10))),  # 127 operators: within the cap
        ("CAST(" * 32 + "id" + " AS BIGINT)" * 32 + " < 2", [0, 1]),  # 32 levels: within the cap
        ("greatest(" + ", ".join(["id"] * 5000) + ") < 2", [0, 1]),  # a call's many arguments are cheap
        ("id IN (" + ", ".join(map(str, range(0, 10_000, 2))) + ")", [0, 2, 4, 6, 8]),  # long lists are cheap
        # Operators inside quotes are data and names, not operators; nor are comment marks.
        ("name = '" + "+-*/%=<>" * 40 + "' OR id = 1", [1]),
        ("name = '--/*$' OR \"id\" = 2", [2]),
        ("name = E'it\\'s' OR id = 3", [3]),  # E'...' with an escaped quote
    ],
)
def test_large_but_cheap_filters_are_served(store, predicate, rows):
    assert matching_rows(store, predicate).tolist() == rows
