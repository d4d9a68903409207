"""An OpenAI-compatible server on loopback whose model is a scripted function."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class ScriptedOpenAIServer:
    """An OpenAI-compatible server on loopback whose model is a function: `reply(prompt, sample)`
    -> text, where `prompt` is the completion prompt or the chat's messages joined by newlines and
    `sample` the sample's index (from the request's seed and n). It lists `models` (owned by
    "vllm", so the client sends n and reads each sample's token ids) and answers /completions and
    /chat/completions; `requests` holds every POST body. Use as a context manager: it gives the
    base URL."""

    def __init__(self, reply: Callable[[str, int], str], models: tuple[str, ...] = ("m",)):
        self.reply = reply
        self.models = models
        self.requests: list[dict] = []

    def __enter__(self) -> str:
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self):
                if not self.path.endswith("/models"):
                    self._send(404, {"error": f"no route {self.path}"})
                    return
                listed = [{"id": m, "owned_by": "vllm"} for m in outer.models]
                self._send(200, {"data": listed})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append(body)
                self._send(200, outer.answer(self.path, body))

            def _send(self, status, payload):
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def answer(self, path: str, body: dict) -> dict:
        chat = path.endswith("/chat/completions")
        prompt = "\n".join(m["content"] for m in body["messages"]) if chat else body["prompt"]
        first = body.get("seed") or 0
        choices = []
        for index in range(body.get("n", 1)):
            text = self.reply(prompt, first + index)
            tokens = list(range(len(text.split()) + 1))
            content = (
                {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
            )
            choices.append(
                {"index": index, "finish_reason": "stop", "token_ids": tokens, **content}
            )
        generated = sum(len(c["token_ids"]) for c in choices)
        usage = {"prompt_tokens": len(prompt.split()), "completion_tokens": generated}
        return {"choices": choices, "usage": {**usage, "total_tokens": sum(usage.values())}}
