"""Print tests/slow.txt's list from a `pytest --durations=0` log: the tests that took >= --seconds (setup,
call and teardown together), sorted."""

from __future__ import annotations

import argparse
import re
import sys

LINE = re.compile(r"^([0-9.]+)s (call|setup|teardown)\s+(\S+)")
HEADER = """# Tests `make test-fast` leaves to `make test` (marked `slow` by tests/conftest.py): the real-model,
# multi-process and other tests that took >= 0.6 s on the 2-core CPU machine. Regenerate with
#   pytest -q tests --durations=0 -p no:cacheprovider > LOG && python tests/slow_list.py LOG --seconds 0.6 > tests/slow.txt
"""


def slow_ids(lines, seconds: float) -> list[str]:
    per: dict[str, float] = {}
    for line in lines:
        m = LINE.match(line)
        if m:
            per[m.group(3)] = per.get(m.group(3), 0.0) + float(m.group(1))
    return sorted(n for n, t in per.items() if t >= seconds)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("log")
    p.add_argument("--seconds", type=float, default=0.6)
    args = p.parse_args()
    with open(args.log) as f:
        sys.stdout.write(HEADER + "".join(n + "\n" for n in slow_ids(f, args.seconds)))


if __name__ == "__main__":
    main()
