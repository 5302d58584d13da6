"""``python -m aioloader``: command-line entry point (argument parsing only).

Without a subcommand it prints the help and exits 0 (it is what a newcomer types first).

Subcommands:

- ``doctor``: check this machine for what breaks data loaders in containers and clusters
  (``/dev/shm``, ``ulimit -n``, start methods, uvloop, CPUs, torch and CUDA) and print what to
  change. Exits 1 when a check fails, else 0. The checks live in ``aioloader._doctor``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m aioloader",
        description="aioloader: an asyncio-native data loader for deep learning.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.add_parser(
        "doctor",
        help="check this machine for what breaks data loaders, and print what to change",
        description=(
            "Check /dev/shm against the loader's shared-memory budget, the open-file limit, "
            "multiprocessing start methods, uvloop, usable CPUs, torch and CUDA, and the Python "
            "version. Each check prints OK, WARN or FAIL with a one-line fix. Exits 1 when a "
            "check fails, else 0."
        ),
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``), run the command and return its exit code."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:  # `python -m aioloader` alone: the help, not a usage error
        parser.print_help()
        return 0
    if args.command == "doctor":
        from . import __version__, _doctor

        checks = _doctor.diagnose(_doctor.observe())
        print(_doctor.render(checks, version=__version__))
        return _doctor.exit_code(checks)
    raise AssertionError(f"unhandled command {args.command!r}")  # argparse allows no other


if __name__ == "__main__":
    sys.exit(main())
