"""The documentation site as a reader sees it: each page of the built site rendered headless in Chromium at
1280 × 900, failing on a code block or table wider than the content column (a reader would have to scroll to see
its end), on code in a table broken inside a word (`growth_fact` / `or`), and on an image that does not load.

It needs Playwright (``pip install playwright``) and a Chromium: the system's (``apt-get install chromium``), one
named by ``CHROMIUM``, or Playwright's own (``playwright install chromium``). Without them the tests skip, saying
why; with ``REQUIRE_BROWSER=1`` (CI: ``.ci/docs-browser``) they fail instead.
"""

from __future__ import annotations

import functools
import importlib
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
VIEWPORT = {"width": 1280, "height": 900}
# every page of the site: docs/x.md is served at x/ (docs/index.md at the root)
PAGES = sorted("" if p.stem == "index" else f"{p.stem}/" for p in DOCS.glob("*.md"))

# Run in the page: what in the content column is wider than the column, broken mid-word, or not loaded.
# A <pre>'s <code> scrolls sideways (Material: overflow auto) when a line is longer than the column; a table sits
# in a scrolling wrapper (.md-typeset__scrollwrap) that scrolls when the table is wider than the column.
FIND_PROBLEMS = """
() => {
  const column = document.querySelector('article.md-content__inner');
  if (!column) return ['no content column (article.md-content__inner) on the page'];
  const right = column.getBoundingClientRect().right + 1;
  const first = (el) => (el.textContent || '').trim().split('\\n')[0].slice(0, 70);
  const problems = [];
  // a line break between two word characters inside code (`growth_fact` / `or`); after a space or a
  // punctuation mark (`bf16-` / `true`, `plugins=` / `[...]`) it is where prose would break too
  const breaksMidWord = (code) => {
    const walker = document.createTreeWalker(code, NodeFilter.SHOW_TEXT);
    const range = document.createRange();
    let top = null;
    let previous = ' ';
    for (let text = walker.nextNode(); text; text = walker.nextNode()) {
      for (let i = 0; i < text.length; i++) {
        range.setStart(text, i);
        range.setEnd(text, i + 1);
        const rect = range.getClientRects()[0];
        const char = text.data[i];
        if (rect && top !== null && rect.top > top + 1 && /\\w\\w/.test(previous + char)) return true;
        if (rect) top = rect.top;
        previous = char;
      }
    }
    return false;
  };
  for (const pre of column.querySelectorAll('pre')) {
    const code = pre.querySelector('code') || pre;
    const wide = [pre, code].some((el) => el.scrollWidth > el.clientWidth + 1);
    if (wide || pre.getBoundingClientRect().right > right) {
      problems.push(`code block cut off (${code.scrollWidth} px of text in ${code.clientWidth} px): ${first(pre)}`);
    }
  }
  for (const table of column.querySelectorAll('table')) {
    const wrap = table.closest('.md-typeset__scrollwrap') || table;
    if (wrap.scrollWidth > wrap.clientWidth + 1 || table.getBoundingClientRect().right > right) {
      problems.push(`table wider than the column (${table.scrollWidth} px in ${wrap.clientWidth} px): ` +
                    first(table.querySelector('tr') || table));
    }
    for (const code of table.querySelectorAll('td code, th code')) {
      if (code.getClientRects().length > 1 && breaksMidWord(code)) {
        problems.push(`\\`${code.textContent}\\` breaks mid-word in a table`);
      }
    }
  }
  for (const img of column.querySelectorAll('img')) {
    if (!img.complete || img.naturalWidth === 0) {
      problems.push(`image does not load: ${img.getAttribute('src')}`);
    }
  }
  return problems;
}
"""


def _unavailable(reason: str) -> None:
    if os.environ.get("REQUIRE_BROWSER") == "1":
        pytest.fail(f"REQUIRE_BROWSER=1 but {reason}", pytrace=False)
    pytest.skip(reason)


def system_chromium() -> str | None:
    """The Chromium to drive: ``CHROMIUM`` if set, else the first of the usual names on PATH; None for
    Playwright's own."""
    named = os.environ.get("CHROMIUM")
    if named:
        return named
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        found = shutil.which(name)
        if found:
            return found
    return None


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    for module in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python"):
        try:
            importlib.import_module(module)
        except ImportError:
            _unavailable(f"{module} is not installed (the docs extra: pip install -e '.[docs]')")
    out = tmp_path_factory.mktemp("browser") / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml")]
    result = subprocess.run(
        [*command, "--site-dir", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}"
    return out


@pytest.fixture(scope="module")
def base_url(site: Path) -> Iterator[str]:
    """The built site over HTTP on a free local port (file:// would not resolve directory URLs)."""

    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base class's name)
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(site)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def browser_page() -> Iterator[Any]:
    try:
        from playwright.sync_api import Error, sync_playwright
    except ImportError:
        _unavailable("Playwright is not installed (pip install playwright)")
    executable = system_chromium()
    with sync_playwright() as playwright:
        try:
            browser = playwright.chromium.launch(executable_path=executable, args=["--no-sandbox"])
        except Error as error:
            where = executable or "Playwright's own Chromium (playwright install chromium)"
            _unavailable(f"no Chromium could be started ({where}): {str(error).splitlines()[0]}")
        try:
            page = browser.new_page(viewport=VIEWPORT)
            yield page
        finally:
            browser.close()


def test_every_page_is_checked():
    assert "" in PAGES and "getting-started/" in PAGES and "api/" in PAGES


@pytest.mark.parametrize("path", PAGES, ids=lambda p: p.rstrip("/") or "home")
def test_page_fits_the_column_and_its_images_load(browser_page: Any, base_url: str, path: str):
    response = browser_page.goto(base_url + path, wait_until="load")
    assert response is not None and response.ok, f"{path}: HTTP {response and response.status}"
    problems = browser_page.evaluate(FIND_PROBLEMS)
    assert not problems, f"{path or 'home'} at 1280 × 900:\n" + "\n".join(problems)
