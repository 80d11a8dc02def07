"""Redraw ``compare``'s chart from the JSON a run wrote (``compare --json out.json``), with the plotting code of the
package as it is now (``lightning_mp.tools.compare_report.write_plot``): a chart can be redrawn after the plotting
changes without running the modes again (the docs' ``docs/assets/compare-vlm-h200.png`` came from an H200).

    python benchmarks/plot_compare.py benchmarks/results/compare_vlm_h200_2026-11-26.json \
        docs/assets/compare-vlm-h200.png

Keys of the JSON that ``ModeResult`` no longer has are left out, and fields it has that an older JSON lacks keep
their defaults (an older run has no speed-up, so the chart shows median step times).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Optional

from lightning_mp.tools.compare_engine import ModeResult
from lightning_mp.tools.compare_report import write_plot


def load_results(path: str) -> list[ModeResult]:
    """The modes of a ``compare --json`` file, as ``compare`` held them when it wrote the file."""
    with open(path) as f:
        payload = json.load(f)
    known = {f.name for f in dataclasses.fields(ModeResult)}
    return [ModeResult(**{k: v for k, v in row.items() if k in known}) for row in payload["results"]]


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("json", help="a file written by compare --json")
    parser.add_argument("png", help="the chart to write")
    args = parser.parse_args(argv)
    write_plot(load_results(args.json), args.png)
    print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
