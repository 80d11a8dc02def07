"""Command-line entry: ``python -m lightning_mp demo``."""

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    commands = {"demo": "train a small byte-level transformer under MPPlugin in fp32, bf16 and fp16, side by side"}
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        if argv and argv[0] not in ("-h", "--help"):
            print(f"unknown command {argv[0]!r}; accepted: {', '.join(commands)}", file=sys.stderr)
        print("usage: python -m lightning_mp COMMAND [options]\n\ncommands:")
        for name, text in commands.items():
            print(f"  {name:8s} {text}")
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    from lightning_mp.demo import main as demo

    return demo(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
