"""The command-line tools, built on the package's public API; the plugin and its parts never import them.

- :mod:`lightning_mp.tools.compare` (with ``compare_setup``, ``compare_engine``, ``compare_stats`` and
  ``compare_report``): ``python -m lightning_mp compare``;
- :mod:`lightning_mp.tools.demo`: ``python -m lightning_mp demo``;
- :mod:`lightning_mp.tools.cli`: ``MPLightningCLI``, a ``LightningCLI`` with short configuration errors.

``lightning_mp.compare`` and ``lightning_mp.cli``, where two of them lived before, are the same modules.
"""

import os
import sys


def program_name() -> str:
    """How the user called us: ``lightning-mp`` (the console script) or ``python -m lightning_mp``."""
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return "python -m lightning_mp" if name in ("", "-c", "__main__.py", "-m") else name
