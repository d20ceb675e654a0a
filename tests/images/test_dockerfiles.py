"""The image Dockerfiles, read offline: bases, lock installs, user, entrypoints, build context.

Each rule is also run once against a broken copy, so a rule that could never fail is caught here.
"""

from __future__ import annotations

import importlib.metadata
import re
import tomllib
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement

from tests.images.dockerfile_rules import parse, problems

REPO = Path(__file__).resolve().parents[2]
IMAGES = REPO / "images"
LINUX_PY311 = {**default_environment(), "sys_platform": "linux", "platform_system": "Linux", "python_version": "3.11"}


def console_scripts(pyproject: Path) -> set[str]:
    return set(tomllib.loads(pyproject.read_text())["project"].get("scripts", {}))


def torch_console_scripts() -> set[str]:
    return {ep.name for ep in importlib.metadata.distribution("torch").entry_points if ep.group == "console_scripts"}


# image folder -> console scripts its ENTRYPOINT may name
IMAGE_SCRIPTS = {
    "cache": lambda: console_scripts(IMAGES / "cache" / "pyproject.toml"),
    "initializer": lambda: console_scripts(IMAGES / "initializer" / "pyproject.toml"),
    "trainer-e2e": torch_console_scripts,
}


def read_lock(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.\-]+)==([^\s;#]+)", line)
        if m:
            pins[m.group(1).lower().replace("_", "-")] = m.group(2)
    return pins


@pytest.mark.parametrize("image", sorted(IMAGE_SCRIPTS))
def test_dockerfile_follows_the_image_rules(image: str) -> None:
    context = IMAGES / image
    assert problems((context / "Dockerfile").read_text(), context, IMAGE_SCRIPTS[image]()) == []


@pytest.mark.parametrize("image", ["cache", "initializer"])
def test_entrypoint_is_the_packages_console_script(image: str) -> None:
    _, stages = parse((IMAGES / image / "Dockerfile").read_text())
    entrypoint = stages[-1].all("ENTRYPOINT")[-1].value
    scripts = console_scripts(IMAGES / image / "pyproject.toml")
    assert len(scripts) == 1
    assert entrypoint == f'["{scripts.pop()}"]'


@pytest.mark.parametrize("image", ["cache", "initializer"])
def test_image_locks_pin_every_package_by_hash(image: str) -> None:
    """The published images install nothing whose bytes the lock does not name (make lock)."""
    text = (IMAGES / image / "requirements.lock").read_text()
    blocks = re.split(r"\n(?=[A-Za-z0-9_.\-]+==)", text.split("\n", 2)[2])
    assert len(blocks) == len(read_lock(IMAGES / image / "requirements.lock")) > 10
    for block in blocks:
        assert re.search(r"--hash=sha256:[0-9a-f]{64}", block), block.splitlines()[0]


@pytest.mark.parametrize("image", ["cache", "initializer"])
def test_build_lock_pins_the_pyproject_build_backend_by_hash(image: str) -> None:
    """What the Dockerfile builds the package with satisfies pyproject's build-system requires."""
    requires = tomllib.loads((IMAGES / image / "pyproject.toml").read_text())["build-system"]["requires"]
    lock = IMAGES / image / "build.lock"
    pins = read_lock(lock)
    for requirement in map(Requirement, requires):
        assert requirement.specifier.contains(pins[requirement.name.lower()]), (requirement, pins)
    blocks = re.split(r"\n(?=[A-Za-z0-9_.\-]+==)", lock.read_text().split("\n", 2)[2])
    assert len(blocks) == len(pins) >= 1
    for block in blocks:
        assert re.search(r"--hash=sha256:[0-9a-f]{64}", block), block.splitlines()[0]
    dev = read_lock(REPO / "requirements-dev.lock")
    assert {name: dev.get(name) for name in pins} == pins, "build.lock drifted from the dev lock: make lock"


@pytest.mark.parametrize("image", sorted(IMAGE_SCRIPTS))
def test_dockerignore_keeps_build_leftovers_out(image: str) -> None:
    ignored = (IMAGES / image / ".dockerignore").read_text().splitlines()
    assert "**/__pycache__" in ignored
    if image != "trainer-e2e":
        assert "**/*.egg-info" in ignored


BREAKAGES = [
    ("cache", "USER 65532:65532", "USER cache", "should be numeric"),
    ("cache", "USER 65532:65532", "USER 0:0", "is root"),
    ("initializer", "USER 65532:65532", "", "sets no USER"),
    ("cache", 'ENTRYPOINT ["data-cache"]', 'ENTRYPOINT ["data-cache-server"]', "not a console script"),
    ("initializer", 'ENTRYPOINT ["cache-initializer"]', "ENTRYPOINT cache-initializer", "exec form"),
    ("cache", "-r requirements.lock", "-r requirements.txt", "must come from the lock"),
    ("initializer", "--require-hashes ", "", "does not --require-hashes"),
    ("initializer", "install --no-deps --no-index", "install --no-index", "without --no-deps"),
    ("cache", "COPY requirements.lock ./", "COPY requirements.lockfile ./", "not in the build context"),
    ("cache", "FROM ${PYTHON_IMAGE}\n", "FROM python:latest\n", "pinned python:3.11.N-slim"),
    ("initializer", "python:3.11.13-slim-bookworm", "python:3.11.13-bookworm", "pinned python:3.11.N-slim"),
    ("cache", "RUN python -m pip uninstall", "RUN python -m pip --version ||", "keeps the base image's pip"),
    ("cache", "COPY --from=build /opt/venv", "COPY src", "copies nothing from a build stage"),
    (
        "cache",
        "COPY --from=build /opt/venv /opt/venv\n",
        "COPY --from=build /opt/venv /opt/venv\nRUN apt-get update && apt-get install -y gcc\n",
        "build tools: gcc",
    ),
    (
        "initializer",
        "COPY --from=build /opt/venv /opt/venv\n",
        "COPY --from=build /opt/venv /opt/venv\nRUN pip --python /opt/venv/bin/python install --no-deps boto3\n",
        "runs pip install",
    ),
    ("trainer-e2e", 'ENTRYPOINT ["torchrun"]', 'ENTRYPOINT ["python"]', "not a console script"),
    ("cache", "--no-build-isolation ", "", "built with pip's build isolation"),
    (
        "initializer",
        "RUN /opt/build/bin/pip wheel --no-deps --no-build-isolation --wheel-dir /tmp/wheels . \\\n"
        " && pip --python /opt/venv/bin/python install --no-deps --no-index --find-links /tmp/wheels kubeflow-cache-initializer",
        "RUN pip --python /opt/venv/bin/python install --no-deps .",
        "built with pip's build isolation",
    ),
    ("cache", "--require-hashes -r /tmp/build.lock", "-r /tmp/build.lock", "build.lock has hashes"),
    ("initializer", "-r /tmp/build.lock", "setuptools", "build.lock is never installed"),
]


@pytest.mark.parametrize(("image", "old", "new", "expected"), BREAKAGES)
def test_a_broken_dockerfile_is_caught(image: str, old: str, new: str, expected: str) -> None:
    context = IMAGES / image
    text = (context / "Dockerfile").read_text()
    assert old in text, f"the breakage no longer applies to images/{image}/Dockerfile: {old!r}"
    found = problems(text.replace(old, new), context, IMAGE_SCRIPTS[image]())
    assert any(expected in p for p in found), found


def test_continuation_lines_and_comments_are_joined() -> None:
    _, stages = parse("ARG B=python:3.11.9-slim\nFROM ${B} AS x\nRUN a \\\n  # note\n  b\n")
    assert stages[0].base == "python:3.11.9-slim"
    assert stages[0].name == "x"
    assert stages[0].all("RUN")[0].value == "a b"


def test_trainer_lock_agrees_with_the_dev_lock() -> None:
    dev = read_lock(REPO / "requirements-dev.lock")
    trainer = read_lock(IMAGES / "trainer-e2e" / "requirements.lock")
    assert "torch" in trainer
    mismatched = {name: (version, dev.get(name)) for name, version in trainer.items() if dev.get(name) != version}
    assert mismatched == {}, "trainer-e2e pins (trainer, dev): " + repr(mismatched)


def test_trainer_lock_completes_the_cache_lock_for_torch() -> None:
    """Every distribution torch needs on Linux/3.11 is pinned by one of the two locks, exactly once."""
    cache = read_lock(IMAGES / "cache" / "requirements.lock")
    trainer = read_lock(IMAGES / "trainer-e2e" / "requirements.lock")
    assert set(cache) & set(trainer) == set(), "pinned twice"
    pinned = {**cache, **trainer}
    missing, todo, seen = set(), ["torch"], set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for spec in importlib.metadata.requires(name) or []:
            req = Requirement(spec)
            if req.marker and not req.marker.evaluate({**LINUX_PY311, "extra": ""}):
                continue
            dep = req.name.lower().replace("_", "-")
            if dep not in pinned:
                missing.add(dep)
            elif not req.specifier.contains(pinned[dep], prereleases=True):
                missing.add(f"{dep} ({pinned[dep]} does not satisfy {req.specifier})")
            todo.append(dep)
    assert missing == set()
