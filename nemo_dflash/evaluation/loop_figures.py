"""The figures of a speedup measured on answers that do not loop (benchmarks/decode.py concurrency): a looping
answer repeats itself and is accepted almost whole, so it flatters tau and the speedup; these leave such answers
out, on both sides, batch by batch."""

from __future__ import annotations

import statistics
from typing import Any, Sequence


def answer_loops(o: Any, stops: Sequence[int]) -> bool:
    """Whether an answer falls into a repetition loop (`data.loops`, as `evaluate` counts them)."""
    from nemo_dflash.data.loops import find_loop_start

    body = o.output_ids[:-1] if o.output_ids and o.output_ids[-1] in set(stops) else o.output_ids
    return find_loop_start(body) is not None


def no_loop_figures(o_plain: list[Any], o_spec: list[Any], per_call: int, b_plain: list[float],
                    b_spec: list[float], n_plain: list[int], n_spec: list[int], stops: Sequence[int]) -> dict[str, Any]:
    """The figures on answers that do not loop: the speculative answers' loop share and tau without them, and
    the speedup over the batches (calls) where no answer loops on either side (None when every one does)."""
    spec_loops = [answer_loops(o, stops) for o in o_spec]
    either = [answer_loops(p, stops) or s for p, s in zip(o_plain, spec_loops)]
    clean = [not any(either[i : i + per_call]) for i in range(0, len(o_spec), per_call)]
    steps = [a for o, lp in zip(o_spec, spec_loops) if not lp for a in o.acceptance_lengths]
    keep = [k for k, c in enumerate(clean) if c]
    speedup = None
    if keep and sum(b_plain[k] for k in keep) > 0 and sum(b_spec[k] for k in keep) > 0:
        speedup = ((sum(n_spec[k] for k in keep) / sum(b_spec[k] for k in keep))
                   / (sum(n_plain[k] for k in keep) / sum(b_plain[k] for k in keep)))
    return {"loop_share": sum(spec_loops) / len(o_spec), "tau_no_loop": statistics.mean(steps) if steps else None,
            "speedup_no_loop": speedup, "batches_no_loop": len(keep)}
