"""Decimal values compared with numbers written with a point or an exponent: refused, naming the
exact form.

SQL reads `128963.25` as a binary floating-point number, and DataFusion compares a decimal with
one by casting both to a decimal of scale 15, the number through floating-point arithmetic:
`price = 128963.25` on a decimal(18, 2) column compared with 128963.249999999991808 and matched
no row, where pyiceberg, Spark and Trino match it (49 of 60 such equalities missed their row, and
22 of 60 `>=`). Written as a decimal with room for its digits, `CAST('128963.25' AS DECIMAL(18,
2))`, the number compares exactly (cast to the column's own scale, as a string `'1.234'`
compared with a decimal(18, 2) column is, it becomes 1.23 and matches rows it should not).
DataFusion's option to read such numbers as decimals is no cure: a float column compared with
one is then cast to a decimal, which fails on NaN.

Two more forms round on the way: a string with more digits after the point than the decimal's
scale (`price = '1.234'` on a decimal(18, 2) column is `price = 1.23`; pyiceberg refuses such a
literal), and a number with a point cast to a decimal (`CAST(1.1 AS DECIMAL(38, 20))` converts
the double 1.1 and is 1.10000000000000008192). Both are refused, naming the exact form.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from decimal import Context, Decimal, InvalidOperation

import pyarrow as pa

from kubeflow_data_cache.errors import BadRequestError, shown
from kubeflow_data_cache.filter_calls import COMPARING_OPERATORS, is_constant, operations

# Forms that compare their first operand with each of the others.
COMPARING_LISTS = frozenset({"InList", "Between"})
# Functions that bring their arguments to one type and compare them, or pick one of them: each
# argument meets each other one (nullif(price, 1.5) IS NULL missed the row holding 1.50).
COMPARING_FUNCTIONS = frozenset({"nullif", "least", "greatest", "coalesce", "nvl", "ifnull", "nvl2"})
# Arithmetic brings a decimal and a floating-point number to floating point: `price + 0.1 = 0.3`
# then compared 0.2 + 0.1 with 0.3 in binary and missed the row holding 0.20.
ARITHMETIC_OPERATORS = frozenset({"+", "-", "*", "/", "%"})
MIXING_OPERATORS = COMPARING_OPERATORS | ARITHMETIC_OPERATORS
# Casts, whose operand is converted to their type (a number with a point, through floating point).
CASTS = frozenset({"Cast", "TryCast"})
# Enough digits for any decimal128 and any string compared with one, for exact checks.
_EXACT = Context(prec=100)
# Wrappers a number passes through unchanged in value (its sign aside).
NUMBER_WRAPPERS = frozenset({"Negative", "Cast", "TryCast", "Alias"})


def check_decimal_comparisons(condition, type_of: Callable[[object], pa.DataType], predicate: str) -> None:
    """Refuse (BadRequestError) a comparison of a decimal value with a floating-point number
    (a literal with a point or an exponent, or any expression of such numbers without a column),
    or arithmetic of the two; the same with a string of more digits than the decimal's scale;
    and a cast of a floating-point number to a decimal.

    ``type_of(expr)``: the type ``expr`` has over the table. Call this only where
    may_compute_decimals: it plans an expression for each operand it types (once each)."""
    types: dict[str, pa.DataType | None] = {}  # by the operand's canonical name: typed once

    def typed(expr, test: Callable[[pa.DataType], bool]) -> pa.DataType | None:
        key = expr.canonical_name()
        if key not in types:
            types[key] = planned_type(expr, type_of)
        kind = types[key]
        return kind if kind is not None and test(kind) else None

    for expr, form, operands in operations(condition):
        if form in CASTS:
            (operand,) = operands[:1]
            kind = typed(expr, pa.types.is_decimal)
            if kind is not None and is_constant(operand) and typed(operand, pa.types.is_floating):
                raise BadRequestError(_cast_refusal(predicate, kind, _number(operand)))
            continue
        if form in COMPARING_LISTS:
            pairs = [(operands[0], other) for other in operands[1:]]
        elif form == "BinaryExpr" and expr.rex_call_operator() in MIXING_OPERATORS and len(operands) == 2:
            pairs = [(operands[0], operands[1])]
        elif form == "ScalarFunction" and expr.rex_call_operator() in COMPARING_FUNCTIONS:
            pairs = [(a, b) for i, a in enumerate(operands) for b in operands[i + 1 :]]
        else:
            continue
        numbers = [o for o in operands if is_constant(o) and typed(o, pa.types.is_floating)]
        texts = {id(o): text for o in operands if (text := _text(o, typed)) is not None}
        if not numbers and not texts:
            continue
        arithmetic = form == "BinaryExpr" and expr.rex_call_operator() in ARITHMETIC_OPERATORS
        verb = "computes" if arithmetic else "compares"
        for a, b in pairs:
            for value, other in ((a, b), (b, a)):
                if is_constant(value):
                    continue
                if any(other is n for n in numbers):
                    kind = typed(value, pa.types.is_decimal)
                    if kind is not None:
                        raise BadRequestError(_refusal(predicate, kind, _number(other), verb))
                elif id(other) in texts:
                    kind = typed(value, pa.types.is_decimal)
                    if kind is not None and _rounds(texts[id(other)], kind):
                        raise BadRequestError(_text_refusal(predicate, kind, texts[id(other)], verb))


def may_compute_decimals(schema: pa.Schema, predicate: str) -> bool:
    """Whether a filter over ``schema`` may hold a decimal value: the table has a decimal column,
    or the filter names the type (a cast to DECIMAL or NUMERIC, an arrow_cast to Decimal128), as
    `CAST(i AS DECIMAL(10, 2)) = '1.004'` on a table of integers does. Others skip the check,
    which plans an expression per operand it types."""
    return has_decimal(schema) or re.search(r"decimal|numeric", predicate, re.IGNORECASE) is not None


def has_decimal(schema: pa.Schema) -> bool:
    """Whether any column of ``schema`` is or holds a decimal."""
    pending = list(schema.types)
    while pending:
        t = pending.pop()
        if pa.types.is_decimal(t):
            return True
        pending.extend(t.field(i).type for i in range(t.num_fields))
    return False


def _exact_form(kind: pa.DataType, value: Decimal | None) -> str:
    """``value`` written as a decimal that holds its digits beside ``kind``'s (_fitting); a
    placeholder where it is not known, or no decimal128 holds both."""
    fitting = _fitting(kind, value) if value is not None else None
    if fitting is None:
        return f"CAST('<number>' AS DECIMAL({kind.precision}, {kind.scale}))"
    return f"CAST('{format(value, 'f')}' AS DECIMAL({fitting}))"


def _refusal(predicate: str, kind: pa.DataType, number: float | None, verb: str) -> str:
    fix = _exact_form(kind, Decimal(repr(number)) if number is not None else None)
    shown_number = repr(number) if number is not None else "a floating-point number"
    return (
        f"invalid filter {shown(predicate)}: it {verb} a {kind} value with {shown_number}, which SQL reads as "
        "binary floating point and rounds on its way to a decimal, so rows equal to it may not match; write the "
        f"number as a decimal: {fix}"
    )


def _cast_refusal(predicate: str, kind: pa.DataType, number: float | None) -> str:
    shown_number = repr(number) if number is not None else "a floating-point number"
    digits = _decimal_text(number) if number is not None else "<number>"
    return (
        f"invalid filter {shown(predicate)}: it casts {shown_number} to {kind} through binary floating point "
        "(SQL reads a number with a point or an exponent as a double), which may round it, so rows equal to it "
        f"may not match; write the number as a string: CAST('{digits}' AS DECIMAL({kind.precision}, {kind.scale}))"
    )


def _text_refusal(predicate: str, kind: pa.DataType, text: str, verb: str) -> str:
    fix = _exact_form(kind, _EXACT.create_decimal(text.strip()))
    return (
        f"invalid filter {shown(predicate)}: it {verb} a {kind} value with the string {shown(text)}, which SQL "
        f"rounds to the value's {kind.scale} digits after the point, so rows not equal to it match; write the "
        f"number as a decimal that holds its digits: {fix}"
    )


def _text(expr, typed: Callable) -> str | None:
    """The text of a string literal, also cast to a string (`CAST('1.234' AS VARCHAR)`), else None.
    The expression is typed only where a string literal is inside: planning every operand of a
    comparison (its columns too) would be work done for none."""
    inner = expr
    while inner.variant_name() in ("Alias", "Cast", "TryCast"):
        (inner,) = inner.rex_call_operands()[:1]
    if inner.variant_name() != "Literal" or not _is_string(inner.python_value().type):
        return None
    return inner.python_value().as_py() if typed(expr, _is_string) else None


def _is_string(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)


def _rounds(text: str, kind: pa.DataType) -> bool:
    """Whether ``text``, a number, has digits past ``kind``'s scale, which a cast to it rounds
    away (False for what is not a number: the cast's own error names it)."""
    try:
        value = _EXACT.create_decimal(text.strip())
        return value.is_finite() and value != value.quantize(Decimal(1).scaleb(-kind.scale), context=_EXACT)
    except InvalidOperation:  # '1e1000': past any decimal's digits; the cast's own error names it
        return False


def _decimal_text(number: float) -> str:
    """``number`` as plain decimal digits, as Python writes it shortest (1e-05 as 0.00001)."""
    return format(Decimal(repr(number)), "f")


def _fitting(kind: pa.DataType, value: Decimal) -> str | None:
    """A decimal's precision and scale that hold both ``kind``'s values and ``value`` exactly (a
    cast to the column's own scale would round 1.234 to 1.23, and match rows it should not);
    None past the 38 digits a decimal128 holds."""
    scale = max(kind.scale, -min(0, value.as_tuple().exponent))
    whole = max(kind.precision - kind.scale, value.adjusted() + 1, 1)
    return f"{whole + scale}, {scale}" if whole + scale <= 38 else None


def planned_type(expr, type_of: Callable[[object], pa.DataType]) -> pa.DataType | None:
    """``expr``'s type (a literal's without planning); None where it cannot be planned."""
    if expr.variant_name() == "Literal":
        return expr.python_value().type
    try:
        return type_of(expr)
    except Exception:  # planning the filter, next, names what is wrong with it
        return None


def _number(expr) -> float | None:
    """The value of a number written as a literal, negated or cast (else None: an expression)."""
    sign = 1.0
    while expr.variant_name() in NUMBER_WRAPPERS:
        if expr.variant_name() == "Negative":
            sign = -sign
        (expr,) = expr.rex_call_operands()[:1]
    if expr.variant_name() != "Literal":
        return None
    value = expr.python_value().as_py()
    # Not infinity or NaN (1e400 overflows to inf), and not past the digits a double holds: the
    # suggestion would show another number than the one written (…456.79 read as …456.8).
    if not isinstance(value, float) or not math.isfinite(value) or len(Decimal(repr(value)).as_tuple().digits) > 15:
        return None
    return sign * value
