"""Cost model: roofline shapes, the profile file round trip, transfer and SSD read times;
and the model specs it is built from."""

import json

import msgspec
import pytest

from mooncake.conductor import CostModel, CostModelError, roofline_cost_model
from mooncake.conductor.costmodel import DEFAULT_SSD_READ_BYTES_PER_S
from mooncake.conductor.network import NetworkState
from mooncake.conductor.roofline import GPUS, PREFILL_MFU, PrefillHardware, master_cost_model
from mooncake.config.settings import Config
from mooncake.errors import ConfigError
from mooncake.model.info import load_model_info
from mooncake.model.spec import get_model_spec, list_model_specs


def test_model_specs_have_the_published_shapes():
    l2 = get_model_spec("llama2-70b")
    assert (l2.num_layers, l2.hidden_size, l2.num_heads, l2.num_kv_heads) == (80, 8192, 64, 8)
    assert (l2.intermediate_size, l2.vocab_size) == (28672, 32000)
    assert round(l2.num_params / 1e9, 1) == 69.0
    assert l2.kv_bytes_per_token(2) == 2 * 80 * 8 * 128 * 2  # 320 KiB
    assert round(get_model_spec("llama3-70b").num_params / 1e9, 1) == 70.6
    assert round(get_model_spec("llama3-8b").num_params / 1e9, 2) == 8.03
    scaling = get_model_spec("llama3.1-8b").rope_scaling
    assert scaling is not None and scaling.factor == 8.0
    tiny = get_model_spec("dummy:tiny")
    assert tiny.vocab_size >= 259 and tiny.num_heads % tiny.num_kv_heads == 0
    alias = get_model_spec("dummy:llama2-70b")
    assert alias.name == "dummy:llama2-70b" and alias.num_layers == 80
    assert "llama2-70b" in list_model_specs()
    with pytest.raises(ConfigError, match="unknown model"):
        get_model_spec("gpt-5")


def test_prefill_flops_count_the_causal_square():
    spec = get_model_spec("llama2-70b")
    assert (
        spec.prefill_flops(1000)
        == spec.flops_per_token * 1000 + spec.attn_flops_per_token_pair * 500_000
    )
    assert spec.prefill_flops(1000, 1000) == 0


def test_dummy_small_has_llama3_proportions_and_a_reuse_bound_over_40_percent():
    """dummy:small keeps LLaMA 3's head_dim, GQA ratio and MLP width, so half an 8k prompt
    reused can cut >= 40% of the prefill FLOPs (dummy:tiny, attention-bound, cannot)."""
    small, l3 = get_model_spec("dummy:small"), get_model_spec("llama3-8b")
    assert small.head_dim == l3.head_dim
    assert small.num_heads // small.num_kv_heads == l3.num_heads // l3.num_kv_heads
    assert small.intermediate_size / small.hidden_size == l3.intermediate_size / l3.hidden_size
    assert small.vocab_size >= 259

    def bound(name: str) -> float:
        spec = get_model_spec(name)
        return 1 - spec.prefill_flops(8192, 4096) / spec.prefill_flops(8192)

    assert bound("dummy:tiny") < 0.40 < bound("dummy:small") < bound("llama3-8b") < 0.5


def test_roofline_prefill_is_compute_bound_and_decode_memory_bound():
    cost = roofline_cost_model("llama2-70b", "A800", tp=8)
    spec = get_model_spec("llama2-70b")
    # long prompts: time ~ FLOPs / (8 x 312 TFLOPS x MFU), within the comm and overhead terms
    compute_s = spec.prefill_flops(32_000) / (8 * GPUS["A800"].bf16_flops * PREFILL_MFU)
    assert compute_s < cost.prefill_time(32_000) < 1.3 * compute_s
    assert (
        cost.prefill_time(12_000, 8_000)
        < cost.prefill_time(12_000, 4_000)
        < cost.prefill_time(12_000)
    )
    # decode: reading 138 GB of weights over 8 x 2 TB/s dominates a small batch
    assert 0.01 < cost.decode_step_time(1, 1000) < 0.03
    assert cost.decode_step_time(64, 64 * 12_000) > cost.decode_step_time(1, 12_000)
    assert cost.decode_step_time(0, 0) == 0.0
    assert 1.2e6 < cost.kv_capacity_tokens < 1.4e6  # (640 GB x 0.9 - 138 GB) / 320 KiB
    h100 = roofline_cost_model("llama3-70b", "H100", tp=8)
    assert h100.prefill_time(8000) < cost.prefill_time(8000)
    with pytest.raises(ConfigError, match="unknown GPU"):
        roofline_cost_model("llama2-70b", "V100")


def test_cost_model_file_round_trip(tmp_path):
    cost = roofline_cost_model("llama3-70b", "H800")
    path = tmp_path / "cost.json"
    cost.save(path)
    data = json.loads(path.read_text())
    assert data["version"] == 1 and data["model"] == "llama3-70b" and data["source"] == "roofline"
    assert data["prefill"]["variables"] == ["input_len", "reused_len"]
    assert set(data["decode"]["fit_error"]) == {"rmse_s", "max_rel", "num_samples"}
    loaded = CostModel.load(path)
    for args in ((9000, 0), (9000, 4096), (128_000, 64_000)):
        assert loaded.prefill_time(*args) == cost.prefill_time(*args)
    assert loaded.decode_step_time(32, 300_000) == cost.decode_step_time(32, 300_000)


def test_bad_cost_model_files_name_the_problem(tmp_path):
    path = tmp_path / "cost.json"
    with pytest.raises(CostModelError, match="cannot read"):
        CostModel.load(path)
    path.write_text("{not json")
    with pytest.raises(CostModelError, match="not valid JSON"):
        CostModel.load(path)
    path.write_text(json.dumps({"version": 99}))
    with pytest.raises(CostModelError, match="version 99"):
        CostModel.load(path)
    roofline_cost_model("llama2-70b", "A800").save(path)
    data = json.loads(path.read_text())
    data["prefill"]["terms"][0]["powers"] = [7, 0]
    path.write_text(json.dumps(data))
    with pytest.raises(CostModelError, match=r"powers \(7, 0\)"):
        CostModel.load(path)
    del data["decode"]
    path.write_text(json.dumps(data))
    with pytest.raises(CostModelError, match="decode"):
        CostModel.load(path)


def test_transfer_time_includes_the_bytes_already_queued():
    assert CostModel.transfer_time(1000, 100.0, queued_bytes=500) == 15.0
    net = NetworkState(1000.0)
    for node in ("a", "b", "c"):
        net.add_node(node)
    assert net.estimate("a", "b", 2000, now=0.0) == 2.0
    assert net.reserve("a", "b", 2000, now=0.0) == 2.0
    assert net.queued_bytes("a", 0.5) == 1500  # egress of a
    assert net.estimate("a", "c", 1000, now=0.5) == 2.5  # waits behind 1,500 bytes on a
    assert net.estimate("c", "b", 1000, now=1.0) == 2.0  # b's ingress is busy too
    assert net.estimate("c", "a", 1000, now=0.0) == 1.0  # a's ingress is free
    assert net.estimate("a", "a", 10**9, now=0.0) == 0.0  # local


def test_a_cost_model_file_without_an_ssd_bandwidth_reads_with_the_default(tmp_path):
    """Files written before the SSD read bandwidth existed still load (2 GB/s); a
    bandwidth that is not positive is refused."""
    spec = roofline_cost_model("llama2-70b", "A800", 8).spec
    raw = msgspec.json.decode(msgspec.json.encode(spec))
    del raw["ssd_read_bytes_per_s"]
    path = tmp_path / "old.json"
    path.write_bytes(msgspec.json.encode(raw))
    cost = CostModel.load(path)
    assert cost.ssd_read_bytes_per_s == DEFAULT_SSD_READ_BYTES_PER_S == 2e9
    assert cost.ssd_read_time(4e9) == pytest.approx(2.0)
    raw["ssd_read_bytes_per_s"] = 0
    path.write_bytes(msgspec.json.encode(raw))
    with pytest.raises(CostModelError, match="ssd_read_bytes_per_s"):
        CostModel.load(path)


def _hf_dir(tmp_path, layers: int, hidden: int) -> str:
    """A Hugging Face-format directory whose shape is in no table (no weights read)."""
    root = tmp_path / f"qwen-{layers}x{hidden}"
    root.mkdir()
    config = {
        "model_type": "qwen2",
        "num_hidden_layers": layers,
        "hidden_size": hidden,
        "num_attention_heads": 20,
        "num_key_value_heads": 4,
        "intermediate_size": 3 * hidden,
        "vocab_size": 151936,
        "torch_dtype": "bfloat16",
    }
    (root / "config.json").write_text(json.dumps(config))
    (root / "model.safetensors").write_bytes(b"\0" * 64)
    return str(root)


def test_master_roofline_covers_every_loadable_model(tmp_path):
    """The master's default cost model (no profile) exists for built-in names, `dummy:`
    aliases and HF directories alike, on the detected GPU type or the H800 x8 default."""
    cfg = Config()
    for path in ("dummy:tiny", "dummy:small", "dummy:llama3-8b", _hf_dir(tmp_path, 40, 2560)):
        info = load_model_info(path)
        cost, source = master_cost_model(cfg, info, gpu_names=[])
        assert cost.spec.model == info.spec.name and cost.prefill_time(4096) > 0
        assert source.startswith(f"roofline of {info.spec.name} on H800 x8, the default")
        assert cost.kv_bytes_per_token == info.spec.kv_bytes_per_token(2)  # bf16 on a GPU
    info = load_model_info("dummy:tiny")
    _, source = master_cost_model(cfg, info, gpu_names=["NVIDIA A100-SXM4-80GB"] * 2)
    assert source == "roofline of dummy:tiny on A100 x2, detected on this host"
    _, source = master_cost_model(cfg, info, gpu_names=["NVIDIA GeForce RTX 4090"])
    assert "H800 x8, the default (NVIDIA GeForce RTX 4090 detected here" in source
    # weights larger than the GPUs: tensor parallelism doubles until they fit
    big = load_model_info(_hf_dir(tmp_path, 400, 16384))  # ~1.3e12 parameters
    cost, source = master_cost_model(cfg, big, gpu_names=["NVIDIA H100 80GB HBM3"])
    assert "; 1 GPUs cannot hold the weights, so 64 are assumed" in source
    assert cost.kv_capacity_tokens > 0


def test_master_cost_model_names_the_key_for_a_bad_profile(tmp_path):
    cfg = msgspec.structs.replace(
        Config(),
        scheduler=msgspec.structs.replace(
            Config().scheduler, cost_model_path=str(tmp_path / "none.json")
        ),
    )
    with pytest.raises(ConfigError, match="^scheduler.cost_model_path: cannot read"):
        master_cost_model(cfg, load_model_info("dummy:tiny"), gpu_names=[])
    # a profile made for another model is refused, naming both and how to make the right one
    roofline_cost_model("llama3-8b", "A800").save(tmp_path / "none.json")
    with pytest.raises(ConfigError) as refused:
        master_cost_model(cfg, load_model_info("dummy:tiny"), gpu_names=[])
    message = str(refused.value)
    assert message.startswith("scheduler.cost_model_path: ") and "`mooncake profile`" in message
    assert "of 'llama3-8b', but model.path serves 'dummy:tiny'" in message
    tiny = load_model_info("dummy:tiny")
    roofline_cost_model(tiny.spec, "A800").save(tmp_path / "none.json")
    cost, source = master_cost_model(cfg, tiny, gpu_names=[])
    assert cost.spec.model == "dummy:tiny" and source.startswith("profile ")


def test_the_roofline_follows_the_first_prefill_node_with_known_gpus(tmp_path):
    """No profile: nodes without GPUs leave the figures; the first with GPUs of a known type
    sets the Conductor's cost model (links added at the old NIC figure take the new one);
    later nodes change nothing. With a profile configured, nothing ever changes."""
    from mooncake.conductor import Conductor

    cfg, info = Config(), load_model_info("dummy:tiny")
    cost, _ = master_cost_model(cfg, info, gpu_names=[])
    conductor = Conductor.from_config(cfg.scheduler, cost=cost, block_tokens=32)
    conductor.add_decode_instance("d0")  # at the H800 node's NIC figure
    hardware = PrefillHardware(cfg, info, cost)
    hardware.follow("cpu-0", [], conductor)
    assert conductor.cost is cost
    hardware.follow("gpu-0", ["NVIDIA A100-SXM4-80GB 79GiB"] * 2, conductor)
    assert conductor.cost.spec.device == "A100 x2 (tp=2)"
    a100_nic = GPUS["A100"].node_nic_bytes_per_s
    assert conductor.network.default_bytes_per_s == a100_nic
    assert conductor.network.estimate("d0", "d0", 1e9, 0.0) == 0.0  # still known
    conductor.add_decode_instance("d1")
    assert conductor.network.estimate("d0", "d1", a100_nic, 0.0) == pytest.approx(1.0)
    hardware.follow("gpu-1", ["NVIDIA H100 80GB HBM3 79GiB"], conductor)
    assert conductor.cost.spec.device == "A100 x2 (tp=2)"
    path = tmp_path / "profile.json"
    cost.save(path)
    scheduler = msgspec.structs.replace(cfg.scheduler, cost_model_path=str(path))
    profiled = msgspec.structs.replace(cfg, scheduler=scheduler)
    conductor = Conductor.from_config(scheduler, cost=cost, block_tokens=32)
    PrefillHardware(profiled, info, cost).follow("gpu-0", ["NVIDIA H100 80GB HBM3"], conductor)
    assert conductor.cost is cost
