"""A tiny OpenAI-compatible completions server, the stand-in for a remote judge (`vllm serve`):
POST /v1/completions answers with top log-probs over "A"/"B" for a pairwise prompt of the form
the `pairwise_compact` template renders ("<digits>=<a>|<b>?"): p(A) = 0.9 when `a` is the sorted
digits, else 0.1. With --text-only it answers text without log-probs (the parsed-text path).

Requests without `Authorization: Bearer $JUDGE_TEST_KEY` get 401. Each request's JSON body is
appended to --log (what the server received, headers excluded), to check that no key leaks
into it. Prints `PORT <n>` once it listens on 127.0.0.1.

    python tests/programs/openai_judge_server.py --log FILE [--text-only]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def verdict(prompt: str) -> float:
    m = re.match(r"^(\d+)=([^|]*)\|(.*)\?$", prompt)
    if not m:
        return 0.5
    digits, a = m.group(1), m.group(2)
    return 0.9 if a == "".join(sorted(digits)) else 0.1


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--log", required=True)
    ap.add_argument("--text-only", action="store_true")
    args = ap.parse_args()
    key = os.environ["JUDGE_TEST_KEY"]

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):   # quiet
            pass

        def _send(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            with open(args.log, "a") as f:
                f.write(json.dumps(body) + "\n")
            if self.headers.get("Authorization") != f"Bearer {key}":
                return self._send(401, {"error": {"message": "invalid api key"}})
            if self.path != "/v1/completions":
                return self._send(404, {"error": {"message": f"no route {self.path}"}})
            p = verdict(body["prompt"])
            choice: dict = {"index": 0, "text": "A" if p > 0.5 else "B", "finish_reason": "length"}
            if not args.text_only:
                choice["logprobs"] = {"tokens": [choice["text"]], "top_logprobs": [
                    {"A": math.log(p), " B": math.log(1 - p), "C": math.log(1e-4)}]}
            self._send(200, {"id": "cmpl-test", "object": "text_completion", "model": body["model"],
                             "choices": [choice]})

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    print(f"PORT {server.server_address[1]}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
