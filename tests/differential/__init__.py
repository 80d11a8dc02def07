"""Property-based differential tests: small Lightning programs drawn by Hypothesis, each run under MPPlugin and
checked against an oracle (Lightning's own plugin of the same mode, or the same program without its poisoned
step). ``programs.py`` draws the programs, ``runner.py`` runs them, ``oracles.py`` compares the final states."""
