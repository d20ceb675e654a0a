"""A small Dockerfile reader and the rules the project's images follow.

``problems(text, context, console_scripts)`` returns what is wrong with one Dockerfile (empty when
nothing is): slim Python 3.11 bases, dependencies installed from the lock with ``--no-deps``, the
package built by the backend its hashed ``build.lock`` pins (no build isolation), a final stage
that installs nothing and keeps no installer, a numeric non-root ``USER``, an exec-form
``ENTRYPOINT`` naming a console script, and ``COPY`` sources that exist in the context.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

PYTHON_BASE_RE = re.compile(r"^python:3\.11\.\d+-slim(?:-[a-z]+)?(?:@sha256:[0-9a-f]{64})?$")
OWN_IMAGE_RE = re.compile(r"^ghcr\.io/kubeflow-data-cache/[a-z0-9-]+:v[\d.]+$")
BUILD_TOOLS = ("gcc", "g++", "build-essential", "make", "cmake", "clang", "git", "python3-dev", "libc6-dev")
NUMERIC_USER_RE = re.compile(r"^(\d+)(?::(\d+))?$")


@dataclass
class Instruction:
    keyword: str
    value: str
    line: int


@dataclass
class Stage:
    base: str
    name: str | None
    line: int
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]


def logical_lines(text: str) -> list[tuple[int, str]]:
    """Join ``\\``-continued lines; drop comments and blank lines (also inside a continuation)."""
    out: list[tuple[int, str]] = []
    buf: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if not buf:
            start = number
        if stripped.endswith("\\"):
            buf.append(stripped[:-1].strip())
            continue
        buf.append(stripped)
        out.append((start, " ".join(buf)))
        buf = []
    if buf:
        out.append((start, " ".join(buf)))
    return out


def substitute(value: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args.get(m.group(1) or m.group(2), m.group(0)), value)


def parse(text: str) -> tuple[dict[str, str], list[Stage]]:
    """Global ``ARG`` defaults (those before the first ``FROM``) and the stages."""
    args: dict[str, str] = {}
    stages: list[Stage] = []
    for line, content in logical_lines(text):
        keyword, _, value = content.partition(" ")
        keyword, value = keyword.upper(), value.strip()
        if keyword == "FROM":
            parts = [p for p in value.split() if not p.startswith("--")]
            name = parts[2] if len(parts) >= 3 and parts[1].lower() == "as" else None
            stages.append(Stage(substitute(parts[0], args), name, line))
        elif not stages:
            if keyword == "ARG" and "=" in value:
                key, _, default = value.partition("=")
                args[key] = default
        else:
            stages[-1].instructions.append(Instruction(keyword, value, line))
    return args, stages


def _copy_sources(instruction: Instruction) -> list[str]:
    value = instruction.value
    parts = json.loads(value) if value.startswith("[") else shlex.split(value)
    parts = [p for p in parts if not p.startswith("--")]
    return parts[:-1]


def problems(text: str, context: Path, console_scripts: set[str]) -> list[str]:
    found: list[str] = []
    _, stages = parse(text)
    if not stages:
        return ["no FROM instruction"]
    names = {s.name for s in stages if s.name}
    for stage in stages:
        if stage.base in names:
            continue
        if not (PYTHON_BASE_RE.match(stage.base) or OWN_IMAGE_RE.match(stage.base)):
            found.append(
                f"line {stage.line}: base image {stage.base!r} is neither a pinned python:3.11.N-slim image "
                "nor one of the project's own images"
            )
    final = stages[-1]
    if not PYTHON_BASE_RE.match(final.base):
        found.append(
            f"line {final.line}: the final stage should start from a python:3.11.N-slim image, got {final.base!r}"
        )

    # Dependencies come from a lock, with --no-deps so nothing outside the lock sneaks in.
    installs = [i for s in stages for i in s.all("RUN") if re.search(r"\bpip\b.*\binstall\b", i.value)]
    lock_installs = [i for i in installs if re.search(r"-r\s+\S*requirements\.lock\b", i.value)]
    if not lock_installs:
        found.append("no `pip install -r ...requirements.lock`: dependencies must come from the lock")
    for i in installs:
        for command in re.split(r"&&|;", i.value):
            if re.search(r"\bpip\b.*\binstall\b", command) and "--no-deps" not in command:
                found.append(f"line {i.line}: pip install without --no-deps can pull versions the lock does not pin")
    copied = {Path(src).name for s in stages for c in s.all("COPY") for src in _copy_sources(c)}
    if "requirements.lock" not in copied:
        found.append("requirements.lock is never copied into the build")
    # A lock with hashes is only worth them when pip checks every download against them.
    for i in installs:
        for command in re.split(r"&&|;", i.value):
            for name in re.findall(r"-r\s+(\S+\.lock)\b", command):
                lock = context / Path(name).name
                if lock.is_file() and "--hash=" in lock.read_text() and "--require-hashes" not in command:
                    found.append(f"line {i.line}: {lock.name} has hashes, but pip install does not --require-hashes")

    # The package itself is built by a backend pinned like everything else: pip's build isolation
    # would fetch whatever setuptools is newest on the day of the build.
    builds = [
        (i, command)
        for s in stages
        for i in s.all("RUN")
        for command in re.split(r"&&|;", i.value)
        if re.search(r"\bpip\b.*\b(install|wheel)\b.*\s\.(?:\[\S*\]|\s|$)|\s\.\[", command + " ")
    ]
    for i, command in builds:
        if "--no-build-isolation" not in command:
            found.append(
                f"line {i.line}: the package is built with pip's build isolation, from an unpinned build backend: "
                "build it with --no-build-isolation where build.lock is installed"
            )
    if builds:
        build_lock = context / "build.lock"
        if not build_lock.is_file() or "--hash=" not in build_lock.read_text():
            found.append(f"{build_lock} should pin the build backend with hashes (make lock)")
        elif not any(re.search(r"-r\s+\S*build\.lock\b", i.value) for i in installs):
            found.append("build.lock is never installed: the build backend would not be the pinned one")

    # The final stage installs nothing: no compilers, no package installs, and no pip left behind.
    for i in final.all("RUN"):
        if re.search(r"\b(apt-get|apt|apk|dnf|yum)\b.*\binstall\b", i.value):
            tools = [t for t in BUILD_TOOLS if re.search(rf"(?<![\w-]){re.escape(t)}(?![\w-])", i.value)]
            found.append(
                f"line {i.line}: the final stage installs system packages"
                + (f" (build tools: {', '.join(tools)})" if tools else "")
            )
        if re.search(r"\bpip\b.*\binstall\b", i.value):
            found.append(f"line {i.line}: the final stage runs pip install; install in the build stage")
    if not any(re.search(r"pip uninstall .*\bpip\b", i.value) for i in final.all("RUN")):
        found.append("the final stage keeps the base image's pip: uninstall it")
    if not any(c.value.startswith("--from=") for c in final.all("COPY")):
        found.append("the final stage copies nothing from a build stage")

    users = final.all("USER")
    if not users:
        found.append("the final stage sets no USER: the image would run as root")
    else:
        user = users[-1].value
        m = NUMERIC_USER_RE.match(user)
        if not m:
            found.append(f"line {users[-1].line}: USER {user!r} should be numeric uid[:gid] (runAsNonRoot checks uids)")
        elif int(m.group(1)) == 0 or (m.group(2) is not None and int(m.group(2)) == 0):
            found.append(f"line {users[-1].line}: USER {user!r} is root")

    entrypoints = final.all("ENTRYPOINT")
    if not entrypoints:
        found.append("the final stage has no ENTRYPOINT")
    else:
        value = entrypoints[-1].value
        try:
            argv = json.loads(value)
        except json.JSONDecodeError:
            argv = None
        if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
            found.append(f"line {entrypoints[-1].line}: ENTRYPOINT {value} should be in exec form: a JSON list")
        elif argv[0] not in console_scripts:
            found.append(
                f"line {entrypoints[-1].line}: ENTRYPOINT {argv[0]!r} is not a console script "
                f"of the package (those are: {sorted(console_scripts)})"
            )

    for s in stages:
        for c in s.all("COPY") + s.all("ADD"):
            if c.value.startswith("--from="):
                continue
            for src in _copy_sources(c):
                if not (context / src).exists():
                    found.append(f"line {c.line}: COPY source {src!r} is not in the build context {context}")
    return found
