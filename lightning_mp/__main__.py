"""Command-line entry: ``python -m lightning_mp COMMAND`` or the ``lightning-mp`` console script (the same commands).

``compare`` and ``demo`` are the commands; ``--version`` prints the versions of lightning-mp, torch and Lightning.
"""

import os
import sys

from lightning_mp.tools import program_name  # (the tools package itself: no heavy imports)

COMMANDS = {
    "compare": "run a model under each precision mode and tell which to use (speed, memory, loss drift, skips)",
    "demo": "train a small byte-level transformer under MPPlugin in fp32, bf16 and fp16, side by side",
}




def version_text() -> str:
    """``lightning-mp 0.2.0.dev0 (torch 2.13.0+cpu, lightning 2.6.6, Python 3.11.7)``: what a bug report needs
    (read from the installed packages' metadata, without importing torch or Lightning: instant)."""
    from importlib.metadata import PackageNotFoundError, version

    import lightning_mp

    def installed(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    python = ".".join(str(v) for v in sys.version_info[:3])
    versions = f"torch {installed('torch')}, lightning {installed('lightning')}, Python {python}"
    return f"lightning-mp {lightning_mp.__version__} ({versions})"


def usage() -> str:
    lines = [f"usage: {program_name()} COMMAND [options]", f"       {program_name()} --version", "", "commands:"]
    lines += [f"  {name:8s} {text}" for name, text in COMMANDS.items()]
    lines += ["", f"`{program_name()} COMMAND --help` shows the options of a command."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # the console script finds modules in the working directory (``--model mycnn:SmallCNN``) as ``python -m`` does
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    if argv and argv[0] in ("-V", "--version"):
        print(version_text())
        return 0
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if argv[0] not in COMMANDS:
        print(f"unknown command {argv[0]!r}; accepted: {', '.join(COMMANDS)}, --version, --help\n", file=sys.stderr)
        print(usage(), file=sys.stderr)
        return 2
    if argv[0] == "compare":
        from lightning_mp.tools.compare import main as compare

        return compare(argv[1:])
    from lightning_mp.tools.demo import main as demo

    return demo(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
