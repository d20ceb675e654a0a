"""Python source that starts a thread named like grpcio's timer thread, for scripts run in a
subprocess: grpcio (Ray, Google Cloud clients) names its threads as Arrow's bundled gRPC does and
never ends them, which is what fork_guard must not mistake for Arrow's gRPC winding down."""

START_GRPC_LIKE_THREAD = """
import ctypes, threading

_named = threading.Event()

def _grpc_like():
    ctypes.CDLL(None).prctl(15, b"grpc_global_tim", 0, 0, 0)  # PR_SET_NAME
    _named.set()
    threading.Event().wait(120)

threading.Thread(target=_grpc_like, daemon=True).start()
_named.wait(10)
"""
