"""The documentation site as a reader sees it: each page of the built site rendered headless in Chromium at
1280 × 900, failing on a code block or table wider than the content column (a reader would have to scroll to see
its end), on code in a table broken inside a word (`growth_fact` / `or`), on an image that does not load, and on a
paragraph that holds a Markdown list (Python-Markdown needs a blank line before a list: without one the items run
on in the paragraph, with literal " - ").

Then each page again at a phone's 390 × 844: the page does not scroll sideways, a table either fits or scrolls in
its wrapper with its first column (the names) in view, an API parameter table fits (its descriptions in view), a
chart's smallest text is at least 9 px (CHART_TEXT_PX), and no code sits under a code block's copy button.

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
PHONE = {"width": 390, "height": 844}
#: each chart's smallest text, in the chart's own pixels: matplotlib's font size (10 pt, or a smaller one the script
#: sets) at the dpi it saves at. A chart not listed fails the phone check: add it.
CHART_TEXT_PX = {
    "compare-vlm-h200.png": 10 * 110 / 72,  # compare --plot: 110 dpi
    "convergence-curves.png": 8 * 120 / 72,  # benchmarks/convergence.py: legend at 8 pt, 120 dpi
    "precision-monitor-fp16.png": 10 * 100 / 72,  # PrecisionMonitor(plot=...): 100 dpi
    "run-all-gpt-1.3b-h200.png": 10 * 100 / 72,  # benchmarks/run_all.py: 100 dpi
    "run-all-gpt-350m-vit-b16-h200.png": 10 * 100 / 72,
    "run-all-vlm-h200.png": 10 * 100 / 72,
}
MIN_TEXT_PX = 9
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

# Run in the page at any width: a Markdown list that ran on in a paragraph (a line of the paragraph's source starts
# with a list marker; Python-Markdown keeps the source's line breaks in the paragraph's text).
FIND_RUN_ON_LISTS = """
() => {
  const problems = [];
  for (const p of document.querySelectorAll('article.md-content__inner p')) {
    const item = (p.textContent || '').split('\\n').slice(1).find((line) => /^\\s*([-*+]|\\d+[.)])\\s+\\S/.test(line));
    const what = 'a Markdown list inside a paragraph (no blank line before it)';
    if (item) problems.push(`${what}: ${item.trim().slice(0, 70)}`);
  }
  return problems;
}
"""

# Run in the page at a phone's width (CHART_TEXT_PX and MIN_TEXT_PX passed in): what a reader could not see.
FIND_PHONE_PROBLEMS = r"""
([textPx, minPx]) => {
  const column = document.querySelector('article.md-content__inner');
  if (!column) return ['no content column (article.md-content__inner) on the page'];
  const first = (el) => (el.textContent || '').trim().split('\n')[0].slice(0, 60);
  const problems = [];
  const page = document.documentElement.scrollWidth;
  if (page > window.innerWidth + 1) problems.push(`the page scrolls sideways (${page} px in ${window.innerWidth})`);
  for (const table of column.querySelectorAll('table')) {
    const wrap = table.closest('.md-typeset__scrollwrap') || table.parentElement;
    const view = Math.min(wrap.getBoundingClientRect().right, window.innerWidth) + 1;
    const api = table.closest('.doc-contents') !== null;
    if (api && (wrap.scrollWidth > wrap.clientWidth + 1 || table.getBoundingClientRect().right > view)) {
      problems.push(`an API table is wider than the phone (${table.scrollWidth} px): ${first(table)}`);
      continue;
    }
    for (const row of table.rows) {
      const cell = row.cells[0];
      const box = cell && cell.getBoundingClientRect();
      if (!box || (!box.width && !box.height)) continue;  // a row not shown (a header the phone's layout hides)
      if (box.right > view || box.width < 24) {
        problems.push(`a table's first column is out of view (${Math.round(box.left)}–${Math.round(box.right)} px):` +
                      ` ${first(cell)}`);
        break;
      }
    }
  }
  for (const img of column.querySelectorAll('img')) {
    const name = (img.getAttribute('src') || '').split('/').pop();
    if (!(name in textPx)) {
      problems.push(`image ${name}: its smallest text size is not in CHART_TEXT_PX`);
      continue;
    }
    const shown = img.getBoundingClientRect().width / img.naturalWidth * textPx[name];
    if (shown < minPx) problems.push(`chart text of ${name} at ${shown.toFixed(1)} px (< ${minPx} px)`);
  }
  for (const pre of column.querySelectorAll('pre')) {
    const button = pre.querySelector('.md-code__nav, .md-clipboard');
    const code = pre.querySelector('code');
    if (!button || !code) continue;
    const b = button.getBoundingClientRect();
    if (!b.width || !b.height) continue;
    const walker = document.createTreeWalker(code, NodeFilter.SHOW_TEXT);
    const range = document.createRange();
    let under = null;
    for (let text = walker.nextNode(); text && !under; text = walker.nextNode()) {
      for (let i = 0; i < text.length; i++) {
        if (/\s/.test(text.data[i])) continue;
        range.setStart(text, i);
        range.setEnd(text, i + 1);
        const r = range.getClientRects()[0];
        if (!r) continue;
        if (r.top >= b.bottom) break;
        if (r.right > b.left && r.left < b.right && r.bottom > b.top) { under = text.data.slice(i, i + 20); break; }
      }
      if (under === null && range.getClientRects()[0] && range.getClientRects()[0].top >= b.bottom) break;
    }
    if (under) problems.push(`code under the copy button: "${under}" in ${first(code)}`);
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
    browser_page.set_viewport_size(VIEWPORT)
    response = browser_page.goto(base_url + path, wait_until="load")
    assert response is not None and response.ok, f"{path}: HTTP {response and response.status}"
    problems = browser_page.evaluate(FIND_PROBLEMS) + browser_page.evaluate(FIND_RUN_ON_LISTS)
    assert not problems, f"{path or 'home'} at 1280 × 900:\n" + "\n".join(problems)


@pytest.mark.parametrize("path", PAGES, ids=lambda p: p.rstrip("/") or "home")
def test_page_reads_on_a_phone(browser_page: Any, base_url: str, path: str):
    browser_page.set_viewport_size(PHONE)
    response = browser_page.goto(base_url + path, wait_until="load")
    assert response is not None and response.ok, f"{path}: HTTP {response and response.status}"
    problems = browser_page.evaluate(FIND_PHONE_PROBLEMS, [CHART_TEXT_PX, MIN_TEXT_PX])
    problems += browser_page.evaluate(FIND_RUN_ON_LISTS)
    assert not problems, f"{path or 'home'} at 390 × 844:\n" + "\n".join(problems)


def test_the_list_check_sees_a_list_that_ran_on_in_a_paragraph(browser_page: Any, base_url: str):
    """The check itself, on a page built for it: what Python-Markdown makes of a list with no blank line before."""
    browser_page.set_viewport_size(VIEWPORT)
    browser_page.goto(base_url, wait_until="load")
    browser_page.evaluate(
        """() => { const p = document.createElement('p');
                   p.textContent = 'Two checks:\\n- the first\\n- the second';
                   document.querySelector('article.md-content__inner').appendChild(p); }"""
    )
    assert browser_page.evaluate(FIND_RUN_ON_LISTS) == [
        "a Markdown list inside a paragraph (no blank line before it): - the first"
    ]
