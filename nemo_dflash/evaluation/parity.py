"""Serving parity: does our decoder accept what the DFlash decoding rules, applied to the exported
checkpoint as the engines read it, accept?

The reference here is written from the rules alone (docs/serve.md, "Serving parity"), with no
cache and nothing shared with `spec_decode` or the draft module:

- the draft is rebuilt from the serving `config.json` dict and its weights the way the engines
  build a Qwen3-style DFlash draft: fc + hidden_norm on the concatenated target layers, per layer
  RMSNorm -> q/k/v (k/v over [context ; block]) -> q_norm/k_norm -> neox RoPE over
  int(head_dim * partial_rotary_factor) dims at theta/scaling from the config -> non-causal
  attention -> o_proj -> residual -> RMSNorm -> SwiGLU -> residual, final norm; a DFlash2 draft (docs/serve.md,
  "DFlash2 drafts") with its grouped causal convolutions around each sublayer, `h += conv_out(attn(conv_in(norm(h))))`
  and the same around the MLP, their per-token kernels `base_kernel + kernel_projection(norm(h))`, over the block;
- each slot's token is its argmax, or for a DFlash2 draft with a selector the T=0 walk: the unary logits
  `softcap(output_multiplier * lm_head(h))` (applied once), each slot's top-K candidates, left to right the
  candidate of the highest pair score given the token chosen before it (the anchor before the first);
- each step drafts `[last, MASK x (B-1)]` against the target features (HF `output_hidden_states`,
  layer i = hidden_states[i + 1]) of every verified token before `last`, at positions
  0..p-1 for the context and p..p+B-1 for the block; accepted = longest prefix where draft[k] == the
  target's argmax at k; plus the target's bonus. At T=0 the argmaxes along an accepted prefix are the target's
  greedy tokens, so the steps walk one full forward over the greedy answer (each of its tokens checked to be the
  forward's argmax) instead of running a forward each.

`check_serving_parity` runs both on a few prompts at T=0 and compares (1) the drafted tokens of our
draft module (its walk, for a selector) and of the rebuilt one on the same context, and (2) our decoder's output and
per-step acceptance with the reference's. A mismatch raises `ServingParityError` (one line). The reference reads the
serving config dict and weights only (plain torch, fp32), nothing of `nemo_dflash.draft`.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from nemo_dflash.engine.acceptance import greedy_accepted_list

logger = logging.getLogger(__name__)

# A few short prompts, enough to run a dozen blocks each.
PARITY_PROMPTS = (
    "Write a Python function that returns the n-th Fibonacci number.",
    "What is the capital of France? Answer in one sentence.",
    "Explain in two sentences why the sky is blue.",
)


class ServingParityError(ValueError):
    """Our decoder and the reference decoding rules disagree on this draft."""


# ----------------------------------------------------------------------------- the draft, rebuilt


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.float()


def _inv_freq(cfg: Mapping[str, Any], rotary_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling from config.json's rope fields."""
    scaling = dict(cfg.get("rope_scaling") or {})
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    theta = float(cfg["rope_theta"])
    if rope_type == "default":
        return 1.0 / theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim), 1.0
    # Scaled types: transformers' own init functions (what the engines port), on the config as loaded.
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv, attn_scale = ROPE_INIT_FUNCTIONS[rope_type](Qwen3Config.from_dict(dict(cfg)), "cpu")
    return inv.double(), float(attn_scale)


def _neox_rope(x: torch.Tensor, pos: torch.Tensor, inv: torch.Tensor, scale: float) -> torch.Tensor:
    """x [T, heads, head_dim]: rotate-half RoPE on the first 2 * len(inv) dims, the rest untouched."""
    rd = 2 * inv.numel()
    ang = pos.double()[:, None] * inv[None, :]
    cos = (ang.cos() * scale).float()[:, None, :]
    sin = (ang.sin() * scale).float()[:, None, :]
    x1, x2, rest = x[..., : rd // 2], x[..., rd // 2: rd], x[..., rd:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1)


def reference_draft_hidden(weights: Mapping[str, torch.Tensor], cfg: Mapping[str, Any], block_emb: torch.Tensor,
                           context: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The draft's final hidden states [B, H] for block embeddings [B, H] and target features
    [C, n*H] at ``positions`` [C + B], computed from the serving config and weights alone (fp32)."""
    w = {k: v.float() for k, v in weights.items()}
    eps = float(cfg["rms_norm_eps"])
    nh, nkv = int(cfg["num_attention_heads"]), int(cfg["num_key_value_heads"])
    hd = int(cfg["head_dim"])
    rd = int(hd * float(cfg.get("partial_rotary_factor", 1.0)))
    inv, scale = _inv_freq(cfg, rd)
    kc = int(dict(cfg.get("dflash_config") or {}).get("conv_kernel_size") or 0)  # absent: 0, no convolution
    ctx = _rms(context.float() @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
    h = block_emb.float()
    n_blk = h.shape[0]
    for i in range(int(cfg["num_hidden_layers"])):
        p = f"layers.{i}."
        x = _rms(h, w[p + "input_layernorm.weight"], eps)
        conv_in, conv_out = _conv_pair(w, p + "attention_conv.", x, kc, cfg)
        x = conv_in(x)
        kv_in = torch.cat([ctx, x], dim=0)
        q = _rms((x @ w[p + "self_attn.q_proj.weight"].T).view(n_blk, nh, hd), w[p + "self_attn.q_norm.weight"], eps)
        k = _rms((kv_in @ w[p + "self_attn.k_proj.weight"].T).view(-1, nkv, hd), w[p + "self_attn.k_norm.weight"], eps)
        v = (kv_in @ w[p + "self_attn.v_proj.weight"].T).view(-1, nkv, hd)
        q = _neox_rope(q, positions[-n_blk:], inv, scale)
        k = _neox_rope(k, positions, inv, scale)
        k, v = k.repeat_interleave(nh // nkv, dim=1), v.repeat_interleave(nh // nkv, dim=1)
        att = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
        o = torch.einsum("hqk,khd->qhd", att.softmax(-1), v).reshape(n_blk, nh * hd)
        h = h + conv_out(o @ w[p + "self_attn.o_proj.weight"].T)
        x = _rms(h, w[p + "post_attention_layernorm.weight"], eps)
        conv_in, conv_out = _conv_pair(w, p + "mlp_conv.", x, kc, cfg)
        x = conv_in(x)
        gate, up = x @ w[p + "mlp.gate_proj.weight"].T, x @ w[p + "mlp.up_proj.weight"].T
        h = h + conv_out((F.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T)
    return _rms(h, w["norm.weight"], eps)


# ----------------------------------------------------------------------------- DFlash2: conv and selector


def _causal_block_conv(z: torch.Tensor, base: torch.Tensor, offsets: torch.Tensor, group: int) -> torch.Tensor:
    """y[i, c] = sum_{t < K, t <= i} (base[t, c] + offsets[i, t, g(c)]) * z[i - t, c] over one block's rows z
    [B, H] (taps before the block's first row are zero); base [K, H], offsets [B, K, G]."""
    y = torch.zeros_like(z)
    for i in range(z.shape[0]):
        for t in range(min(base.shape[0], i + 1)):
            # g(c) = c // group: contiguous channel groups (the page names g(c) only; as our BlockConv groups)
            y[i] += (base[t] + offsets[i, t].repeat_interleave(group)) * z[i - t]
    return y


_Conv = Callable[[torch.Tensor], torch.Tensor]


def _conv_pair(w: Mapping[str, torch.Tensor], prefix: str, z: torch.Tensor, kc: int,
               cfg: Mapping[str, Any]) -> tuple[_Conv, _Conv]:
    """(conv_in, conv_out) of one sublayer of a DFlash2 layer, their per-token kernels from the sublayer's
    normalized input z [B, H]: kernel_projection(z) gives [2 sides, K taps, G groups] offsets per token, added to
    base_kernel [2, K, H]. Both the identity when the config has no convolution (DFlash-1)."""
    if kc == 0:
        return (lambda x: x), (lambda x: x)
    group = int(cfg["dflash_config"].get("conv_group_size") or 0)
    # the page gives the map's width (2 K G) but not its order; (side, tap, group), side major, as our BlockConv
    offsets = (z @ w[prefix + "kernel_projection.weight"].T).view(z.shape[0], 2, kc, -1)
    base = w[prefix + "base_kernel"]
    return ((lambda x: _causal_block_conv(x, base[0], offsets[:, 0], group)),
            (lambda x: _causal_block_conv(x, base[1], offsets[:, 1], group)))


def reference_unary(cfg: Mapping[str, Any], logits: torch.Tensor) -> torch.Tensor:
    """u = softcap(output_multiplier * logits), softcap(x) = c tanh(x / c) when final_logit_softcapping c > 0;
    the plain logits for a DFlash-1 draft (fields absent: multiplier 1, no cap)."""
    dflash = dict(cfg.get("dflash_config") or {})
    u = logits.float() * float(dflash.get("output_multiplier") or 1.0)
    c = float(dflash.get("final_logit_softcapping") or 0.0)
    return c * torch.tanh(u / c) if c > 0 else u


def reference_walk(weights: Mapping[str, torch.Tensor], top_k: int, hidden: torch.Tensor, unary: torch.Tensor,
                   anchor: int) -> list[int]:
    """The selector's T=0 path over drafted slots (hidden [S, H], unary logits [S, V]), left to right: slot k's
    candidates C_k are the top-K of u_k, its token the candidate b of the highest pair score
    u_k(b) + <A[a] * (P h_k), B[b]> given the token a chosen at slot k - 1 (``anchor`` before slot 0); greedy, not
    Viterbi, the lowest candidate index on ties. The page leaves the order of equal unary logits open; here the
    lower token id comes first (torch.topk, which our walk uses, does not promise that order)."""
    a_book = weights["candidate_selector.predecessor_codebook"].float()
    b_book = weights["candidate_selector.successor_codebook"].float()
    proj = weights["candidate_selector.hidden_projection.weight"].float()
    chosen, prev = [], int(anchor)
    for k in range(hidden.shape[0]):
        cand = torch.sort(unary[k].float(), descending=True, stable=True).indices[:top_k]
        scores = unary[k, cand].float() + b_book[cand] @ (a_book[prev] * (proj @ hidden[k].float()))
        prev = int(cand[int(torch.argmax(scores))])  # argmax: the first of equal maxima
        chosen.append(prev)
    return chosen


def reference_proposals(weights: Mapping[str, torch.Tensor], cfg: Mapping[str, Any], hidden: torch.Tensor,
                        head: nn.Module, anchor: int) -> list[int]:
    """The drafted tokens of slots 1..B-1 from the rebuilt draft's states ``hidden`` [B - 1, H]: the selector's
    walk over the unary logits when the config has a selector (DFlash2), else each slot's argmax."""
    unary = reference_unary(cfg, head(hidden.to(head.weight.dtype)).float())
    top_k = int(dict(cfg.get("dflash_config") or {}).get("selector_top_k") or 0)
    if top_k and int(cfg["dflash_config"].get("selector_rank") or 0):
        return reference_walk(weights, top_k, hidden, unary, anchor)
    return unary.argmax(-1).tolist()


# ----------------------------------------------------------------------------- the reference decoder


@dataclass
class ReferenceRun:
    output_ids: list[int]
    acceptance_lengths: list[int] = field(default_factory=list)
    proposals: int = 0        # drafted tokens compared with our draft module's
    proposals_agree: int = 0  # of which equal
    not_greedy_at: Optional[int] = None  # first index where the given tokens are not the target's argmax


def _features(target: nn.Module, ids: list[int], layer_ids: Sequence[int],
              keep: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits of the last ``keep`` positions [keep, V], features [T, n*H]) of one full forward, no cache."""
    import inspect

    dev = next(target.parameters()).device
    extra = {"logits_to_keep": keep} if "logits_to_keep" in inspect.signature(target.forward).parameters else {}
    out = target(input_ids=torch.tensor([ids], device=dev), output_hidden_states=True, use_cache=False, **extra)
    feats = torch.cat([out.hidden_states[i + 1][0] for i in layer_ids], dim=-1)
    return out.logits[0, -keep:].float(), feats


@torch.no_grad()
def reference_acceptance(target: nn.Module, weights: Mapping[str, torch.Tensor], cfg: Mapping[str, Any],
                         prompt_ids: Sequence[int], greedy: Sequence[int], max_new_tokens: int,
                         block_size: Optional[int] = None, stop_ids: Iterable[int] = (),
                         our_draft: Optional[nn.Module] = None) -> ReferenceRun:
    """Greedy DFlash decoding by the rules alone (see the module doc), stepped along ``greedy``: the target's greedy
    continuation of the prompt, stop tokens ignored, at least B tokens past where the answer ends. One full target
    forward checks that each of those tokens is the target's argmax (else `not_greedy_at`, and no steps) and gives
    every position's features; then each step drafts from its anchor with the rebuilt draft and keeps the longest
    prefix of the drafted tokens equal to the target's next tokens, plus the target's own (bonus) token. At T=0 the
    verify's argmaxes along an accepted prefix are these tokens, so no step needs a forward of its own. With
    ``our_draft``, its proposals on each step's context are counted against the rebuilt draft's."""
    dflash = cfg["dflash_config"]
    layer_ids, mask_id = [int(i) for i in dflash["target_layer_ids"]], int(dflash["mask_token_id"])
    blk = int(block_size or cfg["block_size"])
    stops = {int(s) for s in stop_ids}
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    prompt, given = [int(t) for t in prompt_ids], [int(t) for t in greedy]
    logits, feats = _features(target, prompt + given, layer_ids, keep=len(given) + 1)
    nxt = logits.argmax(-1).tolist()  # nxt[k]: the target's token after prompt + given[:k]
    run = ReferenceRun(output_ids=[nxt[0]])
    run.not_greedy_at = next((k for k, (a, b) in enumerate(zip(given, nxt)) if a != b), None)
    if run.not_greedy_at is not None:
        return run
    out = run.output_ids
    while out[-1] not in stops and len(out) < max_new_tokens:
        k0 = len(out)  # nxt index of the first token after the anchor out[-1]
        if k0 + blk > len(nxt):
            raise ValueError(f"reference_acceptance needs {k0 + blk} greedy tokens, was given {len(given)}")
        a = len(prompt) + k0 - 1  # the anchor's position; the context is every verified token before it
        block = torch.tensor([out[-1]] + [mask_id] * (blk - 1), device=feats.device)
        emb, pos = embed(block), torch.arange(a + blk, device=feats.device)
        hid = reference_draft_hidden(weights, cfg, emb, feats[:a], pos)
        drafted = reference_proposals(weights, cfg, hid[1:], head, out[-1])
        if our_draft is not None:
            mine = our_draft(noise_embedding=emb[None].to(our_draft.fc.weight.dtype), target_hidden=feats[None, :a],
                             position_ids=pos[None], block_size=blk)[0, 1:]
            unary = our_draft.slot_logits(mine, head)
            ours = (our_draft.propose_block(mine[None], unary[None], block[:1])[0][0].tolist()
                    if getattr(our_draft, "has_selector", False) else unary.float().argmax(-1).tolist())
            run.proposals += len(ours)
            run.proposals_agree += sum(x == y for x, y in zip(ours, drafted))
        n_acc = greedy_accepted_list(drafted[: blk - 1], nxt[k0: k0 + blk - 1])
        new = nxt[k0: k0 + n_acc + 1]  # the accepted drafts, then the target's bonus token
        run.acceptance_lengths.append(len(new))
        for t in new[: max_new_tokens - len(out)]:
            out.append(t)
            if t in stops:
                break
    return run


# ----------------------------------------------------------------------------- the check


@dataclass
class ParityReport:
    prompts: int
    steps: int
    proposal_agreement: float
    ours_tau: float
    reference_tau: float
    mismatches: list[str]

    def line(self) -> str:
        return (f"serving parity on {self.prompts} prompts, {self.steps} steps: drafted tokens agree "
                f"{self.proposal_agreement:.1%}, tau ours {self.ours_tau:.3f} vs reference rules {self.reference_tau:.3f}")


def serving_weights(draft: nn.Module) -> dict[str, torch.Tensor]:
    """The draft's weights as export writes them (bf16), for the rebuilt draft."""
    return {k: v.detach().to(torch.bfloat16) for k, v in draft.state_dict().items()}


@torch.no_grad()
def check_serving_parity(target: nn.Module, draft: nn.Module, prompts: Sequence[Sequence[int]], *,
                         cfg: Mapping[str, Any], weights: Optional[Mapping[str, torch.Tensor]] = None,
                         max_new_tokens: int = 48, block_size: Optional[int] = None, stop_ids: Iterable[int] = (),
                         min_agreement: float = 0.98) -> ParityReport:
    """Compare our decoder (and draft module) with the reference rules on ``prompts`` (token ids).

    ``cfg``: the serving config.json dict (`nemo_dflash.serving.export.serving_config_dict`, or an exported
    file); ``weights``: the serving weights (default: ``draft``'s, in bf16 as export writes them), which the
    reference runs. Our draft runs (in fp32) with its own weights rounded to the served ones' dtypes, so only
    arithmetic order differs when the served weights are the draft's, and a served weight that is not shows.
    Raises `ServingParityError` when the served weights lack one of the draft's, when drafted tokens agree less
    than ``min_agreement`` or any prompt's output or per-step acceptance differs.
    """
    import copy

    from nemo_dflash.engine.sampling import GREEDY
    from nemo_dflash.engine.spec_decode import DFlashSpeculativeDecoder

    cfg = dict(cfg)
    weights = dict(weights if weights is not None else serving_weights(draft))
    own = draft.state_dict()
    if missing := sorted(set(own) - set(weights)):
        raise ServingParityError(f"the served weights lack {len(missing)} of the draft's ({', '.join(missing[:3])}): "
                                 "export the draft's whole state dict; see docs/serve.md, 'Serving parity'")
    ours_draft = copy.deepcopy(draft).float()
    ours_draft.load_state_dict({k: v.detach().to(weights[k].dtype).float() for k, v in own.items()})
    ours_draft = ours_draft.to(next(target.parameters()).device).eval()
    decoder = DFlashSpeculativeDecoder(target, ours_draft, block_size)
    stops = list(stop_ids)
    mismatches: list[str] = []
    agree = total = steps = 0
    ours_taus, ref_taus = [], []
    for n, ids in enumerate(prompts):
        ours = decoder.generate(list(ids), max_new_tokens=max_new_tokens, sampling=GREEDY, stop_token_ids=stops)
        greedy = decoder.generate(list(ids), max_new_tokens=len(ours.output_ids) + decoder.block_size,
                                  sampling=GREEDY, stop_token_ids=[]).output_ids  # stops ignored: the last steps' tokens
        try:
            ref = reference_acceptance(target, weights, cfg, ids, greedy, max_new_tokens, decoder.block_size, stops,
                                       ours_draft)
        except KeyError as e:  # the served config names a module (a conv, the selector) the weights do not hold
            raise ServingParityError(f"the served config needs weight {e} and the served weights lack it: export "
                                     "config and weights of one draft; see docs/serve.md, 'Serving parity'") from None
        if ref.not_greedy_at is not None:
            mismatches.append(f"prompt {n}: our decoder's token {ref.not_greedy_at} is not the target's argmax")
            continue
        agree, total, steps = agree + ref.proposals_agree, total + ref.proposals, steps + len(ref.acceptance_lengths)
        ref_taus.append(sum(ref.acceptance_lengths) / max(len(ref.acceptance_lengths), 1))
        ours_taus.append(ours.mean_acceptance_length)
        if ours.output_ids != ref.output_ids or ours.acceptance_lengths != ref.acceptance_lengths:
            k = next((i for i, (a, b) in enumerate(zip(ours.acceptance_lengths, ref.acceptance_lengths)) if a != b),
                     min(len(ours.acceptance_lengths), len(ref.acceptance_lengths)))
            mismatches.append(f"prompt {n}: acceptance differs from step {k} (ours {ours.acceptance_lengths[k:k + 4]}, "
                              f"reference {ref.acceptance_lengths[k:k + 4]})")
    report = ParityReport(prompts=len(prompts), steps=steps, proposal_agreement=agree / total if total else 1.0,
                          ours_tau=sum(ours_taus) / max(len(ours_taus), 1),
                          reference_tau=sum(ref_taus) / max(len(ref_taus), 1), mismatches=mismatches)
    if report.proposal_agreement < min_agreement:
        mismatches.insert(0, f"drafted tokens agree {report.proposal_agreement:.1%} < {min_agreement:.0%} "
                             "(the draft module and the served config rotate or normalise differently)")
    if mismatches:
        raise ServingParityError(f"{report.line()}: {'; '.join(mismatches[:3])}: the engines would not serve this "
                                 "draft as it was measured; see docs/serve.md, 'Serving parity'")
    logger.info("%s", report.line())
    return report


def encode_parity_prompts(tokenizer: Any, texts: Sequence[str] = PARITY_PROMPTS) -> list[list[int]]:
    """The prompts as the target's chat template renders them (plain text without a template)."""
    from nemo_dflash.data.chat_template import encode_prompt

    if getattr(tokenizer, "chat_template", None):
        return [encode_prompt(tokenizer, [{"role": "user", "content": t}]) for t in texts]
    return [list(tokenizer(t, add_special_tokens=True)["input_ids"]) for t in texts]


__all__ = ["PARITY_PROMPTS", "ParityReport", "ServingParityError", "check_serving_parity", "encode_parity_prompts",
           "reference_acceptance", "reference_draft_hidden", "serving_weights"]
