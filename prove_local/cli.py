"""`prove-local` command line: run, convert."""
from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="prove-local", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    from convert.cli import add_parser as add_convert
    add_convert(sub)

    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
