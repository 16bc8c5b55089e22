"""The data report of a regenerated file, against a tiny file computed by hand."""

from __future__ import annotations

import json

import pytest

from nemo_dflash.data import DataError
from nemo_dflash.data.report import data_report, nearest_rank, report_dir, write_report

# 26 distinct words: a 13-gram window over them never repeats
ALPHA = "a b c d e f g h i j k l m n o p q r s t u v w x y z".split()


def _rec(dataset, answers, finish="stop", user="question here"):
    messages = [{"role": "system", "content": "be brief"}]
    for a in answers:
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": a}]
    return {"messages": messages, "finish_reason": finish, "source": "x:1", "dataset": dataset}


def _tiny(path):
    """chat: 2 conversations, 3 answers of 14, 13 and 2 words; the 13-word answer repeats the first
    13 words of the 14-word one. code: 1 conversation, cut at a loop, one answer of 5 words."""
    rows = [
        _rec("chat", [" ".join(ALPHA[:14]), " ".join(ALPHA[:13])]),
        _rec("chat", ["hi there"]),
        _rec("code", ["one two three four five"], finish="loop"),
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


class _Tok:
    """A tokenizer of one token per character (no spaces): an independent count."""

    def __call__(self, texts, add_special_tokens=False):
        return {"input_ids": [[0] * len(t.replace(" ", "")) for t in texts]}


def test_report_matches_the_hand_computed_file(tmp_path):
    report, _ = data_report(_tiny(tmp_path / "regen.jsonl"))
    chat, code = report["sources"]
    # chat: 13-grams: 2 in the 14-word answer (a..m, b..n), 1 in the 13-word one (a..m again): 2 distinct of 3
    assert chat["name"] == "chat" and (chat["conversations"], chat["turns"]) == (2, 3)
    assert chat["unique_13gram_share"] == round(2 / 3, 6)
    assert chat["supervised_tokens"] is None and chat["length_unit"] == "words"
    assert chat["answer_length_percentiles"] == {"p10": 2, "p50": 13, "p90": 14, "p99": 14}  # sorted 2, 13, 14
    assert chat["answer_length_mean"] == round(29 / 3, 3) and chat["answer_length_max"] == 14
    assert chat["loop_cut_answers"] == 0 and chat["loop_share_before_cutting"] is None
    assert (code["conversations"], code["turns"], code["unique_13gram_share"]) == (1, 1, None)  # 5 words: no 13-gram
    assert code["loop_cut_answers"] == 1 and code["loop_cut_share"] == 1.0
    everything = report["all"]
    assert (everything["conversations"], everything["turns"]) == (3, 4)
    assert everything["unique_13gram_share"] == round(2 / 3, 6) and everything["loop_cut_share"] == 0.25
    assert everything["answer_length_percentiles"] == {"p10": 2, "p50": 5, "p90": 14, "p99": 14}  # 2, 5, 13, 14
    assert "loop_note" in report and "tokens_note" in report


def test_report_counts_supervised_tokens_with_a_tokenizer(tmp_path):
    report, _ = data_report(_tiny(tmp_path / "regen.jsonl"), tokenizer=_Tok())
    chat, code = report["sources"]
    # characters without spaces: 14, 13 and 7 ("hithere"); each answer + its end-of-turn token
    assert chat["supervised_tokens"] == 14 + 13 + 7 + 3 and chat["length_unit"] == "tokens"
    assert code["supervised_tokens"] == len("onetwothreefourfive") + 1
    assert report["all"]["supervised_tokens"] == 37 + 20


def test_nearest_rank():
    assert nearest_rank([], 50) is None
    assert [nearest_rank(list(range(1, 11)), p) for p in (10, 50, 90, 99, 100)] == [1, 5, 9, 10, 10]


def test_write_report_and_cli(tmp_path):
    data = _tiny(tmp_path / "regen.jsonl")
    written = write_report(data, report_dir(data))
    assert written["json"] == str(tmp_path / "regen_report" / "data_report.json")
    assert written["png"] and open(written["png"], "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    assert json.loads(open(written["json"]).read())["all"]["turns"] == 4
    from nemo_dflash.recipes import data_report as cli

    out = tmp_path / "rep"
    assert cli.main([str(data), "--out", str(out)])["json"] == str(out / "data_report.json")
    before = (out / "data_report.json").read_text()
    with pytest.raises(SystemExit) as e:  # an existing report is not replaced without --overwrite
        cli.main([str(data), "--out", str(out)])
    assert e.value.code == 2 and (out / "data_report.json").read_text() == before
    with pytest.raises(SystemExit) as e:
        cli.main([str(tmp_path / "missing.jsonl"), "--out", str(out)])
    assert e.value.code == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": []}\nnot json\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2 is not JSON"):
        data_report(bad)
    with pytest.raises(SystemExit) as e:
        cli.main([str(bad), "--out", str(tmp_path / "rep2"), "--overwrite"])
    assert e.value.code == 2


def test_regenerate_writes_the_report(tmp_path):
    """`regenerate` ends by writing the report beside its output, in the target's tokens: supervised
    tokens as its own --summary-json counts them."""
    from _tiny_target import make_tiny_target_dir, write_chat_jsonl

    from nemo_dflash.recipes import regenerate

    out = tmp_path / "regen.jsonl"
    summary = regenerate.main(["--target", str(make_tiny_target_dir(tmp_path)), "--data",
                               f"chat={write_chat_jsonl(tmp_path / 'chats.jsonl', n=6)}", "--out", str(out),
                               "--num-samples", "4", "--max-new-tokens", "4", "--batch-size", "2", "--threads", "1",
                               "--summary-json", str(tmp_path / "s.json"), "--decontaminate", "off"])
    report = json.loads((tmp_path / "regen_report" / "data_report.json").read_text())
    assert summary["report"]["json"] == str(tmp_path / "regen_report" / "data_report.json")
    (row,) = report["sources"]
    assert row["name"] == "chat" and report["length_unit"] == "tokens"
    (counted,) = summary["sources"]
    assert (row["conversations"], row["turns"], row["supervised_tokens"]) == (
        counted["conversations"], counted["turns"], counted["supervised_tokens"])
    assert row["conversations"] == summary["written"] > 0


def test_gram_hashes_count_the_distinct_word_ngrams_of_each_text():
    """The vectorised hashes against the n-grams written out as tuples: as many hashes as windows
    inside the texts (none across two texts), as many distinct hashes as distinct n-grams."""
    import random

    from nemo_dflash.data.decontaminate import words
    from nemo_dflash.data.report import gram_hashes

    rng = random.Random(0)
    vocab = ["alpha", "beta", "gamma", "delta", "Eps", "zeta_1"]
    texts = [" ".join(rng.choice(vocab) for _ in range(rng.randint(0, 30))) for _ in range(300)]
    texts += ["a b c d e f g h i j k l m", "a b c d e f g h i j k l m n", "x. " * 3]  # 1 window, 2 windows, 0
    for n, chunk in ((13, 4096), (3, 7), (1, 1)):
        naive = [tuple(w[i:i + n]) for w in map(words, texts) for i in range(len(w) - n + 1)]
        h = gram_hashes(texts, n=n, chunk=chunk)
        assert len(h) == len(naive)
        assert len(set(h.tolist())) == len(set(naive))
    assert len(gram_hashes(["short text"], n=13)) == 0


def test_distinct_count_against_a_set():
    import numpy as np

    from nemo_dflash.data.report import distinct_count

    rng = np.random.default_rng(0)
    for n, high in ((0, 5), (1, 5), (1000, 7), (5000, 10**18)):
        values = rng.integers(-high, high, size=n, dtype=np.int64)
        assert distinct_count(values) == len(set(values.tolist()))


def _recipe_run(tmp_path, monkeypatch, sources):
    """A recipe naming `sources` and target `recipe-target`; the tokenizer loader records the names it is asked
    for and counts characters (`_Tok`); the picture is not drawn (the numbers are the report)."""
    from nemo_dflash.data import report as report_module
    from nemo_dflash.target import loading

    loaded = []
    monkeypatch.setattr(loading, "load_tokenizer", lambda name: loaded.append(name) or _Tok())
    monkeypatch.setattr(report_module, "plot_report", lambda *a: None)
    recipe = tmp_path / "r.yaml"
    recipe.write_text("target:\n  path: recipe-target\ndata:\n  sources:\n"
                      + "".join(f"    - path: {s}\n" for s in sources))
    return recipe, loaded


def test_data_report_takes_its_file_and_tokenizer_from_the_recipe(tmp_path, monkeypatch):
    from nemo_dflash.recipes import data_report as cli

    data = _tiny(tmp_path / "regen.jsonl")
    recipe, loaded = _recipe_run(tmp_path, monkeypatch, [data])
    written = cli.main(["--config", str(recipe), "--out", str(tmp_path / "rep")])
    report = json.loads(open(written["json"]).read())
    assert loaded == ["recipe-target"]
    assert report["all"]["supervised_tokens"] == 37 + 20 and report["all"]["turns"] == 4  # the hand counts above


def test_data_report_flags_and_overrides_win_over_the_recipe(tmp_path, monkeypatch, capsys):
    from nemo_dflash.recipes import data_report as cli

    data = _tiny(tmp_path / "regen.jsonl")
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps(_rec("solo", ["abc"])) + "\n")
    recipe, loaded = _recipe_run(tmp_path, monkeypatch, [data])
    written = cli.main(["--config", str(recipe), "--out", str(tmp_path / "a"), "--data", str(other),
                        "--tokenizer", "flag-target"])
    report = json.loads(open(written["json"]).read())
    assert [s["name"] for s in report["sources"]] == ["solo"] and report["all"]["supervised_tokens"] == 3 + 1
    cli.main(["--config", str(recipe), "--out", str(tmp_path / "b"), "target.path=override-target"])
    assert loaded == ["flag-target", "override-target"]
    several, _ = _recipe_run(tmp_path, monkeypatch, [data, other])
    with pytest.raises(SystemExit) as e:  # two files: the report needs to be told which
        cli.main(["--config", str(several), "--out", str(tmp_path / "c")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1 and "--data FILE" in err
    with pytest.raises(SystemExit) as e:  # the file twice, without a recipe
        cli.main([str(data), "--data", str(other), "--out", str(tmp_path / "d")])
    assert e.value.code == 2
