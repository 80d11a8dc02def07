"""``lightning_mp.cli``, kept for earlier callers: the same module as :mod:`lightning_mp.tools.cli`.

``from lightning_mp.cli import MPLightningCLI`` (the spelling of earlier releases) gives the same class as
``from lightning_mp.tools.cli import MPLightningCLI``; ``import lightning_mp.cli`` gives the module object of
``lightning_mp.tools.cli``.
"""

import sys

from lightning_mp.tools import cli

sys.modules[__name__] = cli
