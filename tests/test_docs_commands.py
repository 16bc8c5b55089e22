"""The commands the docs show still parse, without running: each `nemo_dflash.recipes.*` command of a bash block in
README.md and docs/*.md is read by that command's own parser (every flag and value), the KEY=VALUE overrides after
its `--config RECIPE` name keys of the typed recipe (and config group options that exist), and each flag of a
`python benchmarks/X.py SUB ...` command is one that X.py's SUB declares (read from its source: the benchmarks
are not imported by the tests, and starting each one takes seconds).

A page's shell is read the way a user would run it: `NAME="..."` assignments expand in the lines after them
(`$P`, `"$ANSWERS"`), a `for NAME in A B; do` loop's variable takes its first value, `ENV=1 python ...` and
`torchrun [flags] -m M` launch M. A synopsis (`[--flag VALUE]`, `a|b`, `[--x N | --y]`, `...`) is read as the
commands it stands for: the words outside brackets, then each optional part and each alternative in turn; an
upper-case placeholder (`N`, `DIR`) is taken as any value of a flag's type."""

from __future__ import annotations

import argparse
import ast
import contextlib
import functools
import importlib
import io
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Union
from unittest import mock

import pytest
from test_docs import README, REPO, bash_commands

PAGES = [README, *sorted((REPO / "docs").glob("*.md"))]  # docs/bench and benchmarks/reports: recorded history
SCRIPTS = REPO / "benchmarks"
LAUNCHERS = ("python", "python3", "torchrun")
SEPARATORS = ("&", "&&", "||", ";", "|", ">", ">>")  # a word that ends the command before it
PLACEHOLDER = re.compile(r"[A-Z][A-Z0-9_]*|\$\w+|\$\{\w+\}")
_ASSIGN = re.compile(r"[A-Za-z_]\w*=.*", re.S)
_VAR = re.compile(r"\$(\w+)|\$\{(\w+)\}")
_ALTERNATIVES = re.compile(r"[\w.,:/+-]+(?:\|[\w.,:/+-]+)+")  # `graphs|eager`: a value's alternatives


@dataclass
class DocCommand:
    line: int
    module: Optional[str]  # `-m nemo_dflash.recipes.X`
    script: Optional[str]  # `benchmarks/X.py`
    args: list[str]


def _expand(word: str, env: dict[str, str]) -> list[str]:
    """The shell's expansion of ``word`` by the page's assignments: a lone `$NAME` splits into words (unquoted, as
    the docs write `$EVAL`; a value without spaces is one word either way); inside a word, the text. An unknown
    variable (`$OUT`, `$MASTER_ADDR`) stays, a placeholder."""
    whole = _VAR.fullmatch(word)
    if whole and (whole.group(1) or whole.group(2)) in env:
        return env[whole.group(1) or whole.group(2)].split()
    return [_VAR.sub(lambda m: env.get(m.group(1) or m.group(2), m.group(0)), word)]


def shell_lines(text: str) -> list[tuple[int, list[str]]]:
    """The page's bash commands with its variables expanded, assignments and loop headers taken out."""
    env: dict[str, str] = {}
    out = []
    for line, words in bash_commands(text):
        words = [w for word in words for w in _expand(word, env)]
        if words[0] == "for" and len(words) > 3 and words[2] == "in":  # for NAME in A B; do [COMMAND]
            values = words[3:]
            env[words[1]] = values[0].rstrip(";")
            words = values[values.index("do") + 1:] if "do" in values else []
        while words and words[0] in ("do", "then", "else"):
            words = words[1:]
        if not words:
            continue
        if all(_ASSIGN.fullmatch(w) for w in words):  # NAME=VALUE ...: the lines after it see it
            env.update(w.split("=", 1) for w in words)  # type: ignore[misc]
            continue
        out.append((line, words))
    return out


def doc_command(line: int, words: list[str]) -> Optional[DocCommand]:
    """The `nemo_dflash.recipes.*` or `benchmarks/*.py` command of a shell line (after any `ENV=1` prefix,
    launched by python or torchrun), up to a separator (`&`, `;`, `|`, a redirect); None for any other line."""
    start = next((i for i, w in enumerate(words) if w in LAUNCHERS or w.endswith("/python")), None)
    if start is None:
        return None
    rest = words[start + 1:]
    if words[start] == "torchrun":  # torchrun's own flags, then `-m M` or SCRIPT.py
        at = next((i for i, w in enumerate(rest) if w == "-m" or w.endswith(".py")), None)
    else:
        at = 0 if rest and (rest[0] == "-m" or rest[0].endswith(".py")) else None
    if at is None:
        return None
    module = rest[at + 1] if rest[at] == "-m" and at + 1 < len(rest) else None
    script = rest[at] if module is None else None
    args = rest[at + (2 if module else 1):]
    synopsis = any(w.startswith("[-") for w in args)
    for i, w in enumerate(args):
        if (w in SEPARATORS and not (w == "|" and synopsis)) or w.startswith(("2>", ">")):
            args = args[:i]
            break
        if w.endswith(";"):
            args = [*args[:i], w[:-1]]
            break
    if module and module.startswith("nemo_dflash.recipes."):
        return DocCommand(line, module, None, args)
    if script and script.startswith("benchmarks/"):
        return DocCommand(line, None, script, args)
    return None


# A synopsis as a tree: a sequence of items, each a word (the tuple of its alternatives) or an optional group
# (the list of its alternatives, each a sequence).
Item = Union[tuple, list]


def _synopsis_tree(words: list[str]) -> list[Item]:
    root: list[list[Item]] = [[]]
    stack = [root]
    for w in words:
        if w == "...":  # "more flags" (or any value): nothing to check
            continue
        if w == "|" and len(stack) > 1:
            stack[-1].append([])
            continue
        opens = len(w) - len(w.lstrip("[")) if w.lstrip("[").startswith("-") else 0
        w = w[opens:]
        for _ in range(opens):
            group: list[list[Item]] = [[]]
            stack[-1][-1].append(group)
            stack.append(group)
        closes = 0
        while w.endswith("]") and w.count("]") > w.count("[") and closes < len(stack) - 1:
            w, closes = w[:-1], closes + 1
        if len(stack) > 1:  # `humaneval[,math500]` inside a group: the optional part taken in
            w = w.replace("[", "").replace("]", "")
        if w:
            stack[-1][-1].append(tuple(w.split("|")) if _ALTERNATIVES.fullmatch(w) else (w,))
        del stack[len(stack) - closes:]
    return root[0]


def _variants(seq: list[Item]) -> list[list[str]]:
    """The commands a sequence stands for: its words (first alternatives), then each other alternative of a word
    and each optional group's alternatives (recursively) added to them, one at a time."""
    def base(items: list[Item]) -> list[str]:
        return [x[0] for x in items if isinstance(x, tuple)]

    out = [base(seq)]
    for i, item in enumerate(seq):
        before, after = base(seq[:i]), base(seq[i + 1:])
        if isinstance(item, tuple):
            out += [[*before, alt, *after] for alt in item[1:]]
        else:
            out += [[*before, *sub, *after] for alt in item for sub in _variants(alt)]
    return out


def arg_variants(args: list[str]) -> list[list[str]]:
    """The argument lists a command's words stand for: the words themselves unless they are a synopsis."""
    seen, out = set(), []
    for v in _variants(_synopsis_tree(args)):
        if tuple(v) not in seen:
            seen.add(tuple(v))
            out.append(v)
    return out


# --- nemo_dflash.recipes.*: the command's own parser, then its recipe's keys -----------------------------------

def _placeholder_or(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        return text if PLACEHOLDER.fullmatch(text) else kind(text)

    convert.__name__ = getattr(kind, "__name__", "value")  # argparse names the type in its message
    return convert


@contextlib.contextmanager
def exact_flags() -> Iterator[None]:
    """Each flag as its parser spells it: argparse would take a prefix (`--max-new` for `--max-new-tokens`), a name
    that stops working once another flag shares it."""
    parse = argparse.ArgumentParser.parse_known_args

    def exact(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> Any:
        self.allow_abbrev = False
        return parse(self, *args, **kwargs)

    with mock.patch.object(argparse.ArgumentParser, "parse_known_args", exact):
        yield


def parse_recipe_command(module: str, argv: list[str]) -> tuple[Optional[str], list[str]]:
    """(--config, the KEY=VALUE overrides) of ``argv`` read by ``module``'s parser, as the command reads them before
    loading anything; a refusal raises SystemExit as it does. With --config, required flags may come from the recipe
    (`parse_with_recipe`)."""
    mod = importlib.import_module(module)
    recipe = any(a == "--config" or a.startswith("--config=") for a in argv)
    if module == "nemo_dflash.recipes.pipeline":  # stages=/redo= read, the rest the recipe's overrides
        args, _, _, overrides = mod.parse_args(argv)
        return args.config, overrides
    if not hasattr(mod, "build_parser"):  # train, demo: parse_args parses and checks, nothing more
        args = mod.parse_args(argv)
        return getattr(args, "config", None), list(args.overrides)
    parser = mod.build_parser(file=not recipe) if module.endswith(".data_report") else mod.build_parser()
    for action in parser._actions:
        if recipe and action.required and action.option_strings:
            action.required = False
        if action.type is not None and action.type is not str:
            action.type = _placeholder_or(action.type)
    args = parser.parse_args(argv)
    if getattr(args, "config", None) is None and getattr(args, "overrides", None):
        parser.error(f"{args.overrides[0]}: KEY=VALUE overrides change a recipe: give --config RECIPE")
    return getattr(args, "config", None), list(getattr(args, "overrides", []))


@functools.lru_cache(maxsize=None)
def _schema() -> Any:
    from omegaconf import OmegaConf

    from nemo_dflash.config import RecipeConfig

    return OmegaConf.structured(RecipeConfig)


def override_errors(config: Optional[str], overrides: list[str], text: str) -> list[str]:
    """What the recipe would refuse of the overrides before composing: an unknown key, a group option that is not a
    file. ``config``: a shipped recipe, or one the page writes out (a yaml block opening `# NAME.yaml`)."""
    from nemo_dflash.config import (REPO_CONFIGS, ConfigError, _check_override_keys, _groups, _plain_values_quoted,
                                    resolve_recipe_path)

    dirs = [REPO_CONFIGS]
    if config is not None:
        try:
            dirs.insert(0, resolve_recipe_path(config).resolve().parent)
        except ConfigError as e:
            if not re.search(rf"```yaml\n# {re.escape(config)}\s", text):
                return [str(e).split(". Shipped")[0]]
    groups = _groups(dirs)
    errors = []
    for ov in _plain_values_quoted(overrides, groups):
        try:
            _check_override_keys(_schema(), [ov], groups)
        except ConfigError as e:
            errors.append(str(e))
            continue
        choice = re.fullmatch(r"\+{0,2}(\w+)=([\w.-]+)", ov)
        if choice and choice.group(1) in groups and not any((d / choice.group(1) / f"{choice.group(2)}.yaml").is_file()
                                                            for d in dirs):
            errors.append(f"{ov}: config group {choice.group(1)!r} has no option {choice.group(2)!r}")
    return errors


def recipe_command_errors(cmd: DocCommand, text: str) -> list[str]:
    errors = []
    for argv in arg_variants(cmd.args):
        if "--help" in argv or "-h" in argv:
            continue  # test_docs.py runs the --help of each command
        stderr = io.StringIO()
        try:
            with contextlib.redirect_stderr(stderr), exact_flags():
                config, overrides = parse_recipe_command(cmd.module, argv)  # type: ignore[arg-type]
        except SystemExit as e:
            if e.code:
                said = [ln for ln in stderr.getvalue().splitlines() if ln.strip()]
                msg = re.sub(r"^.*?error: ", "", said[-1]) if said else f"exit {e.code}"  # argparse's or fail's line
                errors.append(f"{msg} (in: {' '.join(argv)})")
            continue
        except ModuleNotFoundError as e:
            errors.append(str(e))
            break
        errors += [f"{msg} (in: {' '.join(argv)})" for msg in override_errors(config, overrides, text)]
    return errors


# --- benchmarks/*.py: the flags their source declares ----------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _functions(path: Path) -> dict[str, ast.FunctionDef]:
    tree = ast.parse(path.read_text(), filename=str(path))
    return {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}


def _subcommands(main: Optional[ast.FunctionDef]) -> Optional[dict[str, str]]:
    """SUBCOMMAND -> its function, from `run_subcommands(tool, doc, {"name": (function, DOC), ...})` in main."""
    for node in ast.walk(main) if main is not None else ():
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "run_subcommands":
            table = next(a for a in node.args if isinstance(a, ast.Dict))
            return {k.value: v.elts[0].id for k, v in zip(table.keys, table.values)}  # type: ignore[union-attr]
    return None


def declared_flags(script: Path, sub: Optional[str]) -> tuple[Optional[set[str]], bool]:
    """(the option strings ``script`` SUB declares, whether the script has subcommands): `add_argument` calls in the
    subcommand's function (or main) and in the functions of the script and benchmarks/_common.py it calls. None when
    the subcommand is unknown."""
    functions = {**_functions(SCRIPTS / "_common.py"), **_functions(script)}
    table = _subcommands(functions.get("main"))
    if table is not None and sub not in table:
        return None, True
    todo, seen, flags = [table[sub] if table is not None else "main"], set(), set()  # type: ignore[index]
    while todo:
        name = todo.pop()
        if name in seen or name not in functions:
            continue
        seen.add(name)
        for node in ast.walk(functions[name]):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
                flags |= {a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("-")}
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                todo.append(node.func.id)
    return flags, table is not None


def benchmark_command_errors(cmd: DocCommand) -> list[str]:
    script = REPO / cmd.script  # type: ignore[operator]
    if not script.is_file():
        return [f"{cmd.script} does not exist"]
    args = cmd.args[:cmd.args.index("--")] if "--" in cmd.args else cmd.args  # after --: another command's flags
    sub = args[0] if args and not args[0].startswith("-") else None
    flags, has_subcommands = declared_flags(script, sub)
    if flags is None:
        return [f"{cmd.script} has no subcommand {sub!r}"]
    used = {w.split("=", 1)[0] for argv in arg_variants(args[1 if has_subcommands else 0:]) for w in argv
            if re.fullmatch(r"--?[A-Za-z][\w-]*(=.*)?", w, re.S)}  # not a value: `--eval-args "--x 1"`
    return [f"{cmd.script}{' ' + sub if has_subcommands else ''}: unknown flag {f}" for f in sorted(used - flags)
            if "--help" != f != "-h"]


def page_errors(name: str, text: str) -> list[str]:
    """Each stale command of a page, as `PAGE:LINE: COMMAND: what its parser says`."""
    errors = []
    for line, words in shell_lines(text):
        cmd = doc_command(line, words)
        if cmd is None:
            if any(re.search(r"nemo_dflash\.recipes\.\w|benchmarks/\w+\.py", w) for w in words):
                errors.append(f"{name}:{line}: a command of an unknown kind: {' '.join(words)} "
                              "(teach tests/test_docs_commands.py to read it)")
            continue
        found = recipe_command_errors(cmd, text) if cmd.module else benchmark_command_errors(cmd)
        errors += [f"{name}:{line}: {cmd.module or cmd.script}: {e}" for e in found]
    return errors


def test_a_page_is_read_as_its_shell_runs_it():
    text = ('```bash\nP="python -m nemo_dflash.recipes.pipeline --config c.yaml"\n'
            'for arm in b d; do   # one after the other\n  $P +arm=$arm run.dir=RUNS/$arm &\ndone; wait\n'
            'HF_HUB_OFFLINE=1 torchrun --nproc-per-node 8 -m nemo_dflash.recipes.train --config c.yaml \\\n'
            '    x=1 2>&1 | tee log\npython benchmarks/b.py sub --flag 1 > out.txt\npython -c "print(1)"\n```\n')
    commands = [doc_command(line, words) for line, words in shell_lines(text)]
    assert commands == [
        DocCommand(4, "nemo_dflash.recipes.pipeline", None, ["--config", "c.yaml", "+arm=b", "run.dir=RUNS/b"]), None,
        DocCommand(6, "nemo_dflash.recipes.train", None, ["--config", "c.yaml", "x=1"]),
        DocCommand(8, None, "benchmarks/b.py", ["sub", "--flag", "1"]), None]


def test_a_synopsis_stands_for_each_of_its_commands():
    words = "--draft DIR [--protocol paper|quick] [--t1 [--batch-size N|auto]] [--k K | --no-k] ...".split()
    assert arg_variants(words) == [
        ["--draft", "DIR"], ["--draft", "DIR", "--protocol", "paper"], ["--draft", "DIR", "--protocol", "quick"],
        ["--draft", "DIR", "--t1"], ["--draft", "DIR", "--t1", "--batch-size", "N"],
        ["--draft", "DIR", "--t1", "--batch-size", "auto"], ["--draft", "DIR", "--k", "K"],
        ["--draft", "DIR", "--no-k"]]
    assert arg_variants(["--out", "E", "[--datasets", "mtbench,humaneval[,aime]]"]) == [
        ["--out", "E"], ["--out", "E", "--datasets", "mtbench,humaneval,aime"]]
    assert arg_variants(["--config", "c.yaml", "data.sources=[{path: x}]"]) == [
        ["--config", "c.yaml", "data.sources=[{path: x}]"]]  # a recipe list is no synopsis


def test_the_command_check_sees_a_stale_flag_key_and_option():
    """A flag, an override key, a group option, a recipe, a value, a benchmark's flag and subcommand, a command
    and a flag's prefix are each reported with the page's line; the same commands spelled right are not."""
    good = ("python -m nemo_dflash.recipes.evaluate --draft DIR --target pkg:smollm2 --out E --max-new-tokens N\n"
            "torchrun --nproc-per-node 2 -m nemo_dflash.recipes.pipeline --config smollm2_135m_200m.yaml "
            "stages=train +arm=a train.max_steps=5\n"
            "python benchmarks/decode.py rows --shape smollm2_135m --rows 1,16 --fold-gqa 0|1\n")
    bad = ("python -m nemo_dflash.recipes.evaluate --draft DIR --target pkg:smollm2 --out E --no-such-flag 1\n"
           "python -m nemo_dflash.recipes.pipeline --config smollm2_135m_200m.yaml trian.max_steps=5\n"
           "python -m nemo_dflash.recipes.train --config smollm2_135m.yaml +arm=zz\n"
           "python -m nemo_dflash.recipes.train --config no_such_recipe.yaml\n"
           "python -m nemo_dflash.recipes.export --checkpoint C --out D [--serving-engine any|vllm|nope]\n"
           "python benchmarks/decode.py rows --shape smollm2_135m --no-such-rows 1\n"
           "python benchmarks/decode.py nosub --x 1\n"
           "python -m nemo_dflash.recipes.nosuch --x 1\n"
           "python -m nemo_dflash.recipes.evaluate --draft DIR --target pkg:smollm2 --out E --max-new 8\n"
           "python -m nemo_dflash.recipes.train --config smollm2_135m.yaml --print\n")
    assert page_errors("good.md", f"```bash\n{good}```\n") == []
    errors = page_errors("bad.md", f"text\n```bash\n{bad}```\n")
    expected = [(3, "--no-such-flag"), (4, "trian.max_steps"), (5, "has no option 'zz'"), (6, "no_such_recipe.yaml"),
                (7, "invalid choice: 'nope'"), (8, "unknown flag --no-such-rows"), (9, "no subcommand 'nosub'"),
                (10, "nemo_dflash.recipes.nosuch"), (11, "unrecognized arguments: --max-new"),
                (12, "unrecognized arguments: --print")]  # a prefix of a flag is not its name
    assert len(errors) == len(expected), errors
    for error, (line, what) in zip(errors, expected):
        assert error.startswith(f"bad.md:{line}: ") and what in error, (error, line, what)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_docs_command_parses(page):
    """Each recipe command of the page parses with its own parser and names recipe keys that exist; each benchmark
    command's flags are its subcommand's. A flag renamed or removed fails here, naming the page and line."""
    text = page.read_text()
    errors = page_errors(str(page.relative_to(REPO)), text)
    assert not errors, "\n".join(errors)


def test_the_docs_show_recipe_and_benchmark_commands():
    """The check reads commands at all: a change to how the pages are read that finds none fails here."""
    found = [doc_command(line, words) for p in PAGES for line, words in shell_lines(p.read_text())]
    assert sum(1 for c in found if c and c.module) >= 30 and sum(1 for c in found if c and c.script) >= 20
