"""``python -m bench._options MODULE [ARGS...]``: run a benchmark module as ``python -m MODULE
ARGS`` would, up to the point where it has parsed its options, and stop there.

``bench/gpu/gpu.sh --options-only`` runs each of its steps this way, so that an option the
script passes and a step no longer takes (renamed, removed, a choice gone) fails in seconds,
where the full smoke run of every step takes minutes (``make soak`` runs that one)."""

from __future__ import annotations

import argparse
import runpy
import sys


class OptionsRead(Exception):
    """Raised by the patched ``parse_args`` once the options parsed."""


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit("usage: python -m bench._options MODULE [ARGS...]")
    module, args = sys.argv[1], sys.argv[2:]
    parse_args = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        parse_args(self, args, namespace)  # exits 2 naming the option it does not take
        raise OptionsRead

    argparse.ArgumentParser.parse_args = parse_then_stop  # type: ignore[method-assign]
    sys.argv = [module, *args]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except OptionsRead:
        print(f"{module}: options read: {' '.join(args)}")
        return
    sys.exit(f"{module} ended without parsing options")


if __name__ == "__main__":
    main()
