"""The minimum versions pyproject.toml declares (dependencies and the `cli` extra) are the ones `make test-min` installs
and tests (CI runs it)."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(
    not (ROOT / "Makefile").exists() or not (ROOT / ".ci" / "run").exists(),
    reason="the repository's Makefile and CI script (not in an sdist)",
)


def _declared() -> dict[str, str]:
    """The floors of the runtime dependencies and of the `cli` extra (jsonargparse: the CLI's tests need it)."""
    text = (ROOT / "pyproject.toml").read_text()
    deps = re.search(r"^dependencies = \[(.*?)^\]", text, re.S | re.M)
    assert deps, "pyproject.toml has a dependencies list"
    cli = re.search(r"^cli = \[(.*?)\]$", text, re.M)
    assert cli, "pyproject.toml has a `cli` extra"
    out = {}
    for name, floor in re.findall(r'"([a-z_-]+)(?:\[[a-z,]+\])?>=([0-9.]+)', deps.group(1) + cli.group(1)):
        out[name] = floor
    return out


def _tested() -> dict[str, str]:
    text = (ROOT / "Makefile").read_text()
    specs = re.search(r"^MIN_SPECS \?= (.*)$", text, re.M)
    assert specs, "the Makefile names the minimum versions it tests"
    return {name: version for name, version in re.findall(r"([a-z_-]+)(?:\[[a-z,]+\])?==([0-9.]+)", specs.group(1))}


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def test_every_declared_minimum_is_the_version_make_test_min_installs():
    declared, tested = _declared(), _tested()
    assert set(declared) == set(tested) == {"torch", "lightning", "torchmetrics", "jsonargparse"}
    for name, floor in declared.items():
        # ">=2.11" is tested as 2.11.0: the same release, zeros filled in
        padded = _release(floor) + (0,) * (len(_release(tested[name])) - len(_release(floor)))
        assert padded == _release(tested[name]), f"{name}: declared >={floor}, tested =={tested[name]}"


def test_ci_runs_the_minimum_versions():
    assert re.search(r"^make test-min$", (ROOT / ".ci" / "run").read_text(), re.M)
