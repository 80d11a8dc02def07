"""Property-based differential tests: small Lightning programs drawn by Hypothesis, each run under MPPlugin and
checked against an oracle: Lightning's own plugin of the same mode, the same program without its poisoned step,
without its writes that change no value, or without its validates and with its resumes merged.

``programs.py`` draws the programs, ``runner.py`` runs them (a LightningModule, its data stream, the callbacks, a
Trainer on the CPU, the final state), ``oracles.py`` compares; ``test_differential.py`` is the property tests
(``DIFFERENTIAL_EXAMPLES`` programs each, ``make test-differential`` ten times the default), ``test_found.py`` the
shrunk failures found so far.

The same for Lightning Fabric loops under MPFabricPrecision: ``fabric_programs.py`` (clipping, steps the loop gives
up, poisoned steps, two optimizers, accumulation, a save and load), ``fabric_runner.py``, ``fabric_oracles.py``
(Fabric's own precision of the mode, the loop without its poisoned and given-up steps, the loop without its save
and load), ``test_fabric_differential.py`` and ``test_fabric_found.py``.
"""
