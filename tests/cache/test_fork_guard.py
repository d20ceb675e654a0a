"""fork_guard on its own: a fork in a process that never opened a cache client is left alone.

The fork cases with a real cache (a read in the main process, then forked DataLoader workers)
are in tests/dataset/test_dataset_connection.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from tests.fake_grpcio import START_GRPC_LIKE_THREAD

# A thread named like one of gRPC's (as grpcio's are) in a process that never opened a cache
# client: the fork must neither wait for it nor mark the child as unable to use the cache.
SCRIPT = (
    START_GRPC_LIKE_THREAD
    + """
import json, os
from kubeflow_data_cache import fork_guard

seen = fork_guard.grpc_threads()
read, write = os.pipe()
pid = os.fork()
if pid == 0:
    try:
        fork_guard.check_usable()
        verdict = "usable"
    except Exception as err:
        verdict = f"{type(err).__name__}: {err}"
    os.write(write, verdict.encode())
    os._exit(0)
os.close(write)
os.waitpid(pid, 0)
print(json.dumps({"seen": seen, "child": os.read(read, 4096).decode()}))
"""
)


def test_fork_without_a_cache_client_ignores_other_grpc_threads():
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(SCRIPT)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["seen"] == ["grpc_global_tim"]  # the thread does look like gRPC's
    assert got["child"] == "usable", got["child"]
