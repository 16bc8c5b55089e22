"""What limits acceptance at T > 0 for a target, computed from the target alone: its entropy along its own
sampled answers, and the acceptance lengths the best possible drafts of each kind would reach.

    python benchmarks/t1_ceiling.py --target pkg:smollm2 --answers EVAL_DIR/answers.jsonl --dataset humaneval \
        [--num-answers 40] [--anchors 4] [--block 16] [--rollouts 32] [--sims 32] [--temperature 1]

Along answers the target sampled at --temperature (an `evaluate` journal, turn 1), at --anchors evenly spaced
answer positions, with the target's own distribution p at that temperature:
- entropy: the mean entropy of p per answer token (nats), and the mean probability of its argmax;
- perfect greedy draft: proposes the target's own greedy continuation from the anchor, each proposal kept with
  probability p(x); expected block length 1 + sum_k prod_{j<=k} p_j(x_j | x_<j);
- perfect marginal draft: the best a DFlash draft can do when it samples each block slot on its own: slot k
  drawn from the target's marginal q_k (p averaged over --rollouts continuations the target samples itself),
  kept with probability min(1, p_k(x_k | x_<k) / q_k(x_k)); mean over --sims drafted blocks of the expected
  block length (the accept probabilities multiplied, not sampled);
- perfect marginal argmax: that draft proposing the argmax of each q_k, kept with probability p of it.
Prints a table; not a test. Minutes on a CPU for 40 answers.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
from pathlib import Path

import torch

from nemo_dflash.core import expected_block_length
from nemo_dflash.inference.evaluate import encode_chat, load_prompt_set
from nemo_dflash.inference.spec_decode import crop_dynamic_cache
from nemo_dflash.recipes._cli import resolve_device_dtype
from nemo_dflash.sampling import SamplingParams
from nemo_dflash.target.loading import load_target

log = logging.getLogger("t1_ceiling")


def repeated(cache, n: int):
    c = copy.deepcopy(cache)
    c.batch_repeat_interleave(n)
    return c


@torch.inference_mode()
def anchor_figures(model, cache, anchor_tok: int, pos: int, k: int, s: SamplingParams, rollouts: int, sims: int,
                   g: torch.Generator) -> dict[str, float]:
    """The three ceilings at one anchor: `cache` holds the context before the anchor token (at `pos`)."""
    dev = next(model.parameters()).device

    def step(c, toks: torch.Tensor, at: int) -> torch.Tensor:  # [N, L] tokens from position `at` -> [N, L, V]
        ids = torch.arange(at, at + toks.shape[1], device=dev).expand(toks.shape[0], -1)
        return model(input_ids=toks, past_key_values=c, use_cache=True, position_ids=ids).logits.float()

    # perfect greedy draft: the target's own greedy continuation, each kept with p of it
    c, tok, acc = copy.deepcopy(cache), torch.tensor([[anchor_tok]], device=dev), []
    for i in range(k):
        logits = step(c, tok, pos + i)[:, -1]
        x = logits.argmax(-1, keepdim=True)
        acc.append(s.probs(logits).gather(-1, x))
        tok = x
    greedy = float(expected_block_length(torch.cat(acc, -1))[0])
    # the marginals q_k: p at slot k averaged over the target's own sampled continuations
    c, tok, q = repeated(cache, rollouts), torch.full((rollouts, 1), anchor_tok, device=dev), []
    for i in range(k):
        p = s.probs(step(c, tok, pos + i)[:, -1])
        q.append(p.mean(0))
        tok = torch.multinomial(p, 1, generator=g)
    q = torch.stack(q)  # [K, V]
    # a draft sampling each slot from q_k on its own, verified against p along its own proposals
    x = torch.stack([torch.multinomial(q[i], sims, replacement=True, generator=g) for i in range(k)], 1)  # [S, K]
    p = s.probs(step(repeated(cache, sims), torch.cat([torch.full((sims, 1), anchor_tok, device=dev), x[:, :-1]], 1),
                     pos))  # [S, K, V]: row k judges slot k + 1
    ratio = (p.gather(-1, x.unsqueeze(-1)).squeeze(-1) / q.gather(-1, x.T).T).clamp(max=1.0)
    marginal = float(expected_block_length(ratio).mean())
    # that draft proposing each marginal's argmax
    xa = q.argmax(-1).view(1, -1)
    pa = s.probs(step(copy.deepcopy(cache), torch.cat([torch.tensor([[anchor_tok]], device=dev), xa[:, :-1]], 1), pos))
    marginal_argmax = float(expected_block_length(pa.gather(-1, xa.unsqueeze(-1)).squeeze(-1))[0])
    return {"greedy": greedy, "marginal": marginal, "marginal_argmax": marginal_argmax}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True)
    p.add_argument("--answers", required=True, type=Path, help="an evaluate answers.jsonl at --temperature")
    p.add_argument("--dataset", default="humaneval")
    p.add_argument("--num-answers", type=int, default=40)
    p.add_argument("--anchors", type=int, default=4, help="anchors per answer, evenly spaced")
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--rollouts", type=int, default=32)
    p.add_argument("--sims", type=int, default=32)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-answer-tokens", type=int, default=1024)
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    s = SamplingParams(args.temperature, args.top_p)
    device, dtype = resolve_device_dtype(args.device, args.dtype)
    rows = [json.loads(x) for x in args.answers.read_text().splitlines() if x.strip()]
    rows = [r for r in rows if r.get("dataset") == args.dataset and "answers" in r
            and SamplingParams.from_key(str(r.get("temperature"))) == SamplingParams(args.temperature)]
    if not rows:
        raise SystemExit(f"error: no {args.dataset} answers at T={args.temperature:g} in {args.answers}")
    _, prompts = load_prompt_set(args.dataset)
    by_id = {x.id: x for x in prompts}
    model, tokenizer = load_target(args.target, dtype=dtype, device=device)
    g = torch.Generator(device=device).manual_seed(0)
    ent, top, figs, k = [], [], [], args.block - 1
    with torch.inference_mode():
        for r in rows[: args.num_answers]:
            turn1 = next(a for a in r["answers"] if a["turn"] == 1)
            prompt = by_id[r["id"]]
            prompt_ids = encode_chat(tokenizer, prompt.history() + [{"role": "user", "content": prompt.turns[0]}])
            out_ids = turn1["output_ids"][: args.max_answer_tokens]
            if len(out_ids) < args.block + 2:
                continue
            seq = torch.tensor([prompt_ids + out_ids], device=device)
            out = model(input_ids=seq, use_cache=True)
            pl = len(prompt_ids)
            probs = s.probs(out.logits[0, pl - 1 : -1])  # p at every answer token
            ent.append(-(probs * probs.clamp(min=1e-30).log()).sum(-1))
            top.append(probs.max(-1).values)
            last = pl + len(out_ids) - k - 1
            for a in torch.linspace(pl, last, args.anchors).long().tolist():
                cache = copy.deepcopy(out.past_key_values)
                crop_dynamic_cache(cache, a)
                figs.append(anchor_figures(model, cache, int(seq[0, a]), a, k, s, args.rollouts, args.sims, g))
    ent_t, top_t = torch.cat(ent), torch.cat(top)
    res = {"dataset": args.dataset, "answers": len(ent), "anchors": len(figs), "block_size": args.block,
           "sampling": s.label, "answer_tokens": int(ent_t.numel()), "mean_entropy_nats": float(ent_t.mean()),
           "mean_top_probability": float(top_t.mean()),
           **{f"ceiling_{key}": sum(f[key] for f in figs) / len(figs) for key in figs[0]},
           "rollouts": args.rollouts, "sims": args.sims, "answers_file": str(args.answers)}
    log.info("%s, %s, block %d: %d answers (turn 1), %d anchors, %d answer tokens", args.dataset, s.label,
             args.block, res["answers"], res["anchors"], res["answer_tokens"])
    log.info("| figure | value |\n| --- | ---: |")
    for key, label in (("mean_entropy_nats", "target entropy per token (nats)"),
                       ("mean_top_probability", "target probability of its argmax"),
                       ("ceiling_greedy", "perfect greedy draft: expected tokens a step"),
                       ("ceiling_marginal", "perfect marginal draft, sampled"),
                       ("ceiling_marginal_argmax", "perfect marginal draft, argmax proposals")):
        log.info("| %s | %.3f |", label, res[key])
    if args.json:
        args.json.write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
