"""The documentation: the site builds strictly (a broken page, link, anchor, included file or API reference fails
here as in `make docs`), and every relative link of the README points to a file that exists."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# [text](target) and ![alt](target), and reference definitions `[label]: target`
INLINE_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.MULTILINE)
FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)


def relative_links(markdown: str) -> list[str]:
    """The link targets of ``markdown`` that are paths in the repository (no URL, no bare anchor), code blocks left
    out."""
    text = FENCE.sub("", markdown)
    targets = INLINE_LINK.findall(text) + REFERENCE_LINK.findall(text)
    return [t for t in targets if not re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", t) and not t.startswith("#")]


def test_relative_links_finds_paths_only():
    text = (
        "[a](docs/a.md) ![b](img.png \"title\") [c](https://x.org) [d](#anchor) [e](docs/e.md#part)\n"
        "```\n[f](inside/a/fence.md)\n```\n[g]: docs/g.md\n[h]: mailto:me@example.org\n"
    )
    assert relative_links(text) == ["docs/a.md", "img.png", "docs/e.md#part", "docs/g.md"]


def test_readme_relative_links_point_to_existing_files():
    links = relative_links((ROOT / "README.md").read_text(encoding="utf-8"))
    assert links, "the README links into the documentation pages"
    missing = [link for link in links if not (ROOT / link.split("#", 1)[0]).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"


@pytest.mark.slow
def test_the_site_builds_strictly(tmp_path):
    for module in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python"):
        try:
            importlib.import_module(module)
        except ImportError:
            pytest.skip(f"{module} is not installed (the docs extra: pip install -e '.[docs]')")
    site = tmp_path / "site"
    # Material prints a notice about MkDocs 2.0 on every build; it is no warning of this site's
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml")]
    result = subprocess.run(
        [*command, "--site-dir", str(site)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}"
    assert (site / "index.html").is_file()
    api = (site / "api" / "index.html").read_text(encoding="utf-8")
    assert 'id="lightning_mp.MPPlugin"' in api and 'id="lightning_mp.PrecisionMonitor"' in api
    # a default read from the table of defaults shows its value (docs/_griffe/defaults.py), not the lookup
    signatures = re.sub(r"<[^>]+>", "", api)
    assert "init_scale: float = 65536.0" in signatures and 'DEFAULTS["' not in signatures.replace("&quot;", '"')


def test_the_api_reference_covers_every_export():
    import lightning_mp

    page = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    documented = set(re.findall(r"^::: lightning_mp\.(\w+)\s*$", page, re.MULTILINE))
    assert documented >= set(lightning_mp.__all__), sorted(set(lightning_mp.__all__) - documented)


def test_the_readme_states_the_suites_time_its_budget_holds():
    """README.md's `make test` times are the budget `make test` enforces (tests/conftest.py: SUITE_MINUTES), and
    docs/development.md says the same."""
    from conftest import SUITE_MINUTES

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    row = re.search(r"^\| `make test` \| ([\d.]+) min \| ([\d.]+) min \|$", readme, re.MULTILINE)
    assert row, "README.md's table of times has a `make test` row"
    assert (float(row[1]), float(row[2])) == (SUITE_MINUTES["native bf16"], SUITE_MINUTES["no native bf16"])
    development = " ".join((ROOT / "docs" / "development.md").read_text(encoding="utf-8").split())
    assert f"about {SUITE_MINUTES['native bf16']} minutes" in development
    assert f"about {SUITE_MINUTES['no native bf16']} minutes" in development


def test_a_suite_over_its_figure_is_reported_and_fails_only_beyond_twice_it_on_a_quiet_machine():
    from conftest import SUITE_MINUTES, suite_over_budget

    native = SUITE_MINUTES["native bf16"]
    assert suite_over_budget(native * 1.2, "native bf16", load=1.0, cores=2) is None
    fails, said = suite_over_budget(native * 1.5, "native bf16", load=1.0, cores=2)  # reported: CI passes
    assert not fails
    assert said.startswith(f"the whole suite took {native * 1.5:.1f} min on this CPU (native bf16, 2 cores,")
    assert "reported, not failed (a run fails beyond twice the figure" in said
    fails, said = suite_over_budget(native * 2.1, "native bf16", load=1.0, cores=2)  # a gross regression
    assert fails and "and beyond twice it" in said and "make the slow tests faster" in said
    assert suite_over_budget(native * 2.1, "native bf16", load=5.0, cores=2)[0] is False  # busy: reported
    assert suite_over_budget(native * 2.1, "native bf16", load=1.0, cores=1)[0] is False  # one core: reported
    emulated = SUITE_MINUTES["no native bf16"]
    assert suite_over_budget(emulated * 1.2, "no native bf16", load=1.0, cores=2) is None  # each kind its figure
    # a machine 4x slower than that of the figures (its small training loop timed first): the figure scaled to it
    assert suite_over_budget(native * 4.5, "native bf16", load=1.0, cores=2, slower=4.0) is None
    fails, said = suite_over_budget(native * 9, "native bf16", load=1.0, cores=2, slower=4.0)
    assert fails and f"README.md's {native} min, scaled by 4.0 for this machine's speed, plus a quarter" in said
