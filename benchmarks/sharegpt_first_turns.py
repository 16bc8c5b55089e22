"""The bundled ShareGPT conversations cut to what `regenerate --turns first` reads, in order.

    python benchmarks/sharegpt_first_turns.py OUT.jsonl [SRC]      # SRC: default the bundled file

`regenerate --turns first` only reads [system?, first user turn] of each conversation, so this
file (16 MB, 4 MB gzipped, against the 27 MB wheel) gives it exactly the same pool, shuffle and
selection as `--data sharegpt`: it is how the ShareGPT prompts travel to a GPU machine that
cannot install the wheel (tests/test_regenerate.py checks the equivalence).
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from nemo_dflash.data import default_sharegpt_path, read_conversations  # noqa: E402
from nemo_dflash.regenerate import split_prompt  # noqa: E402


def write_first_turns(src: str, dst: str) -> int:
    """One line per conversation of `src` (same order, so the same seeded shuffle): its system
    prompt and first user turn, and a placeholder answer. Conversations with no user turn are
    kept whole so that the pool, and therefore the shuffle, does not change."""
    n = 0
    with open(dst, "w", encoding="utf-8") as f:
        for conv in read_conversations(src):
            system, users = split_prompt(conv.messages, "first")
            msgs = conv.messages if not users else system + [
                {"role": "user", "content": users[0]}, {"role": "assistant", "content": "(regenerated)"}]
            f.write(json.dumps({"messages": msgs}, ensure_ascii=False) + "\n")
            n += 1
    return n


def main() -> None:
    src = sys.argv[2] if len(sys.argv) > 2 else default_sharegpt_path()
    n = write_first_turns(src, sys.argv[1])
    print(f"{n} conversations -> {sys.argv[1]}")


if __name__ == "__main__":
    main()
