"""The wire contract between cache clients, the head and the data nodes.

Kept in one module so the server and the training-side client cannot drift. See
docs/protocol.md for the prose version.

* ``GetFlightInfo`` on a PATH descriptor ``[str(index), str(total)]`` (upstream-compatible) or on
  a CMD descriptor holding a JSON :class:`ShardRequest`.
* Each endpoint's ticket is a JSON :class:`Ticket`: self-contained, so a data node serves it
  without asking the head.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import operator
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from typing import Any, NamedTuple

from kubeflow_data_cache.errors import BadRequestError, UnsignedTicketError, first_line, shown

PROTOCOL_VERSION = 1
# Tickets that carry a skip say so in their version: a node from before skipping (which accepts
# version 1 only) refuses them, rather than ignore the skip and send rows the client already has.
SKIP_VERSION = 2
# How a data node orders a shuffled stream; a head says so in each shuffled ticket (``order``).
# 1: the block permutation as it is (tickets without the field); 2: each window's rows dealt out
# across its blocks (sharding.deal). A reader resuming mid-epoch must see the order its saved
# position was counted in: another one puts other rows after the same count.
ORDER_VERSION = 2

# FlightInfo.app_metadata (JSON; plain Flight clients ignore it), where the request has no
# filter (a filter may leave the rows that tell out, and only its rows would tell):
# "null_counts", the table's nulls per requested column that has any; "list_lengths", the fewest
# and most values a row's list holds, per requested list column whose rows differ;
# "inner_list_lengths", for lists of lists where the lists at some level inside differ, the fewest
# and most values per level inside the outermost (null for a level that holds no list).
INFO_NULL_COUNTS = "null_counts"
INFO_LIST_LENGTHS = "list_lengths"
INFO_INNER_LIST_LENGTHS = "inner_list_lengths"
# Also, with or without a filter: "matching_rows", the rows all shards share out (the table's,
# or the filter's matches) before ``even`` drops or pads, 0 included. A reader whose shard got
# none of them under ``even`` knows that no shard did (they are all one size). And
# "snapshot_id", the Iceberg snapshot the cache holds (null for a table without one): with the
# matching rows, what a saved position was counted in (a resumed reader refuses other rows).
INFO_MATCHING_ROWS = "matching_rows"
INFO_SNAPSHOT_ID = "snapshot_id"


def info_null_counts(app_metadata: bytes) -> dict[str, int]:
    """The null counts a FlightInfo's app_metadata carries ({} from a cache that sends none)."""
    return _info_figures(app_metadata, INFO_NULL_COUNTS, int)


def info_list_lengths(app_metadata: bytes) -> dict[str, tuple[int, int]]:
    """The ragged list columns' ``(fewest, most)`` values a FlightInfo's app_metadata carries
    ({} from a cache that sends none)."""
    return _info_figures(app_metadata, INFO_LIST_LENGTHS, _bounds)


def info_inner_list_lengths(app_metadata: bytes) -> dict[str, list[tuple[int, int] | None]]:
    """The lists-of-lists columns whose inner lists differ in length, each level's ``(fewest,
    most)`` values or None, as a FlightInfo's app_metadata carries them ({} where it sends none)."""
    return _info_figures(app_metadata, INFO_INNER_LIST_LENGTHS, _level_bounds)


def info_matching_rows(app_metadata: bytes) -> int | None:
    """The rows all shards share out, as a FlightInfo's app_metadata carries them (None where it
    does not: a cache from before the figure; older caches also left it out when 0)."""
    value = _info_field(app_metadata, INFO_MATCHING_ROWS)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


class SnapshotRows(NamedTuple):
    """What a reader's rows are counted in: the snapshot the cache holds (None: a table without
    one) and the rows all shards share out."""

    snapshot_id: int | None
    matching_rows: int


def info_table(app_metadata: bytes) -> SnapshotRows | None:
    """The snapshot and matching rows a FlightInfo's app_metadata carries (None from a cache that
    does not say both)."""
    rows = info_matching_rows(app_metadata)
    snapshot = _info_field(app_metadata, INFO_SNAPSHOT_ID, default=False)  # null: a table without one
    if rows is None or not (snapshot is None or (isinstance(snapshot, int) and not isinstance(snapshot, bool))):
        return None
    return SnapshotRows(snapshot, rows)


def _info_field(app_metadata: bytes, key: str, default: Any = None) -> Any:
    try:
        figures = json.loads(app_metadata or b"{}")
    except ValueError:
        return default
    return figures.get(key, default) if isinstance(figures, dict) else default


def _level_bounds(value: Any) -> list[tuple[int, int] | None]:
    if not isinstance(value, list):
        raise TypeError("a list of levels")
    return [None if level is None else _bounds(level) for level in value]


def widen(seen: list[int] | None, low: int, high: int) -> list[int]:
    """The fewest and most values over ``seen`` (a ``[fewest, most]`` pair, None for none yet)
    and ``low``..``high``: how the figures of several batches or nodes add up."""
    return [low, high] if seen is None else [min(seen[0], low), max(seen[1], high)]


def _bounds(value: Any) -> tuple[int, int]:
    low, high = value  # a pair, nothing else
    return int(low), int(high)


def _info_figures(app_metadata: bytes, key: str, parse: Callable[[Any], Any]) -> dict[str, Any]:
    """The per-column figures under ``key`` of a FlightInfo's app_metadata, each value parsed;
    {} for metadata that is not JSON, not an object, or holds values ``parse`` refuses."""
    try:
        figures = json.loads(app_metadata or b"{}").get(key) or {}
        return {str(column): parse(value) for column, value in figures.items()}
    except (ValueError, TypeError, AttributeError):
        return {}


EVEN_MODES = ("drop", "pad")
DEFAULT_BLOCK_SIZE = 1024
DEFAULT_BATCH_SIZE = 65536
# seed and epoch are hashed as unsigned 64-bit integers (sharding._keys).
UINT64_MAX = 2**64 - 1
MAX_BATCH_SIZE = 1 << 22
# Planning a shuffled epoch computes the rows of each block a shard's ends cut (the head, per
# GetFlightInfo), and each stream orders at least two blocks at a time (~40 bytes a row while
# computed): blocks of 2**20 rows cost ~40 MiB a request, uncounted, and 64 ranks asking at
# once took a head to 1.1 GiB (40 streams took data nodes to 2.5x their limit). 2**16 keeps a
# request to a few MiB, and with at most 2**21 blocks still shuffles 2**37 rows.
MAX_BLOCK_SIZE = 1 << 16
# Readers are ranks x DataLoader workers: a million is far past any job, and keeps the head's
# per-shard arithmetic in plain ranges.
MAX_SHARDS = 1 << 20
# Row counts and positions in tickets: what numpy's int64 row arithmetic holds (a larger one
# overflowed deep in a stream, an INTERNAL error and a traceback for a malformed ticket).
MAX_ROWS = (1 << 63) - 1
# A projection names each column once; the cap keeps a request's checks cheap (a table of
# thousands of columns still fits).
MAX_COLUMNS = 1 << 14
# A filter is parsed, planned and evaluated by DataFusion on every data node, and its cost grows
# with its size, not with the rows: a chain of 512 additions took 1.5 s to plan here, 12,000 ORs
# overflowed the parser's stack and killed the node. Long IN lists stay cheap (10,000 values: 0.07 s).
# Keywords count as operators too: 1,500 postfix IS TRUE (no symbol, 12 KiB) overflowed the
# stack evaluating them and killed the node; a CASE of 600 WHEN arms took 10 s to plan, 1,000 arms
# held every node for 35 s, and each WHEN, IN or CAST is one more step. So does each subscript
# or slice, `[`: 8,000 `s['a']` (40 KB, no other operator) overflowed the parser's stack and
# killed every node, and planning 600 `l[1:2]` (3 KB) held every node's interpreter for 48 s
# (256: 2.5 s; 128: 0.26 s).
MAX_FILTER_CHARS = 1 << 16
MAX_FILTER_OPERATORS = 128
# Parentheses (a call's included) nested past this: at the parser's recursion limit (50), 50 nested
# CAST(...) made it backtrack for minutes on an 800-character filter.
MAX_FILTER_DEPTH = 32
# Characters that start none of quoted text, a comment or a $ (checked one by one above them).
_PLAIN = re.compile(r"[^'\"`$/-]+")
_OPERATOR = re.compile(
    r"\b(?:AND|OR|NOT|LIKE|ILIKE|SIMILAR|BETWEEN|IS|IN|CASE|WHEN|CAST|TRY_CAST)\b"
    r"|::|<=|>=|<>|!=|\|\||<<|>>|[-+*/%=<>&|^]",
    re.IGNORECASE,
)
# A subscript or slice: a `[` after a value (a name, a quoted name or text, a call's `)`, another
# subscript's `]`). A `[` elsewhere opens an array literal, a constant: 200 of them in an IN list
# plan at once, and counting them refused the list.
_SUBSCRIPT = re.compile(r"[\w)\]']\s*\[")

# A shard request, a ticket or an action's body past this is refused before it is parsed: the
# largest a client sends names 2**14 columns and a 64 KiB filter. Parsing six 256 MiB descriptors
# at once took a head from 140 MiB to 2.4 GiB (its default limit is 1 GiB) and held its
# interpreter for seconds. gRPC itself still takes in a message of any size before any of this
# code sees it (pyarrow sets no limit and offers none): docs/cache.md says what guards that.
MAX_REQUEST_BYTES = 16 << 20

# Actions served by the head and the data nodes (DoAction types).
ACTION_STATUS = "status"
ACTION_REGISTER = "register"  # data node -> head
ACTION_LOAD = "load"  # head -> data node
# In register, load and count bodies where DATA_CACHE_CLUSTER_KEY is set (security.load_cluster_key).
CLUSTER_KEY_FIELD = "cluster_key"
ACTION_COUNT = "count"  # head -> data node: rows matching a filter


def cluster_key_field(key: str | None) -> dict[str, str]:
    """What an internal action's body carries of the cluster key: the key, where one is set."""
    return {CLUSTER_KEY_FIELD: key} if key else {}


def check_request_size(size: int, what: str) -> None:
    _require(
        size <= MAX_REQUEST_BYTES,
        f"the {what} is {size} bytes, more than {MAX_REQUEST_BYTES}: a request names its columns (at most "
        f"{MAX_COLUMNS}) and one filter (at most {MAX_FILTER_CHARS} characters), and a ticket is the head's, unchanged",
    )


def check_filter(predicate: str) -> None:
    """Refuse a filter too large for the data nodes to plan in bounded time and memory."""
    _require(
        len(predicate) <= MAX_FILTER_CHARS,
        f"'filter' is {len(predicate)} characters, more than {MAX_FILTER_CHARS}: a filter is one predicate "
        "over a row's columns; for a long list of values, keep a column that marks the rows to read",
    )
    unquoted = _unquoted(predicate)
    operators = len(_OPERATOR.findall(unquoted)) + len(_SUBSCRIPT.findall(unquoted))
    _require(
        operators <= MAX_FILTER_OPERATORS,
        f"'filter' has {operators} operators (keywords such as IS, IN, WHEN and CAST count too, and each subscript [...]), more than "
        f'{MAX_FILTER_OPERATORS}: write a long chain of comparisons as one IN list ("id IN (1, 2, 3)"), or keep '
        "a column that marks the rows to read",
    )
    depth = _deepest_parentheses(unquoted)
    _require(
        depth <= MAX_FILTER_DEPTH,
        f"'filter' nests parentheses {depth} deep, more than {MAX_FILTER_DEPTH}: a filter over a row's "
        "columns needs a few levels; keep a column that marks the rows to read for anything deeper",
    )


def _deepest_parentheses(text: str) -> int:
    depth = deepest = 0
    for char in text:
        if char == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif char == ")":
            depth = max(0, depth - 1)
    return deepest


def _unquoted(predicate: str) -> str:
    """``predicate`` with its quoted text (data and names: "a-b", 'x+y') left out, as DataFusion's
    tokenizer reads it, for counting operators: '' in '...', backslash escapes in E'...', "..."
    and `...` names. What would make the two read it differently is refused: comments, which
    hid a chain of thousands of additions from the count inside /* ' */ ... /* ' */ (8.5 s to
    plan on every node), and $ (dollar-quoted text, placeholders)."""
    kept, i, n = [], 0, len(predicate)
    while i < n:
        c = predicate[i]
        if c in "'\"`":
            escapes = c == "'" and i > 0 and predicate[i - 1] in "eE" and not _word_char(predicate, i - 2)
            i = _end_of_quoted(predicate, i, escapes)
            kept.append("''")
            continue
        if predicate.startswith(("--", "/*"), i):
            raise BadRequestError("'filter' holds a comment (-- or /*): a filter is one predicate, without comments")
        if c == "$":
            raise BadRequestError("'filter' holds a $ (dollar-quoted text or a placeholder): quote text with '...'")
        plain = _PLAIN.match(predicate, i)  # a run of nothing the cases above look at, taken whole
        stop = plain.end() if plain else i + 1
        kept.append(predicate[i:stop])
        i = stop
    return "".join(kept)


def _word_char(text: str, i: int) -> bool:
    return i >= 0 and (text[i].isalnum() or text[i] == "_")


def _end_of_quoted(text: str, start: int, escapes: bool) -> int:
    """The index past the quoted text opening at ``start`` (its quote doubled inside, or, with
    ``escapes``, also escaped by a backslash); an unterminated one runs to the end (and fails
    DataFusion's parse)."""
    quote, i = text[start], start + 1
    while i < len(text):
        if escapes and text[i] == "\\":
            i += 2
        elif text[i] == quote:
            if text.startswith(quote * 2, i):
                i += 2
            else:
                return i + 1
        else:
            i += 1
    return len(text)


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise BadRequestError(message)


def int_arg(value: object) -> int | None:
    """An integer argument as an int (numpy integers included), or None for anything else."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _as_int(name: str, value: Any, minimum: int = 0, maximum: int | None = None) -> int:
    """``value`` as a Python int (numpy's integers too: a shard computed with numpy), checked."""
    number = int_arg(value)
    if number is None:
        raise BadRequestError(f"'{name}' should be an integer, got {shown(value)}")
    _require(number >= minimum, f"'{name}' should be >= {minimum}, got {shown(number)}")
    if maximum is not None:
        _require(number <= maximum, f"'{name}' should be <= {maximum}, got {shown(number)}")
    return number


@dataclass(frozen=True)
class ShardRequest:
    """What a client asks for: shard ``shard`` of ``num_shards`` of one epoch.

    ``even``: None keeps near-equal contiguous shards (sizes differ by at most one row);
    ``"drop"`` gives every shard ``rows // num_shards`` rows, ``"pad"`` gives every shard
    ``ceil(rows / num_shards)`` rows by wrapping around to the start of the (permuted) order.
    """

    shard: int = 0
    num_shards: int = 1
    epoch: int = 0
    seed: int = 0
    shuffle: bool = False
    columns: tuple[str, ...] | None = None
    filter: str | None = None
    batch_size: int = DEFAULT_BATCH_SIZE
    even: str | None = None
    block_size: int = DEFAULT_BLOCK_SIZE

    def __post_init__(self) -> None:
        for name, least, most in (
            ("num_shards", 1, MAX_SHARDS),
            ("shard", 0, None),
            ("epoch", 0, UINT64_MAX),
            ("seed", 0, UINT64_MAX),
            ("batch_size", 1, MAX_BATCH_SIZE),
            ("block_size", 1, MAX_BLOCK_SIZE),
        ):
            object.__setattr__(self, name, _as_int(name, getattr(self, name), least, most))
        _require(
            self.shard < self.num_shards,
            f"shard index {shown(self.shard)} is out of range: it must be in [0, {shown(self.num_shards)})",
        )
        _require(isinstance(self.shuffle, bool), f"'shuffle' should be true or false, got {shown(self.shuffle)}")
        _require(
            self.even is None or self.even in EVEN_MODES,
            f"'even' should be one of {EVEN_MODES} or null, got {shown(self.even)}",
        )
        if self.columns is not None:
            _require(
                isinstance(self.columns, (list, tuple)) and all(isinstance(c, str) for c in self.columns),
                f"'columns' should be a list of column names, got {shown(self.columns)}",
            )
            _require(len(self.columns) > 0, "'columns' should name at least one column (or be null for all of them)")
            _require(len(self.columns) <= MAX_COLUMNS, f"'columns' names more than {MAX_COLUMNS} columns")
            twice = sorted(c for c, n in Counter(self.columns).items() if n > 1)
            _require(not twice, f"'columns' names {shown(twice)} more than once")
            object.__setattr__(self, "columns", tuple(self.columns))
        _require(
            self.filter is None or (isinstance(self.filter, str) and self.filter.strip() != ""),
            f"'filter' should be a non-empty SQL predicate string, got {shown(self.filter)}",
        )
        if self.filter is not None:
            check_filter(self.filter)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["columns"] = list(self.columns) if self.columns is not None else None
        return out

    def to_json(self) -> bytes:
        return json.dumps(self.to_dict(), sort_keys=True).encode()

    @classmethod
    def from_dict(cls, data: Any) -> ShardRequest:
        _require(isinstance(data, dict), f"a shard request should be a JSON object, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        _require(not unknown, f"unknown shard request field(s) {shown(unknown)}; known fields: {sorted(known)}")
        return cls(**data)

    @classmethod
    def from_json(cls, raw: bytes) -> ShardRequest:
        return cls.from_dict(_loads(raw, "shard request"))

    @classmethod
    def from_path(cls, path: list[bytes] | list[str]) -> ShardRequest:
        """The upstream form: a PATH descriptor ``[index, total]``."""
        parts = [p.decode() if isinstance(p, bytes) else p for p in path]
        _require(
            len(parts) == 2,
            f"a path descriptor should be [shard_index, shard_count], got {len(parts)} element(s) {parts}",
        )
        # Plain decimal digits only (int() would also take " 1", "1_0" or "+1"), and few enough
        # of them for int() to convert: anything longer is out of range anyway.
        if not all(p.isascii() and p.isdigit() and len(p) <= 100 for p in parts):
            shown = [p if len(p) <= 30 else f"{p[:30]}... ({len(p)} characters)" for p in parts]
            raise BadRequestError(
                f"a path descriptor should hold two decimal integers [shard_index, shard_count], got {shown}"
            )
        return cls(shard=int(parts[0]), num_shards=int(parts[1]))


@dataclass(frozen=True)
class Ticket:
    """A data node's part of one shard.

    ``offset`` and ``total`` place this node's rows in the (possibly filtered) virtual row space
    of ``total`` rows; ``node_rows`` is how many of them this node holds, checked on arrival so a
    stale ticket (node reloaded, other filter result) fails instead of serving wrong rows.

    ``rows`` is how many rows the endpoint's stream holds; ``skip`` makes the node leave out
    that many from its start (a client resuming mid-shard, or reopening a broken stream, so the
    rows it has are not sent again). A head that issues no ``rows`` has nodes that do not skip:
    its clients drop what they have as it arrives. A ticket with a skip is version
    SKIP_VERSION; clients add the skip to the head's ticket bytes (``with_skip``), so fields a
    newer head adds pass through unchanged.
    """

    generation: str
    node: int
    offset: int
    node_rows: int
    total: int
    request: ShardRequest
    rows: int | None = None
    skip: int = 0
    order: int | None = None  # ORDER_VERSION, on shuffled tickets

    def __post_init__(self) -> None:
        _as_int("skip", self.skip, 0, MAX_ROWS)
        _require(
            self.offset + self.node_rows <= self.total,
            f"the ticket places {self.node_rows} rows at {self.offset}, past its {self.total} rows",
        )
        if self.order is not None:
            _as_int("order", self.order)
            _require(
                self.order == ORDER_VERSION,
                f"the ticket's shuffled order {self.order} is not the one this node streams ({ORDER_VERSION}): "
                "the head and data nodes should run the same version",
            )
        if self.rows is not None:
            _as_int("rows", self.rows, 0, MAX_ROWS)
            _require(self.skip <= self.rows, f"'skip' ({self.skip}) is past the stream's {self.rows} rows")
        else:
            _require(self.skip == 0, "'skip' needs 'rows': this ticket's head does not serve skips")

    def to_json(self, key: str | None = None) -> bytes:
        """The ticket's JSON; signed (``sig``) with ``key``, the cluster key, where one is given."""
        body: dict[str, Any] = {
            "v": SKIP_VERSION if self.skip else PROTOCOL_VERSION,
            "generation": self.generation,
            "node": self.node,
            "offset": self.offset,
            "node_rows": self.node_rows,
            "total": self.total,
            "request": self.request.to_dict(),
        }
        if self.rows is not None:
            body.update(rows=self.rows, skip=self.skip)
        if self.order is not None:
            body["order"] = self.order
        if key is not None:
            body[TICKET_SIGNATURE_FIELD] = ticket_signature(body, key)
        return json.dumps(body, sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> Ticket:
        """Parse a ticket (its signature is check_ticket_signature's to check)."""
        data = _loads(raw, "ticket")
        _require(isinstance(data, dict), "a ticket should be a JSON object")
        version = data.get("v")
        _require(
            type(version) is int and version in (PROTOCOL_VERSION, SKIP_VERSION),  # not 1.0 or true
            f"ticket protocol version {shown(version)} is not supported (this node speaks "
            f"{PROTOCOL_VERSION} and {SKIP_VERSION})",
        )
        skip = data.get("skip", 0)
        _require(not skip or version == SKIP_VERSION, f"a ticket with a skip should be version {SKIP_VERSION}")
        try:
            return cls(
                generation=str(data["generation"]),
                node=_as_int("node", data["node"], 0, MAX_ROWS),
                offset=_as_int("offset", data["offset"], 0, MAX_ROWS),
                node_rows=_as_int("node_rows", data["node_rows"], 0, MAX_ROWS),
                total=_as_int("total", data["total"], 0, MAX_ROWS),
                request=ShardRequest.from_dict(data["request"]),
                rows=data.get("rows"),
                skip=skip,
                order=data.get("order"),
            )
        except KeyError as missing:
            raise BadRequestError(f"malformed ticket: missing field {missing}") from None


# A ticket's signature: HMAC-SHA256, under the cluster key (DATA_CACHE_CLUSTER_KEY), of every
# field but the ones a client may change (its skip, and the version that says it skips), which
# the node checks against its own counts. Where head and nodes have a key, a node serves only
# the tickets its head wrote: a reader cannot make one up, to have a node evaluate a predicate
# the head never checked, or stream rows under numbers the head never gave.
TICKET_SIGNATURE_FIELD = "sig"
_UNSIGNED_TICKET_FIELDS = frozenset({"v", "skip", TICKET_SIGNATURE_FIELD})
_TICKET_SIGNATURE_CONTEXT = b"kubeflow-data-cache ticket\n"


def ticket_signature(body: dict[str, Any], key: str) -> str:
    """The signature of a ticket's JSON object ``body`` (parsed, or as the head builds it)."""
    signed = {name: value for name, value in body.items() if name not in _UNSIGNED_TICKET_FIELDS}
    message = json.dumps(signed, sort_keys=True, separators=(",", ":")).encode()
    return hmac.new(key.encode(), _TICKET_SIGNATURE_CONTEXT + message, hashlib.sha256).hexdigest()


def check_ticket_signature(raw: bytes, key: str | None) -> None:
    """Refuse a ticket (``raw``, one Ticket.from_json parsed) whose signature is missing or
    wrong, where the node has a key."""
    if key is None:
        return
    body = json.loads(raw)
    given = body.get(TICKET_SIGNATURE_FIELD)
    if not isinstance(given, str) or not hmac.compare_digest(
        given.encode("utf-8", "surrogatepass"), ticket_signature(body, key).encode()
    ):
        raise UnsignedTicketError(
            "the ticket is not signed by this cache's head: tickets come from the head's GetFlightInfo, "
            "unchanged but for their skip (a head and data nodes of different versions, or with different "
            "DATA_CACHE_CLUSTER_KEY values, also give this)"
        )


def _ticket_count(raw: bytes, name: str) -> int | None:
    """Field ``name`` of a head's ticket as a count (an int >= 0), or None where the ticket does
    not hold one (an older cache, or a ticket this client cannot read)."""
    try:
        value = json.loads(raw).get(name)
    except (ValueError, RecursionError, AttributeError):  # as _loads, and JSON that is not an object
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def ticket_rows(raw: bytes) -> int | None:
    """The rows a head's ticket says its stream holds; None where it does not say (an older
    cache, or a ticket this client cannot read: then it is passed on as it is)."""
    return _ticket_count(raw, "rows")


def ticket_order(raw: bytes) -> int:
    """The shuffled order a head's ticket says its node streams (ORDER_VERSION); 1 where it says
    nothing (a cache from before the versions, or a ticket this client cannot read)."""
    order = _ticket_count(raw, "order")
    return 1 if order is None else order


def with_skip(raw: bytes, skip: int) -> bytes:
    """The head's ticket for the stream without its first ``skip`` rows; every other field as
    the head wrote it."""
    if not skip:
        return raw
    body = json.loads(raw)
    version = body.get("v")
    # At least the version that skips; a newer head's own version stays.
    body.update(v=version if isinstance(version, int) and version > SKIP_VERSION else SKIP_VERSION, skip=skip)
    return json.dumps(body, sort_keys=True).encode()


def _loads(raw: bytes, what: str) -> Any:
    check_request_size(len(raw), what)
    try:
        return json.loads(raw)
    # ValueError: an integer of more digits than Python converts; RecursionError: deep nesting.
    except (ValueError, RecursionError) as err:
        raise BadRequestError(f"malformed {what}: not valid JSON ({first_line(err)})") from None
