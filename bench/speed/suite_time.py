"""Where the test suite's time goes: the ``--durations=0`` table of a ``make test`` log, summed
by test folder (``tests/flows``, ``tests/reliability``, ..., the top-level files as
``tests/<file>``) and by phase (``setup``: the fixtures a test builds; ``call``: the test
itself; ``teardown``), with the longest tests and the longest fixture set-ups; with two logs,
each folder before and after.

Seconds are worker seconds: with three pytest workers on two cores each test's time includes
waiting for a core, so a folder's sum is its share of the load, not wall time. The wall time of
the run is pytest's own last line (``N passed ... in S s``).

    git clone . /tmp/suite && cd /tmp/suite && sed -i 's/--durations=30/--durations=0/' Makefile
    make test > /tmp/suite.log 2>&1
    .venv/bin/python -m bench.speed.suite_time /tmp/suite.log [--before OLD.log] [--out F.json]
    .venv/bin/python -m bench.speed.suite_time --smoke     # a built-in sample log
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path

from bench import common

ROW = re.compile(r"^(\d+(?:\.\d+)?)s (setup|call|teardown)\s+(\S+)$")
"""A row of pytest's durations table: ``12.34s call     tests/flows/test_flow.py::test_x``."""

SUMMARY = re.compile(r"^=* ?(\d+) passed.* in (\d+(?:\.\d+)?)s")
"""pytest's last line: the number passed and the run's wall seconds."""

SAMPLE = """\
============================= slowest durations =============================
120.50s call     tests/flows/test_flow.py::test_a_first_run
45.25s setup    tests/flows/test_flow.py::test_a_first_run
0.50s teardown tests/flows/test_flow.py::test_a_first_run
3.75s call     tests/math/test_losses.py::test_clip[1]
2.00s call     tests/test_layering.py::test_rooms
========= 3 passed in 130.25s (0:02:10) =========
"""
"""What ``--smoke`` reads in place of a log."""


def folder_of(node: str) -> str:
    """``tests/flows/test_x.py::test_y[a]`` -> ``tests/flows``; a top-level file keeps its
    name (``tests/test_layering.py``)."""
    path = node.split("::")[0]
    parts = path.split("/")
    return "/".join(parts[:2]) if len(parts) > 2 else path


def read_log(text: str) -> dict:
    """The durations rows of the first pytest run in ``text`` (``make test`` may run a second,
    the AVX2 rerun, after it), summed by folder and phase, with the run's wall seconds."""
    rows: list[tuple[float, str, str]] = []
    wall, passed = None, None
    for line in text.splitlines():
        line = line.strip()
        found = ROW.match(line)
        if found:
            rows.append((float(found[1]), found[2], found[3]))
            continue
        summary = SUMMARY.match(line)
        if summary and rows:
            passed, wall = int(summary[1]), float(summary[2])
            break
    folders: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    tests: dict[str, set[str]] = defaultdict(set)
    per_test: dict[str, float] = defaultdict(float)
    for seconds, phase, node in rows:
        folder = folder_of(node)
        folders[folder][phase] += seconds
        tests[folder].add(node)
        per_test[node] += seconds
    table = {
        folder: {
            "tests_timed": len(tests[folder]),
            **{phase: round(sums.get(phase, 0.0), 1) for phase in ("setup", "call", "teardown")},
            "total": round(sum(sums.values()), 1),
        }
        for folder, sums in folders.items()
    }
    setups = sorted((row for row in rows if row[1] == "setup"), reverse=True)[:10]
    return {
        "passed": passed,
        "wall_s": wall,
        "worker_s": round(sum(row[0] for row in rows), 1),
        "folders": dict(sorted(table.items(), key=lambda item: -item[1]["total"])),
        "longest_tests": [
            {"test": node, "seconds": round(seconds, 1)}
            for node, seconds in sorted(per_test.items(), key=lambda item: -item[1])[:25]
        ],
        "longest_setups": [{"test": node, "seconds": seconds} for seconds, _, node in setups],
    }


def markdown(after: dict, before: dict | None) -> str:
    """The folder table, with the before column when there is one."""
    head = "| folder | tests timed | setup s | call s | total s |"
    rule = "|---|---:|---:|---:|---:|"
    if before:
        head += " before, total s |"
        rule += "---:|"
    lines = [head, rule]
    for folder, row in after["folders"].items():
        line = f"| `{folder}` | {row['tests_timed']} | {row['setup']:.0f} | {row['call']:.0f} | "
        line += f"{row['total']:.0f} |"
        if before:
            old = before["folders"].get(folder)
            line += f" {old['total']:.0f} |" if old else " |"
        lines.append(line)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("log", nargs="?", type=Path, help="a make test log (--durations=0)")
    parser.add_argument("--before", type=Path, help="an earlier log, to compare with")
    parser.add_argument("--out", type=Path, default=common.ROOT / "bench/results/suite_time.json")
    parser.add_argument("--smoke", action="store_true", help=common.HELP)
    args = parser.parse_args()
    if args.smoke:
        after, before = read_log(SAMPLE), None
        args.out = common.output_folder("suite_time") / "suite_time.json"
    else:
        if args.log is None:
            parser.error("give the log of a make test run (or --smoke)")
        after = read_log(args.log.read_text(errors="replace"))
        before = read_log(args.before.read_text(errors="replace")) if args.before else None
    if not after["folders"]:
        raise SystemExit("no durations table in the log: run pytest with --durations=0")
    print(markdown(after, before))
    print(f"wall {after['wall_s']} s, {after['passed']} passed, {after['worker_s']} worker-s")
    result = {"after": after, "before": before, "machine": common.machine()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
