#!/usr/bin/env python3
"""Re-pin the `name==version` lines of a requirements file to the versions of a lock.

    hack/pin-like.py LOCK TARGET

`make lock` runs it on images/trainer-e2e/requirements.lock (the trainer image's additions to the
cache image's lock), which is written by hand but must pin what requirements-dev.lock pins. A
package TARGET pins that LOCK does not is an error: nothing would say which version to take.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;#\\]+)", re.MULTILINE)


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(text: str) -> dict[str, str]:
    # A local label (torch's `+cpu`) is dropped: only that machine's wheel would match it.
    return {canonical(name): version.split("+", 1)[0] for name, version in PIN.findall(text)}


def repin(lock_text: str, target_text: str) -> str:
    locked = pins(lock_text)
    missing = sorted({canonical(name) for name, _ in PIN.findall(target_text)} - set(locked))
    if missing:
        raise SystemExit(f"error: the lock pins no version of {', '.join(missing)}: add them to it, or drop them")
    return PIN.sub(lambda m: f"{m.group(1)}=={locked[canonical(m.group(1))]}", target_text)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    lock, target = (Path(a) for a in argv)
    try:
        target.write_text(repin(lock.read_text(), target.read_text()))
    except OSError as err:
        print(f"error: {err.filename}: {err.strerror}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
