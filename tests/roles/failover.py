"""What the master-failure tests measure: a long prefix stored, the master killed, and the
time until a master serves again, the nodes are back, and the pool's objects are counted."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

PROMPT = [(i * 7 + 3) % 250 + 1 for i in range(1200)]  # a long prompt: many pool blocks


def complete(url: str, prompt: list[int] = PROMPT, max_tokens: int = 4) -> dict[str, Any]:
    body = {"model": "dummy:tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    r = httpx.post(url + "/v1/completions", json=body, timeout=90)
    assert r.status_code == 200, r.text
    return dict(r.json()["usage"])


def status(url: str) -> dict[str, Any]:
    r = httpx.get(url + "/v1/status", timeout=10)
    r.raise_for_status()
    return dict(r.json())


def wait_for(what: str, check: Any, timeout_s: float = 60.0) -> float:
    """Poll `check()` until it is true; the seconds it took (AssertionError past timeout_s,
    a bound against hangs, not a figure under test)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        try:
            if check():
                return time.monotonic() - t0
        except (httpx.HTTPError, KeyError, ValueError):
            pass
        time.sleep(0.05)
    raise AssertionError(f"{what}: not within {timeout_s:g} s")


def nodes_ready(url: str, want: int) -> bool:
    nodes = [n for n in status(url)["nodes"] if n["role"] != "master"]
    return len(nodes) >= want and all(n["state"] == "ready" for n in nodes)


@dataclass
class Stream:
    """A streaming completion read on a thread: how it ended."""

    url: str
    tokens: int = 0
    error: str = ""  # an error event in the stream, or the client's exception
    is_done: bool = False  # the [DONE] line came
    started: threading.Event = field(default_factory=threading.Event)

    def start(self) -> threading.Thread:
        t = threading.Thread(target=self._run, daemon=True)
        t.start()
        return t

    def _run(self) -> None:
        body = {
            "model": "dummy:tiny",
            "prompt": PROMPT[:100],
            "max_tokens": 4000,
            "ignore_eos": True,
            "stream": True,
        }
        try:
            with httpx.stream(
                "POST",
                self.url + "/v1/completions",
                json=body,
                timeout=httpx.Timeout(10.0, read=60.0),
            ) as r:
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        self.is_done = True
                    elif line.startswith("data: ") and '"error"' in line:
                        self.error = line
                    elif line.startswith("data: "):
                        self.tokens += 1
                        self.started.set()
        except httpx.HTTPError as e:
            self.error = f"{type(e).__name__}: {e}"
        finally:
            self.started.set()
