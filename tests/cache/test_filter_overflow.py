"""filter_overflow.py: integer arithmetic that would wrap around refuses the filter, not its rows.

Without the check, DataFusion's wrapped values matched the wrong rows and the count agreed with
them: `x + x > 0` on int32 values near 2^31 matched none of them, and nothing said so.
"""

import datetime
import json
import uuid
from decimal import Decimal

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight
import pytest

from kubeflow_data_cache.errors import BadRequestError, server_message
from kubeflow_data_cache.filtering import matching_rows
from kubeflow_data_cache.store import NodeStore

ROWS = 100
I64_MAX = (1 << 63) - 1


@pytest.fixture(scope="module")
def store():
    batch = pa.record_batch(
        {
            "id": pa.array(np.arange(ROWS, dtype=np.int64)),
            # Near int32's top: x + x wraps to a negative number on every row.
            "x": pa.array([(1 << 31) - 3 + i % 3 for i in range(ROWS)], pa.int32()),
            # int8's whole range at its ends: -(-128) and 127 + 1 wrap, 127 + 0 does not.
            "i8": pa.array([-128 if i == 0 else i % 128 for i in range(ROWS)], pa.int8()),
            "u": pa.array([1] * (ROWS - 1) + [(1 << 64) - 1], pa.uint64()),
            "d": pa.array([datetime.date(2000, 1, 1) + datetime.timedelta(days=i) for i in range(ROWS)]),
        }
    )
    return NodeStore(batch.schema, [batch])


@pytest.mark.parametrize(
    ("predicate", "operation", "kind"),
    [
        ("x + x > 0", "x + x", "int32"),
        ("id + 9223372036854775807 > 0", "id + 9223372036854775807", "int64"),
        ("id * 9223372036854775807 > 0", "id * 9223372036854775807", "int64"),
        ("id - 9223372036854775807 - 2 < 0", "id - 9223372036854775807 - 2", "int64"),
        ("x + CAST(1 AS INT) > 0", "x + CAST(1 AS Int32)", "int32"),  # an int literal alone widens
        ("-i8 > 0", "(- i8)", "int8"),
        ("i8 + i8 > 0", "i8 + i8", "int8"),
        ("u * u > 0", "u * u", "uint64"),  # past 2^64 squared: checked in a 256-bit decimal
        # An operation inside others: each is checked.
        ("(x + x) * 2 > 0", "x + x", "int32"),
        # Evaluated on every row, also those a guard would not use: refused rather than guessed.
        ("CASE WHEN id > 98 THEN id * 9223372036854775807 > 0 ELSE true END", "id * 9223372036854775807", "int64"),
    ],
)
def test_integer_arithmetic_that_wraps_refuses_the_filter_naming_it(store, predicate, operation, kind):
    with pytest.raises(BadRequestError) as refused:
        matching_rows(store, predicate)
    message = str(refused.value)
    assert message.startswith(f"invalid filter {predicate!r}: ")
    assert f"{operation}" in message and f"overflows {kind} on some rows" in message
    assert "CAST the operands AS" in message


def test_the_wider_type_the_refusal_names_gives_the_exact_rows(store):
    """The refusal's fix, applied, matches what exact integer arithmetic matches."""
    x = store.batches[0].column("x").to_pylist()
    assert matching_rows(store, "CAST(x AS BIGINT) + x > 0").tolist() == [i for i, v in enumerate(x) if v + v > 0]
    wide = "CAST(id AS DECIMAL(38, 0)) + 9223372036854775807 > 0"
    assert matching_rows(store, wide).tolist() == [i for i in range(ROWS) if i + I64_MAX > 0]


@pytest.mark.parametrize(
    ("predicate", "rows"),
    [
        ("x + 1 > 0", list(range(ROWS))),  # int32 + an int64 literal is int64: no wrap
        ("id % 10 = 0", list(range(0, ROWS, 10))),  # % and / cannot wrap: not checked
        ("id + 1 > 98", [98, 99]),
        ("i8 + CAST(0 AS TINYINT) = 99", [99]),
        ("i8 + CAST(0 AS TINYINT) = -128", [0]),  # the bound itself is in range
        # Narrowing casts do not wrap: compared, the optimizer compares the value itself; past the
        # range otherwise, DataFusion raises a cast error (below). Not checked.
        ("CAST(id AS INT) = 5", [5]),
        ("CAST(id * 100000000 AS INT) > 0", list(range(1, ROWS))),
        ("arrow_cast(id * 2, 'Int8') >= 0", list(range(ROWS))),
        ("CAST(x AS BIGINT) > 0", list(range(ROWS))),
        ("TRY_CAST(id * 100000000 AS INT) IS NULL", [i for i in range(ROWS) if i * 100_000_000 >= 1 << 31]),
        # A difference of dates is an int64 of days in DataFusion, of operands that are no
        # integers: not checked (a decimal cast of a date failed the whole filter).
        ("d - d = 0", list(range(ROWS))),
        ("d - DATE '2000-01-01' > 50", list(range(51, ROWS))),
        ("u * 2 > 0", list(range(ROWS))),  # DataFusion computes uint64 * int64 as a decimal
    ],
)
def test_integer_arithmetic_within_range_is_served_exactly(store, predicate, rows):
    assert matching_rows(store, predicate).tolist() == rows


def test_a_filter_without_integer_arithmetic_gets_no_check(store, monkeypatch):
    """A check costs a decimal evaluation per row; filters that cannot wrap plan none."""
    import kubeflow_data_cache.filtering as filtering

    planned = []
    real = filtering.overflow_checks

    def spy(condition, type_of):
        checks = real(condition, type_of)
        planned.append(len(checks))
        return checks

    monkeypatch.setattr(filtering, "overflow_checks", spy)
    matching_rows(store, "id % 10 = 0 AND x > 5 AND i8 IS NOT NULL AND d - d = 0")
    # int32 + a literal is computed in int64, which it cannot leave: only id + 1 can.
    matching_rows(store, "id + 1 > 3 AND x + 1 > 3 AND CAST(id AS INT) > 0")
    assert planned == [0, 1]


def test_a_narrowing_cast_past_its_range_is_datafusions_cast_error_not_a_wrap(store):
    # The first row past the range: id 22.
    with pytest.raises(BadRequestError, match="Cast error: Can't cast value 2200000000 to type Int32"):
        matching_rows(store, "CAST(id * 100000000 AS INT) + 0 > 0")


@pytest.fixture(scope="module")
def decimal_store():
    batch = pa.record_batch(
        {"price": pa.array([Decimal("0.20"), Decimal("0.30"), Decimal("19.99")], pa.decimal128(18, 2))}
    )
    return NodeStore(batch.schema, [batch])


@pytest.mark.parametrize(
    ("predicate", "number"),
    [("price + 0.1 = 0.3", "0.1"), ("0.5 * price > 0", "0.5"), ("price / 2.5 < 1", "2.5"), ("price % 0.5 = 0", "0.5")],
)
def test_decimal_arithmetic_with_a_floating_point_literal_is_refused_with_the_exact_form(
    decimal_store, predicate, number
):
    """DataFusion computed `price + 0.1` in binary floating point: 0.2 + 0.1 missed 0.3."""
    with pytest.raises(BadRequestError) as refused:
        matching_rows(decimal_store, predicate)
    assert f"computes a decimal128(18, 2) value with {number}" in str(refused.value)
    assert f"CAST('{number}' AS DECIMAL(18, 2))" in str(refused.value)


def test_decimal_arithmetic_with_numbers_written_as_decimals_is_exact(decimal_store):
    exact = "price + CAST('0.1' AS DECIMAL(18, 2)) = CAST('0.3' AS DECIMAL(18, 2))"
    assert matching_rows(decimal_store, exact).tolist() == [0]
    assert matching_rows(decimal_store, "price * 2 > 1").tolist() == [2]  # an integer converts exactly


@pytest.fixture(scope="module")
def typed_store():
    the_uuid = uuid.UUID(int=0x1EEF)
    batch = pa.record_batch(
        {
            "id": pa.array([5, 6], pa.int64()),
            "t": pa.array([datetime.time(0, 30), datetime.time(2, 0)], pa.time64("us")),
            "u": pa.array([the_uuid.bytes, uuid.UUID(int=7).bytes], pa.binary(16)),
        }
    )
    return NodeStore(batch.schema, [batch]), the_uuid


@pytest.mark.parametrize(
    ("predicate", "hint", "working", "rows"),
    [
        ("10 / (id - 5) > 1", "divide by nullif(<divisor>, 0)", "10 / nullif(id - 5, 0) > 1", [1]),
        ("CASE WHEN id = 5 THEN false ELSE 10 / (id - 5) > 1 END", "a guard does not help", None, None),
        ("t < TIME '01:00:00'", "t < '01:00:00'", "t < '01:00:00'", [0]),
        ("u = '{uuid}'", "u = X'<32 hex digits>'", "u = X'{hex}'", [0]),
    ],
)
def test_a_refusal_with_a_known_working_form_names_it(typed_store, predicate, hint, working, rows):
    store, the_uuid = typed_store
    fill = {"uuid": str(the_uuid), "hex": the_uuid.hex}
    with pytest.raises(BadRequestError) as refused:
        matching_rows(store, predicate.format(**fill))
    assert hint in str(refused.value)
    if working is not None:
        assert matching_rows(store, working.format(**fill)).tolist() == rows


def test_a_wrapping_filter_is_refused_to_a_flight_client_before_any_row_is_served(small_cache):
    """Through the head: GetFlightInfo (which counts the filter's rows on the nodes) refuses it,
    where it used to return a wrong total_records and serve the wrong rows."""
    body = {"filter": "id * 4611686018427387904 > 0", "columns": ["id"]}
    descriptor = flight.FlightDescriptor.for_command(json.dumps(body).encode())
    with pytest.raises(pa.ArrowInvalid) as err:
        flight.FlightClient(small_cache.endpoint).get_flight_info(descriptor)
    message = server_message(err.value)
    assert message.startswith(f"invalid filter {body['filter']!r}: ")
    assert "'id * 4611686018427387904' overflows int64 on some rows" in message


@pytest.mark.parametrize("predicate", ["l / -1 > 0", "abs(l) > 0"])
def test_an_overflow_datafusion_raises_itself_is_refused_naming_a_wider_type(predicate):
    """MIN / -1 and abs(MIN) are DataFusion's own errors (no wrap to check for): they came with its
    text alone, where the operators it lets wrap name a wider type."""
    batch = pa.record_batch({"l": pa.array([-(2**63), 5], pa.int64())})
    with pytest.raises(
        BadRequestError,
        match=r"overflow.*compute it in a wider type, CAST integer operands AS DECIMAL\(38, 0\), or any operands AS DOUBLE",
    ):
        matching_rows(NodeStore(batch.schema, [batch]), predicate)
