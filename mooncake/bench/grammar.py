"""What `mooncake bench grammar` measures: the cost of structured outputs.

- step: `DecodeRunner.step` time with a full batch of requests all held to one JSON schema
  against the same batch unconstrained, in the same run (rounds alternate, so that both
  see the same machine); the guided step fills the masks on the grammar engine's thread
  while the forward pass runs, then bans tokens in the sampler.
- compile: `GrammarEngine.compile` of distinct random schemas (`random_schema`), each a
  cache miss: llguidance's grammar built and its lexer checked.

`random_schema` also feeds the tests: objects with required and optional properties,
strings with a maximum length, bounded integers, numbers, booleans, enums, small arrays,
nesting and anyOf, every object closed (`additionalProperties: false`), so that every
value has a bounded length and a random-weights model ends it.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from typing import Any

import msgspec

# a schema whose output a batch row cannot finish within a timed round (8+ items)
STEP_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "quantity": {"type": "integer"},
                    "in_stock": {"type": "boolean"},
                },
                "required": ["name", "quantity", "in_stock"],
                "additionalProperties": False,
            },
            "minItems": 8,
        }
    },
    "required": ["items"],
    "additionalProperties": False,
}


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """A random JSON schema (an object at the top) whose every instance is short."""
    if depth == 0:
        return _object(rng, depth)
    kind = rng.choice(
        ["string", "integer", "number", "boolean", "enum", "array", "object", "anyOf", "null"]
    )
    if kind in ("array", "object", "anyOf") and depth >= 2:
        kind = "string"
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(1, 12)}
    if kind == "integer":
        low = rng.randint(-100, 100)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 1000)}
    if kind == "number":
        return {"type": "number", "minimum": -1000, "maximum": 1000}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "cyan", 1, 2, True, None], 3)}
    if kind == "array":
        return {
            "type": "array",
            "items": random_schema(rng, depth + 1),
            "minItems": rng.randint(0, 1),
            "maxItems": rng.randint(1, 3),
        }
    if kind == "object":
        return _object(rng, depth)
    if kind == "anyOf":
        return {"anyOf": [random_schema(rng, depth + 1), random_schema(rng, depth + 1)]}
    return {"type": kind}  # boolean, null


def _object(rng: random.Random, depth: int) -> dict[str, Any]:
    names = rng.sample(["id", "name", "city", "tags", "score", "ok", "kind", "note"], 4)
    num = rng.randint(1, 4)
    props = {n: random_schema(rng, depth + 1) for n in names[:num]}
    required = [n for n in props if rng.random() < 0.7]
    return {
        "type": "object",
        "properties": props,
        "required": required,
        "additionalProperties": False,
    }


class GrammarFigures(msgspec.Struct, kw_only=True):
    model: str
    device: str
    temperature: float  # of every row (0: greedy)
    batch: int  # rows per step, every one constrained in the guided rounds
    context_len: int  # prompt tokens per row
    num_steps: int  # timed steps per round and mode
    free_step_ms: float  # median step, unconstrained
    guided_step_ms: float  # median step, every row held to STEP_SCHEMA
    ratio: float  # guided / free
    mask_fill_ms: float  # median fill of the batch's masks alone (beside the forward)
    num_schemas: int
    compile_ms_p50: float
    compile_ms_p99: float
    compile_ms_max: float


def measure_compile(engine: Any, num_schemas: int, seed: int = 0) -> list[float]:
    """Milliseconds per compile of `num_schemas` distinct random schemas (cache misses)."""
    from mooncake.model.params import Guided

    rng = random.Random(seed)
    times = []
    for i in range(num_schemas):
        schema = random_schema(rng)
        schema["title"] = f"s{seed}-{i}"  # NOTE: distinct text, so never a cache hit
        guided = Guided(kind="json_schema", spec=json.dumps(schema))
        start = time.perf_counter()
        engine.compile(guided)
        times.append((time.perf_counter() - start) * 1e3)
    return times


def run_grammar_bench(
    model_path: str = "smollm2-135m-instruct",
    *,
    device: str = "cpu",
    batch: int = 32,
    context_len: int = 64,
    num_steps: int = 8,
    num_rounds: int = 3,
    num_schemas: int = 200,
    temperature: float = 1.0,
) -> GrammarFigures:
    """Both figures on `model_path`'s weights and tokenizer (a real vocabulary: the masks
    cost what they cost in service). Two runners hold a batch each, one free and one
    guided, and step in turns, so that a pair of steps sees the same machine."""
    from mooncake.model.decode import DecodeRunner
    from mooncake.model.grammar import create_grammar_engine
    from mooncake.model.info import load_model_info, resolve_dtype
    from mooncake.model.kvcache import PagedKVCache
    from mooncake.model.params import Guided, SamplingParams
    from mooncake.model.sequence import Sequence
    from mooncake.model.tokenizer import create_tokenizer
    from mooncake.model.weights import create_model

    info = load_model_info(model_path)
    model = create_model(info, resolve_dtype(info, "auto", device), device)
    tokenizer = create_tokenizer(model_path, info.eos_token_ids)
    engine = create_grammar_engine(tokenizer, info.spec.vocab_size)
    block, vocab = 16, info.spec.vocab_size
    num_blocks = batch * ((context_len + num_steps + 2) // block + 2)
    runners = {
        is_guided: DecodeRunner(
            model,
            PagedKVCache.for_model(model, num_blocks, block),
            max_batch=batch,
            grammar=engine,
        )
        for is_guided in (False, True)
    }
    guided = Guided(kind="json_schema", spec=json.dumps(STEP_SCHEMA))
    step_ms: dict[bool, list[float]] = {False: [], True: []}
    fill_ms: list[float] = []
    for r in range(num_rounds + 1):  # the first round warms up
        for is_guided, runner in runners.items():
            params = SamplingParams(
                max_tokens=num_steps + 2,
                temperature=temperature,
                seed=r,
                guided=guided if is_guided else None,
            )
            for i in range(batch):
                prompt = [(7919 * (i + 1) + 104729 * j + r) % vocab for j in range(context_len)]
                seq = Sequence(r * batch + i, prompt, params, eos_token_ids=info.eos_token_ids)
                runner.add(seq)
            runner.step()  # admission: the prompts' prefill and the first token
        for _ in range(num_steps):
            for is_guided, runner in runners.items():
                assert len(runner.running) == batch, "a row ended within the timed steps"
                if is_guided:
                    rows = [(i, s.grammar) for i, s in enumerate(runner.running)]
                    start = time.perf_counter()
                    engine.fill_masks(rows, batch)  # type: ignore[arg-type]
                    fill_ms.append((time.perf_counter() - start) * 1e3)
                _sync(device)
                start = time.perf_counter()
                runner.step()
                _sync(device)
                if r > 0:
                    step_ms[is_guided].append((time.perf_counter() - start) * 1e3)
        for runner in runners.values():
            for s in list(runner.running):
                runner.abort(s.seq_id)
    compile_ms = sorted(measure_compile(engine, num_schemas))
    engine.close()
    free, held = statistics.median(step_ms[False]), statistics.median(step_ms[True])
    return GrammarFigures(
        model=model_path,
        device=device,
        temperature=temperature,
        batch=batch,
        context_len=context_len,
        num_steps=num_steps,
        free_step_ms=free,
        guided_step_ms=held,
        ratio=held / free,
        mask_fill_ms=statistics.median(fill_ms),
        num_schemas=num_schemas,
        compile_ms_p50=compile_ms[len(compile_ms) // 2],
        compile_ms_p99=compile_ms[min(len(compile_ms) - 1, int(len(compile_ms) * 0.99))],
        compile_ms_max=compile_ms[-1],
    )


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()
