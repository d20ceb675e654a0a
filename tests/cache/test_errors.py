"""The message helpers keep what a server said and drop what pyarrow and gRPC append to it."""

from __future__ import annotations

import time

import pyarrow as pa
import pyarrow.flight as flight
import pytest

from kubeflow_data_cache.errors import (
    MAX_ERROR_BYTES,
    bounded_message,
    first_line,
    grpc_message_bytes,
    server_message,
    shown,
)


class _Failing(flight.FlightServerBase):
    """A Flight server whose DoAction raises what the action's body names."""

    def do_action(self, context, action):
        text = action.body.to_pybytes().decode()
        if action.type == "value":
            raise ValueError(text)
        raise flight.FlightUnavailableError(text)


@pytest.fixture(scope="module")
def failing_client():
    server = _Failing("grpc://127.0.0.1:0")
    client = flight.FlightClient(f"grpc://127.0.0.1:{server.port}")
    yield client
    client.close()
    server.shutdown()


def _raised(client, kind: str, text: str) -> Exception:
    # A ValueError in a handler reaches the client as ArrowInvalid, a Flight error as itself.
    with pytest.raises((flight.FlightError, pa.ArrowInvalid)) as caught:
        list(client.do_action(flight.Action(kind, text.encode())))
    return caught.value


def test_a_handlers_traceback_and_grpc_context_are_dropped(failing_client):
    err = _raised(failing_client, "value", "column 'x' does not exist")
    # What pyarrow hands the client carries the handler's traceback and gRPC's debug context.
    assert "Traceback" in str(err)
    assert server_message(err) == "column 'x' does not exist"
    assert first_line(err) == "column 'x' does not exist"


def test_a_multi_line_message_is_kept_whole_or_cut_to_its_first_line(failing_client):
    err = _raised(failing_client, "unavailable", "node 1 is loading\nrows 10 of 20")
    assert server_message(err) == "node 1 is loading\nrows 10 of 20"
    assert first_line(err) == "node 1 is loading"


def test_an_empty_message_names_the_error_type():
    assert first_line(ValueError("  ")) == "ValueError"
    assert server_message(ValueError("  ")) == ""


def test_grpc_client_debug_context_is_dropped():
    err = flight.FlightUnavailableError('node 2 is down. gRPC client debug context: UNKNOWN:{"created_time": "..."}')
    assert server_message(err) == "node 2 is down"


def test_a_long_message_keeps_its_start_and_its_end_within_the_limit():
    """A message past what gRPC's trailers carry keeps what failed (its start) and the fix (its end)."""
    message = "invalid filter 'id IN (" + "1, " * 5000 + "...)': No field named lable. Name a column of the table"
    bounded = bounded_message(message)
    assert len(bounded) <= MAX_ERROR_BYTES
    assert bounded.startswith("invalid filter 'id IN (1, 1, ")
    assert bounded.endswith("No field named lable. Name a column of the table")
    assert f"[... {len(message) - MAX_ERROR_BYTES + 60} characters left out ...]" in bounded
    assert bounded_message("short") == "short"
    assert shown("x" * 10) == "'xxxxxxxxxx'"
    assert shown("x" * 500) == "'" + "x" * 199 + f"... ({len('x' * 500) + 2} characters)"


def test_a_long_message_reaches_a_flight_client_with_its_reason(failing_client):
    """Past 16 KiB of trailers the client got "Stream removed", not the message."""
    err = _raised(failing_client, "value", bounded_message("no such column: " + "c" * 30_000 + " (see docs)"))
    assert server_message(err).endswith("(see docs)")


@pytest.mark.parametrize("name", ["列名称甲", "é", "%", "\n"])
def test_a_message_is_bounded_by_the_bytes_grpc_sends_not_its_characters(failing_client, name):
    """gRPC percent-encodes what is not printable ASCII, three bytes for each byte of it: 600
    column names in CJK, listed in a refusal, took 19,602 bytes and the client got "Stream
    removed" instead of the reason."""
    message = "unknown column(s) ['x']; the table has " + str([f"{name}{i}" for i in range(3000)]) + " (the fix)"
    bounded = bounded_message(message)
    assert grpc_message_bytes(bounded) <= MAX_ERROR_BYTES
    assert bounded.startswith("unknown column(s) ['x']; the table has [") and bounded.endswith(" (the fix)")
    err = _raised(failing_client, "value", bounded)
    assert server_message(err) == bounded


def test_client_statuses_are_formatted_without_a_traceback_and_other_errors_as_before():
    """pyarrow formats a handler's exception with traceback.format_exception for the status it
    sends; the cache's refusals of a client's mistakes lose their frames there, nothing else does
    (logs of real failures keep theirs)."""
    import traceback

    from kubeflow_data_cache.client_statuses import InvalidArgument, Unimplemented, install

    install()

    def raised(err: Exception) -> Exception:
        try:
            raise err
        except Exception as caught:
            return caught

    for err in (raised(InvalidArgument("bad shard")), raised(Unimplemented("no DoPut"))):
        assert traceback.format_exception(type(err), err, err.__traceback__) == [type(err).__name__]
        assert traceback.format_exception(err) == [type(err).__name__]
    other = raised(ValueError("a bug"))
    # Where both are given, the value is what Python formats, whatever the first argument is.
    mixed = traceback.format_exception(raised(InvalidArgument("x")), other, other.__traceback__)
    assert "ValueError: a bug" in "".join(mixed) and "Traceback" in "".join(mixed)
    formatted = "".join(traceback.format_exception(type(other), other, other.__traceback__))
    assert formatted.startswith("Traceback (most recent call last):") and "ValueError: a bug" in formatted
    assert "test_errors.py" in "".join(traceback.format_exception(other))
    # INVALID_ARGUMENT and UNIMPLEMENTED as before: pyarrow maps ValueError and NotImplementedError.
    assert isinstance(InvalidArgument("x"), pa.ArrowInvalid) and isinstance(Unimplemented("x"), NotImplementedError)


class _LateAnswer(flight.FlightServerBase):
    """Its call waits past the caller's deadline, then reaches a handler wrapped as the cache's are."""

    def __init__(self, location: str):
        super().__init__(location)
        from kubeflow_data_cache.service import Metrics, flight_errors

        self.metrics = Metrics("head")
        self.ran: list[str] = []
        self.raised: list[BaseException] = []
        self.answer = flight_errors(self.metrics, "GetFlightInfo")(lambda context: self.ran.append("answered"))

    def do_action(self, context, action):
        time.sleep(0.5)  # a call that waited for a thread, or for the GIL, past its deadline
        try:
            self.answer(context)
        except BaseException as err:
            self.raised.append(err)
        return []


def test_a_call_whose_caller_left_is_not_answered():
    """A storm of calls with 2 ms deadlines: each was answered all the same, for no one, and
    gRPC kept adding threads for the work (3,600 on a head) until its probes timed out."""
    server = _LateAnswer("grpc://127.0.0.1:0")
    client = flight.FlightClient(f"grpc://127.0.0.1:{server.port}")
    try:
        with pytest.raises(flight.FlightTimedOutError):
            list(client.do_action(flight.Action("x", b""), flight.FlightCallOptions(timeout=0.1)))
        deadline = time.monotonic() + 5
        while not server.raised and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.ran == []
        assert [type(err) for err in server.raised] == [flight.FlightCancelledError]
        labels = {"method": "GetFlightInfo", "action": "", "code": "CANCELLED"}
        assert server.metrics.registry.get_sample_value("data_cache_errors_total", labels) == 1
        # A caller still waiting is answered.
        assert list(client.do_action(flight.Action("x", b""))) == [] and server.ran == ["answered"]
    finally:
        client.close()
        server.shutdown()
