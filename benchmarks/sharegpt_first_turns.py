"""The bundled ShareGPT conversations cut after their first answer, in the same order.

    python benchmarks/sharegpt_first_turns.py OUT.jsonl

`regenerate --turns first` only reads [system?, user] of each conversation, so this file (~1/4
of the 27 MB wheel's size) gives it exactly the same pool, shuffle and selection as `--data sharegpt`:
it is how the ShareGPT prompts travel to a GPU machine that cannot install the wheel.
"""

from __future__ import annotations

import json
import sys

from nemo_dflash.data import default_sharegpt_path, read_conversations
from nemo_dflash.regenerate import split_prompt


def main() -> None:
    n = 0
    with open(sys.argv[1], "w", encoding="utf-8") as f:
        for conv in read_conversations(default_sharegpt_path()):
            system, users = split_prompt(conv.messages, "first")  # exactly what regenerate reads
            msgs = conv.messages if not users else system + [
                {"role": "user", "content": users[0]}, {"role": "assistant", "content": "(regenerated)"}]
            f.write(json.dumps({"messages": msgs}, ensure_ascii=False) + "\n")
            n += 1
    print(f"{n} conversations -> {sys.argv[1]}")


if __name__ == "__main__":
    main()
