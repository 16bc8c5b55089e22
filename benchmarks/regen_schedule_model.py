"""A step-level model of the slot engine's schedule: how the admission order of conversations sets
the tail of a whole-set regeneration (the last conversations run turn after turn in a batch that
is emptying). A model, not a timing: prefill time and the decode window are left out.

    python benchmarks/regen_schedule_model.py --data regen.jsonl [--slots 2048] [--json OUT]

--data is a regenerated set (each assistant message is one answer; its length in tokens is taken
as characters / 4). Each step, every busy slot generates one token; a conversation's next turn
continues in its slot at the next refill, and a refill happens once 1/16 of the slots are idle
(generation.REFILL_FRACTION) or nothing is waiting. Prints steps to finish and the tail (steps
run with fewer than half the slots busy) for the given order, a shuffle (what the `regenerate`
recipe's selection does), most user turns first (the recipe's schedule; --sharegpt-turns counts
them in the source, as the recipe does), and longest conversation first (an oracle: it needs the
answers' lengths in advance).
"""

from __future__ import annotations

import argparse
import collections
import gzip
import heapq
import json
import os
import random
import sys
from typing import Any, Optional, Sequence


def load_answers(path: str, source_turns: Optional[list[int]] = None) -> list[tuple[list[int], int]]:
    """Each conversation: (its answers' token lengths, its user turns: in ``source_turns`` at the
    record's source line when given, else those answered)."""
    opener = gzip.open if path.endswith(".gz") else open
    out = []
    with opener(path, "rt", encoding="utf-8") as f:
        for line in f:
            record = json.loads(line)
            messages = record["messages"]
            answers = [max(1, len(m["content"]) // 4) for m in messages if m["role"] == "assistant"]
            users = sum(m["role"] == "user" for m in messages)
            if source_turns is not None:
                users = source_turns[int(record["source"].rsplit(":", 1)[1]) - 1]
            if answers:
                out.append((answers, users))
    return out


def sharegpt_user_turns() -> list[int]:
    """User turns of every conversation of the bundled ShareGPT file, in file order (the order of
    benchmarks/sharegpt_first_turns.py's lines, which the records' sources number from 1)."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from nemo_dflash.data import SHAREGPT_FILE, read_conversations
    from nemo_dflash.target.loading import package_file
    from nemo_dflash.data.regenerate import split_prompt

    return [len(split_prompt(c.messages, "all")[1]) for c in read_conversations(str(package_file(*SHAREGPT_FILE)))]


def simulate(convs: Sequence[list[int]], slots: int, refill_fraction: int = 16) -> dict[str, Any]:
    """Steps until every turn is answered, and the steps with under half of the slots busy.
    Event-driven: nothing changes between two answers' ends, so time jumps from end to end."""
    pending = collections.deque(range(len(convs)))
    ends: list[tuple[int, int, int, int]] = []  # heap of (step it ends, slot, conversation, turn)
    held: list[tuple[int, int, int]] = []  # (slot, conversation, turn just answered) with a next turn
    free = list(range(slots))
    now, tail, tokens = 0, 0, 0
    while pending or held or ends:
        idle = len(free) + len(held)
        if idle >= max(1, slots // refill_fraction) or len(free) >= len(pending) or not ends:
            for s, c, t in held:
                heapq.heappush(ends, (now + convs[c][t + 1], s, c, t + 1))
            held = []
            while free and pending:
                c = pending.popleft()
                heapq.heappush(ends, (now + convs[c][0], free.pop(), c, 0))
        nxt = ends[0][0]
        busy = len(ends)
        tokens += busy * (nxt - now)
        tail += (nxt - now) if busy < slots // 2 else 0
        now = nxt
        while ends and ends[0][0] == now:
            _, s, c, t = heapq.heappop(ends)
            if t + 1 < len(convs[c]):
                held.append((s, c, t))
            else:
                free.append(s)
    return {"steps": now, "tail_steps": tail, "tokens": tokens, "mean_busy": round(tokens / max(now, 1), 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True)
    p.add_argument("--slots", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sharegpt-turns", action="store_true",
                   help="order by the user turns of each record's ShareGPT source (what `regenerate` knows before "
                        "it starts: --data from sharegpt_first_turns.py --turns=all), not by the turns answered")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    data = load_answers(args.data, sharegpt_user_turns() if args.sharegpt_turns else None)
    shuffled = data[:]
    random.Random(args.seed).shuffle(shuffled)
    orders = {
        "given": data,
        "shuffled": shuffled,
        "most turns first": sorted(shuffled, key=lambda x: -x[1]),  # stable: the recipe's schedule
        "longest chain first (oracle)": sorted(shuffled, key=lambda x: -sum(x[0])),  # needs the answers
    }
    turns = sum(len(a) for a, _ in data)
    tokens = sum(sum(a) for a, _ in data)
    chain = max(sum(a) for a, _ in data)
    print(f"# {len(data)} conversations, {turns} turns, {tokens} answer tokens, {args.slots} slots (tokens = "
          f"characters / 4): {tokens / args.slots:.0f} steps if every slot were busy; the longest conversation "
          f"alone takes {chain}")
    print(f"{'order':<30} {'steps':>7} {'tail steps':>11} {'mean busy':>10}")
    rows = {}
    for name, convs in orders.items():
        r = simulate([a for a, _ in convs], args.slots)
        rows[name] = r
        print(f"{name:<30} {r['steps']:>7} {r['tail_steps']:>11} {r['mean_busy']:>10}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"data": args.data, "slots": args.slots, "turns_from": "sharegpt source" if args.sharegpt_turns
                       else "answered", "conversations": len(data), "turns": turns,
                       "answer_tokens": tokens, "dense_steps": round(tokens / args.slots, 1), "longest_chain": chain,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
