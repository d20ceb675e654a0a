"""docs/protocol.md's Settings table names every env variable the cache reads, with its real flag."""

from __future__ import annotations

import re
from pathlib import Path

from kubeflow_data_cache import cli, config
from tests.conftest import REPO_ROOT


def settings_rows() -> list[str]:
    text = (REPO_ROOT / "docs" / "protocol.md").read_text()
    section = text.split("### Settings", 1)[1].split("\n## ", 1)[0]
    return [line for line in section.splitlines() if line.startswith("| `")]


def row_of(var: str) -> str:
    rows = [row for row in settings_rows() if f"`{var}`" in row.split("|")[1]]
    assert len(rows) == 1, f"{var} should have one row in the Settings table of docs/protocol.md"
    return rows[0]


def test_every_env_variable_read_is_documented_with_its_real_flag():
    source = Path(config.__file__).read_text()
    # pick("flag_dest", "VAR"): the env variable and the flag that overrides it.
    pairs = re.findall(r'pick\("(\w+)", "([A-Z][A-Z0-9_]+)"\)', source)
    assert len(pairs) > 10
    for dest, var in pairs:
        flag = "--" + dest.replace("_", "-")
        assert f"`{flag}" in row_of(var).split("|")[2], f"{var} should name its flag {flag}"
    read_directly = re.findall(r'env(?:\.get\(|\[)"([A-Z][A-Z0-9_]+)"', source)
    read_directly += re.findall(r'os\.environ\.get\("([A-Z][A-Z0-9_]+)"', Path(cli.__file__).read_text())
    assert "TERMINATION_LOG" in read_directly and "LOG_LEVEL" in read_directly
    for var in read_directly:
        row_of(var)
    # And no row names a flag that does not exist.
    parser = cli.build_parser()
    known = {option for action in parser._actions for option in action.option_strings}
    for sub in parser._subparsers._group_actions[0].choices.values():
        known |= {option for action in sub._actions for option in action.option_strings}
    for row in settings_rows():
        for flag in re.findall(r"--[a-z][a-z-]*", row.split("|")[2]):
            assert flag in known, f"docs/protocol.md names {flag}, which no command has"


def test_health_port_row_lists_status():
    assert "`/status`" in row_of("HEALTH_PORT")
