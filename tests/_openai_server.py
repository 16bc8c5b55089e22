"""A real OpenAI-compatible HTTP server for the regeneration tests: the standard library's
``ThreadingHTTPServer`` on 127.0.0.1, serving ``GET /v1/models`` and ``POST /v1/chat/completions``
from a responder (a deterministic derivation of the conversation, or a real model's greedy answer),
with planted faults (a status, a slow answer, a dropped connection, an answer for another model,
a death after N answers)."""

from __future__ import annotations

import json
import socket
import threading
import time
import zlib
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Optional

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def echo_responder(tokenizer: Any, *, with_ids: bool = True, count_stop: bool = True) -> Callable:
    """Answers derived from the conversation and the request's seed (a few words, ``stop``), like a
    server that samples: the same request, the same answer. ``with_ids``: report token ids as vLLM's
    ``return_token_ids`` does; ``count_stop``: ``usage.completion_tokens`` counts the stop token."""
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def respond(body: dict[str, Any]) -> dict[str, Any]:
        key = zlib.crc32(json.dumps([body["messages"], body.get("seed")]).encode())
        n = 3 + key % 5
        text = " ".join(WORDS[(key >> (2 * i)) % len(WORDS)] for i in range(n))
        ids = tokenizer.encode(text, add_special_tokens=False)
        finish = "stop"
        if len(ids) > body["max_tokens"]:
            ids, finish = ids[: body["max_tokens"]], "length"
            text = tokenizer.decode(ids)
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                  "finish_reason": finish}
        if with_ids:
            choice["token_ids"] = ids + ([eos] if finish == "stop" else [])
        return {"choice": choice, "completion_tokens": len(ids) + (finish == "stop" and count_stop)}

    return respond


def model_responder(model: Any, tokenizer: Any, stop_ids: list[int]) -> Callable:
    """The target's own greedy answer (transformers' ``generate`` on the one unpadded prompt, rendered by
    the target's chat template): what a serving engine of the target returns at temperature 0."""
    import torch

    lock = threading.Lock()

    def respond(body: dict[str, Any]) -> dict[str, Any]:
        prompt = tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=True)
        if isinstance(prompt, dict) or hasattr(prompt, "input_ids"):
            prompt = prompt["input_ids"]
        with lock, torch.inference_mode():
            out = model.generate(torch.tensor([list(prompt)]), max_new_tokens=body["max_tokens"], do_sample=False,
                                 eos_token_id=stop_ids, pad_token_id=stop_ids[0])
        new = out[0, len(prompt):].tolist()
        end = next((i for i, t in enumerate(new) if t in stop_ids), None)
        ids, finish = (new, "length") if end is None else (new[:end], "stop")
        text = tokenizer.decode(ids, skip_special_tokens=True)
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish,
                  "token_ids": new if end is None else new[: end + 1]}
        return {"choice": choice, "completion_tokens": len(new) if end is None else end + 1}

    return respond


class Faults:
    """Planted faults, each consumed as it fires; ``requests`` counts the chat requests seen."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.status: list[int] = []  # answer the next requests with these statuses
        self.slow: int = 0  # the next N requests sleep ``slow_s`` before answering
        self.slow_s: float = 0.0
        self.drop: int = 0  # the next N requests: connection closed without an answer
        self.truncate: int = 0  # the next N requests: half a body, then the connection closed
        self.wrong_model: int = 0  # the next N answers name another model
        self.empty: int = 0  # the next N answers are empty (the stop token alone)
        self.die_after: Optional[int] = None  # stop serving after this many answers
        self.after = 1  # the first N requests pass untouched (the run's one-token check of the endpoint)
        self.requests = 0
        self.answered = 0
        self.seen: Counter = Counter()  # fault name -> times fired

    def take(self) -> Optional[str]:
        with self.lock:
            self.requests += 1
            if self.requests <= self.after:
                return None
            if self.status:
                self.seen["status"] += 1
                return f"status:{self.status.pop(0)}"
            for name in ("slow", "drop", "truncate", "wrong_model", "empty"):
                if getattr(self, name) > 0:
                    setattr(self, name, getattr(self, name) - 1)
                    self.seen[name] += 1
                    return name
        return None


class OpenAIServer:
    """The server on 127.0.0.1 (``port=0``: any free port; a restart may ask for the old one)."""

    def __init__(self, responder: Callable, model: str = "tiny", port: int = 0, *, chat: bool = True,
                 api_key: Optional[str] = None, max_model_len: Optional[int] = None,
                 faults: Optional[Faults] = None) -> None:
        self.responder, self.model, self.chat, self.api_key = responder, model, chat, api_key
        self.max_model_len, self.faults = max_model_len, faults or Faults()
        self.bodies: list[dict[str, Any]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def _send(self, status: int, payload: dict[str, Any], headers: Optional[dict[str, str]] = None) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

            def _authorised(self) -> bool:
                if outer.api_key is None or self.headers.get("Authorization") == f"Bearer {outer.api_key}":
                    return True
                self._send(401, {"error": {"message": "bad key"}})
                return False

            def do_GET(self) -> None:  # noqa: N802
                if not self._authorised():
                    return
                if self.path.rstrip("/") == "/v1/models":
                    entry: dict[str, Any] = {"id": outer.model, "object": "model"}
                    if outer.max_model_len is not None:
                        entry["max_model_len"] = outer.max_model_len
                    self._send(200, {"object": "list", "data": [entry]})
                else:
                    self._send(404, {"error": {"message": "not found"}})

            def do_POST(self) -> None:  # noqa: N802
                length = int(self.headers.get("Content-Length", "0"))
                body = json.loads(self.rfile.read(length) or b"{}")
                if not self._authorised():
                    return
                if self.path.rstrip("/") != "/v1/chat/completions" or not outer.chat:
                    self._send(404, {"error": {"message": "not found"}})
                    return
                if body.get("model") != outer.model:
                    self._send(404, {"error": {"message": f"model {body.get('model')} not found"}})
                    return
                fault = outer.faults.take()
                if fault is not None and fault.startswith("status:"):
                    self._send(int(fault.split(":")[1]), {"error": {"message": "planted"}}, {"Retry-After": "0"})
                    return
                if fault == "drop":
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if fault == "slow":
                    time.sleep(outer.faults.slow_s)
                answer = outer.responder(body)
                if fault == "empty":
                    answer = {"choice": {"index": 0, "message": {"role": "assistant", "content": ""},
                                         "finish_reason": "stop"}, "completion_tokens": 1}
                payload = {"id": "chatcmpl-1", "object": "chat.completion", "created": 0,
                           "model": "another-model" if fault == "wrong_model" else outer.model,
                           "choices": [answer["choice"]],
                           "usage": {"prompt_tokens": 0, "completion_tokens": answer["completion_tokens"],
                                     "total_tokens": answer["completion_tokens"]}}
                if fault == "truncate":
                    data = json.dumps(payload).encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data[: len(data) // 2])
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                with outer.faults.lock:
                    dying = outer.faults.die_after is not None and outer.faults.answered >= outer.faults.die_after
                    if not dying:
                        outer.faults.answered += 1
                        outer.bodies.append(body)
                if dying:  # the server is going down: this request gets no answer
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    threading.Thread(target=outer.stop, daemon=True).start()
                    return
                self._send(200, payload)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.stopped = threading.Event()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> "OpenAIServer":
        self.thread.start()
        return self

    def stop(self) -> None:
        if self.stopped.is_set():
            return
        self.stopped.set()
        self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self) -> "OpenAIServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
