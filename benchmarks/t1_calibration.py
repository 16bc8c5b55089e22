"""How well a draft's sampling distribution fits the target's at T > 0, and what a draft temperature would give.

    python benchmarks/t1_calibration.py --target pkg:smollm2 --draft EXPORT_DIR \
        --answers EVAL_DIR/answers.jsonl --dataset mtbench [--num-answers 40] [--tokens 192] \
        [--temperature 1] [--draft-temperatures 0.7,1,1.3,1.6,2] [--device cpu --dtype fp32]

At T > 0 speculative sampling keeps slot k of a block with probability min(1, p/q) for a token drawn
from the draft's q, so a slot is kept with probability sum_v min(p_v, q_v): the overlap of the two
distributions. Along answers the target sampled itself (an `evaluate` journal at this temperature,
turn 1), every answer position is an anchor; the draft's block from it gives q for slots 1..B-1 and
the target's teacher-forced logits give p. Per anchor, the expected acceptance length is
1 + sum_k prod_{j<=k} overlap_j (slots treated as independent along the sampled path); the mean over
anchors is printed beside the overlap of slot 1, for the draft sampled at the target's temperature,
at others (q = softmax(z / t_draft)), and for greedy proposals (the draft's argmax, kept with
probability p of it). Any q keeps the output distribution equal to the target's;
only acceptance changes. Prints a table; not a test.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import torch

from nemo_dflash.core import draft_block_hidden
from nemo_dflash.draft.build import load_draft_for_target
from nemo_dflash.inference.evaluate import encode_chat, load_prompt_set
from nemo_dflash.recipes._cli import resolve_device_dtype
from nemo_dflash.target import HFDFlashTargetModel
from nemo_dflash.target.loading import load_target

log = logging.getLogger("t1_calibration")


def overlaps(p_logits: torch.Tensor, q_logits: torch.Tensor, temperature: float, draft_temps: list[float]) -> torch.Tensor:
    """[A, K, V] target and draft logits -> [len(draft_temps) + 1, A, K] overlaps sum_v min(p_v, q_v), the
    last row for a greedy proposal (q one-hot on the draft's argmax: the overlap is p of that token)."""
    p = torch.softmax(p_logits.float() / temperature, dim=-1)
    rows = [torch.minimum(p, torch.softmax(q_logits.float() / t, dim=-1)).sum(-1) for t in draft_temps]
    rows.append(p.gather(-1, q_logits.argmax(-1, keepdim=True)).squeeze(-1))
    return torch.stack(rows)


def expected_tau(ov: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[..., A, K] overlaps (slots past the answer masked by `valid` [A, K]) -> [..., A] 1 + sum_k prod_{j<=k}."""
    return 1.0 + torch.cumprod(ov * valid, dim=-1).sum(-1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True)
    p.add_argument("--draft", required=True)
    p.add_argument("--answers", required=True, type=Path, help="an evaluate answers.jsonl at --temperature")
    p.add_argument("--dataset", default="mtbench")
    p.add_argument("--num-answers", type=int, default=40)
    p.add_argument("--tokens", type=int, default=192, help="answer tokens used per answer (its first N)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--draft-temperatures", default="0.7,1,1.3,1.6,2")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    draft_temps = [float(x) for x in args.draft_temperatures.split(",")]
    device, dtype = resolve_device_dtype(args.device, args.dtype)
    rows = [json.loads(x) for x in args.answers.read_text().splitlines() if x.strip()]
    rows = [r for r in rows if "header" not in r and float(r.get("temperature", -1)) == args.temperature
            and r.get("dataset") == args.dataset]
    if not rows:
        raise SystemExit(f"error: no {args.dataset} answers at T={args.temperature:g} in {args.answers}")
    name, prompts = load_prompt_set(args.dataset)
    by_id = {x.id: x for x in prompts}
    model, tokenizer = load_target(args.target, dtype=dtype, device=device)
    draft = load_draft_for_target(args.draft, model.config, tokenizer, device=device, dtype=dtype)
    target = HFDFlashTargetModel(model, draft.target_layer_ids)
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    blk = int(draft.config.block_size)
    taus, slot1, used = [], [], 0
    with torch.inference_mode():
        for r in rows[: args.num_answers]:
            turn1 = next(a for a in r["answers"] if a["turn"] == 1)
            prompt = by_id[r["id"]]
            prompt_ids = encode_chat(tokenizer, prompt.history() + [{"role": "user", "content": prompt.turns[0]}])
            out_ids = turn1["output_ids"][: args.tokens]
            n = len(out_ids)
            if n < 2:
                continue
            seq = torch.tensor([prompt_ids + out_ids], dtype=torch.long, device=device)
            feats, out = target.forward_features(seq, need_logits=True)
            t_logits = out.logits[0]  # row s predicts token s + 1
            pl = len(prompt_ids)
            anchors = torch.arange(pl, pl + n - 1, device=device).unsqueeze(0)  # anchor token: output index i
            hidden = draft_block_hidden(draft, embed, seq, feats, torch.ones_like(seq), anchors,
                                        torch.ones_like(anchors, dtype=torch.bool), blk, int(draft.mask_token_id),
                                        backend="sdpa")
            a = anchors.shape[1]
            q_logits = head(hidden.view(a, blk, -1)[:, 1:].to(head.weight.dtype))  # [A, K, V]: slot k -> index i + k
            pos = anchors[0].view(-1, 1) + torch.arange(blk - 1, device=device).view(1, -1)  # judged by row anchor+k-1
            valid = (pos < pl + n - 1).float()  # slot k of anchor i needs output index i + k to exist
            p_logits = t_logits[pos.clamp(max=seq.shape[1] - 1)]
            ov = overlaps(p_logits, q_logits, args.temperature, draft_temps)  # [D, A, K]
            taus.append(expected_tau(ov, valid))
            slot1.append(ov[:, :, 0])
            used += 1
    tau = torch.cat(taus, dim=1).mean(1)
    s1 = torch.cat(slot1, dim=1).mean(1)
    log.info("%s: %d answers (turn 1, first %d tokens), target T=%g, block %d, %s %s", name, used, args.tokens,
             args.temperature, blk, device, dtype)
    log.info("| draft temperature | slot-1 overlap | expected tau |\n| ---: | ---: | ---: |")
    for t, a, e in zip([f"{t:g}" for t in draft_temps] + ["greedy (argmax)"], s1.tolist(), tau.tolist()):
        log.info("| %s | %.3f | %.3f |", t, a, e)


if __name__ == "__main__":
    main()
