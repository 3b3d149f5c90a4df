"""Predictions at a steady pace through a Service, one new connection per request; every answer recorded.

``python load_client.py URL INSTANCES.json OUT.jsonl STOPFILE [INTERVAL]``, run inside the
cluster (a client pod). Each line of OUT: ``{"t", "ok", "status", "model_version",
"cube_version", "error"}``. No retries: a request that fails is written down as failed.
"""

from __future__ import annotations

import http.client
import json
import os
import sys
import time
from urllib.parse import urlsplit


def one(url, body: bytes, timeout: float = 10.0) -> dict:
    parts = urlsplit(url)
    started = time.time()
    record = {"t": started, "ok": False, "status": None, "model_version": None, "cube_version": None, "error": None}
    conn = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=timeout)
    try:
        conn.request("POST", "/v1/predict", body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
        record["status"] = resp.status
        if resp.status == 200:
            answer = json.loads(data)
            record.update(
                ok=len(answer["predictions"]) > 0,
                model_version=answer.get("model_version"),
                cube_version=answer.get("cube_version"),
            )
        else:
            record["error"] = data[:200].decode("utf-8", "replace")
    except (OSError, http.client.HTTPException, ValueError) as e:
        record["error"] = f"{type(e).__name__}: {e}"
    finally:
        conn.close()
    record["seconds"] = time.time() - started
    return record


def main() -> None:
    url, instances, out, stop = sys.argv[1:5]
    interval = float(sys.argv[5]) if len(sys.argv) > 5 else 0.05
    with open(instances) as f:
        body = json.dumps({"instances": json.load(f)}).encode()
    with open(out, "a", buffering=1) as f:
        while not os.path.exists(stop):
            f.write(json.dumps(one(url, body)) + "\n")
            time.sleep(interval)


if __name__ == "__main__":
    main()
