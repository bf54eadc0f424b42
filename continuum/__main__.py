"""``python -m continuum serve MODEL ...``: the same as the ``continuum`` console script."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print("usage: continuum serve MODEL [options]   (continuum serve --help for the options)")
        return 0 if args else 2
    if args[0] != "serve":
        print(f"continuum: unknown command {args[0]!r}; the command is 'serve'", file=sys.stderr)
        return 2
    from .serve.cli import main as serve

    return serve(args[1:])


if __name__ == "__main__":
    sys.exit(main())
