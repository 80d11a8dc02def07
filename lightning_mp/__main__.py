"""Command-line entry: ``python -m lightning_mp compare`` and ``python -m lightning_mp demo``."""

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    commands = {
        "compare": "run a model under each precision mode and tell which to use (speed, memory, loss drift, skips)",
        "demo": "train a small byte-level transformer under MPPlugin in fp32, bf16 and fp16, side by side",
    }
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        if argv and argv[0] not in ("-h", "--help"):
            print(f"unknown command {argv[0]!r}; accepted: {', '.join(commands)}", file=sys.stderr)
        print("usage: python -m lightning_mp COMMAND [options]\n\ncommands:")
        for name, text in commands.items():
            print(f"  {name:8s} {text}")
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    if argv[0] == "compare":
        from lightning_mp.compare import main as compare

        return compare(argv[1:])
    from lightning_mp.demo import main as demo

    return demo(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
