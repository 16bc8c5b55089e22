"""Regeneration on an OpenAI-compatible server (vLLM, SGLang, TensorRT-LLM, llama.cpp's llama-server).

A user who has outgrown one machine already runs a serving fleet; this backend asks it for the
target's answers instead of loading the target here. Everything but the generation is the
engine's: the conversations, the target's own earlier answers as history, the loop and cap
policies, the journal and the resume (:class:`~nemo_dflash.data.regenerate._Regeneration` runs
unchanged on :class:`ServerEngine`, which yields the engine's ``Completion`` objects).

Token fidelity: the draft trains on the target's tokens, so each answer's token ids are taken
from the server where it returns them (vLLM's ``return_token_ids`` / ``return_tokens_as_token_ids``,
llama.cpp's ``logprobs`` entries with ``id``) and kept when they decode to the server's text with
the target's tokenizer; otherwise the text is re-tokenised, and the answers whose re-tokenised
length differs from the server's ``usage.completion_tokens`` are counted (:class:`Fidelity`).

Faults: a timeout, a 429 or 5xx, a dropped connection or a truncated body is retried with
exponential back-off (``Retry-After`` honoured); once ``retries`` are spent the run stops with
:class:`ServerUnavailable` (the journal keeps every finished conversation; the same command
continues). An answer for another model, or one the server refuses (4xx), is skipped with its reason.
The standard library only: ``urllib`` and a thread pool.
"""

from __future__ import annotations

import collections
import json
import logging
import random
import re
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from http.client import HTTPException
from typing import Any, Callable, Iterable, Iterator, NoReturn, Optional, Sequence

from nemo_dflash.data.loops import LoopDetector
from nemo_dflash.data.regenerate import RegenSettings, _Regeneration
from nemo_dflash.engine.plain import Completion, Request
from nemo_dflash.engine.sampling import GREEDY, SamplingParams

logger = logging.getLogger(__name__)

# Statuses worth asking again: the server is overloaded, restarting or behind a proxy that lost it.
RETRY_STATUS = frozenset({408, 409, 425, 429, 500, 502, 503, 504})
MAX_BACKOFF_S = 30.0
_TOKEN_ID = re.compile(r"^token_id:(\d+)$")


class EndpointError(Exception):
    """A problem the user fixes in the recipe or by starting the server: one line, before any prompt."""


class ServerUnavailable(Exception):
    """The server stopped answering mid-run (retries spent): the run stops, its journal kept."""


@dataclass
class Endpoint:
    """Where and how to ask: the server's base URL (``http://HOST:PORT/v1``), the model it serves,
    the API key (read from the environment, never from the recipe) and the request policy."""

    base_url: str
    model: str
    api_key: Optional[str] = None
    timeout_s: float = 600.0
    retries: int = 5
    backoff_s: float = 1.0
    extensions: bool = True  # send the fields vLLM / SGLang / llama.cpp take beyond OpenAI's

    def url(self, path: str) -> str:
        return self.base_url.rstrip("/") + "/" + path.lstrip("/")


class _Transient(Exception):
    """One attempt failed in a way another attempt may not (timeout, 429/5xx, dropped connection)."""

    def __init__(self, reason: str, retry_after: Optional[float] = None) -> None:
        super().__init__(reason)
        self.retry_after = retry_after


class _Refused(Exception):
    """The server refused this request for good (a 4xx other than 408/409/425/429)."""

    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:200]}")
        self.status, self.body = status, body


def _request(endpoint: Endpoint, method: str, path: str, body: Optional[dict[str, Any]] = None,
             timeout: Optional[float] = None) -> dict[str, Any]:
    """One HTTP exchange, the JSON answer; :class:`_Transient` or :class:`_Refused` otherwise."""
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", "Accept": "application/json"}
    if endpoint.api_key:
        headers["Authorization"] = f"Bearer {endpoint.api_key}"
    req = urllib.request.Request(endpoint.url(path), data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout or endpoint.timeout_s) as resp:
            raw = resp.read()
    except urllib.error.HTTPError as e:
        try:
            text = e.read().decode("utf-8", "replace")
        except (OSError, HTTPException):
            text = ""
        if e.code in RETRY_STATUS:
            after = e.headers.get("Retry-After") if e.headers is not None else None
            try:
                wait_s = float(after) if after is not None else None
            except ValueError:
                wait_s = None
            raise _Transient(f"HTTP {e.code}", wait_s) from None
        raise _Refused(e.code, text) from None
    except (urllib.error.URLError, HTTPException, OSError) as e:  # refused, reset, timed out, truncated
        reason = getattr(e, "reason", e)
        raise _Transient(f"{type(reason).__name__}: {reason}") from None
    try:
        answer = json.loads(raw)
    except ValueError:
        raise _Transient("a body that is not JSON (truncated?)") from None
    if not isinstance(answer, dict):
        raise _Transient("a JSON body that is not an object")
    return answer


# ---- before any prompt: is the endpoint what the recipe says? ----

def served_models(endpoint: Endpoint, timeout: float = 10.0) -> list[dict[str, Any]]:
    """``GET /models``: the models the server serves (EndpointError when it cannot be asked)."""
    try:
        answer = _request(endpoint, "GET", "models", timeout=timeout)
    except _Transient as e:
        raise EndpointError(f"cannot reach --endpoint {endpoint.base_url} ({e}): start the server, or fix the URL "
                            "(the OpenAI base URL, e.g. http://HOST:8000/v1)") from None
    except _Refused as e:
        if e.status in (401, 403):
            raise EndpointError(f"--endpoint {endpoint.base_url} refused the API key (HTTP {e.status}): export the "
                                "right key in the variable --api-key-env names") from None
        raise EndpointError(f"--endpoint {endpoint.base_url} has no OpenAI model list (GET /models: HTTP {e.status}): "
                            "give the OpenAI base URL of the server, e.g. http://HOST:8000/v1") from None
    data = answer.get("data")
    if not isinstance(data, list):
        raise EndpointError(f"--endpoint {endpoint.base_url}: GET /models is not an OpenAI model list: give the "
                            "OpenAI base URL of the server, e.g. http://HOST:8000/v1")
    return [m for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]


def pick_model(models: Sequence[dict[str, Any]], wanted: Optional[str], base_url: str) -> dict[str, Any]:
    """The served model the run asks: ``wanted``, or the only one served."""
    names = [m["id"] for m in models]
    if wanted is None:
        if len(names) == 1:
            return models[0]
        raise EndpointError(f"--endpoint {base_url} serves {len(names)} models ({', '.join(names) or 'none'}): "
                            "name one with --model")
    for m in models:
        if m["id"] == wanted:
            return m
    raise EndpointError(f"--model {wanted} is not served by {base_url} (it serves: {', '.join(names) or 'nothing'}): "
                        "set --model to the served name (vLLM: --served-model-name)")


def chat_body(endpoint: Endpoint, messages: Sequence[dict[str, str]], *, max_tokens: int, sampling: SamplingParams,
              seed: Optional[int], reasoning: Optional[str]) -> dict[str, Any]:
    """The chat-completions request of one turn. Sampling is sent whole (top-k off, no penalties) so
    the server's defaults (a checkpoint's generation_config) do not reshape the distribution the
    draft trains on, as the engine's explicit settings do; with ``extensions`` the server is also
    asked for the answer's token ids (``top_logprobs`` 1, not 0: llama.cpp returns no logprobs, so no
    ids, for 0)."""
    body: dict[str, Any] = {"model": endpoint.model, "messages": list(messages), "max_tokens": max_tokens,
                            "temperature": sampling.temperature, "top_p": 1.0 if sampling.greedy else sampling.top_p,
                            "n": 1,
                            "stream": False}
    if seed is not None:
        body["seed"] = seed
    if endpoint.extensions:
        body.update(top_k=-1, min_p=0.0, repetition_penalty=1.0, logprobs=True, top_logprobs=1,
                    return_token_ids=True, return_tokens_as_token_ids=True, skip_special_tokens=True)
        if reasoning is not None:
            body["chat_template_kwargs"] = {"enable_thinking": reasoning == "on"}
    return body


def probe_chat(endpoint: Endpoint, timeout: Optional[float] = None) -> dict[str, Any]:
    """A one-token chat completion: the server has chat completions and takes the recipe's fields."""
    body = chat_body(endpoint, [{"role": "user", "content": "Hi"}], max_tokens=1, sampling=GREEDY,
                     seed=0, reasoning=None)
    for attempt in range(endpoint.retries + 1):  # a server still warming up answers 503 for a while
        try:
            return _request(endpoint, "POST", "chat/completions", body, timeout=timeout)
        except _Transient as e:
            if attempt == endpoint.retries:
                raise EndpointError(f"--endpoint {endpoint.base_url} did not answer a one-token chat completion "
                                    f"({e}): check that the server is up and not overloaded") from None
            time.sleep(min(endpoint.backoff_s * 2 ** attempt, MAX_BACKOFF_S))
        except _Refused as e:
            _refused_probe(endpoint, e)  # raises
    raise AssertionError("unreachable")


def _refused_probe(endpoint: Endpoint, e: _Refused) -> NoReturn:
    """The one line for a server that refused the one-token check, by status."""
    if e.status in (404, 405, 501):
        raise EndpointError(f"--endpoint {endpoint.base_url} has no chat completions (POST /chat/completions: "
                            f"HTTP {e.status}): serve the target with an OpenAI-compatible server (vllm serve, "
                            "SGLang, llama-server)")
    if e.status in (401, 403):
        raise EndpointError(f"--endpoint {endpoint.base_url} refused the API key (HTTP {e.status}): export the "
                            "right key in the variable --api-key-env names")
    hint = (" (a server that takes only OpenAI's fields: pass --server-extensions off)" if endpoint.extensions
            else "")
    raise EndpointError(f"--endpoint {endpoint.base_url} refused a one-token chat completion for {endpoint.model} "
                        f"(HTTP {e.status}: {e.body[:120]!r}){hint}")


def connect(base_url: str, model: Optional[str], api_key: Optional[str], *, timeout_s: float, retries: int,
            extensions: bool, backoff_s: float = 1.0) -> tuple[Endpoint, dict[str, Any]]:
    """Check the endpoint before any prompt is sent: reachable, the model served, chat completions
    answered. The endpoint and the served model's entry of ``/models`` (vLLM gives ``max_model_len``)."""
    endpoint = Endpoint(base_url, model or "", api_key, timeout_s, retries, backoff_s, extensions)
    entry = pick_model(served_models(endpoint), model, base_url)
    endpoint.model = entry["id"]
    probe_chat(endpoint)
    return endpoint, entry


# ---- an answer: its text, its token ids where the server gives them ----

def server_token_ids(choice: dict[str, Any]) -> Optional[list[int]]:
    """The answer's token ids as the server reports them, or None: vLLM's ``token_ids``
    (``return_token_ids``), llama.cpp's ``logprobs.content[].id``, or vLLM's ``token_id:N`` tokens
    (``return_tokens_as_token_ids``)."""
    ids = choice.get("token_ids")
    if isinstance(ids, list) and all(isinstance(t, int) for t in ids):
        return list(ids)
    content = (choice.get("logprobs") or {}).get("content") if isinstance(choice.get("logprobs"), dict) else None
    if not isinstance(content, list) or not content:
        return None
    if all(isinstance(e, dict) and isinstance(e.get("id"), int) for e in content):
        return [e["id"] for e in content]
    found = [_TOKEN_ID.match(e.get("token", "")) if isinstance(e, dict) and isinstance(e.get("token"), str) else None
             for e in content]
    if all(found):
        return [int(m.group(1)) for m in found]
    return None


@dataclass
class Fidelity:
    """How the answers' tokens were had: ``server_ids`` taken from the server (decoding to its text),
    ``retokenized`` from the text; ``mismatch`` the answers whose server ids did not decode to the
    server's text, or whose re-tokenised length differs from ``usage.completion_tokens``;
    ``retokenize_differs`` the answers with server ids whose text re-tokenised gives other ids (what a
    server without token ids would have cost: the same text, other tokens)."""

    server_ids: int = 0
    retokenized: int = 0
    mismatch: int = 0
    retokenize_differs: int = 0
    retries: int = 0  # attempts repeated (timeouts, 429/5xx, dropped connections)
    retry_reasons: collections.Counter = field(default_factory=collections.Counter)

    def as_dict(self) -> dict[str, Any]:
        return {"server_token_ids": self.server_ids, "retokenized": self.retokenized,
                "token_mismatch": self.mismatch, "retokenize_differs": self.retokenize_differs,
                "retries": self.retries, "retry_reasons": dict(self.retry_reasons)}


def answer_tokens(tokenizer: Any, choice: dict[str, Any], usage: Optional[dict[str, Any]], stop_ids: Sequence[int],
                  fidelity: Fidelity, lock: threading.Lock) -> list[int]:
    """The answer's token ids without its stop token: the server's when they decode to its text
    with the target's tokenizer, else the text re-tokenised (counted in ``fidelity``)."""
    text = (choice.get("message") or {}).get("content") or ""
    finish = choice.get("finish_reason")
    ids = server_token_ids(choice)
    if ids is not None:
        while ids and ids[-1] in stop_ids:  # the engine's answer excludes its stop token
            ids.pop()
        if tokenizer.decode(ids, skip_special_tokens=True) == text:
            differs = (tokenizer.encode(text, add_special_tokens=False) if text else []) != ids
            with lock:
                fidelity.server_ids += 1
                fidelity.retokenize_differs += differs
            return ids
        with lock:
            fidelity.mismatch += 1
    had_ids = ids is not None
    ids = tokenizer.encode(text, add_special_tokens=False) if text else []
    told = (usage or {}).get("completion_tokens")
    with lock:
        fidelity.retokenized += 1
        if not had_ids and isinstance(told, int):  # the server counts the stop token it generated
            fidelity.mismatch += told != len(ids) + (finish == "stop")
    return ids


# ---- the engine interface: requests in, completions out ----

class ServerEngine:
    """``generate(pending)`` as the decoding engine's, on a server: up to ``concurrency`` requests in
    flight on a thread pool, each completion yielded as it arrives (the records are put back in
    selection order when the output is finished). A request carries its conversation so far
    (``Request.tag.messages``: system, users, the target's own earlier answers)."""

    def __init__(self, endpoint: Endpoint, tokenizer: Any, *, concurrency: int, max_new_tokens: int,
                 sampling: SamplingParams, seed: int, stop_ids: Sequence[int],
                 loop_detector: Optional[LoopDetector], stop_on_loop: bool, fidelity: Fidelity,
                 reasoning: Optional[str] = None, sleep: Callable[[float], None] = time.sleep) -> None:
        self.endpoint, self.tokenizer, self.concurrency = endpoint, tokenizer, concurrency
        self.max_new_tokens, self.sampling, self.seed = max_new_tokens, sampling, seed
        self.stop_ids, self.loop_detector, self.stop_on_loop = list(stop_ids), loop_detector, stop_on_loop
        self.fidelity, self.reasoning, self.sleep = fidelity, reasoning, sleep
        self.generated_tokens = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()

    def _backoff(self, attempt: int, retry_after: Optional[float]) -> float:
        base = min(self.endpoint.backoff_s * (2 ** attempt), MAX_BACKOFF_S)
        return max(base * (0.5 + random.random() / 2), retry_after or 0.0)

    def _ask(self, request: Request, messages: list[dict[str, str]]) -> tuple[Any, ...]:
        """One turn's answer, retried: ("ok", choice, usage) or ("skip", reason)."""
        from nemo_dflash.engine.batched_static import noise_key

        body = chat_body(self.endpoint, messages, max_tokens=self.max_new_tokens, sampling=self.sampling,
                         seed=noise_key(self.seed, request.key) & 0x7FFFFFFF,
                         reasoning=self.reasoning)
        last = ""
        for attempt in range(self.endpoint.retries + 1):
            if self._stop.is_set():
                raise ServerUnavailable("stopped")
            if attempt:
                with self._lock:
                    self.fidelity.retries += 1
                    self.fidelity.retry_reasons[last.split(":")[0]] += 1
            try:
                answer = _request(self.endpoint, "POST", "chat/completions", body)
            except _Transient as e:
                last = str(e)
                logger.debug("attempt %d of %s: %s", attempt + 1, request.key, e)
                if attempt < self.endpoint.retries:
                    self.sleep(self._backoff(attempt, e.retry_after))
                continue
            except _Refused as e:
                logger.warning("the server refused a turn (%s): skipped", e)
                return ("skip", f"server_refused_{e.status}")
            choices = answer.get("choices")
            choice = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else None
            served = answer.get("model")
            if isinstance(served, str) and served != self.endpoint.model:
                last = "wrong_model"  # a router sent it to another backend: ask again, then skip
                if attempt < self.endpoint.retries:
                    self.sleep(self._backoff(attempt, None))
                    continue
                return ("skip", "wrong_model")
            finish = choice.get("finish_reason") if choice else None
            message = choice.get("message") if choice else None
            if choice is None or not isinstance(message, dict) or finish in (None, "abort"):
                last = "incomplete answer"  # no choice, or an answer aborted (a server restarting)
                if attempt < self.endpoint.retries:
                    self.sleep(self._backoff(attempt, None))
                continue
            if finish not in ("stop", "length"):
                return ("skip", f"finish_{finish}")  # content_filter, tool_calls: not the target's plain answer
            if message.get("reasoning_content") or message.get("reasoning"):
                return ("skip", "reasoning_split")  # a reasoning parser moved the thinking out of the text
            return ("ok", choice, answer.get("usage"))
        raise ServerUnavailable(f"{self.endpoint.base_url} did not answer after {self.endpoint.retries + 1} "
                                f"attempts (last: {last})")

    def _completion(self, request: Request, result: tuple[Any, ...]) -> Completion:
        if result[0] == "skip":
            return Completion(request, [], "skip:" + result[1], 0)
        _, choice, usage = result
        ids = answer_tokens(self.tokenizer, choice, usage, self.stop_ids, self.fidelity, self._lock)
        finish = choice["finish_reason"]
        told = (usage or {}).get("completion_tokens")
        generated = told if isinstance(told, int) else len(ids) + (finish == "stop")
        self.generated_tokens += generated
        start = self.loop_detector.find(ids) if self.loop_detector is not None else None
        if start is not None and self.stop_on_loop:  # the engine's answer stopped at the loop, cut
            return Completion(request, ids[:start], "loop", generated, loop_start=start)
        return Completion(request, ids, finish, generated, loop_start=start)

    def generate(self, pending: collections.deque) -> Iterator[Completion]:
        """Completions of ``pending``'s requests (refilled by the caller as answers end), as they arrive."""
        pool = ThreadPoolExecutor(max_workers=self.concurrency, thread_name_prefix="regen-http")
        inflight: dict[Future, Request] = {}
        try:
            while pending or inflight:
                while pending and len(inflight) < self.concurrency:
                    req = pending.popleft()
                    messages = [dict(m) for m in req.tag.messages]  # the conversation as asked
                    inflight[pool.submit(self._ask, req, messages)] = req
                done, _ = wait(list(inflight), return_when=FIRST_COMPLETED)
                for fut in sorted(done, key=lambda f: inflight[f].key):
                    req = inflight.pop(fut)
                    yield self._completion(req, fut.result())
        finally:
            self._stop.set()  # a failure or a closed generator: the threads stop retrying
            pool.shutdown(wait=False, cancel_futures=True)


class _ServerRegeneration(_Regeneration):
    """The engine's regeneration, plus the turns a server could not answer: skipped with their reason."""

    def _answered(self, done: Completion) -> Optional[dict[str, Any]]:
        if done.finish.startswith("skip:"):
            job = done.request.tag
            job.next_user += 1
            job.messages.pop()  # the user turn left unanswered
            return self._end(job, done.finish[len("skip:"):])
        return super()._answered(done)


def regenerate_on_server(
    server: "ServerTarget",
    tokenizer: Any,
    conversations: Iterable[Any],
    *,
    engine: Any = None,
    reuse_slots: Any = None,
    **settings: Any,
) -> Iterator[dict[str, Any]]:
    """:func:`~nemo_dflash.data.regenerate.regenerate_conversations` with the answers from ``server``:
    the same settings (:class:`~nemo_dflash.data.regenerate.RegenSettings`) mean the same (``batch_size`` is the
    requests in flight), the same records. The engine's own arguments (``engine``, ``reuse_slots``) are accepted and
    unused."""
    s = RegenSettings(**settings)
    gen = ServerEngine(server.endpoint, tokenizer, concurrency=s.batch_size, max_new_tokens=s.max_new_tokens,
                       sampling=s.sampling, seed=s.seed, stop_ids=server.stop_ids,
                       loop_detector=s.loop_detector, stop_on_loop=s.loops != "keep", fidelity=server.fidelity,
                       reasoning=getattr(tokenizer, "reasoning", None))
    run = _ServerRegeneration(gen, tokenizer, conversations, s, s.prompt_budget(server.context))
    return run.records()


@dataclass
class ServerTarget:
    """The target as a server: what regeneration needs in place of a loaded model (its endpoint, the
    stop ids of its tokenizer, its context, its recommended sampling as ``generation_config``) and
    the run's token-fidelity counters."""

    endpoint: Endpoint
    stop_ids: list[int]
    context: Optional[int] = None
    generation_config: Any = None
    fidelity: Fidelity = field(default_factory=Fidelity)

    @property
    def config(self) -> Any:
        """What the recipe reads of a loaded model's config: its context."""
        from types import SimpleNamespace

        return SimpleNamespace(max_position_embeddings=self.context)

    def summary(self) -> dict[str, Any]:
        return {"endpoint": self.endpoint.base_url, "model": self.endpoint.model, "context": self.context,
                **self.fidelity.as_dict()}

