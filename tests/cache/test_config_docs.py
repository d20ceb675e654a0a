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


def _documented_refusals_of_empty_values() -> set[str]:
    text = " ".join((REPO_ROOT / "docs" / "protocol.md").read_text().split())
    sentence = text.split("An empty env value counts as unset, except ", 1)[1].split(", which are refused", 1)[0]
    return set(re.findall(r"`([A-Z][A-Z0-9_]+)`", sentence))


def test_empty_env_values_count_as_unset_except_the_documented_secrets(tmp_path):
    """Each variable the cache reads, set to "": the same settings as unset, or refused naming it
    as set but empty, and the refused ones are exactly those docs/protocol.md lists (it left
    DATA_CACHE_TOKEN_FILE out)."""
    import dataclasses

    from kubeflow_data_cache.errors import ConfigError

    source = Path(config.__file__).read_text()
    variables = {var for _, var in re.findall(r'pick\("(\w+)", "([A-Z][A-Z0-9_]+)"\)', source)}
    variables |= set(re.findall(r'env\.get\("([A-Z][A-Z0-9_]+)"', source))  # TERMINATION_LOG, LWS_*
    variables |= {"DATA_CACHE_TOKEN", "DATA_CACHE_TOKEN_FILE", "DATA_CACHE_CLUSTER_KEY"}
    flags = {"metadata_loc": "x", "data_nodes": 1, "host": "127.0.0.1", "port": 0, "health_port": 0}
    unset = dataclasses.asdict(config.build_config("head", flags, env={}))
    refused = set()
    for var in sorted(variables):
        try:
            empty = dataclasses.asdict(config.build_config("head", flags, env={var: ""}))
        except ConfigError as err:
            assert f"{var} is set but empty" in str(err), (var, str(err))
            refused.add(var)
            continue
        assert empty == unset, var
    assert refused == _documented_refusals_of_empty_values()


def test_an_empty_token_beside_a_token_file_is_refused_as_set_but_empty(tmp_path):
    """The file's token was used, and the empty DATA_CACHE_TOKEN passed without a word."""
    import pytest

    from kubeflow_data_cache.errors import ConfigError

    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    flags = {"metadata_loc": "x", "data_nodes": 1, "host": "127.0.0.1", "port": 0, "health_port": 0}
    env = {"DATA_CACHE_TOKEN": "", "DATA_CACHE_TOKEN_FILE": str(token_file)}
    with pytest.raises(ConfigError, match="DATA_CACHE_TOKEN is set but empty"):
        config.build_config("head", flags, env=env)
    with pytest.raises(ConfigError, match="not both"):
        config.build_config("head", flags, env={**env, "DATA_CACHE_TOKEN": "other"})
    assert config.build_config("head", flags, env={"DATA_CACHE_TOKEN_FILE": str(token_file)}).token == "s3cret"


def test_an_empty_log_level_counts_as_unset(monkeypatch):
    """It was refused (exit 2) though every other empty setting counts as unset."""
    monkeypatch.setenv("LOG_LEVEL", "")
    args = cli.build_parser().parse_args(["head"])
    assert cli._log_level(args.log_level) == "INFO"
    monkeypatch.setenv("LOG_LEVEL", "debug")
    assert cli._log_level(cli.build_parser().parse_args(["head"]).log_level) == "DEBUG"


def test_every_module_of_the_package_is_named_in_a_module_table():
    """docs/cache.md (server) and docs/dataset.md (client) say what each module is for; a module
    added without a row (filter_calls.py was) leaves a reader to guess."""
    package = Path(cli.__file__).parent
    tables = "\n".join(
        line
        for doc in ("cache.md", "dataset.md")
        for line in (REPO_ROOT / "docs" / doc).read_text().splitlines()
        if line.startswith("| `")
    )
    named = set(re.findall(r"^\| `([a-z0-9_]+\.py)`", tables, flags=re.M))
    modules = {p.name for p in package.glob("*.py")} - {"__init__.py", "__main__.py"}
    assert modules - named == set(), "modules without a row in a module table of docs/cache.md or docs/dataset.md"
