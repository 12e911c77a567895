"""A random-weights LLaMA checkpoint in Hugging Face format, made locally and cached, so
that another server (vLLM) and ours serve the very same model (`mooncake bench vllm`).

The directory holds what both loaders read: `config.json` (model_type llama, float32),
`model.safetensors` (HF tensor names, weights drawn from N(0, 0.02) with a fixed seed,
norms 1), `generation_config.json`, and a byte-level BPE `tokenizer.json` trained with
`tokenizers` on a fixed corpus (`tokenizer_config.json` names `<s>` / `</s>`). No model
hub is needed. The directory's name is a digest of the shape, seed and FORMAT, so a
cached one is reused only when it is what would be made; it is written under a temporary
name and renamed, so a half-written one is never reused.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mooncake.errors import ConfigError
from mooncake.model.spec import get_model_spec

FORMAT = 1  # bump when the files written change
CACHE_DIR = Path(tempfile.gettempdir()) / "mooncake-checkpoints"
SPECIALS = ("<s>", "</s>")


@dataclass(frozen=True)
class CheckpointShape:
    """The LLaMA shape to make (default: dummy:small's)."""

    num_layers: int = 2
    hidden_size: int = 2048
    num_heads: int = 16
    num_kv_heads: int = 4
    intermediate_size: int = 7168
    vocab_size: int = 512
    max_position_embeddings: int = 8192
    rope_theta: float = 500000.0
    seed: int = 0

    @classmethod
    def of(cls, name: str, seed: int = 0) -> CheckpointShape:
        """The shape of a named spec (`dummy:small`, `dummy:tiny`, ...)."""
        spec = get_model_spec(name)
        return cls(
            num_layers=spec.num_layers,
            hidden_size=spec.hidden_size,
            num_heads=spec.num_heads,
            num_kv_heads=spec.num_kv_heads,
            intermediate_size=spec.intermediate_size,
            vocab_size=spec.vocab_size,
            max_position_embeddings=spec.max_position_embeddings,
            rope_theta=spec.rope_theta,
            seed=seed,
        )

    def validate(self) -> None:
        problems = []
        if self.num_heads < 1 or self.hidden_size % self.num_heads:
            problems.append(
                f"--hidden {self.hidden_size} must be a multiple of --heads {self.num_heads}"
            )
        if self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads:
            problems.append(
                f"--heads {self.num_heads} must be a multiple of --kv-heads {self.num_kv_heads}"
            )
        if self.vocab_size < 256 + len(SPECIALS):
            problems.append(
                f"--vocab-size must be >= {256 + len(SPECIALS)} (every byte and the specials), "
                f"got {self.vocab_size}"
            )
        if min(self.num_layers, self.intermediate_size) < 1:
            problems.append("--layers and --ffn must be >= 1")
        if problems:
            raise ConfigError(problems)

    @property
    def digest(self) -> str:
        text = json.dumps({"format": FORMAT, **asdict(self)}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:12]

    @property
    def dirname(self) -> str:
        return f"llama-{self.num_layers}l-{self.hidden_size}h-{self.digest}"


def hf_config(shape: CheckpointShape) -> dict[str, object]:
    """The `config.json` of `shape` (float32, untied embeddings, RMSNorm eps 1e-5)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "head_dim": shape.hidden_size // shape.num_heads,
        "vocab_size": shape.vocab_size,
        "max_position_embeddings": shape.max_position_embeddings,
        "rope_theta": shape.rope_theta,
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "torch_dtype": "float32",
    }


def _tensors(shape: CheckpointShape) -> dict[str, Any]:
    import torch

    gen = torch.Generator().manual_seed(shape.seed)
    head_dim = shape.hidden_size // shape.num_heads
    h, kv = shape.hidden_size, shape.num_kv_heads * head_dim

    def rand(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen) * 0.02

    out: dict[str, Any] = {"model.embed_tokens.weight": rand(shape.vocab_size, h)}
    for i in range(shape.num_layers):
        p = f"model.layers.{i}."
        sizes = {
            "self_attn.q_proj": (h, h),
            "self_attn.k_proj": (kv, h),
            "self_attn.v_proj": (kv, h),
            "self_attn.o_proj": (h, h),
            "mlp.gate_proj": (shape.intermediate_size, h),
            "mlp.up_proj": (shape.intermediate_size, h),
            "mlp.down_proj": (h, shape.intermediate_size),
        }
        out.update({f"{p}{name}.weight": rand(*size) for name, size in sizes.items()})
        out[f"{p}input_layernorm.weight"] = torch.ones(h)
        out[f"{p}post_attention_layernorm.weight"] = torch.ones(h)
    out["model.norm.weight"] = torch.ones(h)
    out["lm_head.weight"] = rand(shape.vocab_size, h)
    return out


def _corpus(seed: int) -> list[str]:
    """A fixed text to train the tokenizer's merges on (words of the replay's word list
    and random letter runs: every byte value also enters through the initial alphabet)."""
    from mooncake.replay.prompts import WORDS

    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    lines = []
    for _ in range(2000):
        words = [rng.choice(WORDS) for _ in range(12)]
        words.append("".join(rng.choice(letters) for _ in range(rng.randint(2, 8))))
        lines.append(" ".join(words))
    return lines


def write_tokenizer(out: Path, shape: CheckpointShape) -> None:
    """Train a byte-level BPE of at most `shape.vocab_size` ids; specials get ids 0, 1."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError as e:
        raise ConfigError("making a checkpoint needs `pip install tokenizers` (extra hf)") from e
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=shape.vocab_size,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(shape.seed), trainer)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIALS[0],
        "eos_token": SPECIALS[1],
        "model_max_length": shape.max_position_embeddings,
        "add_bos_token": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def make_checkpoint(shape: CheckpointShape, cache_dir: Path = CACHE_DIR) -> Path:
    """The checkpoint directory of `shape` under `cache_dir`, made unless already there."""
    shape.validate()
    final = cache_dir / shape.dirname
    if (final / "model.safetensors").exists():
        return final
    try:
        from safetensors.torch import save_file
    except ImportError as e:
        raise ConfigError("making a checkpoint needs `pip install safetensors` (extra hf)") from e
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{shape.dirname}-", dir=cache_dir))
    try:
        (tmp / "config.json").write_text(json.dumps(hf_config(shape), indent=2))
        gen = {"bos_token_id": 0, "eos_token_id": 1, "do_sample": False}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2))
        write_tokenizer(tmp, shape)
        save_file(_tensors(shape), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        os.chmod(tmp, 0o755)  # mkdtemp's 0700 would keep a server run as another user out
        try:
            tmp.rename(final)
        except OSError:  # another run made it meanwhile: keep theirs
            if not (final / "model.safetensors").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
