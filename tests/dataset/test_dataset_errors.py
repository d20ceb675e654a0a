"""What a user sees when the endpoint, the token or a request is wrong."""

from __future__ import annotations

import time

import pytest

from kubeflow_data_cache.client import CacheClient
from kubeflow_data_cache.dataset import DataCacheDataset
from kubeflow_data_cache.errors import BadRequestError, CacheAuthError, CacheUnavailableError
from tests.conftest import free_port

TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def secured(cache_factory):
    return cache_factory(300, 1, 1, token=TOKEN)


def test_wrong_endpoint_fails_at_the_first_batch_naming_the_setting():
    endpoint = f"grpc://127.0.0.1:{free_port()}"
    ds = DataCacheDataset(endpoint, deadline_seconds=1.0)
    it = iter(ds)  # nothing is contacted before the first batch
    with pytest.raises(CacheUnavailableError) as err:
        next(it)
    message = str(err.value)
    assert endpoint in message and "set DATA_CACHE_ENDPOINT" in message and "Connection refused" in message


def test_retries_last_until_the_deadline_itself():
    """A node that is down is retried for deadline_seconds, the last try at the deadline: not
    given up one backoff step early (which at 3 s meant after about 1.5 s)."""
    endpoint = f"grpc://127.0.0.1:{free_port()}"
    client = CacheClient(endpoint, deadline_seconds=3.0)
    started = time.monotonic()
    with pytest.raises(CacheUnavailableError, match=r"within 3s"):
        client.status()
    assert 3.0 <= time.monotonic() - started < 30


def test_a_call_retried_for_long_says_so_at_warning_level(monkeypatch, caplog):
    """Retries are INFO; a wrong endpoint must not wait out its deadline in silence where
    logging is not set up (Python then shows WARNING and above)."""
    import logging

    from kubeflow_data_cache import client as client_module

    monkeypatch.setattr(client_module, "RETRY_WARN_AFTER_SECONDS", 0.5)
    monkeypatch.setattr(client_module, "RETRY_WARN_EVERY_SECONDS", 1.0)
    endpoint = f"grpc://127.0.0.1:{free_port()}"
    with caplog.at_level(logging.WARNING, logger="kubeflow_data_cache.client"):
        started = time.time()  # the clock of LogRecord.created
        with pytest.raises(CacheUnavailableError):
            next(iter(DataCacheDataset(endpoint, deadline_seconds=2.6)))
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "still retrying" in r.getMessage()]
    # Tries at ~0, 0.05, 0.15, 0.35, 0.75, 1.55 s, then at the deadline: one WARNING past 0.5 s,
    # the next due 1 s later (at most one more before the deadline), none at the first failures.
    assert 1 <= len(warnings) <= 2, [r.getMessage() for r in warnings]
    first = warnings[0].getMessage()
    assert f"GetFlightInfo at {endpoint} has failed for " in first and "giving up in 2s" in first, first
    assert warnings[0].created - started >= 0.5 - 0.05


def test_missing_or_wrong_token_is_refused_with_the_fix(secured, monkeypatch):
    for name in ("DATA_CACHE_TOKEN", "DATA_CACHE_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(CacheAuthError, match="refused the token.*no token was sent.*set DATA_CACHE_TOKEN") as refused:
        next(iter(DataCacheDataset(secured.endpoint)))
    assert str(refused.value).count("DATA_CACHE_TOKEN_FILE") == 1, str(refused.value)  # the fix, said once
    with pytest.raises(CacheAuthError, match="refused the token.*the token was rejected.*DATA_CACHE_TOKEN_FILE"):
        next(iter(DataCacheDataset(secured.endpoint, token="guess")))
    monkeypatch.setenv("DATA_CACHE_TOKEN", TOKEN)
    ids = [i for b in DataCacheDataset(secured.endpoint, columns=["id"]) for i in b["id"].tolist()]
    assert sorted(ids) == list(range(300))
    # The token travels on every call, the status action included.
    assert CacheClient(secured.endpoint, token=TOKEN).status()["state"] == "ready"
    with pytest.raises(CacheAuthError):
        CacheClient(secured.endpoint, token="guess").status()


def test_bad_request_names_the_problem(small_cache):
    cache = small_cache
    with pytest.raises(BadRequestError, match="no_such_column"):
        next(iter(DataCacheDataset(cache.endpoint, columns=["id", "no_such_column"])))


def test_a_data_nodes_address_given_for_the_heads_is_named_as_such(small_cache):
    """Not a raw ArrowNotImplementedError with a server traceback in it."""
    with CacheClient(small_cache.endpoint) as client:
        node = client.status()["nodes"][0]["location"]
    with pytest.raises(BadRequestError, match=rf"GetFlightInfo is not served by {node}: .*goes to the head") as err:
        next(iter(DataCacheDataset(node)))
    assert "Traceback" not in str(err.value)


def test_a_conversion_error_kept_by_the_caller_leaves_no_stream_open(cache_factory):
    """The error a training loop (or a notebook, as its last exception) keeps holds the reading
    frames: the streams are closed as the error leaves the dataset, not when it is dropped."""
    import gc
    import threading

    class FailingDataset(DataCacheDataset):
        calls = 0

        def from_arrow_rb_to_tensor(self, batch):
            FailingDataset.calls += 1
            if FailingDataset.calls == 2:
                raise ValueError("the tokenizer failed on a bad row")
            return super().from_arrow_rb_to_tensor(batch)

    cache = cache_factory(400_000, 4)
    ds = FailingDataset(cache.endpoint, batch_size=64, shuffle=True, block_size=16)
    kept = None
    try:
        for _ in ds:
            pass
    except ValueError as err:
        kept = err
    assert kept is not None
    gc.collect()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and [t for t in threading.enumerate() if t.name.startswith("cache-stream")]:
        time.sleep(0.1)
    assert [t.name for t in threading.enumerate() if t.name.startswith("cache-stream")] == []
    assert kept.__traceback__ is not None  # still held: the streams ended without its release
