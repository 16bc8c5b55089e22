"""Shared fixtures: tiny random-weight targets (Qwen3 and Llama, the training shape of tests/_tiny_models.py) and
drafts built on them; the slow tests' marks."""

from __future__ import annotations

import collections
from pathlib import Path

import pytest

import nemo_dflash.train.trainer  # noqa: F401  binds the real load_target before any test patches the loader's
from nemo_dflash import HFDFlashTargetModel

from _tiny_models import train_draft, train_llama, train_qwen3  # the one set of builders (tests/_tiny_models.py)


@pytest.fixture(params=["qwen3", "llama"])
def target_and_draft(request):
    target = train_qwen3() if request.param == "qwen3" else train_llama()
    draft = train_draft(target)
    wrapper = HFDFlashTargetModel(target, draft.config.target_layer_ids)
    return wrapper, draft


_SLOW = frozenset(line.strip() for line in Path(__file__).with_name("slow.txt").read_text().splitlines()
                  if line.strip() and not line.startswith("#"))


# The files that run for minutes (multi-process trainings, benchmarks end to end), longest first: `make test` hands
# whole files to its two workers in collection order, and one of these started last would leave the other worker
# idle while it runs. A file missing from here only starts later; a stale entry costs nothing.
LONGEST_FIRST = ("tests/test_distributed.py", "tests/test_eval_replay.py", "tests/test_pipeline.py",
                 "tests/test_batched_static.py", "tests/test_sampling_settings.py", "tests/test_regenerate_sources.py",
                 "tests/test_train.py", "tests/test_pipeline_stale.py", "tests/test_evaluate.py",
                 "tests/test_regenerate_openai.py", "tests/test_data_prompts.py", "tests/test_regenerate.py",
                 "tests/test_smollm2_summaries.py", "tests/test_bench_files.py", "tests/test_decode_graphs.py",
                 "tests/test_faults.py", "tests/test_dflash2.py", "tests/test_spec_decode.py", "tests/test_config.py",
                 "tests/test_faults_writes.py", "tests/test_data_summary_row.py", "tests/test_faults_runs.py")


def pytest_collection_modifyitems(config, items):
    """Mark the tests tests/slow.txt lists `slow`: `make test-fast` (-m "not slow") leaves them to `make test`.
    Then the files of LONGEST_FIRST first, the others by their number of tests, most first (the order xdist's
    --dist loadfile would pick; the Makefile turns its own reordering off so that this one holds)."""
    for item in items:
        if item.nodeid in _SLOW:
            item.add_marker(pytest.mark.slow)
    files = [item.nodeid.split("::", 1)[0] for item in items]
    count = collections.Counter(files)
    rank = {f: (LONGEST_FIRST.index(f) if f in LONGEST_FIRST else len(LONGEST_FIRST), -count[f]) for f in count}
    items[:] = [item for _, item in sorted(zip(files, items), key=lambda p: rank[p[0]])]
