"""Run under torchrun (2 gloo ranks): build the datasets with the host's ranks sharing the preparation
(`host_share`), in blocks of 8 conversations, and save what each rank built (`test_data_dataset.py`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _data_fixtures import qwen3_tokenizer  # noqa: E402

from nemo_dflash.data import DataConfig, DataSourceConfig, build_datasets  # noqa: E402
from nemo_dflash.data import dataset as dataset_module  # noqa: E402
from nemo_dflash.train.distributed import host_share, init_distributed, shutdown_distributed  # noqa: E402


def main() -> None:
    out, paths = Path(sys.argv[1]), sys.argv[2:]
    dataset_module._PREPARE_BLOCK = 8  # several blocks a source, shared between the ranks
    prepared = []
    real = dataset_module._prepare_block
    dataset_module._prepare_block = lambda span: prepared.append(span) or real(span)  # one worker: runs in place
    state = init_distributed("cpu")
    share = host_share(state)
    cfg = DataConfig(sources=[DataSourceConfig(path=p) for p in paths], max_length=128, holdout_fraction=0.1, seed=3,
                     tokenize_workers=1)
    train, holdout = build_datasets(cfg, qwen3_tokenizer(), share=share)
    store = train._store
    np.savez(out / f"rank{state.rank}.npz", ids=store.ids, mask=store.mask, offsets=store.offsets,
             train=train.indices, holdout=holdout.indices)
    (out / f"rank{state.rank}.json").write_text(json.dumps({
        "stats": train.stats, "prepared": [list(s) for s in prepared], "directory": str(share.directory),
        "local_rank": share.rank, "ranks": share.ranks}))
    shutdown_distributed()


if __name__ == "__main__":
    main()
