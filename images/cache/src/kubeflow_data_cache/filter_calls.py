"""What a filter's parsed expression may hold: a walk over DataFusion's expression tree.

A filter is evaluated on every data node, over every row it holds. What keeps that bounded is
what the expression may call, so the rule is a list of what is allowed, not of what is refused:
a refusal list missed `array_to_string(string_to_array(x, NULL), x)`, which squares a value's
length at each level (three levels, a 330-character filter, aborted both data nodes of a
10,000-row table on a failed 2 GiB allocation), and `concat(x, x, ...)` with 5,000 arguments.

Allowed: the expression forms of a predicate (comparisons, AND/OR/NOT, arithmetic, `||`, CASE,
IN lists, BETWEEN, LIKE, ~, IS ..., CAST; not SIMILAR TO, which
DataFusion matches unanchored, its % and _ no wildcards) and functions whose value is a fixed size or no larger
than their arguments, within a constant: math, string tests and cuts (length, lower, substr,
starts_with, regexp_like, ...), date parts, hashes, and reads of lists, maps and structs. Not
allowed: functions that build values from others (concat, array_to_string, string_to_array,
make_array of columns, repeat, lpad, replace, ...), volatile ones (random(), now()), and
anything that is not one row's predicate (subqueries, aggregates, window functions, unnest).
The canonical text of an expression cannot be used instead: it shows string literals unescaped,
so a literal can fake or hide a call there.
"""

from __future__ import annotations

from collections.abc import Iterator

from kubeflow_data_cache.errors import BadRequestError, shown

# Expression forms that compute one value per row from their operands. `||` is a BinaryExpr:
# its growth is bounded by the operator count (protocol.check_filter).
PREDICATE_FORMS = frozenset(
    {
        "Alias",
        "BinaryExpr",
        "Between",
        "Case",
        "Cast",
        "TryCast",
        "InList",
        "Like",
        "Not",
        "Negative",
        "IsNull",
        "IsNotNull",
        "IsTrue",
        "IsFalse",
        "IsUnknown",
        "IsNotTrue",
        "IsNotFalse",
        "IsNotUnknown",
    }
)

# Functions whose value changes from call to call: the head and the nodes would count different
# rows for the same filter, and shards would overlap or miss rows.
VOLATILE_FUNCTIONS = frozenset(
    {"random", "rand", "uuid", "now", "today", "current_date", "current_time", "current_timestamp"}
)

_MATH = """abs acos acosh asin asinh atan atan2 atanh cbrt ceil cos cosh cot degrees exp factorial floor gcd
    lcm ln log log10 log2 nanvl pi pow power radians round signum sin sinh sqrt tan tanh trunc isnan iszero"""
_CONDITIONAL = "coalesce nullif nvl nvl2 ifnull greatest least"
# No larger than their first argument (or a fixed size), whatever the nesting.
_STRINGS = """ascii bit_length btrim char_length character_length length octet_length chr contains ends_with
    starts_with instr strpos position find_in_set left right ltrim rtrim trim lower upper initcap reverse
    split_part substr substring substr_index substring_index translate regexp_like regexp_count
    regexp_instr md5 sha224 sha256 sha384 sha512 digest to_hex decode"""
_TIME = """date_bin date_part datepart date_trunc datetrunc make_date make_time to_date to_time to_timestamp
    to_timestamp_seconds to_timestamp_millis to_timestamp_micros to_timestamp_nanos to_unixtime
    from_unixtime to_local_time"""
_TYPES = "arrow_cast arrow_try_cast arrow_typeof cast_to_type try_cast_to_type"
# Reads of one list, map or struct value: a scalar, or a part of it.
_NESTED = """array_has array_has_all array_has_any array_contains list_has list_has_all list_has_any
    list_contains arrays_overlap cardinality array_length list_length array_ndims list_ndims array_dims
    list_dims array_empty list_empty empty array_element array_extract list_element list_extract
    element_at array_position list_position array_indexof list_indexof array_max array_min list_max
    array_sum list_sum array_avg list_avg array_product list_product array_slice list_slice
    array_distinct list_distinct array_sort list_sort array_reverse list_reverse array_any_value
    list_any_value array_pop_back array_pop_front list_pop_back list_pop_front array_remove
    array_remove_n array_remove_all list_remove list_remove_n list_remove_all array_compact
    list_compact flatten array_distance list_distance cosine_distance inner_product dot_product
    get_field map_extract map_keys map_values map_entries union_extract union_tag"""
ALLOWED_FUNCTIONS = frozenset(" ".join((_MATH, _CONDITIONAL, _STRINGS, _TIME, _TYPES, _NESTED)).split())
# Values written out in the filter ("l[1:2] = [1, 2]", "s = {'a': 2}"): allowed where every
# element is a constant (no column in it), so its size is the filter's; of columns,
# make_array(x, x, ...) repeats a row's value.
CONSTANT_BUILDERS = frozenset({"make_array", "make_list", "named_struct", "struct"})
# Where a long string or binary literal may stand: compared with a row's value (operators, LIKE,
# IN lists, and functions that test a value against it). Elsewhere a result (`x || 'a...'`, a
# CASE arm, coalesce(x, 'a...')) is a copy of it in every row: a 30,000-character literal
# concatenated took 2 MiB of rows to 1.1 GB.
COMPARING_OPERATORS = frozenset(
    {"=", "!=", "<", "<=", ">", ">=", "IS DISTINCT FROM", "IS NOT DISTINCT FROM", "~", "~*", "!~", "!~*"}
)
COMPARING_FORMS = frozenset({"Like", "InList"})
_TESTING = """starts_with ends_with contains strpos instr position find_in_set regexp_like regexp_count regexp_instr
    array_has array_has_any array_has_all array_contains list_has list_has_any list_has_all list_contains
    array_position array_indexof list_position list_indexof"""
TESTING_FUNCTIONS = frozenset(_TESTING.split())
# Regular expressions, whose pattern (and flags) must be constants: DataFusion compiles a pattern
# that is not once per row, and keeps every one: `text ~ ('\w{20}' || text)` took a data node
# past 4 GB on one slice of 65,536 rows (every node at once, as the head asks each to count),
# and killed it, where the matching deadline is only looked at between slices.
REGEX_OPERATORS = frozenset({"~", "~*", "!~", "!~*"})
# Each function's pattern and flags arguments, by position (its others, such as a start, may vary).
REGEX_FUNCTIONS = {"regexp_like": (1, 2), "regexp_count": (1, 3), "regexp_instr": (1, 4)}
MAX_RESULT_LITERAL_BYTES = 1024


def check_calls(condition, predicate: str) -> None:
    """Refuse (BadRequestError) a parsed filter that holds anything but a row's predicate made of
    PREDICATE_FORMS and ALLOWED_FUNCTIONS (and constants built of literals), or a long literal
    where it would be a copy in every row."""
    pending = [(condition, False)]  # (expression, whether it is compared with, not a result)
    while pending:
        expr, compared = pending.pop()
        form = expr.variant_name()
        if form == "Column":
            continue
        if form == "Literal":
            _check_literal(expr, compared, predicate)
            continue
        if form == "ScalarFunction":
            name = expr.rex_call_operator()
            operands = expr.rex_call_operands()
            if name in VOLATILE_FUNCTIONS:
                raise BadRequestError(
                    f"invalid filter {shown(predicate)}: it calls {name}(), whose value changes between calls, so "
                    'ranks would see overlapping rows; to sample, use a column, e.g. "id % 10 = 0"'
                )
            constant = name in CONSTANT_BUILDERS and all(is_constant(o) for o in operands)
            if name not in ALLOWED_FUNCTIONS and not constant:
                raise BadRequestError(
                    f"invalid filter {shown(predicate)}: {name}() is not among the functions a filter may call: "
                    "only those whose result is no larger than their arguments (length, lower, substr, regexp_like, "
                    "date_part, array_has, abs, ...; docs/protocol.md lists them)"
                )
            if name in REGEX_FUNCTIONS:
                _check_pattern(
                    [operands[i] for i in REGEX_FUNCTIONS[name] if i < len(operands)], f"{name}()", predicate
                )
            testing = name in TESTING_FUNCTIONS
            pending.extend((o, testing and i > 0) for i, o in enumerate(operands))
            continue
        if form in ("SimilarTo", "RLike"):  # the binding names DataFusion's SimilarTo "RLike"
            # DataFusion matches SIMILAR TO as an unanchored regular expression, not as SQL says: %
            # and _ are no wildcards and 'row-1' matched 'row-10'. Wrong rows, and the head's count
            # agreed with them: refused rather than silently read otherwise. (RLIKE and REGEXP,
            # which would mean that, DataFusion does not plan at all.)
            raise BadRequestError(
                f"invalid filter {shown(predicate)}: SIMILAR TO is not allowed, as DataFusion does not match it as "
                "SQL does (% and _ are no wildcards there, and a pattern matches anywhere in the value); use LIKE, "
                "or an anchored regular expression: name ~ '^row-[0-9]+$'"
            )
        if form not in PREDICATE_FORMS:
            raise BadRequestError(
                f"invalid filter {shown(predicate)}: {_form_name(form)} is not allowed; a filter is a predicate "
                "over one row's columns"
            )
        operands = expr.rex_call_operands()
        operator = expr.rex_call_operator() if form == "BinaryExpr" else None
        if operator in REGEX_OPERATORS:
            _check_pattern(operands[1:], operator, predicate)
        comparing = form in COMPARING_FORMS or operator in COMPARING_OPERATORS
        pending.extend((o, comparing) for o in operands)


def _check_pattern(arguments: list, what: str, predicate: str) -> None:
    """Refuse a regular expression's pattern or flags (``arguments``, all but the value matched)
    that name a column."""
    if not all(is_constant(argument) for argument in arguments):
        raise BadRequestError(
            f"invalid filter {shown(predicate)}: the pattern of {what} names a column; a regular expression's pattern "
            "must be a constant (a string literal), as one built from a row's values is compiled for every row "
            "and kept, which can take a data node's memory; compare with LIKE where the pattern comes from a column"
        )


def _check_literal(expr, compared: bool, predicate: str) -> None:
    if compared:
        return
    value = expr.python_value().as_py()  # text or bytes of any Arrow string or binary type
    if isinstance(value, (str, bytes)) and len(value) > MAX_RESULT_LITERAL_BYTES:
        raise BadRequestError(
            f"invalid filter {shown(predicate)}: a {len(value)}-character literal is allowed only where a value is "
            f"compared with it (=, <, IN, LIKE, starts_with, ...); elsewhere every row would hold a copy of it (at "
            f"most {MAX_RESULT_LITERAL_BYTES} there)"
        )


def operations(condition) -> Iterator[tuple[object, str, list]]:
    """Every expression in ``condition`` that has operands (not a column or a literal), with its
    form (variant name) and operands: the walk the decimal and overflow checks share."""
    pending = [condition]
    while pending:
        expr = pending.pop()
        form = expr.variant_name()
        if form in ("Column", "Literal"):
            continue
        operands = expr.rex_call_operands()
        pending.extend(operands)
        yield expr, form, operands


def is_constant(expr) -> bool:
    """Whether ``expr`` names no column: literals, and casts and lists of them."""
    pending = [expr]
    while pending:
        expr = pending.pop()
        form = expr.variant_name()
        if form == "Column":
            return False
        if form != "Literal":
            pending.extend(expr.rex_call_operands())
    return True


def _form_name(form: str) -> str:
    return {
        "InSubquery": "a subquery (IN (SELECT ...))",
        "Exists": "a subquery (EXISTS)",
        "ScalarSubquery": "a subquery",
        "AggregateFunction": "an aggregate function",
        "WindowFunction": "a window function",
        "Unnest": "unnest()",
        "Placeholder": "a placeholder ($1)",
    }.get(form, form)
