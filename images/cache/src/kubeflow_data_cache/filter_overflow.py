"""Integer arithmetic in a filter, checked for overflow on the rows it is evaluated over.

DataFusion's integer `+`, `-`, `*` and unary minus wrap around on overflow, without an error, and
its ANSI mode does not change that: `x + x > 0` on an int32 column of values near 2^31 matched
none of them, and `id + 9223372036854775807 > 0` one of 100 rows, with `total_records` agreeing,
so rows were silently left out (or added). Spark in ANSI mode, Trino and Postgres raise an error
instead, and pyiceberg's Python integers never wrap. (Casts to a narrower integer type do not
wrap: DataFusion raises a cast error past the range, or compares exactly where its optimizer
unwraps the cast. Division and `%` raise their own error where they overflow, MIN / -1, and so do
`abs`, `factorial` and `lcm`: `id % 10 = 0` sampling costs nothing extra.)

So each such operation on integer operands gets a check, evaluated alongside the filter: the same
operation on its operands (as the filter computes them) widened to a decimal that holds any sum,
difference or product of two 64-bit integers exactly (WIDE, or WIDEST for unsigned 64-bit
results), and tested against the bounds of the type DataFusion gives the result. A row past them
refuses the filter, naming the operation and a wider type to compute it in. An operation whose
operands' ranges (their types', or a literal's value) cannot take it out of its type, such as an
int32 column plus a small literal computed in int64, gets no check.

A check is evaluated on every row, also where a CASE arm or an AND would not use the value:
a filter whose guarded branch overflows on the rows it guards against is refused too, a
conservative answer rather than a wrong one.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import pyarrow as pa

from kubeflow_data_cache.errors import BadRequestError, shown
from kubeflow_data_cache.filter_calls import operations
from kubeflow_data_cache.filter_decimals import planned_type

# Wide enough for any +, - or * of two signed 64-bit integers (below 2^126, 38 digits), exactly;
# a product of unsigned 64-bit integers (up to 2^128, 39 digits) takes the 256-bit decimal,
# which DataFusion computes at half the speed.
WIDE = pa.decimal128(38, 0)
WIDEST = pa.decimal256(76, 0)
WRAPPING_OPERATORS = frozenset({"+", "-", "*"})
_TYPED_INTEGER = re.compile(r"\bU?Int(?:8|16|32|64)\((-?[0-9]+)\)")


@dataclass(frozen=True)
class OverflowCheck:
    """One operation's check: ``failed`` (an expression) is true on the rows where the
    operation's value leaves the range of ``kind``, its type; ``text`` names the operation."""

    text: str
    kind: pa.DataType
    failed: Any


def overflow_checks(condition, type_of: Callable[[object], pa.DataType]) -> list[OverflowCheck]:
    """A check for each integer operation in ``condition`` that DataFusion would let wrap.

    ``type_of(expr)``: the type ``expr`` has over the table (planned once per operation)."""
    from datafusion import lit

    checks = []
    for expr, form, operands in operations(condition):
        if not _may_wrap(expr, form, operands):
            continue
        kind = planned_type(expr, type_of)
        if kind is None or not pa.types.is_integer(kind):
            continue
        ranges = [_range(o, type_of) for o in operands]
        if None in ranges:
            continue  # an operand that is no integer (a date difference is an int64 of dates)
        if _fits(form, expr, ranges, kind):
            continue
        wide = WIDEST if kind == pa.uint64() else WIDE
        low, high = _bounds(kind)
        widened = _widened(expr, form, operands, wide, lit)
        failed = widened.between(lit(pa.scalar(low, wide)), lit(pa.scalar(high, wide)), negated=True)
        checks.append(OverflowCheck(expr.canonical_name(), kind, failed))
    return checks


def refusal(predicate: str, check: OverflowCheck) -> BadRequestError:
    wider = "BIGINT" if check.kind.bit_width < 64 else "DECIMAL(38, 0)"
    return BadRequestError(
        f"invalid filter {shown(predicate)}: {shown(_readable(check.text))} overflows {check.kind} on some rows, "
        f"where DataFusion (which evaluates filters) would wrap it around and match the wrong rows; compute it in "
        f"a wider type: CAST the operands AS {wider}, or AS DOUBLE"
    )


def _may_wrap(expr, form: str, operands) -> bool:
    if form == "BinaryExpr":
        return expr.rex_call_operator() in WRAPPING_OPERATORS and len(operands) == 2
    return form == "Negative" and len(operands) == 1


def _range(operand, type_of: Callable[[object], pa.DataType]) -> tuple[int, int] | None:
    """The values an integer operand can take: a literal's own, else its type's; None where it
    is not an integer."""
    if operand.variant_name() == "Literal":
        value = operand.python_value().as_py()
        return (value, value) if isinstance(value, int) and not isinstance(value, bool) else None
    kind = planned_type(operand, type_of)
    if kind is None or not pa.types.is_integer(kind):
        return None
    low, high = _bounds(kind)
    return int(low), int(high)


def _fits(form: str, expr, ranges: list[tuple[int, int]], kind: pa.DataType) -> bool:
    """Whether the operation's value stays in ``kind`` whatever its operands' values in ``ranges``."""
    if form == "Negative":
        ((low, high),) = ranges
        values = (-low, -high)
    else:
        (a_low, a_high), (b_low, b_high) = ranges
        operator = expr.rex_call_operator()
        if operator == "+":
            values = (a_low + b_low, a_high + b_high)
        elif operator == "-":
            values = (a_low - b_high, a_high - b_low)
        else:
            values = tuple(a * b for a in (a_low, a_high) for b in (b_low, b_high))
    low, high = _bounds(kind)
    return low <= min(values) and max(values) <= high


def _widened(expr, form: str, operands, wide: pa.DataType, lit):
    """The operation (one _may_wrap accepts) recomputed in ``wide``."""
    if form == "BinaryExpr":
        a, b = (o.cast(wide) for o in operands)
        return {"+": a + b, "-": a - b, "*": a * b}[expr.rex_call_operator()]
    return lit(pa.scalar(Decimal(0), wide)) - operands[0].cast(wide)


def _bounds(kind: pa.DataType) -> tuple[Decimal, Decimal]:
    bits = kind.bit_width
    if pa.types.is_signed_integer(kind):
        return Decimal(-(1 << (bits - 1))), Decimal((1 << (bits - 1)) - 1)
    return Decimal(0), Decimal((1 << bits) - 1)


def _readable(text: str) -> str:
    """An expression's canonical text as written: without the table name DataFusion puts
    before columns, and integer literals without their type (`Int64(2)` as `2`)."""
    return _TYPED_INTEGER.sub(r"\1", text.replace("data.", ""))
