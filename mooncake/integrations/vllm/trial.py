"""Two vLLM instances on one pool, end to end: what the integration test asserts and what
`mooncake bench vllm-pool` reports.

    pool      a master and a store node (`mooncake up --role master|store`), real processes
    A         vLLM with PoolConnector: a warm-up, then prompts P0..Pn-1 and Q (stored)
    B         another vLLM with PoolConnector on the same pool: a warm-up, then for each i
              a fresh prompt Ri as long as Pi (a cold TTFT) and Pi (a pool hit: TTFT,
              external hit tokens); then the store node is SIGKILLed and B gets Q (the
              pool cannot give it: B recomputes)
    C         vLLM without the connector: every Pi and Q (the reference tokens)

Greedy decoding throughout; one instance runs at a time (a 2-core machine runs one well).
KV moves over TCP, as between hosts.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import select
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx

from mooncake.bench.checkpoint import CheckpointShape, make_checkpoint
from mooncake.bench.servers import LaunchedServer
from mooncake.bench.versus import VersusPlan, server_spec
from mooncake.errors import MooncakeError
from mooncake.local.launcher import free_port

SECRET = "vllm-pool-trial-secret-0123456789"
REPO = Path(__file__).resolve().parents[3]  # on vLLM's PYTHONPATH: the connector's package
CONNECTOR = "PoolConnector"
EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"


@dataclass(frozen=True)
class TrialPlan:
    vllm_python: str
    shape: CheckpointShape
    work_dir: Path
    block_tokens: int = 32
    prompt_blocks: int = 8  # P, Q and R are this many blocks and 5 tokens
    output_tokens: int = 8
    max_model_len: int = 1024
    start_timeout_s: float = 600.0  # vLLM profiles and warms up at start
    node_timeout_s: float = 300.0  # a master or store node to report ready
    seed: int = 0
    pairs: int = 3  # (cold, pool hit) prompt pairs on B: TTFTs are their medians


@dataclass
class Answer:
    """One streamed greedy completion."""

    ttft_s: float
    text: str
    token_ids: list[int] = field(default_factory=list)


@dataclass
class TrialResult:
    a: dict[str, Answer]  # "P0".., "Q"
    b: dict[str, Answer]  # "R0".. (cold), "P0".. (pool hits), "Q" (store node dead)
    c: dict[str, Answer]  # "P0".., "Q" without the connector
    b_external_hit_tokens: float  # after P
    b_external_hit_tokens_after_q: float
    b_log: str  # B's log (the failed loads are logged there)

    @property
    def checked(self) -> list[str]:
        """The prompts all three instances answered (A's, B's and C's tokens compared)."""
        return sorted(self.c)

    def agree(self, key: str) -> bool:
        """The greedy tokens of A, B and C are the same for prompt `key`."""
        return bool(self.a[key].token_ids) and (
            self.a[key].token_ids == self.b[key].token_ids == self.c[key].token_ids
        )

    def median_ttft_s(self, prefix: str, on: str = "b") -> float:
        """The median TTFT of instance `on` ("a", "b", "c") over its prompts named
        `prefix`N (on B: "R" cold, "P" pool hits; on C: "P" without the connector)."""
        answers: dict[str, Answer] = getattr(self, on)
        return statistics.median(
            x.ttft_s for k, x in answers.items() if k[0] == prefix and k[1:].isdigit()
        )

    @property
    def hit_over_cold_ttft(self) -> float:
        return self.median_ttft_s("P") / self.median_ttft_s("R")


def pool_config(path: Path, master_port: int, dram: str = "256MiB") -> Path:
    path.write_text(
        f'[cluster]\nmaster = "127.0.0.1:{master_port}"\nsecret = "{SECRET}"\n'
        '[model]\npath = "dummy:tiny"\n[scheduler]\ncost_model_path = ""\n'
        f'[api]\nhost = "127.0.0.1"\nport = {free_port()}\n[metrics]\nenabled = false\n'
        f'[store]\ndram_bytes = "{dram}"\n'
        # NOTE: as if the store node ran on another host: over shm a reader maps the node's
        # arena itself, and a killed node's arena outlives it
        '[transfer]\nprotocol = "tcp"\n'
    )
    return path


class Node:
    """`mooncake up --role ROLE` as a child process, ready once it printed its handshake."""

    def __init__(self, role: str, config: Path, log: Path, timeout_s: float):
        cmd = [sys.executable, "-m", "mooncake", "up", "--role", role, "--config", str(config)]
        self.role, self.log = role, log
        with open(log, "wb") as err:
            self.proc = subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=err, start_new_session=True
            )
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        line = self.proc.stdout.readline() if ready else b""
        if not line.startswith(b"{"):
            self.kill()
            tail = log.read_text(errors="replace")[-2000:]
            raise MooncakeError(f"the {role} node did not report ready: {tail}")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(30)
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@contextlib.contextmanager
def pool(plan: TrialPlan) -> Iterator[tuple[Path, Node]]:
    """A master and a store node; yields (the TOML file naming them, the store node)."""
    config = pool_config(plan.work_dir / "mooncake.toml", free_port())
    master = Node("master", config, plan.work_dir / "master.log", plan.node_timeout_s)
    store = None
    try:
        store = Node("store", config, plan.work_dir / "store.log", plan.node_timeout_s)
        yield config, store
    finally:
        if store is not None:
            store.kill(signal.SIGTERM)
        master.kill(signal.SIGTERM)


def vllm(plan: TrialPlan, name: str, model: Path, config: Path | None) -> LaunchedServer:
    """vLLM on `model`; with `config`, PoolConnector on the pool it names."""
    # NOTE: eager: no torch.compile at start (minutes on a busy 2-core host); all three the same
    args = ["--max-model-len", str(plan.max_model_len), "--enforce-eager"]
    env: dict[str, str] = {}
    if config is not None:
        transfer = {
            "kv_connector": CONNECTOR,
            "kv_connector_module_path": "mooncake.integrations.vllm",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"config": str(config)},
        }
        args += ["--kv-transfer-config", json.dumps(transfer)]
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    versus = VersusPlan(
        model=str(model),
        vocab_size=plan.shape.vocab_size,
        vllm_python=plan.vllm_python,
        vllm_args=tuple(args),
        start_timeout_s=plan.start_timeout_s,
        work_dir=plan.work_dir,
    )
    spec = server_spec(versus, "vllm", plan.work_dir, plan.block_tokens)
    spec = replace(spec, name=name, env={**spec.env, **env})
    return LaunchedServer(spec, plan.work_dir / f"{name}.log")


def complete(url: str, model: str, prompt: list[int], max_tokens: int) -> Answer:
    """One streamed greedy completion: time to its first token, its text and token ids."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "return_token_ids": True,
        "ignore_eos": True,
    }
    sent, first = time.perf_counter(), 0.0
    text: list[str] = []
    ids: list[int] = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as resp:
        if resp.status_code != 200:
            raise MooncakeError(f"{url}: HTTP {resp.status_code}: {resp.read()[:500]!r}")
        for line in resp.iter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            for choice in json.loads(line[5:]).get("choices") or ():
                if (choice.get("text") or choice.get("token_ids")) and not first:
                    first = time.perf_counter()
                text.append(choice.get("text") or "")
                ids += choice.get("token_ids") or []
    if not first:
        raise MooncakeError(f"{url}: the completion streamed no token")
    return Answer(ttft_s=first - sent, text="".join(text), token_ids=ids)


def external_hits(url: str) -> float:
    """vLLM's counter of prompt tokens served by the connector (summed over labels)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(EXTERNAL_HITS)
    )


def run_trial(plan: TrialPlan) -> TrialResult:
    """Run the whole trial (module docstring); raises MooncakeError or ServerStartError."""
    plan.work_dir.mkdir(parents=True, exist_ok=True)
    model = make_checkpoint(plan.shape)
    rng = random.Random(plan.seed)
    n = plan.prompt_blocks * plan.block_tokens + 5

    def prompt() -> list[int]:  # NOTE: ids 0 and 1 are the made tokenizer's <s> and </s>
        return [rng.randrange(2, plan.shape.vocab_size) for _ in range(n)]

    pairs = [(f"R{i}", f"P{i}") for i in range(plan.pairs)]
    stored = [p for _, p in pairs]
    names = ["W", "V", "Q", *(k for pair in pairs for k in pair)]  # W, V: warm-ups of A, B
    prompts = {k: prompt() for k in names}
    out = plan.output_tokens
    with pool(plan) as (config, store):
        with vllm(plan, "vllm-a", model, config) as a:
            ask_a = lambda k: complete(a.spec.url, str(model), prompts[k], out)  # noqa: E731
            ask_a("W")
            got_a = {k: ask_a(k) for k in (*stored, "Q")}
        with vllm(plan, "vllm-b", model, config) as b:
            ask_b = lambda k: complete(b.spec.url, str(model), prompts[k], out)  # noqa: E731
            ask_b("V")
            got_b = {k: ask_b(k) for pair in pairs for k in pair}
            hits = external_hits(b.spec.url)
            store.kill()
            got_b["Q"] = ask_b("Q")
            hits_after = external_hits(b.spec.url)
            b_log = b.log_path
    with vllm(plan, "vllm-c", model, None) as c:
        got_c = {k: complete(c.spec.url, str(model), prompts[k], out) for k in (*stored, "Q")}
    return TrialResult(
        a=got_a,
        b=got_b,
        c=got_c,
        b_external_hit_tokens=hits,
        b_external_hit_tokens_after_q=hits_after,
        b_log=b_log.read_text(errors="replace"),
    )
