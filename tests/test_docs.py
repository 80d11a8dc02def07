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
