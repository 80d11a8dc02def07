"""``lightning_mp.compare``, kept for earlier callers: the same module as :mod:`lightning_mp.tools.compare`.

``import lightning_mp.compare`` gives the module object of ``lightning_mp.tools.compare`` (every name, private
ones included, and a monkeypatch through either name reaches the code that runs); ``python -m lightning_mp.compare``
still runs ``python -m lightning_mp compare``.
"""

import sys

from lightning_mp.tools import compare

if __name__ == "__main__":
    sys.exit(compare.main())

sys.modules[__name__] = compare
