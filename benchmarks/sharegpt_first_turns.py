"""The bundled ShareGPT conversations cut to what `regenerate` reads, in order.

    python benchmarks/sharegpt_first_turns.py OUT.jsonl [SRC] [--turns first|all]   # SRC: the bundled file

`regenerate --turns first` only reads [system?, first user turn] of each conversation, and
`--turns all` [system?, every user turn]: the source's answers are replaced anyway. So this
file (first turns: 16 MB, 4 MB gzipped; all turns: see docs/data.md; against the 27 MB wheel)
gives it exactly the same pool, shuffle and selection as `--data sharegpt`: it is how the
ShareGPT prompts travel to a GPU machine that cannot install the wheel
(tests/test_regenerate.py checks the equivalence).
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from nemo_dflash.data import SHAREGPT_FILE, read_conversations  # noqa: E402
from nemo_dflash.target.loading import package_file  # noqa: E402
from nemo_dflash.data.regenerate import split_prompt  # noqa: E402


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
    args = [a for a in sys.argv[1:] if not a.startswith("--turns")]
    turns = next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--turns=")), "first")
    src = args[1] if len(args) > 1 else str(package_file(*SHAREGPT_FILE))
    n = write_first_turns(src, args[0], turns)
    print(f"{n} conversations -> {sys.argv[1]}")


if __name__ == "__main__":
    main()
