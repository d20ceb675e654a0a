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
        # A predicate whose value is NULL keeps no row, as WHERE does (not refused as non-boolean).
        ("NULL", []),
        ("CASE WHEN id > 1 THEN NULL END", []),
        # A long literal where a value is compared with it.
        ("name = '" + "r" * 3000 + "' OR id = 1", [1]),
        ("name IN ('" + "r" * 3000 + "', 'r2)')", [2]),
        ("name LIKE '" + "r" * 3000 + "%' OR starts_with(name, '" + "x" * 3000 + "') OR id = 3", [3]),
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

    def slow_match(s, predicate, executing=None):
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
        # What is not one row's predicate is named.
        ("id IN (SELECT 1)", "a subquery (IN (SELECT ...))"),
        ("id = (SELECT 1)", "a subquery"),
        ("sum(id) > 1", "an aggregate function"),
        ("count(*) OVER () > 1", "a window function"),
    ],
)
def test_a_refused_filter_says_what_is_wrong_with_it(store, predicate, cause):
    with pytest.raises(BadRequestError, match="invalid filter") as refused:
        matching_rows(store, predicate)
    assert cause in str(refused.value)
    assert ".." not in str(refused.value).replace("(SELECT ...)", "")  # not cut short


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
            "has 1001 operators (keywords such as IS, IN, WHEN and CAST count too, and each subscript [...]), more than 128",
        ),
        (" OR ".join(f"id = {i}" for i in range(70)), "has 139 operators"),
        # Values far larger than the rows: repeat() took a node to 22 GB, then an abort.
        ("length(repeat(name, 100000000)) > 0", "repeat() is not among the functions"),
        ("length(lpad(name, 1000000000)) > 0", "lpad() is not among the functions"),
        # Nested, each of these multiplies a value's length: seven regexp_replace of an empty
        # pattern (a 247-character filter) took 100 rows from 70 to 269 MiB.
        ("length(regexp_replace(name, '', 'xxxx', 'g')) > 0", "regexp_replace() is not among the functions"),
        ("length(replace(name, '', 'xxxx')) > 0", "replace() is not among the functions"),
        ("length(encode(name, 'hex')) > 0", "encode() is not among the functions"),
        # Comments hid a chain of additions from the count (/* ' */ read as the start of a quote).
        ("/* ' */ id" + " + id" * 1000 + " > 0 /* ' */", "holds a comment"),
        ("id = 1 -- and then", "holds a comment"),
        ("id = $$1$$", "holds a $"),
        # E'...' escapes its quote with a backslash: read as '...', '\'' hid the ORs between two.
        ("name = E'\\'' OR " + " OR ".join(f"id = {i}" for i in range(70)) + " OR name = E'\\''", "has 143 operators"),
        # Keywords are operators too: 1,500 IS TRUE (no symbol at all) killed the node (SIGSEGV);
        # a CASE of 1,000 arms held every node for 35 s, 600 took 10 s to plan.
        ("id > 1" + " IS TRUE" * 1500, "has 1501 operators (keywords such as IS, IN, WHEN and CAST count too"),
        ("CASE " + " ".join(f"WHEN id IN ({i}) THEN true" for i in range(600)) + " ELSE false END", "has 1201"),
        ("id" + "::BIGINT" * 200 + " > 1", "has 201 operators"),
        # Subscripts and slices are operators too: 8,000 s['a'] (40 KB, nothing else counted)
        # overflowed the parser's stack and killed every node (SIGSEGV); planning 600 l[1:2]
        # held every node's interpreter for 48 s, their health probes unanswered.
        (
            "name" + "['a']" * 8000 + " IS NULL",
            "has 8001 operators (keywords such as IS, IN, WHEN and CAST count too, "
            "and each subscript [...]), more than 128",
        ),
        ("name" + "[1:2]" * 600 + " IS NULL", "has 601 operators"),
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
        # Array literals are constants, not subscripts: 200 of them in an IN list plan at once.
        ("id < 3 AND [7] IN (" + ", ".join(f"[{i}]" for i in range(200)) + ")", [0, 1, 2]),
        ("id IN (" + ", ".join(map(str, range(0, 10_000, 2))) + ")", [0, 2, 4, 6, 8]),  # long lists are cheap
        # Operators inside quotes are data and names, not operators; nor are comment marks.
        ("name = '" + "+-*/%=<>" * 40 + "' OR id = 1", [1]),
        ("name = '--/*$' OR \"id\" = 2", [2]),
        ("name = E'it\\'s' OR id = 3", [3]),  # E'...' with an escaped quote
    ],
)
def test_large_but_cheap_filters_are_served(store, predicate, rows):
    assert matching_rows(store, predicate).tolist() == rows


def _squaring(levels: int) -> str:
    """Each level squares a value's length: split into characters, joined by the value itself."""
    x = "name"
    for _ in range(levels):
        x = f"array_to_string(string_to_array({x}, NULL), {x})"
    return x


@pytest.mark.parametrize(
    ("predicate", "function"),
    [
        # Three levels (330 characters) aborted both data nodes of a 10,000-row table on a failed
        # 2 GiB allocation; none of it was on the list of refused functions then.
        (f"length({_squaring(3)}) > 0", "array_to_string"),
        ("length(concat(" + ", ".join(["name"] * 5000) + ")) > 0", "concat"),  # 0.2 MiB of rows took 1.1 GB
        ("cardinality(string_to_array(name, NULL)) > 0", "string_to_array"),
        ("array_has(make_array(name, name), 'r1)')", "make_array"),  # a list of columns repeats the row
        ("length(overlay(name placing name from 1)) > 0", "overlay"),
        ("levenshtein(name, reverse(name)) > 0", "levenshtein"),
        ("length(to_char(id, '%c')) > 0", "to_char"),  # its format, 2 characters, gives 24 a row
        ("id > 0 AND random() < 0.5", "random"),
        ("named_struct('a', id) IS NOT NULL", "named_struct"),  # values written out may hold no column
        # Found wherever it sits: a CASE's later arm, an IN list, a CAST, beside an alias.
        ("CASE WHEN id = 1 THEN true WHEN id = 2 THEN length(concat(name, name)) > 0 ELSE false END", "concat"),
        ("id IN (1, length(concat(name, name)))", "concat"),
        ("CAST(length(repeat(name, 9)) AS DOUBLE) > 0", "repeat"),
        # The expression's text shows string literals unescaped; the tree cannot be fooled by them.
        ("name = 'a\") OR Utf8(\"' OR length(concat(name, name)) > 0 OR name = '\")'", "concat"),
    ],
)
def test_a_filter_may_call_only_functions_that_cannot_make_values_larger(store, predicate, function):
    with pytest.raises(BadRequestError) as refused:
        matching_rows(store, predicate)
    message = str(refused.value)
    assert f"{function}() " in message and len(message) < 500, message  # names it, not the whole filter
    reason = "changes between calls" if function == "random" else "not among the functions a filter may call"
    assert reason in message, message


@pytest.mark.parametrize(
    "predicate", ["name SIMILAR TO 'r1'", "name NOT SIMILAR TO 'r%'", "id = 1 OR name SIMILAR TO 'r_)'"]
)
def test_similar_to_is_refused_rather_than_matched_unlike_sql(store, predicate):
    """DataFusion reads SIMILAR TO's pattern as an unanchored regular expression: 'r1' matched
    r1) and r10), '%' and '_' matched nothing. Refused, naming what matches as meant."""
    with pytest.raises(BadRequestError) as refused:
        matching_rows(store, predicate)
    message = str(refused.value)
    assert "SIMILAR TO is not allowed" in message and "use LIKE, or an anchored regular expression" in message


def test_the_alternatives_named_for_similar_to_match_as_sql_would(store):
    assert matching_rows(store, "name LIKE 'r1_'").tolist() == [1]  # r1): r, 1, then one character
    assert matching_rows(store, "name LIKE 'r_'").tolist() == []
    assert matching_rows(store, "name ~ '^r[0-9]\\)$'").tolist() == list(range(10))


@pytest.mark.parametrize("function", ["random()", "now()", "uuid()", "current_date()"])
def test_a_function_whose_value_changes_between_calls_is_refused_as_such(store, function):
    """The head and the nodes would count different rows: shards would overlap or miss rows."""
    with pytest.raises(BadRequestError, match=r"whose value changes between calls"):
        matching_rows(store, f"id > 0 AND CAST({function} AS VARCHAR) <> ''")


@pytest.mark.parametrize(
    "predicate",
    [
        # A value test's first argument is the value tested, computed for every row.
        "starts_with('" + "x" * 2000 + "', name)",
        # A list built of an expression of a column repeats the row's values, as one of columns does.
        "array_has(make_array(1 + id), 2)",
    ],
)
def test_the_value_a_test_reads_and_lists_of_column_expressions_are_checked_like_any_result(store, predicate):
    with pytest.raises(BadRequestError, match="literal is allowed only where a value is compared|make_array"):
        matching_rows(store, predicate)


@pytest.fixture(scope="module")
def rich_store():
    """Every kind of column a filter compares: what the allowed forms give must be DataFusion's."""
    n = 40
    schema = pa.schema(
        [
            ("id", pa.int64()),
            ("Score", pa.float64()),
            ("name", pa.string()),
            ("ts", pa.timestamp("us")),
            ("d", pa.date32()),
            ("dec", pa.decimal128(9, 2)),
            ("flag", pa.bool_()),
            ("st", pa.struct([("a", pa.int64())])),
            ("l", pa.list_(pa.int64())),
            ("m", pa.map_(pa.string(), pa.int64())),
        ]
    )
    columns = [
        pa.array(range(n)),
        pa.array([None if i % 7 == 0 else float("nan") if i % 11 == 0 else i / 3 for i in range(n)]),
        pa.array([None if i % 9 == 0 else f"Row-{i:02d},tag{i % 3}" for i in range(n)]),
        pa.array([1_704_067_200_000_000 + i * 3_600_000_000 for i in range(n)], pa.timestamp("us")),
        pa.array([19_700 + i for i in range(n)], pa.date32()),
        pa.array([None if i % 5 == 0 else f"{i / 4:.2f}" for i in range(n)]).cast(pa.decimal128(9, 2)),
        pa.array([None if i % 6 == 0 else i % 2 == 0 for i in range(n)]),
        pa.array([{"a": i % 4} for i in range(n)]),
        pa.array([list(range(i % 5)) for i in range(n)]),
        pa.array([[("k", i)] if i % 2 else [] for i in range(n)], pa.map_(pa.string(), pa.int64())),
    ]
    table = pa.table(columns, schema=schema)
    return NodeStore(schema, table.to_batches(max_chunksize=13)), table


@pytest.mark.parametrize(
    "predicate",
    [
        '"Score" > 2 AND NOT isnan("Score")',
        'coalesce("Score", 0) < 1',
        "abs(id - 20) < 3 OR round(id / 7) = 2",
        "length(name) > 10 AND lower(name) LIKE 'row-1%'",
        "starts_with(upper(name), 'ROW-2') AND substr(name, 5, 1) = '2'",
        "split_part(name, ',', 2) = 'tag1' AND strpos(name, 'tag') > 0",
        "regexp_like(name, '^Row-[0-3]5') OR name ~ '9,'",
        "btrim(translate(name, 'R', 'r')) ILIKE 'row-0%' AND md5(name) <> ''",
        "date_part('hour', ts) BETWEEN 3 AND 6 OR date_trunc('day', ts) = TIMESTAMP '2024-01-02'",
        "d > DATE '2023-12-25' + INTERVAL '3 days' AND extract(day FROM d) % 2 = 0",
        "dec >= CAST('2.5' AS DECIMAL(9, 2)) AND CAST(dec AS DOUBLE) < 6",
        "flag IS NOT TRUE AND id > 30",
        "st['a'] = 2 AND cardinality(l) BETWEEN 1 AND 3",
        "array_has(l, 3) OR l[1:2] = [0, 1]",
        "m['k'] > 30 OR array_length(l) = 4",
        "CASE WHEN id < 10 THEN flag ELSE name LIKE '%tag2' END",
        "greatest(id, 35) = id AND nullif(id % 3, 0) IS NOT NULL",
        "CAST(id AS VARCHAR) || name LIKE '1%' AND TRY_CAST(split_part(name, '-', 2) AS INT) IS NULL",
        # Values written out: lists and structs of constants, typed and nested.
        "l = [CAST(0 AS BIGINT), 1]",
        "array_has([DATE '2023-12-31', DATE '2024-01-05'], d)",
        "st = {'a': 2} AND id < 20",
        "cardinality([[1, 2], [3]]) = 3 AND id < 3",
    ],
)
def test_allowed_functions_match_what_datafusion_gives_over_the_whole_table(rich_store, predicate):
    import datafusion

    store, table = rich_store
    ctx = datafusion.SessionContext()
    ctx.register_record_batches("t", [table.to_batches()])
    expected = ctx.sql(f"SELECT id FROM t WHERE {predicate} ORDER BY id").to_arrow_table().column(0).to_pylist()
    assert expected, f"{predicate} matches nothing here: it tests nothing"
    assert matching_rows(store, predicate).tolist() == expected


def test_rows_are_matched_slice_by_slice_across_the_stored_chunks(rich_store, monkeypatch):
    from kubeflow_data_cache import filtering

    store, _ = rich_store
    whole = matching_rows(store, "id % 3 = 1 OR flag")
    for rows, nbytes in ((3, 1 << 20), (1 << 16, 100), (1 << 16, 1)):
        monkeypatch.setattr(filtering, "FILTER_SLICE_ROWS", rows)
        monkeypatch.setattr(filtering, "FILTER_SLICE_BYTES", nbytes)
        assert len(filtering._slices(store)) > len(store.batches)
        assert matching_rows(store, "id % 3 = 1 OR flag").tolist() == whole.tolist()


def test_a_filter_that_runs_past_its_time_is_refused_and_remembered(rich_store, monkeypatch):
    """A filter still matching after FILTER_TIMEOUT_SECONDS is refused; a reader retrying it (the
    head retries a slow count) is answered at once instead of starting it again."""
    from kubeflow_data_cache import filtering

    store, _ = rich_store
    monkeypatch.setattr(filtering, "FILTER_SLICE_ROWS", 4)
    for predicate in ("id >= 0", "id < 0"):  # matching nothing too: it is checked all the same
        with pytest.raises(BadRequestError, match=r"is too costly: this data node's 40 rows took more than 0 s"):
            matching_rows(store, predicate, timeout=0)
    calls = []

    def timed_out(s, predicate, executing=None):
        calls.append(predicate)
        return matching_rows(s, predicate, timeout=0)

    monkeypatch.setattr(filtering, "matching_rows", timed_out)
    cache = FilterCache(store)
    for _ in range(3):
        with pytest.raises(BadRequestError, match="is too costly"):
            cache.rows("id >= 0")
    assert calls == ["id >= 0"]


def test_the_documented_filter_functions_are_exactly_the_allowed_ones():
    """docs/protocol.md's list is what users read to write a filter: it must be the code's."""
    import re
    from pathlib import Path

    from kubeflow_data_cache.filter_calls import ALLOWED_FUNCTIONS

    text = (Path(__file__).resolve().parents[2] / "docs" / "protocol.md").read_text()
    section = text.split("\n## Filters\n", 1)[1].split("\n## ", 1)[0]
    allowed_part = section.split("- functions whose value", 1)[1].split("Anything else is refused", 1)[0]
    documented = set(re.findall(r"`([a-z_0-9]+)`", allowed_part))
    # Each list_ alias goes with its documented array_ name ("also under its list_ name").
    undocumented = {
        name
        for name in ALLOWED_FUNCTIONS - documented
        if not (name.startswith("list_") and "array_" + name.removeprefix("list_") in documented)
    }
    assert not undocumented, f"allowed but not in docs/protocol.md: {sorted(undocumented)}"
    assert documented <= ALLOWED_FUNCTIONS, f"documented but refused: {sorted(documented - ALLOWED_FUNCTIONS)}"
    refused_part = section.split("Anything else is refused", 1)[1].split("\n\n", 1)[0]  # its paragraph
    named_as_refused = set(re.findall(r"`([a-z_0-9]+)`", refused_part))
    assert named_as_refused and not named_as_refused & ALLOWED_FUNCTIONS


@pytest.mark.parametrize(
    "predicate",
    [
        # Concatenated, a 30,000-character literal took 2 MiB of rows to 1.1 GB: a copy in every row.
        "length(name || '" + "x" * 2000 + "') > 0",
        "CASE WHEN id > 1 THEN '" + "x" * 2000 + "' ELSE name END = name",
        "coalesce(name, '" + "x" * 2000 + "') = 'r1)'",
    ],
)
def test_a_long_literal_that_would_be_copied_into_every_row_is_refused(store, predicate):
    with pytest.raises(BadRequestError, match="a 2000-character literal is allowed only where a value is compared"):
        matching_rows(store, predicate)


def test_a_refusal_that_is_not_the_filters_fault_is_not_remembered(store, monkeypatch):
    """A filter that ran out of time while the node was busy is tried again after a while; a
    MemoryError is the node's state, not an invalid filter, and is not remembered at all."""
    from kubeflow_data_cache import filtering

    real = filtering.matching_rows
    failures = [filtering.FilterTooCostlyError("too costly"), MemoryError()]

    def flaky(s, predicate, executing=None):
        if failures:
            raise failures.pop(0)
        return real(s, predicate)

    monkeypatch.setattr(filtering, "matching_rows", flaky)
    monkeypatch.setattr(filtering, "FILTER_TIMEOUT_MEMORY_SECONDS", 0.2)
    cache = FilterCache(store)
    with pytest.raises(BadRequestError, match="too costly"):
        cache.rows("id < 3")
    with pytest.raises(BadRequestError, match="too costly"):
        cache.rows("id < 3")  # remembered, for a while
    import time

    time.sleep(0.3)
    with pytest.raises(MemoryError):
        cache.rows("id < 3")
    assert cache.rows("id < 3").tolist() == [0, 1, 2]
    with pytest.raises(BadRequestError, match="invalid filter"):
        cache.rows("nosuch > 1")
    failures.append(MemoryError())  # a refusal about the filter itself stays: never evaluated again
    with pytest.raises(BadRequestError, match="invalid filter"):
        cache.rows("nosuch > 1")
    assert failures, "the remembered refusal was answered without matching again"


def test_a_memory_error_while_matching_is_not_called_an_invalid_filter(store, monkeypatch):
    from kubeflow_data_cache import filtering

    def no_memory(*args, **kwargs):
        raise MemoryError

    monkeypatch.setattr(filtering, "check_calls", no_memory)
    with pytest.raises(MemoryError):
        matching_rows(store, "id < 3")


@pytest.fixture(scope="module")
def decimal_store():
    from decimal import Decimal

    prices = [Decimal("128963.25"), Decimal("-891325.57"), Decimal("1.10"), None, Decimal("0.30")]
    batch = pa.record_batch(
        {
            "price": pa.array(prices, pa.decimal128(18, 2)),
            "f": [1.0, float("nan"), 2.5, 3.0, 0.3],
            "i": pa.array([1, 2, 3, 4, 5], pa.int64()),
        }
    )
    return NodeStore(batch.schema, [batch])


@pytest.mark.parametrize(
    ("predicate", "rows"),
    [
        ("price = CAST('128963.25' AS DECIMAL(18, 2))", [0]),
        ("price = CAST('-891325.57' AS DECIMAL(18, 2))", [1]),
        ("price = '0.30'", [4]),
        ("price IN ('1.10', '0.30')", [2, 4]),
        ("price > 100", [0]),  # an integer converts exactly
        ("f = 0.3 AND price >= CAST('0.3' AS DECIMAL(18, 2))", [4]),  # a float column compares with a float
    ],
)
def test_decimal_columns_compare_exactly_with_numbers_written_as_decimals(decimal_store, predicate, rows):
    assert matching_rows(decimal_store, predicate).tolist() == rows


@pytest.mark.parametrize(
    ("predicate", "number", "kind", "rows"),
    [
        # DataFusion compared price with 128963.249999999991808 and matched no row.
        ("price = 128963.25", "128963.25", "decimal128(18, 2)", [0]),
        ("price = -891325.57", "-891325.57", "decimal128(18, 2)", [1]),
        ("0.3 <= price", "0.3", "decimal128(18, 2)", [0, 2, 4]),
        ("price IN (1.1, '0.30')", "1.1", "decimal128(18, 2)", [2, 4]),
        ("price BETWEEN 1 AND 1.5", "1.5", "decimal128(18, 2)", [2]),
        ("f > 0 AND abs(price + 1) = 2.1", "2.1", "decimal128(23, 2)", [2]),
    ],
)
def test_a_decimal_compared_with_a_floating_point_literal_is_refused_with_the_exact_form(
    decimal_store, predicate, number, kind, rows
):
    with pytest.raises(BadRequestError) as refused:
        matching_rows(decimal_store, predicate)
    message = str(refused.value)
    assert f"compares a {kind} value with {number}" in message
    precision, scale = kind[len("decimal128(") : -1].split(", ")
    suggested = f"CAST('{number}' AS DECIMAL({precision}, {scale}))"
    assert message.endswith(suggested)
    # The form it names, in place of the number, matches the rows equal to it exactly.
    assert matching_rows(decimal_store, predicate.replace(number, suggested, 1)).tolist() == rows


def test_a_filtered_in_order_stream_places_its_range_among_the_matches_without_copying_them():
    """An in-order stream's one range covers the node's whole part of the shard: placed as a copy
    (and an arange beside it), it held 16 bytes per matching row for the stream's life."""
    import tracemalloc

    from kubeflow_data_cache.filtering import matched_rows

    matches = np.arange(0, 8_000_000, 2, dtype=np.int64)  # 32 MB of matches
    tracemalloc.start()
    try:
        parts = matched_rows(iter([range(10, 3_000_010), np.array([0, 5])]), matches)
        first = next(parts)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak  # a view: nothing of the range's 24 MB copied
    assert np.shares_memory(first, matches) and first[0] == 20 and len(first) == 3_000_000
    assert next(parts).tolist() == [0, 10]  # an index array of positions is gathered


@pytest.mark.parametrize(
    ("predicate", "number", "suggested", "rows"),
    [
        # Cast to the column's own scale, 1.234 became 1.23, and `>=` matched 1.23.
        ("price >= 1.234", "1.234", "CAST('1.234' AS DECIMAL(19, 3))", [0]),
        ("price = 1.234", "1.234", "CAST('1.234' AS DECIMAL(19, 3))", []),
        ("price > 0.00001", "0.00001", "CAST('0.00001' AS DECIMAL(21, 5))", [0, 2, 4]),  # 1e-05 as digits
        ("price < 1e20", "1e20", "CAST('100000000000000000000' AS DECIMAL(23, 2))", [0, 1, 2, 4]),
        ("price = -(891325.57)", "-(891325.57)", "CAST('-891325.57' AS DECIMAL(18, 2))", [1]),
        ("price = CAST(128963.25 AS DOUBLE)", "CAST(128963.25 AS DOUBLE)", "CAST('128963.25' AS DECIMAL(18, 2))", [0]),
        ("price = 128963.25::double", "128963.25::double", "CAST('128963.25' AS DECIMAL(18, 2))", [0]),
    ],
)
def test_the_suggested_decimal_holds_the_number_exactly_and_matches_its_rows(
    decimal_store, predicate, number, suggested, rows
):
    """The suggestion keeps every digit of the number (a cast to the column's own scale would round
    it), written in digits (a string such as '1e-05' does not cast), and applies however the number
    was wrapped (negated, cast to a double)."""
    with pytest.raises(BadRequestError) as refused:
        matching_rows(decimal_store, predicate)
    assert str(refused.value).endswith(suggested), str(refused.value)
    assert matching_rows(decimal_store, predicate.replace(number, suggested)).tolist() == rows


def test_an_expression_of_floating_point_numbers_compared_with_a_decimal_is_refused(decimal_store):
    with pytest.raises(BadRequestError, match="with a floating-point number, which SQL reads as binary floating point"):
        matching_rows(decimal_store, "price = 515853/4.0")


@pytest.mark.parametrize(
    ("predicate", "rows"),
    [
        ("i BETWEEN 1.5 AND 3", [1, 2]),  # the number is compared with an integer column
        ("f IN (i, 0.3)", [0, 4]),
        ("CAST(price AS DOUBLE) > 1.5", [0]),  # the user's own cast: a double compared with a double
    ],
)
def test_numbers_compared_with_other_columns_beside_a_decimal_are_not_refused(decimal_store, predicate, rows):
    assert matching_rows(decimal_store, predicate).tolist() == rows


def test_tables_without_decimals_are_not_typed_for_the_check(store, monkeypatch):
    """The check plans an expression per operand it types: tables with no decimal skip it."""
    from kubeflow_data_cache import filtering

    def typed(*args):
        raise AssertionError("checked a table without decimals")

    monkeypatch.setattr(filtering, "check_decimal_comparisons", typed)
    assert matching_rows(store, "id > 2.5").tolist() == [3, 4, 5, 6, 7, 8, 9]


@pytest.mark.parametrize(
    "predicate",
    [
        "nullif(price, 128963.25) IS NULL",  # matched only the null row, not the one holding 128963.25
        "least(price, 128963.25) = price",
        "greatest(price, 0.3) = price",
        "coalesce(price, 1.5) > 0",
    ],
)
def test_functions_that_compare_their_arguments_are_checked_like_comparisons(decimal_store, predicate):
    with pytest.raises(BadRequestError, match="compares a decimal128\\(18, 2\\) value with"):
        matching_rows(decimal_store, predicate)


@pytest.mark.parametrize(
    "predicate",
    [
        "price > 1e400",  # infinity: a TypeError escaped the check and read as an invalid filter
        "price = 1234567890123456.79",  # more digits than a double holds: it reads as ...456.8
    ],
)
def test_a_number_a_double_cannot_hold_is_not_written_back_as_another(decimal_store, predicate):
    with pytest.raises(BadRequestError) as refused:
        matching_rows(decimal_store, predicate)
    message = str(refused.value)
    assert "with a floating-point number" in message, message
    assert message.endswith("CAST('<number>' AS DECIMAL(18, 2))"), message


def test_a_number_past_a_decimals_38_digits_at_the_columns_scale_gets_a_placeholder():
    """1e30 at scale 10 needs 41 digits: a cast to DECIMAL(38, 10) of it is refused as well."""
    from decimal import Decimal

    batch = pa.record_batch({"amount": pa.array([Decimal("1.5")], pa.decimal128(38, 10))})
    with pytest.raises(BadRequestError) as refused:
        matching_rows(NodeStore(batch.schema, [batch]), "amount < 1e30")
    message = str(refused.value)
    assert "with 1e+30" in message and message.endswith("CAST('<number>' AS DECIMAL(38, 10))"), message


@pytest.mark.parametrize("slice_rows", [4, 7, 1 << 16])
def test_filters_work_past_the_first_slice_of_a_table_with_structs_in_structs(monkeypatch, slice_rows):
    """DataFusion panicked on a sliced struct whose child is a struct: every filter on such a
    table (an image as struct<bytes, path> inside a record) failed once a node held more than
    one slice, whatever columns the filter named."""
    from kubeflow_data_cache import filtering

    inner = pa.struct([pa.field("a", pa.int32(), nullable=False), pa.field("s", pa.string())])
    outer = pa.struct([pa.field("in", inner), pa.field("x", pa.float64())])
    values = [
        None if i % 5 == 0 else {"in": None if i % 3 == 0 else {"a": i, "s": str(i)}, "x": float(i)} for i in range(23)
    ]
    table = pa.table({"id": pa.array(range(23), pa.int64()), "meta": pa.array(values, outer)})
    store = NodeStore(table.schema, table.to_batches(max_chunksize=10))
    monkeypatch.setattr(filtering, "FILTER_SLICE_ROWS", slice_rows)

    assert matching_rows(store, "id % 2 = 0").tolist() == list(range(0, 23, 2))
    expected = [i for i, v in enumerate(values) if v is not None and v["in"] is not None and v["in"]["a"] % 2 == 0]
    assert matching_rows(store, "meta['in']['a'] % 2 = 0").tolist() == expected
    expected = [i for i, v in enumerate(values) if v is None or v["in"] is None]
    assert matching_rows(store, "meta['in'] IS NULL").tolist() == expected


def test_different_new_filters_are_matched_one_at_a_time(store, monkeypatch):
    """A filter per rank, all new at once: each match holds DataFusion's working memory and the
    figures' buffers, and 64 at once took nodes 115 MiB past their memory limit."""
    import contextlib
    import threading
    import time

    from kubeflow_data_cache import filtering

    real, running, most = filtering.matching_rows, [], []
    lock = threading.Lock()

    def watched_match(s, predicate, executing=None):
        @contextlib.contextmanager
        def watched():
            with executing or contextlib.nullcontext():
                with lock:
                    running.append(predicate)
                    most.append(len(running))
                time.sleep(0.05)
                try:
                    yield
                finally:
                    with lock:
                        running.remove(predicate)

        return real(s, predicate, executing=watched())

    monkeypatch.setattr(filtering, "matching_rows", watched_match)
    cache = FilterCache(store)
    results: dict[int, list[int]] = {}
    threads = [
        threading.Thread(target=lambda k=k: results.__setitem__(k, cache.rows(f"id % 6 = {k}").tolist()))
        for k in range(6)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert max(most) == 1 and len(most) == 6
    assert results == {k: real(store, f"id % 6 = {k}").tolist() for k in range(6)}


def test_a_filter_waiting_for_its_turn_holds_none_of_the_nodes_rows(store, monkeypatch):
    """Its slices (and their row-number column, 8 bytes a row) were made before the wait: 64 new
    filters waiting took ~6 MiB each on a 500K-row node, 100 MiB past its memory limit."""
    import threading

    from kubeflow_data_cache import filtering

    real, made = filtering._slices, []
    monkeypatch.setattr(filtering, "_slices", lambda s: made.append(1) or real(s))
    cache = FilterCache(store)
    result: list[list[int]] = []
    with cache._one_match:  # another filter being matched
        asking = threading.Thread(target=lambda: result.append(cache.rows("id < 3").tolist()))
        asking.start()
        asking.join(0.5)
        assert asking.is_alive(), "it waits for its turn"
        assert made == [], "the rows were registered while it waited"
    asking.join(30)
    assert result == [[0, 1, 2]] and made == [1]


def test_a_mistaken_filter_is_named_at_once_while_another_is_matched(store):
    """Only the matching takes turns: checking and planning a filter do not wait for another's
    match, which may take up to FILTER_TIMEOUT_SECONDS."""
    import threading

    cache = FilterCache(store)
    refused: list[BaseException] = []

    def ask() -> None:
        try:
            cache.rows("id >>> ")
        except BadRequestError as err:
            refused.append(err)

    with cache._one_match:  # another filter being matched
        asking = threading.Thread(target=ask)
        asking.start()
        asking.join(5)
        assert not asking.is_alive(), "the mistaken filter waited for the other's match"
    assert "invalid filter" in str(refused[0])
    assert cache.rows("id < 3").tolist() == [0, 1, 2]


@pytest.mark.parametrize(
    ("typ", "value", "predicate", "keep"),
    [
        (
            pa.list_(pa.struct([("a", pa.int32())]), 2),
            lambda i: [{"a": i}, {"a": -i}],
            "id % 2 = 0",
            lambda i, v: i % 2 == 0,
        ),
        (
            pa.struct([("f", pa.list_(pa.struct([("a", pa.int32())]), 2))]),
            lambda i: None if i % 4 == 0 else {"f": [{"a": i}, {"a": -i}]},
            "c['f'][1]['a'] % 2 = 0",
            lambda i, v: v is not None and i % 2 == 0,
        ),
        (pa.struct([]), lambda i: {}, "id < 5", lambda i, v: i < 5),
        (
            pa.struct([("f", pa.list_(pa.int32(), 2))]),
            lambda i: None if i % 4 == 0 else {"f": [i, -i]},
            "c['f'][1] % 2 = 0",
            lambda i, v: v is not None and i % 2 == 0,
        ),
    ],
    ids=["fixed-size list of structs", "struct of fixed-size list of structs", "struct without fields", "null structs"],
)
def test_filters_work_past_the_first_slice_of_fixed_size_lists_of_structs_and_null_structs(
    monkeypatch, typ, value, predicate, keep
):
    """DataFusion panicked on a sliced fixed-size list of structs too; and a struct that is null
    reads as null in every field (the values under it are placeholders)."""
    from kubeflow_data_cache import filtering

    values = [value(i) for i in range(23)]
    table = pa.table({"id": pa.array(range(23), pa.int64()), "c": pa.array(values, typ)})
    store = NodeStore(table.schema, table.to_batches(max_chunksize=10))
    monkeypatch.setattr(filtering, "FILTER_SLICE_ROWS", 4)
    assert matching_rows(store, predicate).tolist() == [i for i, v in enumerate(values) if keep(i, v)]


def _rows_of_structs(rows: int) -> pa.StructArray:
    """One struct per row, null in odd rows, its required field 7 everywhere: under the null
    structs too, as a Parquet reader leaves it (a placeholder the struct's nulls hide)."""
    return pa.StructArray.from_arrays(
        [pa.array([7] * rows, pa.int32())],
        fields=[pa.field("z", pa.int32(), nullable=False)],
        mask=pa.array([i % 2 == 1 for i in range(rows)]),
    )


@pytest.mark.parametrize(
    ("holder", "field"),
    [
        ("list", "c[1]"),
        ("large list", "c[1]"),
        ("fixed-size list", "c[1]"),
        ("map", "c['k']"),
        ("list in a struct", "c['l'][1]"),
        ("list of lists", "c[1][1]"),
    ],
)
@pytest.mark.parametrize("slice_rows", [4, 1 << 16])
def test_a_null_struct_inside_a_list_or_map_reads_as_null_in_every_field(monkeypatch, holder, field, slice_rows):
    """Only top-level structs had their nulls passed down to their fields: inside a list or a
    map, a filter read the placeholder under a null struct, and `c[1]['z'] = 7` matched rows
    whose struct is null (which `c[1] IS NULL` also matched)."""
    from kubeflow_data_cache import filtering

    rows = 23
    structs = _rows_of_structs(rows)
    one_each = pa.array(range(rows + 1), pa.int32())
    column = {
        "list": lambda: pa.ListArray.from_arrays(one_each, structs),
        "large list": lambda: pa.LargeListArray.from_arrays(pa.array(range(rows + 1), pa.int64()), structs),
        "fixed-size list": lambda: pa.FixedSizeListArray.from_arrays(structs, 1),
        "map": lambda: pa.MapArray.from_arrays(one_each, pa.array(["k"] * rows), structs),
        "list in a struct": lambda: pa.StructArray.from_arrays([pa.ListArray.from_arrays(one_each, structs)], ["l"]),
        "list of lists": lambda: pa.ListArray.from_arrays(one_each, pa.ListArray.from_arrays(one_each, structs)),
    }[holder]()
    table = pa.table({"id": pa.array(range(rows), pa.int64()), "c": column})
    store = NodeStore(table.schema, table.to_batches(max_chunksize=10))
    monkeypatch.setattr(filtering, "FILTER_SLICE_ROWS", slice_rows)

    held = list(range(0, rows, 2))
    assert matching_rows(store, f"{field}['z'] = 7").tolist() == held
    assert matching_rows(store, f"{field}['z'] IS NULL").tolist() == list(range(1, rows, 2))
    assert matching_rows(store, f"{field}['z'] = 7 AND {field} IS NULL").tolist() == []
    # What is served keeps the column as stored: only the filter's copy is rebuilt.
    assert store.batches[0].column(1).equals(column.slice(0, 10))


@pytest.mark.parametrize(
    ("predicate", "rows"),
    [
        # '1.104' became 1.10 at the column's scale: each matched row 2, which holds 1.10.
        ("price = '1.104'", []),
        ("price >= '1.104'", [0]),
        ("price <> '1.104'", [0, 1, 2, 4]),
        ("price BETWEEN '1.104' AND '1.2'", []),
        ("price IN ('1.104', '0.30')", [4]),
        ("nullif(price, '1.104') IS NULL", [3]),
    ],
)
def test_a_decimal_compared_with_a_string_of_more_digits_than_its_scale_is_refused(decimal_store, predicate, rows):
    """SQL casts the string to the decimal's own type, rounding it: pyiceberg refuses such a
    literal ("scales differ"), and the cache matched rows that are not equal to it."""
    with pytest.raises(BadRequestError) as refused:
        matching_rows(decimal_store, predicate)
    message = str(refused.value)
    suggested = "CAST('1.104' AS DECIMAL(19, 3))"
    assert "compares a decimal128(18, 2) value with the string '1.104'" in message and message.endswith(suggested)
    assert matching_rows(decimal_store, predicate.replace("'1.104'", suggested)).tolist() == rows


@pytest.mark.parametrize(
    ("predicate", "rows"),
    [("price = '1.10'", [2]), ("price = '1.1'", [2]), ("price = '1.100'", [2]), ("price < '-0'", [1])],
)
def test_a_string_the_decimals_scale_holds_exactly_is_taken(decimal_store, predicate, rows):
    assert matching_rows(decimal_store, predicate).tolist() == rows


@pytest.mark.parametrize(
    ("predicate", "written", "suggested"),
    [
        ("price = CAST(1.1 AS DECIMAL(38, 20))", "CAST(1.1 AS DECIMAL(38, 20))", "CAST('1.1' AS DECIMAL(38, 20))"),
        ("price = 1.1::decimal(38,20)", "1.1::decimal(38,20)", "CAST('1.1' AS DECIMAL(38, 20))"),
        (
            "price = TRY_CAST(-1.1 AS DECIMAL(30, 10))",
            "TRY_CAST(-1.1 AS DECIMAL(30, 10))",
            "CAST('-1.1' AS DECIMAL(30, 10))",
        ),
    ],
)
def test_a_number_with_a_point_cast_to_a_decimal_is_refused(decimal_store, predicate, written, suggested):
    """The cast converts the number through binary floating point: CAST(1.1 AS DECIMAL(38, 20))
    is 1.10000000000000008192, and matched no row holding 1.10."""
    with pytest.raises(BadRequestError) as refused:
        matching_rows(decimal_store, predicate)
    message = str(refused.value)
    assert "through binary floating point" in message and message.endswith(suggested), message
    expected = [] if suggested.startswith("CAST('-") else [2]
    assert matching_rows(decimal_store, predicate.replace(written, suggested)).tolist() == expected


@pytest.mark.parametrize(
    ("predicate", "what"),
    [
        ("name ~ ('^' || name)", "~"),
        ("name !~* name", "!~*"),
        ("NOT (name ~* lower(name))", "~*"),
        ("regexp_like(name, name)", "regexp_like()"),
        ("regexp_like(name, 'r', name)", "regexp_like()"),  # the flags
        ("regexp_count(name, concat_ws('', name)) > 0", None),  # refused for concat_ws itself
        ("regexp_count(name, '^' || name) > 0", "regexp_count()"),
        ("regexp_instr(name, 'r', 1, 1, name) > 0", "regexp_instr()"),
    ],
)
def test_a_regular_expression_whose_pattern_names_a_column_is_refused(store, predicate, what):
    """DataFusion compiles such a pattern for every row and keeps each: `text ~ ('\\w{20}' ||
    text)` took every data node past 4 GB on one slice, and killed it."""
    with pytest.raises(BadRequestError) as refused:
        matching_rows(store, predicate)
    if what is not None:
        assert f"the pattern of {what} names a column" in str(refused.value)


@pytest.mark.parametrize(
    ("predicate", "rows"),
    [
        ("name ~ ('^r' || '[0-2]')", [0, 1, 2]),  # built of constants: compiled once
        ("regexp_count(name, 'r', id + 1) > 0", [0]),  # a start from a column is no pattern
        ("name LIKE name", list(range(10))),  # LIKE takes a pattern from a column without that cost
    ],
)
def test_a_constant_pattern_and_a_varying_start_are_taken(store, predicate, rows):
    assert matching_rows(store, predicate).tolist() == rows


def test_a_string_past_any_decimals_digits_is_left_to_the_casts_own_refusal(decimal_store):
    """Its rounding check gave up on it with a bare `[<class 'decimal.InvalidOperation'>]`."""
    with pytest.raises(BadRequestError) as refused:
        matching_rows(decimal_store, "price = '1e1000'")
    message = str(refused.value)
    assert "InvalidOperation" not in message and "1e1000" in message, message


def test_a_string_cast_to_a_string_is_checked_as_the_string(decimal_store):
    with pytest.raises(BadRequestError, match="with the string '1.104'"):
        matching_rows(decimal_store, "price = CAST('1.104' AS VARCHAR)")


@pytest.mark.parametrize(
    ("predicate", "exact", "rows"),
    [
        # Matched id 1: the string became 1.00.
        ("CAST(id AS DECIMAL(10, 2)) = '1.004'", "CAST(id AS DECIMAL(10, 2)) = CAST('1.004' AS DECIMAL(11, 3))", []),
        (
            "CAST(id AS DECIMAL(38, 20)) = CAST(1.1 AS DECIMAL(38, 20))",
            "CAST(id AS DECIMAL(38, 20)) = CAST('1.1' AS DECIMAL(38, 20))",
            [],
        ),
        (
            "CAST(id AS NUMERIC(10, 2)) >= 1.5",
            "CAST(id AS NUMERIC(10, 2)) >= CAST('1.5' AS DECIMAL(10, 1))",
            list(range(2, 10)),
        ),
    ],
)
def test_a_filter_that_makes_its_own_decimals_is_checked_on_a_table_without_any(store, predicate, exact, rows):
    with pytest.raises(BadRequestError, match="invalid filter"):
        matching_rows(store, predicate)
    assert matching_rows(store, exact).tolist() == rows
