"""Pre-tokenised chat dataset, padding collator and a checkpointable data loader."""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, TypeVar

import numpy as np
import torch
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

from nemo_dflash.data.chat_template import (
    ChatTemplateError,
    TokenizedConversation,
    detect_chat_format,
    tokenize_conversations,
)
from nemo_dflash.data.config import DataConfig, as_data_config
from nemo_dflash.data.packing import PackedBatchSampler, PackedCollator
from nemo_dflash.data.sampler import ChatBatchSampler
from nemo_dflash.data.decontaminate import filter_stream, training_index
from nemo_dflash.data.sources import BadRecordCounter, DataError, apply_weight, read_conversations
from nemo_dflash.data.workers import HostShare, default_workers, fork_pool

logger = logging.getLogger(__name__)

T = TypeVar("T")

_TOKENIZE_CHUNK = 128  # conversations per batched tokenizer call
_VERIFY_FIRST = 4  # conversations checked against apply_chat_template(tokenize=True) per source


def pad_token_id_of(tokenizer: Any) -> int:
    """``pad_token_id``, else ``eos_token_id``: padded positions are masked out either way."""
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, list):
            value = value[0] if value else None
        if value is not None:
            return int(value)
    raise DataError("the tokenizer has neither a pad nor an eos token; set tokenizer.pad_token before building data")


class _TokenStore:
    """All samples in two flat arrays (int32 ids, uint8 mask) + offsets.

    Python lists of ints cost ~36 bytes a token; flat numpy arrays cost 5 and are shared
    copy-on-write with forked data-loader workers.
    """

    def __init__(self, ids: np.ndarray, mask: np.ndarray, offsets: np.ndarray) -> None:
        self.ids, self.mask, self.offsets = ids, mask, offsets

    @classmethod
    def from_samples(cls, samples: Iterable[TokenizedConversation]) -> "_TokenStore":
        ids, mask, offsets = [], [], [0]
        for s in samples:
            if len(s.input_ids) != len(s.loss_mask):
                raise ValueError("input_ids and loss_mask differ in length")
            ids.append(np.asarray(s.input_ids, dtype=np.int32))
            mask.append(np.asarray(s.loss_mask, dtype=np.uint8))
            offsets.append(offsets[-1] + len(s.input_ids))
        cat = lambda xs, dt: np.concatenate(xs) if xs else np.zeros(0, dtype=dt)  # noqa: E731
        return cls(cat(ids, np.int32), cat(mask, np.uint8), np.asarray(offsets, dtype=np.int64))

    @classmethod
    def from_parts(cls, parts: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> "_TokenStore":
        """From blocks of (concatenated ids, concatenated mask, sample lengths), in order."""
        cat = lambda xs, dt: np.concatenate(xs).astype(dt, copy=False) if xs else np.zeros(0, dtype=dt)  # noqa: E731
        lengths = cat([p[2] for p in parts], np.int64)
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        return cls(cat([p[0] for p in parts], np.int32), cat([p[1] for p in parts], np.uint8), offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def get(self, sample_id: int) -> tuple[np.ndarray, np.ndarray]:
        a, b = self.offsets[sample_id], self.offsets[sample_id + 1]
        return self.ids[a:b], self.mask[a:b]


class ChatDataset(Dataset):
    """Map-style dataset of tokenised conversations.

    Items are ``{"input_ids": LongTensor[L], "loss_mask": LongTensor[L]}``. Several positions may
    point at the same stored sample (mixing weight > 1) without storing it twice.
    Build it with :func:`build_datasets` / :meth:`from_config`, or :meth:`from_samples`.
    """

    def __init__(
        self,
        store: _TokenStore,
        indices: Optional[np.ndarray] = None,
        *,
        pad_token_id: int,
        max_length: int,
        pad_to_multiple_of: int = 64,
        stats: Optional[dict[str, Any]] = None,
    ) -> None:
        self._store = store
        self.indices = np.arange(len(store), dtype=np.int64) if indices is None else np.asarray(indices, dtype=np.int64)
        self.pad_token_id = pad_token_id
        self.max_length = max_length
        self.pad_to_multiple_of = pad_to_multiple_of
        self.stats: dict[str, Any] = dict(stats or {})
        self.lengths: np.ndarray = store.lengths()[self.indices] if len(store) else np.zeros(0, dtype=np.int64)

    @classmethod
    def from_samples(
        cls,
        samples: Sequence[TokenizedConversation],
        *,
        pad_token_id: int,
        max_length: int,
        pad_to_multiple_of: int = 64,
    ) -> "ChatDataset":
        return cls(
            _TokenStore.from_samples(samples),
            pad_token_id=pad_token_id,
            max_length=max_length,
            pad_to_multiple_of=pad_to_multiple_of,
        )

    @classmethod
    def from_config(cls, config: DataConfig | Any, tokenizer: Any, split: str = "train") -> "ChatDataset":
        """One split of :func:`build_datasets` ("train" or "holdout"); use that to get both at once."""
        if split not in ("train", "holdout"):
            raise ValueError(f"split must be 'train' or 'holdout' (got {split!r})")
        train, holdout = build_datasets(config, tokenizer)
        if split == "holdout":
            if holdout is None:
                raise DataError("no holdout split: set data.holdout_fraction > 0")
            return holdout
        return train

    def __len__(self) -> int:
        return len(self.indices)

    def count_token(self, token_id: int) -> int:
        """How often ``token_id`` occurs in this dataset's samples (e.g. a would-be mask token)."""
        hits = np.flatnonzero(self._store.ids == token_id)
        samples = np.searchsorted(self._store.offsets, hits, side="right") - 1
        return int(np.count_nonzero(np.isin(samples, self.indices)))

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids, mask = self._store.get(int(self.indices[i]))
        return {
            "input_ids": torch.from_numpy(ids.astype(np.int64)),
            "loss_mask": torch.from_numpy(mask.astype(np.int64)),
        }

    def subset(self, positions: Sequence[int] | np.ndarray, stats: Optional[dict[str, Any]] = None) -> "ChatDataset":
        """A dataset over some positions of this one, sharing the token storage."""
        return ChatDataset(
            self._store,
            self.indices[np.asarray(positions, dtype=np.int64)],
            pad_token_id=self.pad_token_id,
            max_length=self.max_length,
            pad_to_multiple_of=self.pad_to_multiple_of,
            stats=stats,
        )

    def collator(self) -> "ChatCollator":
        return ChatCollator(self.pad_token_id, self.pad_to_multiple_of, self.max_length)


@dataclass
class ChatCollator:
    """Right-pad a batch to its longest sample rounded up to ``pad_to_multiple_of`` (capped at ``max_length``)."""

    pad_token_id: int
    pad_to_multiple_of: int = 64
    max_length: Optional[int] = None

    def __call__(self, batch: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
        return collate(batch, self.pad_token_id, self.pad_to_multiple_of, self.max_length)


def collate(
    batch: Sequence[dict[str, Any]],
    pad_token_id: int,
    pad_to_multiple_of: int = 64,
    max_length: Optional[int] = None,
) -> dict[str, torch.Tensor]:
    """Pad ``[{"input_ids", "loss_mask"}, ...]`` into ``input_ids``/``attention_mask``/``loss_mask`` ``[B, S]``."""
    if not batch:
        raise ValueError("cannot collate an empty batch")
    ids = [torch.as_tensor(b["input_ids"], dtype=torch.long) for b in batch]
    masks = [torch.as_tensor(b["loss_mask"], dtype=torch.long) for b in batch]
    longest = max(len(x) for x in ids)
    seq = max(1, math.ceil(longest / pad_to_multiple_of)) * pad_to_multiple_of
    if max_length is not None:
        seq = min(seq, max_length)
    out_ids = torch.full((len(batch), seq), pad_token_id, dtype=torch.long)
    attention = torch.zeros((len(batch), seq), dtype=torch.long)
    loss = torch.zeros((len(batch), seq), dtype=torch.long)
    for row, (x, m) in enumerate(zip(ids, masks)):
        n = min(len(x), seq)
        out_ids[row, :n] = x[:n]
        attention[row, :n] = 1
        loss[row, :n] = m[:n]
    return {"input_ids": out_ids, "attention_mask": attention, "loss_mask": loss}


def split_holdout(items: Sequence[T], fraction: float, seed: int) -> tuple[list[T], list[T]]:
    """Seeded split into ``(train, holdout)``; both keep the input order.

    Split unique conversations BEFORE applying mixing weights, or duplicates leak into the holdout.
    """
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"holdout fraction must be in [0, 1) (got {fraction})")
    n_hold = int(round(fraction * len(items)))
    if fraction > 0 and len(items) >= 2:
        n_hold = min(max(n_hold, 1), len(items) - 1)
    held = set(np.random.default_rng([seed, 0x401D]).permutation(len(items))[:n_hold].tolist())
    train = [x for i, x in enumerate(items) if i not in held]
    holdout = [x for i, x in enumerate(items) if i in held]
    return train, holdout


def _chunks(it: Iterable[T], size: int) -> Iterator[list[T]]:
    chunk: list[T] = []
    for x in it:
        chunk.append(x)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


_PREPARE_BLOCK = 2048  # conversations a worker decontaminates and tokenises per job


@dataclass
class _Prepared:
    """One block of conversations, decontaminated and tokenised: what a worker sends back (flat arrays,
    not per-token Python ints, so the way back costs 5 bytes a token)."""

    ids: np.ndarray  # int32, the kept samples' tokens one after another
    mask: np.ndarray  # uint8
    lengths: np.ndarray  # int64, one per kept sample
    read: int = 0  # conversations past decontamination
    contaminated: int = 0
    no_supervision: int = 0
    truncated: int = 0
    errors: list[tuple[str, str]] = field(default_factory=list)  # (location, reason) of template errors


# what forked workers inherit instead of receiving it per job: (conversations, tokenizer, max_length, format, index)
_PREPARE_STATE: Optional[tuple[Any, ...]] = None


def _prepare_block(span: tuple[int, int]) -> _Prepared:
    """Decontaminate and tokenise conversations ``span`` of :data:`_PREPARE_STATE` (the first
    :data:`_VERIFY_FIRST` of a source checked against ``apply_chat_template(tokenize=True)``)."""
    convs, tokenizer, max_length, fmt, index = _PREPARE_STATE  # type: ignore[misc]
    start, end = span
    out = _Prepared(np.zeros(0, np.int32), np.zeros(0, np.uint8), np.zeros(0, np.int64))
    counts = {"contaminated": 0}
    kept = list(filter_stream(convs[start:end], index, counts) if index is not None else convs[start:end])
    out.contaminated = counts["contaminated"]
    ids, mask, lengths = [], [], []
    for chunk in _chunks(kept, _TOKENIZE_CHUNK):
        errors: list[Optional[ChatTemplateError]] = []
        verify = max(0, _VERIFY_FIRST - out.read) if start == 0 else 0
        results = tokenize_conversations(
            tokenizer, [c.messages for c in chunk], max_length, chat_format=fmt, verify=verify, errors=errors,
            reasoning=[getattr(c, "reasoning", None) for c in chunk],
        )
        for conv, res, err in zip(chunk, results, errors):
            out.read += 1
            if err is not None:
                out.errors.append((conv.location, str(err)))
            elif res is None:
                out.no_supervision += 1
            else:
                if len(res.input_ids) != len(res.loss_mask):
                    raise ValueError("input_ids and loss_mask differ in length")
                out.truncated += int(res.truncated)
                ids.append(np.asarray(res.input_ids, dtype=np.int32))
                mask.append(np.asarray(res.loss_mask, dtype=np.uint8))
                lengths.append(len(res.input_ids))
    if lengths:
        out.ids, out.mask, out.lengths = np.concatenate(ids), np.concatenate(mask), np.asarray(lengths, np.int64)
    return out


def _prepare(convs: list[Any], tokenizer: Any, max_length: int, fmt: Any, index: Any,
             workers: int, share: Optional[HostShare] = None, tag: str = "") -> Iterator[_Prepared]:
    """:func:`_prepare_block` over ``convs`` in blocks, in order, on ``workers`` forked processes (the
    decontamination and the chat template's rendering and masking are Python: minutes for 500,000
    conversations on one core). The blocks come back in order, so the dataset is the one-process one.
    With ``share``, this rank prepares its share of the blocks into the host's directory (named ``tag``
    and the block's number) and, after the job's barrier, reads them all back in order."""
    global _PREPARE_STATE
    spans = [(a, min(a + _PREPARE_BLOCK, len(convs))) for a in range(0, len(convs), _PREPARE_BLOCK)]
    mine = list(range(len(spans))) if share is None else list(range(share.rank, len(spans), share.ranks))
    _PREPARE_STATE = (convs, tokenizer, max_length, fmt, index)
    try:
        with fork_pool(min(workers, len(mine))) as pool:
            jobs = [spans[i] for i in mine]
            blocks = pool.map(_prepare_block, jobs) if pool is not None else map(_prepare_block, jobs)
            if share is None:
                yield from blocks
                return
            share.directory.mkdir(parents=True, exist_ok=True)
            for i, block in zip(mine, blocks):
                _save_block(share.directory / f"{tag}{i:06d}", block)
    finally:
        _PREPARE_STATE = None
    share.barrier()
    for i in range(len(spans)):
        yield _load_block(share.directory / f"{tag}{i:06d}")


_BLOCK_COUNTS = ("read", "contaminated", "no_supervision", "truncated")


def _save_block(stem: Path, block: _Prepared) -> None:
    """One prepared block as ``STEM.npz`` (arrays only, no pickle), its template errors in ``STEM.errors.json``
    first: the .npz appears whole (written aside, then renamed), and its presence means the block is complete."""
    if block.errors:
        stem.with_suffix(".errors.json").write_text(json.dumps(block.errors))
    tmp = stem.with_name(stem.name + ".partial.npz")
    np.savez(tmp, ids=block.ids, mask=block.mask, lengths=block.lengths,
             counts=np.asarray([getattr(block, k) for k in _BLOCK_COUNTS], dtype=np.int64))
    os.replace(tmp, stem.with_suffix(".npz"))


def _load_block(stem: Path) -> _Prepared:
    with np.load(stem.with_suffix(".npz"), allow_pickle=False) as z:
        out = _Prepared(z["ids"], z["mask"], z["lengths"], **dict(zip(_BLOCK_COUNTS, map(int, z["counts"]))))
    errors = stem.with_suffix(".errors.json")
    if errors.is_file():
        out.errors = [tuple(e) for e in json.loads(errors.read_text())]
    return out


def _ranks_on_host() -> int:
    """The ranks of this job on this host (torchrun's LOCAL_WORLD_SIZE): they build the data side by side."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def _read_source(si: int, src: Any, cfg: DataConfig, tokenizer: Any, fmt: Any, index: Any, workers: int,
                 share: Optional[HostShare], bad: BadRecordCounter,
                 parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]], n_samples: int
                 ) -> tuple[list[int], dict[str, Any]]:
    """Source `si` read and tokenised: its blocks appended to `parts`, its samples numbered from `n_samples`;
    returns (their ids, the source's counts)."""
    counts = {"path": src.path, "read": 0, "skipped_no_supervision": 0, "template_errors": 0, "truncated": 0,
              "contaminated": 0}
    ids: list[int] = []
    convs = list(read_conversations(src.path, bad=bad, max_samples=src.max_samples))
    for block in _prepare(convs, tokenizer, cfg.max_length, fmt, index, workers, share, tag=f"s{si}_"):
        counts["contaminated"] += block.contaminated
        for location, reason in block.errors:
            bad.report(location, reason)
        counts["read"] += block.read
        counts["template_errors"] += len(block.errors)
        counts["skipped_no_supervision"] += block.no_supervision
        counts["truncated"] += block.truncated
        ids.extend(range(n_samples, n_samples + len(block.lengths)))
        n_samples += len(block.lengths)
        parts.append((block.ids, block.mask, block.lengths))
    del convs
    return ids, counts


def _split_datasets(store: _TokenStore, train_ids: list[int], holdout_ids: list[int], totals: dict[str, int],
                    per_source: list[dict[str, Any]], pad_id: int, cfg: DataConfig
                    ) -> tuple[ChatDataset, Optional[ChatDataset]]:
    """The train and holdout datasets over the one token store, with the run's data statistics (logged)."""
    stats = {
        **totals,
        "samples": len(store),
        "train_samples": len(train_ids),
        "holdout_samples": len(holdout_ids),
        "tokens": int(store.offsets[-1]),
        "supervised_tokens": int(store.mask.sum()),
        "sources": per_source,
    }
    logger.info(
        "data: %d conversations read, %d skipped (no assistant tokens), %d bad; %d train / %d holdout samples, "
        "%d tokens (%d supervised)",
        stats["read"], stats["skipped_no_supervision"], stats["bad"], stats["train_samples"],
        stats["holdout_samples"], stats["tokens"], stats["supervised_tokens"],
    )
    common = dict(pad_token_id=pad_id, max_length=cfg.max_length, pad_to_multiple_of=cfg.pad_to_multiple_of)
    train = ChatDataset(store, np.asarray(train_ids, dtype=np.int64), stats={**stats, "split": "train"}, **common)
    holdout = (
        ChatDataset(store, np.asarray(holdout_ids, dtype=np.int64), stats={**stats, "split": "holdout"}, **common)
        if holdout_ids
        else None
    )
    return train, holdout


def build_datasets(config: DataConfig | Any, tokenizer: Any,
                   share: Optional[HostShare] = None) -> tuple[ChatDataset, Optional[ChatDataset]]:
    """Read, tokenise and mix ``config.sources``; return ``(train, holdout or None)``.

    Per source: conversations are tokenised once, a seeded ``holdout_fraction`` of them is held
    out (unique, unweighted), and the rest is repeated/subsampled by the source's weight. With ``share``
    (several ranks on one host), the host's ranks tokenise a share each and read the others' (the same
    datasets, byte for byte).
    """
    cfg = as_data_config(config)
    fmt = detect_chat_format(tokenizer)
    pad_id = pad_token_id_of(tokenizer)
    bad = BadRecordCounter(cfg.max_bad_lines)
    index = training_index(cfg.decontaminate)
    train_ids: list[int] = []
    holdout_ids: list[int] = []
    totals = {"read": 0, "skipped_no_supervision": 0, "template_errors": 0, "truncated": 0, "contaminated": 0}
    per_source: list[dict[str, Any]] = []
    if share is not None and share.ranks <= 1:
        share = None
    workers = cfg.tokenize_workers if cfg.tokenize_workers is not None else default_workers(_ranks_on_host())
    parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (ids, mask, lengths) of each prepared block
    n_samples = 0
    for si, src in enumerate(cfg.sources):
        bad_before = bad.count
        ids, counts = _read_source(si, src, cfg, tokenizer, fmt, index, workers, share, bad, parts, n_samples)
        n_samples += len(ids)
        if counts["contaminated"] and not counts["read"]:
            raise DataError(f"data.sources[{si}] ({src.path}): every conversation shares a {index.n}-gram with the "
                            f"{index.name}; remove the source (or set data.decontaminate=false)")
        tr, ho = split_holdout(ids, cfg.holdout_fraction, cfg.seed + si)
        weighted = apply_weight(tr, src.weight, seed=cfg.seed * 1000 + si)
        train_ids.extend(weighted)
        holdout_ids.extend(ho)
        counts.update(bad=bad.count - bad_before, samples=len(ids), train=len(weighted), holdout=len(ho))
        per_source.append(counts)
        logger.info(
            "%s: %d conversations read, %d dropped by decontamination, %d without assistant tokens skipped, %d bad, "
            "%d truncated to %d tokens; %d samples -> %d train (weight %g), %d holdout",
            src.path, counts["read"], counts["contaminated"], counts["skipped_no_supervision"], counts["bad"],
            counts["truncated"],
            cfg.max_length, len(ids), len(weighted), src.weight, len(ho),
        )
        for k in totals:
            totals[k] += counts[k]
    if not train_ids:
        raise DataError(
            f"no usable training conversations: {totals['read']} read, {totals['skipped_no_supervision']} without "
            f"assistant tokens in their first data.max_length={cfg.max_length} tokens, {bad.count} malformed. Check "
            "data.sources and that they contain assistant replies, or raise data.max_length if the replies start later."
        )
    store = _TokenStore.from_parts(parts)
    del parts
    if share is not None:  # every rank has read every block: the host's first rank removes them
        share.barrier()
        if share.rank == 0:
            shutil.rmtree(share.directory, ignore_errors=True)
    return _split_datasets(store, train_ids, holdout_ids, {**totals, "bad": bad.count}, per_source, pad_id, cfg)


def build_dataloader(
    dataset: ChatDataset,
    batch_size: int,
    *,
    rank: int = 0,
    world_size: int = 1,
    seed: int = 0,
    batching: str = "length_grouped",
    num_workers: int = 0,
    drop_last: bool = False,
    collate_fn: Optional[Any] = None,
    pin_memory: bool = False,
    pack_length: int = 0,
) -> StatefulDataLoader:
    """A checkpointable loader of this rank's batches (``state_dict()``/``load_state_dict()`` resume exactly).

    With ``pack_length > 0`` a batch is ``batch_size`` packed rows of ``pack_length`` tokens
    (nemo_dflash.data.packing): every batch has the same shape.
    """
    lengths = getattr(dataset, "lengths", None)
    if lengths is None:
        raise TypeError("build_dataloader needs a dataset with per-sample `lengths` (e.g. ChatDataset)")
    sampler: Any
    if pack_length > 0:
        sampler = PackedBatchSampler(lengths, batch_size, pack_length, rank=rank, world_size=world_size, seed=seed)
        if collate_fn is None:
            collate_fn = PackedCollator(dataset.pad_token_id, batch_size, pack_length)
    else:
        sampler = ChatBatchSampler(
            lengths, batch_size, batching=batching, rank=rank, world_size=world_size, seed=seed, drop_last=drop_last
        )
    if collate_fn is None:
        collate_fn = dataset.collator()
    with warnings.catch_warnings():  # torchdata 0.11 calls a torch API deprecated in torch >= 2.9
        warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
        return StatefulDataLoader(
            dataset,
            batch_sampler=sampler,
            collate_fn=collate_fn,
            num_workers=num_workers,
            pin_memory=pin_memory,
        )
