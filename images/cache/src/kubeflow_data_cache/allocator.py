"""Which Arrow memory pools a cache process uses, and why.

Two jobs with opposite needs:

- Loading decodes Parquet through pyarrow's default pool, which also holds the rows for good.
  Decode scratch is freed when the load ends; pyarrow's default allocator (mimalloc) keeps those
  pages resident, which measured as ~0.4x of the node's Arrow bytes of dead weight. jemalloc
  with both decay times at 0 hands freed pages straight back to the OS, so a loaded node holds
  its rows plus the interpreter and little else.
- Serving gathers (shuffled or filtered reads) allocate and free one output batch at a time.
  There, returning pages at once would fault them in again on every batch, so gathers use a
  separate pool that keeps its few in-flight buffers (mimalloc).

Arrow reads ``ARROW_DEFAULT_MEMORY_POOL`` and jemalloc its ``JE_ARROW_MALLOC_CONF`` once, when
first used, so the data node's choice is made in ``data-cache worker`` before pyarrow loads.
Values already set in the environment win, so an operator can still pick another pool.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import MutableMapping

log = logging.getLogger(__name__)

DATA_NODE_POOL = "jemalloc"
# Freed pages go back to the OS at once instead of after a decay period.
DATA_NODE_JEMALLOC_CONF = "dirty_decay_ms:0,muzzy_decay_ms:0"


def configure_data_node(environ: MutableMapping[str, str] | None = None) -> bool:
    """Pick the data node's load pool. Returns False when pyarrow is already loaded (too late)."""
    environ = os.environ if environ is None else environ
    if "pyarrow" in sys.modules:
        log.debug("pyarrow already imported; keeping its memory pool")
        return False
    environ.setdefault("ARROW_DEFAULT_MEMORY_POOL", DATA_NODE_POOL)
    environ.setdefault("JE_ARROW_MALLOC_CONF", DATA_NODE_JEMALLOC_CONF)
    return True


@functools.cache
def serve_pool():
    """The pool for per-request gathers: mimalloc where this pyarrow build has it."""
    import pyarrow as pa

    try:
        return pa.mimalloc_memory_pool()
    except NotImplementedError:
        return pa.default_memory_pool()
