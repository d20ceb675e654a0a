"""Which install extra a part of the package needs, checked before it starts.

The base install is the training-side client, so a trainer image does not carry the server's
libraries. The server imports some of them only when a request needs them (DataFusion at the
first filter, pyiceberg at the load): without this check a cache started from a client-only
install would fail minutes in, or only for some requests.
"""

from __future__ import annotations

import importlib.util

from kubeflow_data_cache.errors import ConfigError

# The `server` extra of images/cache/pyproject.toml, as the modules it provides.
SERVER_MODULES = ("pyiceberg", "datafusion", "prometheus_client")
# The package is installed from a checkout (it is on no index): the command says so.
SERVER_INSTALL = 'pip install "./images/cache[server]" (from a checkout of this repository)'


def missing_server_modules() -> list[str]:
    """The server extra's modules this interpreter cannot import (found, not imported)."""
    return [name for name in SERVER_MODULES if importlib.util.find_spec(name) is None]


def require_server(command: str) -> None:
    """Refuse to run ``data-cache COMMAND`` in an install without the server extra."""
    missing = missing_server_modules()
    if missing:
        raise ConfigError(
            f"`data-cache {command}` runs the cache server, which needs the `server` extra; this install "
            f"lacks {', '.join(missing)}: {SERVER_INSTALL} (the cache image has it; the base install is "
            "the training-side client only)"
        )
