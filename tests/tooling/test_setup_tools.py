"""The set-up tools every fresh machine and CI run goes through: hack/ensure-uv.sh, `make lock`."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.images.test_dockerfiles import read_lock

REPO = Path(__file__).resolve().parents[2]
ENSURE_UV = REPO / "hack" / "ensure-uv.sh"


def _script_setting(name: str) -> str:
    return re.search(rf"^{name}=(\S+)$", ENSURE_UV.read_text(), re.MULTILINE).group(1)


def _fake_bin(tmp_path: Path, uv_on_path: str | None, python_uv: str | None) -> Path:
    """A PATH holding fake `uv` and `python3`: each uv reports the version given (None: absent);
    the fake python3 records `-m pip install` and from then on reports the installed uv."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "awk", "sort", "head", "env", "cat"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    if uv_on_path:
        (bin_dir / "uv").write_text(f'#!/bin/bash\necho "uv {uv_on_path} (fake)"\n')
        (bin_dir / "uv").chmod(0o755)
    installed = tmp_path / "installed"
    if python_uv:
        installed.write_text(python_uv)
    (bin_dir / "python3").write_text(
        "#!/bin/bash\n"
        f'installed="{installed}"\n'
        'if [ "$1 $2" = "-m uv" ]; then [ -f "$installed" ] || exit 1; echo "uv $(cat "$installed") (fake)"; exit 0; fi\n'
        'if [ "$1 $2 $3" = "-m pip --version" ]; then echo "pip 24.0"; exit 0; fi\n'
        'if [ "$1 $2 $3" = "-m pip install" ]; then echo "$*" >> "$installed.calls"; '
        'for a in "$@"; do case "$a" in uv==*) echo "${a#uv==}" > "$installed";; esac; done; exit 0; fi\n'
        "exit 1\n"
    )
    (bin_dir / "python3").chmod(0o755)
    return bin_dir


def _ensure(bin_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(ENSURE_UV)], env={"PATH": str(bin_dir), "HOME": str(bin_dir)}, capture_output=True, text=True,
        timeout=30,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("uv_on_path", "python_uv", "command"),
    [
        ("0.13.9", None, "uv"),
        ("0.5.0", None, "uv"),
        ("0.4.30", "0.8.22", "python3 -m uv"),
        (None, "0.6.0", "python3 -m uv"),
        ("not-a-version", "0.6.0", "python3 -m uv"),  # an odd --version output is not taken as new
    ],
)
def test_a_recent_enough_uv_is_used_as_found(tmp_path, uv_on_path, python_uv, command) -> None:
    done = _ensure(_fake_bin(tmp_path, uv_on_path, python_uv))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == command
    assert not (tmp_path / "installed.calls").exists(), "nothing to install"


@pytest.mark.parametrize(("uv_on_path", "python_uv"), [(None, None), ("0.4.30", None), ("0.2.37", "0.4.30")])
def test_a_missing_or_too_old_uv_is_replaced_by_the_pinned_release(tmp_path, uv_on_path, python_uv) -> None:
    """uv 0.4 installed PyPI's CUDA torch from the lock, without its nvidia libraries."""
    done = _ensure(_fake_bin(tmp_path, uv_on_path, python_uv))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "python3 -m uv"  # stdout names the command, and only it
    pinned = _script_setting("UV_VERSION")
    assert f"uv=={pinned}" in (tmp_path / "installed.calls").read_text()
    assert f"installing uv {pinned}" in done.stderr


def test_the_pinned_uv_is_at_least_the_minimum() -> None:
    minimum, pinned = _script_setting("UV_MIN_VERSION"), _script_setting("UV_VERSION")
    as_tuple = [tuple(int(p) for p in v.split(".")) for v in (minimum, pinned)]
    assert as_tuple[0] <= as_tuple[1]


def _lock_commands(env_extra: dict[str, str]) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PIP_FIND_LINKS", "UV_FIND_LINKS")} | env_extra
    done = subprocess.run(["make", "-n", "lock"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return [c for c in done.stdout.replace("\\\n", " ").splitlines() if not c.lstrip().startswith("#")]


def test_make_lock_compiles_torch_from_the_cpu_index_without_find_links(tmp_path) -> None:
    """Without find-links, PyPI's torch (the CUDA build) put 19 nvidia-*/cuda-*/triton pins in the lock;
    find-links without a torch wheel resolved to it too."""
    cpu_index = "--extra-index-url https://download.pytorch.org/whl/cpu"
    dev = [c for c in _lock_commands({}) if "-o requirements-dev.lock" in c]
    assert len(dev) == 1 and cpu_index in dev[0]
    wheels, empty = tmp_path / "wheels", tmp_path / "empty"
    wheels.mkdir()
    empty.mkdir()
    (wheels / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").touch()
    cases = ((str(wheels), False), (str(empty), True), (f"{empty},{wheels}", False), ("https://wheels.example/", False))
    for links, from_index in cases:  # a URL cannot be looked into: trusted to hold torch
        (command,) = [c for c in _lock_commands({"UV_FIND_LINKS": links}) if "-o requirements-dev.lock" in c]
        assert (cpu_index in command) == from_index, links


PACKAGE_INITS = (
    "images/cache/src/kubeflow_data_cache/__init__.py",
    "images/initializer/src/kubeflow_cache_initializer/__init__.py",
)


@pytest.mark.parametrize(
    ("finds", "rebuilt"),
    [
        ("here", False),
        ("elsewhere", True),  # a checkout moved or copied with its .venv: the editable installs point back
        ("nothing", True),  # the venv's interpreter is gone (exit 127)
    ],
)
def test_a_venv_that_does_not_run_this_checkouts_packages_is_rebuilt(tmp_path, finds, rebuilt) -> None:
    """The stamp alone passed a venv whose Python was uninstalled (every target failed with
    "No such file or directory") and a copied checkout's venv, which ran the original's code."""
    checkout = tmp_path / "checkout"
    for init in PACKAGE_INITS:
        (checkout / init).parent.mkdir(parents=True)
        (checkout / init).touch()
    shutil.copy(REPO / "Makefile", checkout / "Makefile")
    for dep in ("requirements-dev.lock", "images/cache/pyproject.toml", "images/initializer/pyproject.toml"):
        (checkout / dep).touch()
    venv = checkout / ".venv"
    (venv / "bin").mkdir(parents=True)
    found = {"here": checkout, "elsewhere": tmp_path / "original"}.get(finds)
    python = venv / "bin" / "python"
    python.write_text(
        "#!/bin/sh\n" + (f"echo {' '.join(str(found / i) for i in PACKAGE_INITS)}\n" if found else "exit 127\n")
    )
    python.chmod(0o755)
    (venv / ".installed").touch()  # newer than the locks: up to date by its time
    done = subprocess.run(["make", "-n", "setup"], cwd=checkout, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert ("rebuilding it" in done.stdout) == rebuilt
    assert ("rm -rf .venv" in done.stdout) == rebuilt
    assert ("venv --allow-existing" in done.stdout) == rebuilt
    assert venv.exists()  # a dry run (or `make help`) removes nothing; only the rebuild does
    subprocess.run(["make", "help"], cwd=checkout, capture_output=True, text=True, timeout=60, check=True)
    assert venv.exists()


def test_make_lock_holds_the_image_locks_to_the_dev_locks_versions() -> None:
    commands = _lock_commands({})
    for lock in ("images/cache/requirements.lock", "images/initializer/requirements.lock"):
        (compile_line,) = [c for c in commands if f"-o {lock}" in c]
        assert "-c requirements-dev.lock" in compile_line and "--generate-hashes" in compile_line
    assert any("hack/pin-like.py requirements-dev.lock images/trainer-e2e/requirements.lock" in c for c in commands)
    # The images' build backend: pyproject's build-system requires, hashed, held to the dev lock.
    (build_line,) = [c for c in commands if "build.lock" in c]
    assert '["build-system"]["requires"]' in build_line and "images/$image/pyproject.toml" in build_line
    assert "-c requirements-dev.lock" in build_line and "--generate-hashes" in build_line
    assert "-o images/$image/build.lock" in build_line and "for image in cache initializer" in build_line


def test_the_image_locks_pin_the_dev_locks_versions() -> None:
    """The images run what the tests ran: python-dateutil was 4.0.0 in both images, 2.9.0 in the tests."""
    dev = read_lock(REPO / "requirements-dev.lock")
    for image in ("cache", "initializer"):
        pins = read_lock(REPO / "images" / image / "requirements.lock")
        differing = {
            name: (version, dev.get(name)) for name, version in pins.items() if name in dev and dev[name] != version
        }
        assert differing == {}, f"{image} image vs dev lock: {differing}"
        assert set(pins) <= set(dev), f"{image} image pins what the tests never installed: {set(pins) - set(dev)}"


def test_pin_like_repins_a_hand_written_lock(tmp_path) -> None:
    lock = tmp_path / "dev.lock"
    lock.write_text("filelock==4.2.12\n    # via torch\ntorch==2.13.0+cpu\nSetupTools==84.2.1\n")
    target = tmp_path / "trainer.lock"
    target.write_text("# the trainer's additions\nfilelock==4.2.11\nsetuptools==80.0\ntorch==2.12.0\n")
    tool = [shutil.which("python3") or "python3", str(REPO / "hack" / "pin-like.py")]
    done = subprocess.run([*tool, str(lock), str(target)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert target.read_text() == "# the trainer's additions\nfilelock==4.2.12\nsetuptools==84.2.1\ntorch==2.13.0\n"
    target.write_text("numpy==2.0.0\n")
    refused = subprocess.run([*tool, str(lock), str(target)], capture_output=True, text=True, timeout=30)
    assert refused.returncode == 1 and "pins no version of numpy" in refused.stderr
    assert target.read_text() == "numpy==2.0.0\n"
    missing = subprocess.run(
        [*tool, str(tmp_path / "nope.lock"), str(target)], capture_output=True, text=True, timeout=30
    )
    assert missing.returncode == 2 and missing.stderr.startswith("error: ") and "nope.lock" in missing.stderr
