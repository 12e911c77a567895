"""Sharded loading (`create_model(..., tp=TPGroup(rank, size))`, `shardplan`): a rank
holds exactly the slice `shard_model` cuts from the whole model (HF checkpoints, both
expert layouts, dummy weights), reads about 1/size of the checkpoint's bytes, and over gloo
2 and 4 ranks so loaded compute one rank's logits (fp32, 1e-5), dense and mixture-of-
experts (Mixtral, Qwen3-MoE with a dense layer) alike."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

torch = pytest.importorskip("torch", reason="the engine tests need torch")

from mooncake.errors import ConfigError  # noqa: E402
from mooncake.model import weights  # noqa: E402
from mooncake.model.info import load_model_info  # noqa: E402
from mooncake.model.parallel import TPGroup, check_shardable, shard_model  # noqa: E402
from mooncake.model.weights import create_model  # noqa: E402
from tests.model.conftest import HF_SHAPES  # noqa: E402
from tests.model.test_parallel import assert_same_decode  # noqa: E402

transformers = pytest.importorskip(
    "transformers", reason="test-only dependency: pip install transformers safetensors"
)
from safetensors import safe_open  # noqa: E402

VOCAB = 302  # not a multiple of 4: the last of 4 LM-head shards is padded
LLAMA = dict(HF_SHAPES, vocab_size=VOCAB)
MIXTRAL = dict(LLAMA, num_local_experts=4, num_experts_per_tok=2, intermediate_size=48)
QWEN3_MOE = dict(
    LLAMA,
    num_hidden_layers=3,
    head_dim=16,
    moe_intermediate_size=32,
    num_experts=8,
    num_experts_per_tok=3,
    norm_topk_prob=False,
    mlp_only_layers=[1],
)


def _save(path: Path, kind: str) -> str:
    """A random transformers checkpoint of `kind` (routers sharpened so that routing
    decides the output) in `path`."""
    torch.manual_seed(0)
    config_cls, model_cls, shapes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, LLAMA),
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM, MIXTRAL),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM, QWEN3_MOE),
    }[kind]
    model = model_cls(config_cls(**shapes)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.normal_(0, 0.5)
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return {k: _save(tmp_path_factory.mktemp(k), k) for k in ("llama", "mixtral", "qwen3_moe")}


def _sharded(path: str, rank: int, size: int) -> dict[str, torch.Tensor]:
    model = create_model(load_model_info(path), cpu_gemm="torch", tp=TPGroup(rank, size))
    return dict(model.state_dict())


def _cut(path: str, rank: int, size: int) -> dict[str, torch.Tensor]:
    whole = create_model(load_model_info(path), cpu_gemm="torch")
    return dict(shard_model(whole, TPGroup(rank, size)).state_dict())


@pytest.mark.parametrize(
    "kind", ["llama", "mixtral", "qwen3_moe", "dummy:tiny", "dummy:mixtral-tiny"]
)
def test_a_rank_loads_what_shard_model_cuts(checkpoints: dict[str, str], kind: str) -> None:
    """Every parameter of every rank at 2 and 4 ranks (KV heads split, then replicated)
    equals the slice of the whole model, bit for bit."""
    path = checkpoints.get(kind, kind)
    for size in (2, 4):
        for rank in range(size):
            got, want = _sharded(path, rank, size), _cut(path, rank, size)
            assert got.keys() == want.keys()
            for name, value in want.items():
                assert torch.equal(got[name], value), (kind, size, rank, name)


def test_a_rank_reads_its_share_of_the_checkpoint(
    checkpoints: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """At 2 ranks each rank reads about half the checkpoint's bytes (embedding, LM head and
    norms counted); the norms, which both read whole, are the only bytes read twice. One
    rank reads them all once."""
    path = Path(checkpoints["llama"])
    readers: list[weights._Checkpoint] = []

    class Counting(weights._Checkpoint):
        def __init__(self, info):  # type: ignore[no-untyped-def]
            super().__init__(info)
            readers.append(self)

    monkeypatch.setattr(weights, "_Checkpoint", Counting)
    total = norms = 0
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118
            t = f.get_tensor(name)
            total += t.numel() * t.element_size()
            norms += t.numel() * t.element_size() if name.endswith("norm.weight") else 0
    info = load_model_info(str(path))
    create_model(info, cpu_gemm="torch")
    assert readers.pop().bytes_read == total
    for rank in range(2):
        create_model(info, cpu_gemm="torch", tp=TPGroup(rank, 2))
    per_rank = [r.bytes_read for r in readers]
    assert sum(per_rank) == total + norms
    for n in per_rank:
        assert 0.5 <= n / total < 0.5 + norms / total + 1e-9, (n, total)


def test_what_does_not_split_is_refused_before_loading(checkpoints: dict[str, str]) -> None:
    """An MLP width or an expert width that the ranks do not divide is named."""
    info = load_model_info(checkpoints["mixtral"])
    check_shardable(create_model(info, device="meta"), 4)  # no dense layer: its MLP width
    narrow = msgspec.structs.replace(info.spec, moe_intermediate_size=30)
    with pytest.raises(ConfigError, match="tensor_parallel = 4 does not divide its experts' "):
        create_model(msgspec.structs.replace(info, spec=narrow), tp=TPGroup(0, 4))
    with pytest.raises(ConfigError, match="tensor_parallel = 3 does not divide its 4 attention"):
        create_model(load_model_info(checkpoints["llama"]), tp=TPGroup(0, 3))


@pytest.mark.cluster
@pytest.mark.parametrize(
    ("kind", "tp"), [("llama", 2), ("llama", 4), ("mixtral", 2), ("qwen3_moe", 2)]
)
def test_sharded_checkpoints_equal_one_rank(
    checkpoints: dict[str, str], kind: str, tp: int
) -> None:
    """Over gloo, `tp` follower-loaded ranks give one rank's greedy tokens and logits."""
    assert_same_decode(tp, checkpoints[kind], VOCAB)
