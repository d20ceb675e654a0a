"""Decimal values compared with numbers written with a point or an exponent: refused, naming the
exact form.

SQL reads `128963.25` as a binary floating-point number, and DataFusion compares a decimal with
one by casting both to a decimal of scale 15, the number through floating-point arithmetic:
`price = 128963.25` on a decimal(18, 2) column compared with 128963.249999999991808 and matched
no row, where pyiceberg, Spark and Trino match it (49 of 60 such equalities missed their row, and
22 of 60 `>=`). Written as a decimal, `CAST('128963.25' AS DECIMAL(18, 2))` (or the string
`'128963.25'`), the number compares exactly. DataFusion's option to read such numbers as
decimals is no cure: a float column compared with one is then cast to a decimal, which fails on
NaN.
"""

from __future__ import annotations

from collections.abc import Callable

import pyarrow as pa

from kubeflow_data_cache.errors import BadRequestError, shown
from kubeflow_data_cache.filter_calls import COMPARING_OPERATORS

# Forms that compare their first operand with the others.
COMPARING_LISTS = frozenset({"InList", "Between"})


def check_decimal_comparisons(condition, type_of: Callable[[object], pa.DataType], predicate: str) -> None:
    """Refuse (BadRequestError) a comparison of a decimal value with a floating-point literal.

    ``type_of(expr)``: the type ``expr`` has over the table (asked only of the other operands
    of a comparison that holds such a literal)."""
    pending = [condition]
    while pending:
        expr = pending.pop()
        form = expr.variant_name()
        if form in ("Column", "Literal"):
            continue
        operands = expr.rex_call_operands()
        pending.extend(operands)
        comparing = form in COMPARING_LISTS or (
            form == "BinaryExpr" and expr.rex_call_operator() in COMPARING_OPERATORS
        )
        if not comparing:
            continue
        numbers = [i for i, o in enumerate(operands) if _float_literal(o)]
        if not numbers:
            continue
        for i, operand in enumerate(operands):
            if i in numbers or operand.variant_name() == "Literal":
                continue
            try:
                kind = type_of(operand)
            except Exception:  # planning the filter, next, names what is wrong with it
                continue
            if pa.types.is_decimal(kind):
                number = repr(operands[numbers[0]].python_value().as_py())
                raise BadRequestError(
                    f"invalid filter {shown(predicate)}: it compares a {kind} value with {number}, a number SQL "
                    "reads as binary floating point, which is rounded on its way to a decimal, so rows equal to it "
                    f"would not match; write the number as a decimal: CAST('{number}' AS DECIMAL({kind.precision}, "
                    f"{kind.scale}))"
                )


def _float_literal(expr) -> bool:
    return expr.variant_name() == "Literal" and pa.types.is_floating(expr.python_value().type)
