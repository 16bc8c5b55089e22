"""`regenerate --backend openai`: regeneration on an OpenAI-compatible server, against a real HTTP
server on 127.0.0.1 (tests/_openai_server.py): the engine's records from the same target, multi-turn
history, planted faults retried, a server killed mid-run and a client killed mid-run resumed with
nothing lost or repeated, bad endpoints refused before any prompt; llama.cpp's llama-server when
its binary is there."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
from _openai_server import Faults, OpenAIServer, echo_responder, model_responder
from _tiny_target import make_tiny_target_dir, write_chat_jsonl

from nemo_dflash.data import read_conversations
from nemo_dflash.data.openai_backend import Fidelity, answer_tokens, server_token_ids
from nemo_dflash.recipes import regenerate as cli


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    return make_tiny_target_dir(tmp_path_factory.mktemp("regen_openai"))


@pytest.fixture(scope="module")
def tokenizer(target_dir):
    from nemo_dflash.target.loading import load_tokenizer

    return load_tokenizer(str(target_dir))


@pytest.fixture(scope="module")
def chat_file(tmp_path_factory) -> Path:
    return write_chat_jsonl(tmp_path_factory.mktemp("chats") / "chats.jsonl", n=10)


@pytest.fixture(scope="module")
def multi_turn_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("multi") / "multi.jsonl"
    with open(path, "w") as f:
        for i in range(6):
            turns = []
            for t in range(1 + i % 3):
                turns += [{"role": "user", "content": f"question {i}.{t} about beta"},
                          {"role": "assistant", "content": "an old answer"}]
            f.write(json.dumps({"messages": [{"role": "system", "content": "be brief"}, *turns]}) + "\n")
    return path


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _args(target_dir, data, out, url, *extra) -> list[str]:
    return ["--target", str(target_dir), "--data", str(data), "--out", str(out), "--backend", "openai",
            "--endpoint", url, "--decontaminate", "off", "--max-new-tokens", "16", "--retries", "2",
            "--request-timeout", "5", "--retry-backoff", "0.05", *extra]


def test_answers_equal_the_engines_on_the_same_target(tmp_path, target_dir, chat_file):
    """Greedy answers of the tiny target served by a real HTTP server (transformers' generate behind
    it) give the engine's file line for line: the same prompts, the same stop handling, the same
    records, and every answer's token ids taken from the server."""
    from nemo_dflash.data.chat_template import stop_token_ids
    from nemo_dflash.target.loading import load_target

    model, tok = load_target(str(target_dir), dtype="fp32")
    common = ["--target", str(target_dir), "--data", str(chat_file), "--num-samples", "6", "--max-new-tokens", "6",
              "--sampling", "greedy", "--decontaminate", "off", "--seed", "2"]
    engine_out = tmp_path / "engine.jsonl"
    cli.main([*common, "--out", str(engine_out), "--batch-size", "3"])
    with OpenAIServer(model_responder(model, tok, stop_token_ids(model, tok))) as server:
        summary = cli.main([*common, "--out", str(tmp_path / "server.jsonl"), "--backend", "openai",
                            "--endpoint", server.url, "--concurrency", "3"])
    assert (tmp_path / "server.jsonl").read_text() == engine_out.read_text()
    assert summary["backend"] == "openai" and summary["server"]["model"] == "tiny"
    assert summary["server"]["server_token_ids"] == summary["answers"] == 6
    assert summary["server"]["token_mismatch"] == 0 and summary["server"]["retries"] == 0
    probe, *asked = server.bodies  # the one-token check before the run, then the run's requests
    assert probe["max_tokens"] == 1 and len(asked) == 6
    assert all(b["temperature"] == 0 and b["top_k"] == -1 and b["max_tokens"] == 6 for b in asked)
    # the ids asked for: llama.cpp returns no logprobs (no ids) when top_logprobs is 0
    assert all(b["logprobs"] is True and b["top_logprobs"] == 1 for b in asked)


def test_all_turns_send_the_targets_own_answers_as_history(tmp_path, target_dir, multi_turn_file):
    """--turns all: each later turn's request holds the system turn, the users and the answers the
    server gave before (never the data's old answers); the file has the engine's schema and the
    training reader reads it."""
    out = tmp_path / "regen.jsonl"
    with OpenAIServer(echo_responder(__import__("transformers").AutoTokenizer.from_pretrained(target_dir))) as server:
        summary = cli.main(_args(target_dir, multi_turn_file, out, server.url, "--turns", "all", "--concurrency", "4"))
    records = _read(out)
    assert len(records) == 6 and summary["turns"] == 1 + 2 + 3 + 1 + 2 + 3
    for r in records:
        roles = [m["role"] for m in r["messages"]]
        assert roles == ["system"] + ["user", "assistant"] * ((len(roles) - 1) // 2)
        assert set(r) == {"messages", "finish_reason", "source", "dataset"} and r["finish_reason"] == "stop"
        assert "an old answer" not in [m["content"] for m in r["messages"]]
        # the request of turn k is the record's first 2k messages (system + k users + k - 1 answers)
        for k in range(1, (len(roles) - 1) // 2 + 1):
            asked = r["messages"][: 2 * k]
            assert any(b["messages"] == asked for b in server.bodies[1:]), (r["source"], k)
    assert len(server.bodies) - 1 == summary["answers"] == summary["turns"]  # the first: the one-token check
    assert [c.messages for c in read_conversations(str(out))] == [r["messages"] for r in records]


def test_planted_faults_are_retried_and_change_nothing(tmp_path, target_dir, chat_file, tokenizer):
    """A 500, a 503, a 429, a dropped connection, a truncated body and an answer slower than
    --request-timeout are each asked again; the file is the fault-free run's."""
    reference = tmp_path / "ref.jsonl"
    with OpenAIServer(echo_responder(tokenizer)) as server:
        cli.main(_args(target_dir, chat_file, reference, server.url, "--num-samples", "6"))
    faults = Faults()
    faults.status, faults.drop, faults.truncate, faults.slow, faults.slow_s = [500, 503, 429], 1, 1, 1, 1.5
    out = tmp_path / "run.jsonl"
    with OpenAIServer(echo_responder(tokenizer), faults=faults) as server:
        summary = cli.main(_args(target_dir, chat_file, out, server.url, "--num-samples", "6", "--retries", "6",
                                 "--request-timeout", "0.5", "--concurrency", "1"))
    assert faults.seen == {"status": 3, "drop": 1, "truncate": 1, "slow": 1}
    assert summary["server"]["retries"] == 6
    assert out.read_text() == reference.read_text()


@pytest.mark.parametrize("fault, reason", [("wrong_model", "wrong_model"), ("status", "server_refused_400"),
                                           ("empty", "empty_answer")])
def test_a_bad_answer_is_skipped_with_its_reason(tmp_path, target_dir, chat_file, tokenizer, fault, reason):
    """An answer for another model (asked again, then skipped), a turn the server refuses (400: not
    asked again) and an empty answer: the conversation is skipped, counted by its reason."""
    faults = Faults()
    if fault == "wrong_model":
        faults.wrong_model = 3  # the first conversation's first attempt and both retries
    elif fault == "status":
        faults.status = [400]
    else:
        faults.empty = 1
    with OpenAIServer(echo_responder(tokenizer), faults=faults) as server:
        summary = cli.main(_args(target_dir, chat_file, tmp_path / "r.jsonl", server.url, "--num-samples", "5",
                                 "--concurrency", "1"))
    assert summary["skipped_generation"] == {reason: 1} and summary["written"] == 4
    assert faults.requests == 1 + 5 + (2 if fault == "wrong_model" else 0)  # the check, the answers, the retries


def test_capped_answers_follow_the_engines_cap_policy(tmp_path, target_dir, chat_file, tokenizer):
    """finish_reason length is the engine's token cap: kept (the record says length) or, with --capped
    drop, the conversation skipped; the two runs split the same conversations."""
    with OpenAIServer(echo_responder(tokenizer)) as server:
        keep = cli.main(_args(target_dir, chat_file, tmp_path / "keep.jsonl", server.url, "--max-new-tokens", "4"))
        drop = cli.main(_args(target_dir, chat_file, tmp_path / "drop.jsonl", server.url, "--max-new-tokens", "4",
                              "--capped", "drop"))
    kept = _read(tmp_path / "keep.jsonl")
    capped = [r["source"] for r in kept if r["finish_reason"] == "length"]
    assert 0 < len(capped) < len(kept) == 10 and keep["capped_after"] == len(capped)
    assert drop["skipped_generation"] == {"length": len(capped)}
    assert [r for r in kept if r["source"] not in capped] == _read(tmp_path / "drop.jsonl")
    assert all(len(tokenizer.encode(r["messages"][-1]["content"], add_special_tokens=False)) == 4
               for r in kept if r["finish_reason"] == "length")


def test_server_killed_mid_run_then_restarted_loses_and_repeats_nothing(tmp_path, target_dir, multi_turn_file,
                                                                        tokenizer, capsys):
    """The server dies after 5 answers: the run stops with one line, its journal holding whole
    conversations only; a server restarted on the same port and the same command finish the file,
    equal to an uninterrupted run's. A server down for a moment is ridden out by the retries."""
    args = ["--turns", "all", "--concurrency", "2", "--retries", "1"]
    reference = tmp_path / "ref.jsonl"
    with OpenAIServer(echo_responder(tokenizer)) as server:
        cli.main(_args(target_dir, multi_turn_file, reference, server.url, *args))
    faults = Faults()
    faults.die_after = 5
    server = OpenAIServer(echo_responder(tokenizer), faults=faults).start()
    out = tmp_path / "run.jsonl"
    with pytest.raises(SystemExit) as exc:
        cli.main(_args(target_dir, multi_turn_file, out, server.url, *args))
    assert exc.value.code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and "the server stopped answering" in err[0] and "run the same command" in err[0]
    partial = _read(tmp_path / "run.jsonl.partial")
    assert not out.exists() and len(partial) < 6
    assert all(line in reference.read_text().splitlines() for line in map(json.dumps, []))
    ref = {r["source"]: r for r in _read(reference)}
    assert all(ref[r["source"]] == r for r in partial)  # whole conversations, the uninterrupted run's
    port = server.port
    server.stop()
    with OpenAIServer(echo_responder(tokenizer), port=port) as again:
        summary = cli.main(_args(target_dir, multi_turn_file, out, again.url, *args))
    assert summary["resumed_done"] == len(partial) and summary["written"] == 6
    assert out.read_text() == reference.read_text()

    # down for a moment, back on the same port: the retries ride it out
    first = OpenAIServer(echo_responder(tokenizer)).start()
    port = first.port
    first.faults.die_after = 3
    holder: dict = {}

    def restart() -> None:
        first.stopped.wait(30)
        time.sleep(0.3)
        holder["server"] = OpenAIServer(echo_responder(tokenizer), port=port).start()

    import threading

    t = threading.Thread(target=restart)
    t.start()
    out2 = tmp_path / "ridden.jsonl"
    try:
        summary = cli.main(_args(target_dir, multi_turn_file, out2, first.url, "--turns", "all", "--concurrency", "2",
                                 "--retries", "8"))
    finally:
        t.join()
        holder["server"].stop()
    assert out2.read_text() == reference.read_text() and summary["server"]["retries"] >= 1


def test_client_killed_mid_run_then_resumed(tmp_path, monkeypatch, target_dir, multi_turn_file, tokenizer):
    """The client dies after 3 conversations (the last one torn mid-write): the same command
    continues the journal and writes the uninterrupted run's file; no conversation asked twice
    beyond those in flight at the kill."""
    from nemo_dflash.data import openai_backend

    args = ["--turns", "all", "--concurrency", "1"]
    with OpenAIServer(echo_responder(tokenizer)) as server:
        reference = tmp_path / "ref.jsonl"
        cli.main(_args(target_dir, multi_turn_file, reference, server.url, *args))
        out = tmp_path / "run.jsonl"
        real, calls = openai_backend.ServerEngine._completion, []

        def killed_later(self, *a, **k):
            calls.append(1)
            if len(calls) == 7:
                raise KeyboardInterrupt
            return real(self, *a, **k)

        monkeypatch.setattr(openai_backend.ServerEngine, "_completion", killed_later)
        with pytest.raises(KeyboardInterrupt):
            cli.main(_args(target_dir, multi_turn_file, out, server.url, *args))
        monkeypatch.setattr(openai_backend.ServerEngine, "_completion", real)
        partial = tmp_path / "run.jsonl.partial"
        written = _read(partial)
        assert 0 < len(written) < 6 and not out.exists()
        with open(partial, "a") as f:
            f.write('{"messages": [{"ro')  # killed mid-write
        summary = cli.main(_args(target_dir, multi_turn_file, out, server.url, *args))
    assert summary["resumed_done"] == len(written)
    assert out.read_text() == reference.read_text()
    assert not partial.exists() and not (tmp_path / "run.jsonl.partial.json").exists()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("case, message", [
    ("unreachable", "cannot reach --endpoint"),
    ("wrong_model", "--model nope is not served by"),
    ("no_chat", "has no chat completions"),
    ("key_missing", "--api-key-env NEMO_DFLASH_TEST_KEY: the variable is not set"),
    ("wrong_key", "refused the API key"),
    ("not_openai", "has no OpenAI model list"),
])
def test_bad_endpoints_are_one_line_before_any_prompt(tmp_path, target_dir, chat_file, tokenizer, capsys, monkeypatch,
                                                      case, message):
    server = OpenAIServer(echo_responder(tokenizer), chat=case != "no_chat",
                          api_key="secret" if case in ("wrong_key", "key_missing") else None).start()
    url, extra = server.url, []
    monkeypatch.delenv("NEMO_DFLASH_TEST_KEY", raising=False)
    if case == "unreachable":
        url = f"http://127.0.0.1:{_closed_port()}/v1"
    elif case == "wrong_model":
        extra = ["--model", "nope"]
    elif case in ("key_missing", "wrong_key"):
        extra = ["--api-key-env", "NEMO_DFLASH_TEST_KEY"]
        if case == "wrong_key":
            monkeypatch.setenv("NEMO_DFLASH_TEST_KEY", "wrong")
    elif case == "not_openai":
        url = server.url[: -len("/v1")]
    try:
        with pytest.raises(SystemExit) as exc:
            cli.main(_args(target_dir, chat_file, tmp_path / "r.jsonl", url, *extra))
    finally:
        server.stop()
    assert exc.value.code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and message in err[0], err
    assert server.bodies == [] and not list(tmp_path.iterdir())  # no prompt answered, nothing written


def test_the_right_key_is_sent(tmp_path, target_dir, chat_file, tokenizer, monkeypatch):
    monkeypatch.setenv("NEMO_DFLASH_TEST_KEY", "secret")
    with OpenAIServer(echo_responder(tokenizer), api_key="secret") as server:
        summary = cli.main(_args(target_dir, chat_file, tmp_path / "r.jsonl", server.url, "--num-samples", "2",
                                 "--api-key-env", "NEMO_DFLASH_TEST_KEY"))
    assert summary["written"] == 2
    assert "secret" not in (tmp_path / "r.jsonl").read_text()


def test_token_ids_from_each_servers_layout(tokenizer):
    """vLLM's token_ids, llama.cpp's logprobs ids, vLLM's token_id:N tokens; none without them."""
    assert server_token_ids({"token_ids": [5, 6]}) == [5, 6]
    assert server_token_ids({"logprobs": {"content": [{"id": 7, "token": "a"}, {"id": 8, "token": "b"}]}}) == [7, 8]
    assert server_token_ids({"logprobs": {"content": [{"token": "token_id:9"}, {"token": "token_id:10"}]}}) == [9, 10]
    assert server_token_ids({"logprobs": {"content": [{"token": "a"}]}}) is None
    assert server_token_ids({"message": {"content": "x"}}) is None


def test_retokenized_answers_are_checked_against_the_servers_count(tokenizer):
    """Without token ids the text is re-tokenised; an answer whose length differs from
    usage.completion_tokens (the stop token counted) is counted; server ids that do not decode to
    the server's text are not trusted."""
    import threading

    text = "alpha beta gamma"
    ids = tokenizer.encode(text, add_special_tokens=False)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    lock, fid = threading.Lock(), Fidelity()
    stop = {"message": {"content": text}, "finish_reason": "stop"}
    assert answer_tokens(tokenizer, stop, {"completion_tokens": len(ids) + 1}, [eos], fid, lock) == ids
    assert (fid.retokenized, fid.mismatch) == (1, 0)
    answer_tokens(tokenizer, stop, {"completion_tokens": len(ids)}, [eos], fid, lock)  # the stop token not counted
    assert (fid.retokenized, fid.mismatch) == (2, 1)
    capped = {"message": {"content": text}, "finish_reason": "length"}
    answer_tokens(tokenizer, capped, {"completion_tokens": len(ids)}, [eos], fid, lock)
    assert fid.mismatch == 1
    assert answer_tokens(tokenizer, {**stop, "token_ids": ids + [eos]}, None, [eos], fid, lock) == ids
    assert fid.server_ids == 1
    other = [i + 1 for i in ids]  # another vocabulary's ids
    assert answer_tokens(tokenizer, {**stop, "token_ids": other}, None, [eos], fid, lock) == ids
    assert (fid.server_ids, fid.mismatch, fid.retokenized) == (1, 2, 4)
    assert fid.retokenize_differs == 0
    # ids a model may sample that spell the same text another way ("al" + "pha" for "alpha"): kept, and
    # counted as what re-tokenising the text would have changed
    split = tokenizer.encode("al", add_special_tokens=False) + tokenizer.encode("pha beta gamma",
                                                                                add_special_tokens=False)
    assert split != ids and tokenizer.decode(split) == text
    assert answer_tokens(tokenizer, {**stop, "token_ids": split + [eos]}, None, [eos], fid, lock) == split
    assert (fid.server_ids, fid.retokenize_differs, fid.mismatch) == (2, 1, 2)


def test_retokenized_run_reports_the_mismatches(tmp_path, target_dir, chat_file, tokenizer):
    with OpenAIServer(echo_responder(tokenizer, with_ids=False, count_stop=False)) as server:
        summary = cli.main(_args(target_dir, chat_file, tmp_path / "r.jsonl", server.url, "--num-samples", "4"))
    assert summary["server"]["retokenized"] == 4 and summary["server"]["server_token_ids"] == 0
    assert summary["server"]["token_mismatch"] == summary["finish"].get("stop", 0) == 4


@pytest.mark.parametrize("bad, message", [
    (["--endpoint", "localhost:8000"], "is not an http(s) URL"),
    (["--concurrency", "0"], "--concurrency must be in"),
    (["--request-timeout", "0"], "--request-timeout must be > 0"),
    (["--retries", "-1"], "--retries must be >= 0"),
])
def test_bad_server_flags(tmp_path, bad, message, capsys):
    argv = ["--target", "x", "--data", "y", "--out", str(tmp_path / "o.jsonl"), "--backend", "openai",
            "--endpoint", "http://127.0.0.1:1/v1", *bad]
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_openai_without_endpoint_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        cli.main(["--target", "x", "--data", "y", "--out", str(tmp_path / "o.jsonl"), "--backend", "openai"])
    assert "--backend openai needs --endpoint" in capsys.readouterr().err


# ---- llama.cpp's llama-server, when its binary is there (NEMO_DFLASH_LLAMA_SERVER or on PATH) ----

def _llama_server() -> str:
    found = os.environ.get("NEMO_DFLASH_LLAMA_SERVER") or shutil.which("llama-server")
    if not found or not os.access(found, os.X_OK):
        pytest.skip("llama-server is not installed (set NEMO_DFLASH_LLAMA_SERVER to its binary)")
    return found


class LlamaServer:
    """llama.cpp's server on 127.0.0.1 serving the SmolLM2 GGUF on CPU, started (and waited for:
    /health 200) and stopped or killed by the test; ``port`` keeps the address across a restart.
    One thread: on a CPU shared with the test's own process, two spinning threads ran 10x slower."""

    def __init__(self, binary: str, log: Path, port: int = 0, *, slots: int = 2, context: int = 2048) -> None:
        self.binary, self.log, self.slots, self.context = binary, log, slots, context
        self.port = port or _closed_port()
        self.proc: "subprocess.Popen | None" = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> "LlamaServer":
        import urllib.request

        from nemo_dflash.target.loading import smollm2_gguf_path

        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [self.binary, "-m", str(smollm2_gguf_path()), "--host", "127.0.0.1", "--port", str(self.port),
                 "-c", str(self.context), "-np", str(self.slots), "-t", "1", "--alias", "smollm2"],
                stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"llama-server exited: {self.log.read_text()[-2000:]}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.1)
        self.kill()
        raise AssertionError(f"llama-server did not answer /health: {self.log.read_text()[-2000:]}")

    def kill(self) -> None:
        """SIGKILL: the server dies as a crashed or preempted one does, mid-answer."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()

    def __enter__(self) -> "LlamaServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


@pytest.fixture(scope="module")
def llama_chats(tmp_path_factory) -> Path:
    """Conversations of 1 to 3 user turns with a system turn: prompts a 135M model answers briefly."""
    path = tmp_path_factory.mktemp("llama") / "chats.jsonl"
    topics = ["the moon", "bread", "rivers", "chess", "rain", "cats", "maps", "tea"]
    with open(path, "w") as f:
        for i, topic in enumerate(topics):
            turns = []
            for t, ask in enumerate(["What is {}?", "Name one fact about {}.", "Why does {} matter?"][: 1 + i % 3]):
                turns += [{"role": "user", "content": ask.format(topic)},
                          {"role": "assistant", "content": "an old answer"}]
            f.write(json.dumps({"messages": [{"role": "system", "content": "Answer in one sentence."}, *turns]})
                    + "\n")
    return path


def _llama_args(data: Path, out: Path, url: str, *extra: str) -> list[str]:
    return ["--target", "pkg:smollm2", "--data", str(data), "--out", str(out), "--backend", "openai", "--endpoint",
            url, "--turns", "all", "--after-cut", "continue", "--max-new-tokens", "32", "--sampling", "greedy",
            "--decontaminate", "off", "--concurrency", "2", "--retries", "1", "--retry-backoff", "0.05",
            "--request-timeout", "60", *extra]


def test_llama_server_serving_smollm2(tmp_path, llama_chats):
    """The SmolLM2 GGUF served by llama-server on CPU, every turn: the engine's schema and turns (the
    engine run on the same target and flags), the server's own answers as the history, each answer's
    tokens taken from the server (logprobs ids) decoding to its text with the target's tokenizer, the
    stop token dropped as the engine drops it, and the prompt cap taken from the slot's context."""
    from nemo_dflash.target.loading import load_tokenizer

    binary = _llama_server()
    out, engine_out = tmp_path / "regen.jsonl", tmp_path / "engine.jsonl"
    with LlamaServer(binary, tmp_path / "server.log", slots=2, context=2048) as server:
        summary = cli.main(_llama_args(llama_chats, out, server.url))
    engine = cli.main(["--target", "pkg:smollm2", "--data", str(llama_chats), "--out", str(engine_out), "--turns",
                       "all", "--after-cut", "continue", "--max-new-tokens", "32", "--sampling", "greedy",
                       "--decontaminate", "off", "--batch-size", "2"])
    records, engine_records = _read(out), _read(engine_out)
    assert len(records) == summary["written"] == engine["written"] == 8
    assert summary["turns"] == engine["turns"] == 1 + 2 + 3 + 1 + 2 + 3 + 1 + 2
    for r, e in zip(records, engine_records):
        assert set(r) == set(e) and r["source"] == e["source"]
        assert [m["role"] for m in r["messages"]] == [m["role"] for m in e["messages"]]
        assert [m for m in r["messages"] if m["role"] != "assistant"] == \
            [m for m in e["messages"] if m["role"] != "assistant"]
        assert all(set(m) == {"role", "content"} for m in r["messages"])
        assert all(m["content"].strip() and "an old answer" != m["content"] and "<|im_end|>" not in m["content"]
                   for m in r["messages"] if m["role"] == "assistant")
    assert [c.messages for c in read_conversations(str(out))] == [r["messages"] for r in records]
    told = summary["server"]
    assert told["model"] == "smollm2" and told["server_token_ids"] == summary["answers"] == summary["turns"]
    assert told["retokenized"] == 0 and told["token_mismatch"] == 0 and told["retries"] == 0
    assert told["context"] == 1024  # 2048 over 2 slots: the slot's n_ctx, not the model's 8192
    tok = load_tokenizer("pkg:smollm2")
    stops = {tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id}
    for r in records:  # the answers the draft trains on: tokens of the text, no stop token inside
        for m in r["messages"]:
            if m["role"] == "assistant":
                assert not stops & set(tok.encode(m["content"], add_special_tokens=False))


def test_llama_server_killed_then_client_killed_loses_and_repeats_nothing(tmp_path, monkeypatch, llama_chats):
    """llama-server SIGKILLed mid-run: the run stops with one line, its journal whole conversations
    only; the server restarted on the same port and the same command continue; the client killed
    mid-run (the journal torn mid-write) and the same command again finish the file: every
    conversation exactly once, in the uninterrupted run's order, those journalled kept verbatim."""
    from nemo_dflash.data import openai_backend

    binary = _llama_server()
    reference = tmp_path / "ref.jsonl"
    log = tmp_path / "server.log"
    server = LlamaServer(binary, log).start()
    try:
        cli.main(_llama_args(llama_chats, reference, server.url))
        ref_sources = [r["source"] for r in _read(reference)]
        out = tmp_path / "run.jsonl"
        partial = tmp_path / "run.jsonl.partial"
        real = openai_backend.ServerEngine._completion

        def journalled() -> int:
            return len(partial.read_text().splitlines()) if partial.exists() else 0

        def server_dies(self, *a, **k):
            if journalled() >= 2:  # two conversations in: the answers in flight die with the server
                server.kill()
            return real(self, *a, **k)

        monkeypatch.setattr(openai_backend.ServerEngine, "_completion", server_dies)
        with pytest.raises(SystemExit) as exc:
            cli.main(_llama_args(llama_chats, out, server.url))
        assert exc.value.code == 2
        monkeypatch.setattr(openai_backend.ServerEngine, "_completion", real)
        first = partial.read_text().splitlines()
        assert not out.exists() and 2 <= len(first) < 8
        assert len({json.loads(line)["source"] for line in first}) == len(first)

        server = LlamaServer(binary, log, port=server.port).start()  # the same address, a new process

        def client_dies(self, *a, **k):
            if journalled() > len(first):  # one more conversation journalled: the client dies
                raise KeyboardInterrupt
            return real(self, *a, **k)

        monkeypatch.setattr(openai_backend.ServerEngine, "_completion", client_dies)
        with pytest.raises(KeyboardInterrupt):
            cli.main(_llama_args(llama_chats, out, server.url))
        monkeypatch.setattr(openai_backend.ServerEngine, "_completion", real)
        second = partial.read_text().splitlines()
        assert second[: len(first)] == first and len(first) < len(second) < 8
        with open(partial, "a") as f:
            f.write('{"messages": [{"ro')  # killed mid-write
        summary = cli.main(_llama_args(llama_chats, out, server.url))
    finally:
        server.stop()
    records = out.read_text().splitlines()
    assert summary["resumed_done"] == len(second) and summary["written"] == 8
    assert [json.loads(line)["source"] for line in records] == ref_sources  # none lost, none twice, in order
    assert set(second) <= set(records)  # the journalled conversations, verbatim
    assert not partial.exists()


PIPELINE_RECIPE = """
run: {{dir: {run}}}
output_dir: {run}/train
target: {{path: {target}, dtype: fp32}}
draft: {{num_layers: 2, block_size: 4}}
data: {{max_length: 64, holdout_fraction: 0.2}}
loss: {{num_anchors: 8}}
optim: {{lr: 3.0e-3}}
train: {{micro_batch_size: 2, log_every: 1, max_steps: 2}}
distributed: {{strategy: none}}
wandb: {{mode: disabled}}
regenerate:
  data: [{chat}]
  max_new_tokens: 8
  turns: all
  backend: openai
  endpoint: {url}
  concurrency: 4
  retry_backoff: 0.05
"""


def test_a_pipeline_on_a_server_regenerates_and_trains(tmp_path, target_dir, multi_turn_file, tokenizer):
    """One recipe key switches the backend: the pipeline's regenerate stage asks the server and the
    train stage reads its file unchanged."""
    from nemo_dflash.recipes import pipeline

    run = tmp_path / "run"
    with OpenAIServer(echo_responder(tokenizer)) as server:
        config = tmp_path / "recipe.yaml"
        config.write_text(PIPELINE_RECIPE.format(run=run, target=target_dir, chat=multi_turn_file, url=server.url))
        outcome = pipeline.main(["--config", str(config), "stages=regenerate,train"])
    assert outcome == {"regenerate": "done", "train": "done"}
    regen = next(run.rglob("regen.jsonl"))
    records = _read(regen)
    assert len(records) == 6 and len(server.bodies) - 1 == sum((len(r["messages"]) - 1) // 2 for r in records)


def test_the_recipe_keys_are_the_flags():
    """`regenerate.backend: openai` and its keys in a recipe reach the command as the same values."""
    import dataclasses

    from nemo_dflash.config import RegenerateConfig
    from nemo_dflash.recipes._cli import section_argv

    section = RegenerateConfig(data=["chitchat"], backend="openai", endpoint="http://h:8000/v1", model="m",
                               api_key_env="KEY_VAR", concurrency=7, request_timeout=3.5, retries=1, retry_backoff=0.1,
                               server_extensions="off")
    argv = ["--target", "t", "--out", "o.jsonl", *section_argv(cli.build_parser(), section)]
    assert argv[argv.index("--backend") + 1] == "openai" and argv[argv.index("--model") + 1] == "m"
    args = vars(cli.build_parser().parse_args(argv))
    assert {f.name: args[f.name] for f in dataclasses.fields(section)} == dataclasses.asdict(section)


def test_the_targets_sampling_and_thinking_mode_reach_the_server(tmp_path, target_dir, chat_file, tokenizer):
    """--sampling target sends the target's generation_config (temperature, top_p) with top-k off;
    --reasoning both asks each conversation in both modes through chat_template_kwargs, each record
    tagged with its mode as the engine tags it."""
    import shutil as sh

    target = tmp_path / "target"
    sh.copytree(target_dir, target)
    (target / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": 0.6, "top_p": 0.8}))
    with OpenAIServer(echo_responder(tokenizer)) as server:
        summary = cli.main(_args(target, chat_file, tmp_path / "r.jsonl", server.url, "--num-samples", "3",
                                 "--reasoning", "both"))
    asked = server.bodies[1:]
    assert summary["sampling"] == {"temperature": 0.6, "top_p": 0.8, "from": "target generation_config"}
    assert len(asked) == 6 and all((b["temperature"], b["top_p"], b["top_k"]) == (0.6, 0.8, -1) for b in asked)
    modes = sorted(b["chat_template_kwargs"]["enable_thinking"] for b in asked)
    assert modes == [False] * 3 + [True] * 3
    records = _read(tmp_path / "r.jsonl")
    assert sorted(r["reasoning"] for r in records) == ["off"] * 3 + ["on"] * 3
    assert len({b["seed"] for b in asked}) == 6  # each answer its own key
