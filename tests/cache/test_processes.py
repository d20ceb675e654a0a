"""stop_processes: real child processes, stopped politely when they listen, by force when not."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from kubeflow_data_cache.processes import exit_status, stop_processes
from tests.freeze import freeze

# A child that prints "ready", then sleeps; with "ignore" it ignores SIGTERM; with "spawn" it
# first starts a grandchild in its group (printing its pid) that does not exit on SIGTERM but
# notes it, and each SIGWINCH, in the file $TERM_LOG (when set). The grandchild blocks both and
# takes them one at a time with sigwaitinfo, which dequeues the lowest pending signal first: a
# Python handler can be entered again by the next signal before it has written its note (the
# WINCH was once noted before a TERM that had arrived first).
GRANDCHILD = """
import os, signal
WATCHED = {signal.SIGTERM, signal.SIGWINCH}
signal.pthread_sigmask(signal.SIG_BLOCK, WATCHED)
print("up", flush=True)
while True:
    signum = signal.sigwaitinfo(WATCHED).si_signo
    if os.environ.get("TERM_LOG"):
        with open(os.environ["TERM_LOG"], "a") as log:
            log.write(signal.Signals(signum).name.removeprefix("SIG") + "\\n")
"""
CHILD = f"""
import signal, subprocess, sys, time
if "ignore" in sys.argv:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if "spawn" in sys.argv:
    g = subprocess.Popen([sys.executable, "-c", {GRANDCHILD!r}], stdout=subprocess.PIPE, text=True)
    g.stdout.readline()
    print(g.pid, flush=True)
print("ready", flush=True)
time.sleep(600)
"""


def start(*flags: str, session: bool = False, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, *flags],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=session,
        env=None if env is None else {**os.environ, **env},
    )


def wait_ready(proc: subprocess.Popen) -> str:
    """The child's first line before "ready" (the grandchild's pid), or "". A child that dies
    first ends its output, which fails the test instead of waiting forever."""
    lines = []
    for line in proc.stdout:
        if line.strip() == "ready":
            return lines[0] if lines else ""
        lines.append(line.strip())
    raise AssertionError(f"the child exited with {proc.wait(timeout=10)} before it was ready: {lines}")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is gone but for its exit code


def test_processes_that_listen_stop_on_sigterm_without_waiting_the_grace():
    procs = [start(), start()]
    for proc in procs:
        wait_ready(proc)
    started = time.monotonic()
    stop_processes(procs, grace=30)
    assert time.monotonic() - started < 10
    assert all(proc.returncode == -15 for proc in procs)


def test_a_stopped_process_gets_its_sigterm_at_once_not_a_sigkill_after_the_grace():
    """A SIGSTOPped child (a hung pod's stand-in, a shell's Ctrl-Z) held the SIGTERM for the
    whole grace period, then was SIGKILLed."""

    for session in (False, True):
        proc = start(session=session)
        wait_ready(proc)
        freeze(proc.pid)
        started = time.monotonic()
        stop_processes([proc], grace=20, term_group=session)
        assert time.monotonic() - started < 10
        assert proc.returncode == -15


def test_a_process_that_ignores_sigterm_is_killed_after_the_grace():
    proc = start("ignore")
    wait_ready(proc)
    started = time.monotonic()
    stop_processes([proc], grace=1)
    assert 0.9 <= time.monotonic() - started < 10
    assert proc.returncode == -9


class _Unkillable:
    """Stands in for a process stuck in the kernel (D state, a hung NFS read), which outlives even
    SIGKILL: no test can make a real one."""

    pid = 0
    args = "unkillable"
    returncode = None

    def poll(self) -> None:
        return None

    def send_signal(self, sig: int) -> None:
        pass

    def wait(self, timeout: float | None = None) -> int:
        raise subprocess.TimeoutExpired(self.args, timeout)


def test_one_process_that_outlives_sigkill_does_not_spare_the_others():
    """The stuck one is reported (TimeoutExpired), after the ones behind it are killed and reaped."""
    proc = start("ignore")
    wait_ready(proc)
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            stop_processes([_Unkillable(), proc], grace=0.5)
        assert proc.returncode == -9
    finally:  # not left behind when the assertion fails
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_kill_group_sweeps_what_outlives_the_groups_leader():
    proc = start("spawn", session=True)
    grandchild = int(wait_ready(proc))
    stop_processes([proc], grace=1, kill_group=True)
    assert proc.returncode == -15  # the leader listened...
    deadline = time.monotonic() + 10
    while alive(grandchild) and time.monotonic() < deadline:  # ...its child, reparented, is killed
        time.sleep(0.05)
    assert not alive(grandchild)


def test_term_group_reaches_every_member_of_the_group(tmp_path):
    """With term_group the grandchild gets the SIGTERM too (it notes it and lives on); without,
    only the process itself does.

    No timed watch decides "it never came": once stop_processes has returned, a SIGTERM it sent
    is already pending or taken, so a SIGWINCH sent after it is noted after it (the grandchild's
    sigwaitinfo takes the lowest pending signal first, and SIGTERM is 15, SIGWINCH 28).
    The grandchild's note of the SIGWINCH therefore closes the record."""
    for term_group in (True, False):
        log = tmp_path / f"term-{term_group}"
        log.touch()
        proc = start("spawn", session=True, env={"TERM_LOG": str(log)})
        grandchild = int(wait_ready(proc))
        try:
            stop_processes([proc], grace=1, term_group=term_group)
            os.kill(grandchild, signal.SIGWINCH)
            deadline = time.monotonic() + 10
            while not log.read_text().endswith("WINCH\n") and time.monotonic() < deadline:
                time.sleep(0.05)
            assert log.read_text() == ("TERM\nWINCH\n" if term_group else "WINCH\n")
            assert alive(grandchild)  # signalled, not killed (that is kill_group's part)
        finally:
            os.kill(grandchild, 9)


def test_already_finished_processes_are_fine():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    stop_processes([proc], grace=1)
    assert proc.returncode == 0


def test_without_kill_group_only_the_process_itself_is_killed():
    proc = start("spawn", "ignore", session=True)
    grandchild = int(wait_ready(proc))
    try:
        stop_processes([proc], grace=0.5)
        assert proc.returncode == -9
        assert alive(grandchild)
    finally:
        os.kill(grandchild, 9)


# A parent that starts a sleeping child with die_with_parent, prints its pid, then sleeps.
PARENT = """
import subprocess, sys, time
from kubeflow_data_cache.processes import die_with_parent
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], preexec_fn=die_with_parent())
print(child.pid, flush=True)
time.sleep(600)
"""


# A parent that starts a sleeping child without a preexec_fn (as torchrun starts its ranks): the
# child asks for the signal itself, says so, then sleeps.
PARENT_OF_A_CHILD_THAT_ASKS = """
import subprocess, sys, time
child = "from kubeflow_data_cache.processes import end_with_parent; import time; "
child += "print(end_with_parent(), flush=True); time.sleep(600)"
proc = subprocess.Popen([sys.executable, "-c", child])
print(proc.pid, flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize(
    ("parent_script", "child_says"),
    [
        (PARENT, None),
        # A torchrun rank: started by a program that sets no death signal, and left running when
        # that program dies before stopping its ranks.
        (PARENT_OF_A_CHILD_THAT_ASKS, "True"),
    ],
    ids=["die_with_parent", "end_with_parent"],
)
def test_the_child_stops_when_its_parent_is_sigkilled(parent_script, child_says):
    parent = subprocess.Popen(
        [sys.executable, "-c", parent_script], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        child = int(parent.stdout.readline())
        if child_says is not None:
            assert parent.stdout.readline().strip() == child_says  # the child's own line: it is set
        parent.kill()
        parent.wait(timeout=10)
        deadline = time.monotonic() + 10
        while alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(child)
    finally:
        stop_processes([parent], grace=1, kill_group=True)  # sweeps the child if it outlived the parent


@pytest.mark.parametrize(
    ("code", "said"),
    [
        (0, "exited with code 0"),
        (2, "exited with code 2"),
        (-9, "was killed by SIGKILL"),  # Popen's returncode for a signal: "exited with code -9" said nothing
        (-15, "was killed by SIGTERM"),
        (-40, "was killed by signal 40"),  # a real-time signal has no name
    ],
)
def test_an_exit_is_said_in_words(code, said):
    assert exit_status(code) == said
