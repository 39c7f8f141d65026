"""The `prove-local` console script. The command line imports numpy and llama.cpp's bindings before
its own handlers exist (a second or more on a cold disk): this wrapper imports it inside one, so that
Ctrl-C then is one line and status 130, as it is during a command, not a traceback."""
from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    try:
        from .cli import main as cli_main
    except KeyboardInterrupt:
        print("\nprove-local: interrupted", file=sys.stderr)
        return 130
    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
