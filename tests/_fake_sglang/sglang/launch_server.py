"""A fake SGLang server for CPU tests: ``python -m sglang.launch_server`` with this folder's parent on PYTHONPATH.

It speaks the endpoints and JSON shapes rlhfkit's SGLang engine uses (those of sglang 0.5.17): ``/health``,
``/generate`` (``input_ids``, ``sampling_params`` list, ``return_logprob``), ``/release_memory_occupation``,
``/resume_memory_occupation``, ``/update_weights_from_tensor`` (base64 pickles of ``[(name, tensor)]``),
``/update_weight_version``, ``/flush_cache``; plus ``/fake_state`` for tests to read what it received.

Tokens are deterministic: sample j of a request gets ``token_t = 3 + (sum(prompt) + seed + 5 * version + 7 * t) % 50``
(seed: ``sampling_seed``, or 0 when greedy or unseeded; version: the last weight version set) and log-prob
``-(token_t % 10 + 1) / 10``. A sample stops at a token in ``stop_token_ids`` (kept) or at ``max_new_tokens``.

Failure modes (``FAKE_SGLANG_MODE``, comma-separated): ``exit_at_start`` (exit 7 after printing a line),
``never_healthy`` (``/health`` answers 503), ``die_on_generate`` (the process exits while answering ``/generate``),
``hang_on_generate``, ``bad_json_generate``, ``reject_weights`` (``success: false``).
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import pickle
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODES = set(filter(None, os.environ.get("FAKE_SGLANG_MODE", "").split(",")))
STATE = {"version": 0, "released": [], "calls": [], "weights": {}, "flushes": 0, "args": sys.argv[1:]}
LOCK = threading.Lock()


class AllowListUnpickler(pickle.Unpickler):
    """sglang 0.5.17's SafeUnpickler rule (sglang/srt/utils/common.py), for the modules a tensor payload may use: a
    payload that needs another module fails here as it would there."""

    ALLOWED = ("builtins.", "collections.", "copyreg.", "functools.", "operator.", "torch.")

    def find_class(self, module, name):
        if any((module + ".").startswith(prefix) for prefix in self.ALLOWED):
            return super().find_class(module, name)
        raise RuntimeError(f"Blocked unsafe class loading ({module}.{name})")


def sample(prompt, params, version):
    seed = 0 if float(params.get("temperature", 1.0)) == 0 else int(params.get("sampling_seed") or 0)
    stops = set(params.get("stop_token_ids") or [])
    tokens, entries, finish = [], [], "length"
    for t in range(int(params.get("max_new_tokens", 16))):
        token = 3 + (sum(prompt) + seed + 5 * version + 7 * t) % 50
        tokens.append(token)
        entries.append([-(token % 10 + 1) / 10, token, None])
        if token in stops:
            finish = "stop"
            break
    return tokens, entries, finish


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):  # quiet
        pass

    def reply(self, code, body, raw=False):
        data = body.encode() if raw else json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def body(self):
        length = int(self.headers.get("Content-Length") or 0)
        return json.loads(self.rfile.read(length)) if length else None

    def do_GET(self):
        if self.path == "/health":
            return self.reply(503 if "never_healthy" in MODES else 200, "", raw=True)
        if self.path == "/fake_state":
            with LOCK:
                return self.reply(200, STATE)
        return self.reply(404, {"error": self.path})

    def do_POST(self):
        body = self.body()
        with LOCK:
            STATE["calls"].append(self.path)
        handler = getattr(self, "post_" + self.path.strip("/"), None)
        if handler is None:
            return self.reply(404, {"error": self.path})
        return handler(body)

    def post_generate(self, body):
        if "die_on_generate" in MODES:
            os._exit(9)
        if "hang_on_generate" in MODES:
            time.sleep(3600)
        if "bad_json_generate" in MODES:
            return self.reply(200, "<html>not json", raw=True)
        if "weights" in STATE["released"] or "kv_cache" in STATE["released"]:
            return self.reply(400, {"error": {"message": f"memory released: {STATE['released']}"}})
        prompts, params = body["input_ids"], body["sampling_params"]
        params = params if isinstance(params, list) else [params] * len(prompts)
        with LOCK:
            STATE["last_sampling_params"] = params[0] if params else None
            STATE["env"] = {name: os.environ.get(name) for name in ("SGLANG_RETURN_ORIGINAL_LOGPROB",
                                                                    "SGLANG_MEMORY_SAVER_CUDA_GRAPH")}
        results = []
        for prompt, p in zip(prompts, params):
            tokens, entries, finish = sample(prompt, p, STATE["version"])
            meta = {"finish_reason": {"type": finish}, "prompt_tokens": len(prompt),
                    "completion_tokens": len(tokens), "weight_version": str(STATE["version"])}
            if body.get("return_logprob"):
                meta["output_token_logprobs"] = entries
            results.append({"text": "", "output_ids": tokens, "meta_info": meta})
        return self.reply(200, results)

    def post_release_memory_occupation(self, body):
        with LOCK:
            STATE["released"] = sorted(set(STATE["released"]) | set(body.get("tags") or ["weights", "kv_cache"]))
        return self.reply(200, None)

    def post_resume_memory_occupation(self, body):
        with LOCK:
            STATE["released"] = sorted(set(STATE["released"]) - set(body.get("tags") or STATE["released"]))
        return self.reply(200, None)

    def post_update_weights_from_tensor(self, body):
        if "reject_weights" in MODES:
            return self.reply(400, {"success": False, "message": "fake: rejected"})
        import torch  # noqa: F401  (the pickles rebuild torch tensors)

        payloads = body["serialized_named_tensors"]
        for payload in payloads[:1]:
            for name, tensor in AllowListUnpickler(io.BytesIO(base64.b64decode(payload))).load():
                with LOCK:
                    STATE["weights"][name] = [list(tensor.shape), float(tensor.double().sum())]
        with LOCK:
            STATE["tp_payloads"] = len(payloads)
        return self.reply(200, {"success": True, "message": "Success"})

    def post_update_weight_version(self, body):
        with LOCK:
            STATE["version"] = int(body["new_version"])
        return self.reply(200, {"success": True, "message": "ok", "new_version": body["new_version"]})

    def post_flush_cache(self, body):
        with LOCK:
            STATE["flushes"] += 1
        return self.reply(200, "Cache flushed.\n", raw=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    args, _ = parser.parse_known_args()
    print(f"fake sglang: starting on {args.host}:{args.port} with {sys.argv[1:]}", flush=True)
    if "exit_at_start" in MODES:
        print("fake sglang: CUDA error: no kernel image is available (exit_at_start)", flush=True)
        sys.exit(7)
    ThreadingHTTPServer((args.host, args.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
