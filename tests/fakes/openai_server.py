"""OpenAI-compatible servers on loopback: one whose answers are a function of the request, and
one whose model is a scripted function of the prompt; and a served model's tokenizer built
offline."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

Answer = Callable[[str, str, dict], tuple]


class CannedServer:
    """A loopback HTTP server: `GET /models` lists `models` (owned by `owned_by`), other GETs
    are not found (no /metrics, no /slots); a POST gets `answer(method, path, body)` -> (status,
    JSON[, headers]). `requests` records each POST's JSON body. As a context manager it gives
    the base URL and `requests`."""

    def __init__(
        self,
        answer: Answer | None = None,
        owned_by: str = "local",
        models: tuple[str, ...] = ("m",),
    ):
        if answer is not None:
            self.answer = answer
        self.owned_by, self.models = owned_by, models
        self.requests: list[dict] = []

    def answer(self, method: str, path: str, body: dict) -> tuple:
        raise NotImplementedError(f"{type(self).__name__} has no answers: pass answer=")

    def __enter__(self) -> tuple[str, list[dict]]:
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self):
                if self.path.endswith("/models"):
                    listed = [{"id": m, "owned_by": outer.owned_by} for m in outer.models]
                    self._reply(200, {"data": listed}, {})
                    return
                self._reply(404, {"error": f"no route {self.path}"}, {})

            def do_POST(self):
                self._answer(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))

            def _answer(self, body):
                outer.requests.append(body)
                status, payload, *headers = outer.answer(self.command, self.path, body)
                self._reply(status, payload, headers[0] if headers else {})

            def _reply(self, status, payload, headers):
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for name, value in headers.items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1", self.requests

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


class ScriptedOpenAIServer(CannedServer):
    """An OpenAI-compatible server whose model is a function: `reply(prompt, sample)` -> text,
    where `prompt` is the completion prompt or the chat's messages joined by newlines and
    `sample` the sample's index (from the request's seed and n). It lists `models` (owned by
    "vllm", so the client sends n and reads each sample's token ids) and answers /completions
    and /chat/completions; `requests` holds every POST body. As a context manager it gives the
    base URL."""

    def __init__(self, reply: Callable[[str, int], str], models: tuple[str, ...] = ("m",)):
        super().__init__(owned_by="vllm", models=models)
        self.reply = reply

    def __enter__(self) -> str:  # type: ignore[override]
        return super().__enter__()[0]

    def answer(self, method: str, path: str, body: dict) -> tuple:
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
        return 200, {"choices": choices, "usage": {**usage, "total_tokens": sum(usage.values())}}


def word_tokenizer(dest: Path) -> Path:
    """A served model's tokenizer as a Hugging Face directory at `dest`, built offline with the
    `tokenizers` library: each word and each punctuation mark one token (all unknown but the
    end-of-sequence token). Returns `dest`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel({"<unk>": 0, "</s>": 1}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", eos_token="</s>")
    fast.save_pretrained(dest)
    return dest
