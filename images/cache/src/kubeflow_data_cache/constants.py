"""Ports, timeouts and reserved names, in one place."""

FLIGHT_PORT = 50051
HEALTH_PORT = 8080
# The Service the initializer makes for a TrainJob's cache: {TRAIN_JOB_NAME}-cache-service.
JOB_CACHE_SERVICE_SUFFIX = "-cache-service"

# Columns the cache adds while filtering; table columns may not start with this.
INTERNAL_COLUMN_PREFIX = "__dc_"

# How long nodes wait for each other and for the load before giving up.
STARTUP_TIMEOUT_SECONDS = 600.0
# Data nodes re-register this often, so a restarted head finds them again.
REGISTER_INTERVAL_SECONDS = 5.0
# A data node that cannot reach its head says so in its log once it has failed for this long
# (a head still starting is not worth a warning), then every REGISTER_WARN_EVERY_SECONDS: on
# Kubernetes a probe's /ready body is not in any log or event, and the deadline is minutes away.
REGISTER_WARN_AFTER_SECONDS = 5.0
REGISTER_WARN_EVERY_SECONDS = 30.0
# How often the head polls data nodes while they load, and afterwards.
LOAD_POLL_SECONDS = 0.05
SUPERVISE_POLL_SECONDS = 5.0
# Timeout of one internal Flight call between head and data nodes.
RPC_TIMEOUT_SECONDS = 10.0
# Data nodes one head may have: far past any cluster, and small enough that the head's
# per-node bookkeeping (and the memory advice's search) stays cheap.
MAX_DATA_NODES = 1 << 14
# How long the head waits for the data node registered under an index before it lets another
# take that index (a node that moved answers nothing at its old address).
REGISTER_PROBE_SECONDS = 3.0
# The head's `count` call (a new filter's matches on one node): one pass of DataFusion over the
# node's rows, seconds on a large node. Under the readers' own 30 s call limit, so a slow count
# answers UNAVAILABLE (retry) rather than the reader timing out; the node goes on counting and
# the retry waits for that same count (filtering.FilterCache).
COUNT_TIMEOUT_SECONDS = 25.0
# How long the head keeps sending `load` to a data node that registered but does not answer at
# its location, following it if it registers again elsewhere (a node that crashed after
# registering, and its replacement); then the load fails, pointing at its advertised address.
LOAD_UNREACHABLE_SECONDS = 30.0
# After a failed load a node keeps answering /ready and /status with the reason this long
# (so the initializer and `kubectl logs` can read it), then exits non-zero.
FAILURE_GRACE_SECONDS = 30.0
TERMINATION_LOG = "/dev/termination-log"
# On SIGTERM, how long open DoGet streams may keep a node from exiting (Kubernetes' default grace
# period is 30 s; a reader that stopped reading would otherwise hold the node for ever).
SHUTDOWN_GRACE_SECONDS = 10.0

# What the interpreter, pyarrow and pyiceberg take before any data is loaded.
BASELINE_MEMORY_BYTES = 400 << 20
# A data node merges its rows into as few chunks as possible (one gather per chunk is what makes
# shuffled reads fast); a chunk's variable-width columns (strings, lists) stay under this many
# bytes each, far from the 2 GiB their 32-bit offsets allow.
STORE_CHUNK_VARIABLE_BYTES = 1 << 30
# A data node's load decodes whole files while their scratch fits beside its rows within this share
# of them, and column groups of at least READ_GROUP_MIN_BYTES estimated bytes beyond (decode_budget).
READ_SCRATCH_SHARE = 0.12
READ_GROUP_MIN_BYTES = 4 << 20
# The same from an object store (s3://, s3a://): each group's reopening is a few requests there.
READ_GROUP_MIN_REMOTE_BYTES = 32 << 20
# A data node's reads of large row groups (parquet_batches): about how many decoded bytes one
# batch holds (small beside a node's memory, large enough that a batch's fixed costs stay a
# small share of its decode), and at most how many rows (pyarrow's scanner's batch size, the
# most pyiceberg yielded at once before).
BATCH_TARGET_BYTES = 16 << 20
MAX_BATCH_ROWS = 131_072
# ... and past how many times that target a batch decoded has the next one sized down: the most
# one batch holds, but for its first rows.
RESIZE_FACTOR = 2
# A file is read batch by batch where a row group of it holds more than this many rows, or more
# than this many uncompressed bytes of the columns read; else by the scanner. pyarrow's file
# reader holds some MiB per column beside what it yields (a 250,000-row file of the sample table:
# 44 MiB at its peak, against the scanner's 30), so it pays only where the scanner would decode
# more than a couple of batches at once.
BATCHWISE_MIN_GROUP_ROWS = 2 * MAX_BATCH_ROWS
BATCHWISE_MIN_GROUP_BYTES = 2 * BATCH_TARGET_BYTES
# Filters whose per-node match counts the head keeps (least recently used dropped): a few per
# job; the bound keeps clients that send ever-new predicates from growing the head for ever.
CACHED_FILTER_COUNTS = 256
# A data node keeps each cached filter's matching rows (8 bytes a match) within this share
# of its own rows' bytes, outside the memory check (filtering.FilterCache).
FILTER_CACHE_SHARE = 0.125
FILTER_CACHE_MIN_BYTES = 16 << 20
# Shuffled or filtered DoGet: batches gathered ahead of the one being sent, the one being
# gathered included, as many as GATHER_AHEAD_BYTES holds (at most READAHEAD_BATCHES): a 3-column
# batch of 64K rows (1 MiB) is gathered 2 ahead; an all-column one of the benchmarks' table
# (3.6 MiB) when Flight asks for it, so its node holds one such batch at a time, not three.
# Gathering ran slower than sending here, so a queue ahead was mostly empty and these bounds
# changed no read's time in paired runs, but each batch in it is resident on the node (the peak
# of a 2-node, 2M-row cache while serving fell by ~6-7 MiB a node; docs/cache.md).
READAHEAD_BATCHES = 4
GATHER_AHEAD_BYTES = 2 << 20
# A served batch holds the request's batch_size rows, but no more than this many bytes of the
# requested columns: a gathering stream holds a few batches at a time, so with wide rows (a
# 2 KiB embedding) and many concurrent readers, row-counted batches alone would let serving
# memory grow far past what the memory check keeps aside (BASELINE_MEMORY_BYTES).
SERVED_BATCH_MAX_BYTES = 4 << 20
# An in-order DoGet hands Flight's C++ writer its zero-copy slices in windows of about this many
# bytes (rows of the average size; at least one batch): Python runs, and counts rows served, once
# per window. Per batch, a Python generator cost ~65 us of GIL hand-over here, 10% of a
# fixed-width stream; a reader that stops early is counted at most one window past what it was sent.
SERVE_WINDOW_BYTES = 16 << 20
# ... and of at most this many batches: a window of one-row batches (a client's batch_size=1) held
# each slice's own buffers, rebased offsets and batch overhead, several KiB a row, so a window of
# "16 MiB" of rows took hundreds of MiB, uncounted (4 such streams: 1.1 GiB on a 218 MiB node).
SERVE_WINDOW_BATCHES = 256

# The largest decoded-per-compressed ratio a load order's ``expansions`` may hold, and a head
# sends: past what any codec reaches (zstd's runs of one byte, ~32,000x), far below what would
# overflow an estimate.
MAX_EXPANSION = 1e6
