"""GPUs end to end on injected readings: --gpu-layers, the llama.cpp backend's pools, the slot's load, auto, status.

No test here needs a GPU: the devices are fake NVML readings or MemoryPools, the
llama.cpp build's offload answer is injected. What a real GPU would add (llama.cpp
actually placing the layers) is not checked here.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from backends.memory import MemoryBackend
from contract import wire
from contract.sizing import MemoryPool, ModelFacts
from contract.types import (
    GPU_LAYERS_ALL,
    GPU_LAYERS_AUTO,
    ActiveModel,
    CacheStatus,
    Config,
    DaemonStatus,
    DeviceInfo,
    LoadModelRequest,
    ModelInfo,
    OpenSessionRequest,
    format_gpu_layers,
    parse_gpu_layers,
)
from modeld.bootstrap import engine_facts
from modeld.capacity import Policy, make_planner
from modeld.engine_choice import EngineFacts, choose_backend
from modeld.serve import load as load_serve_settings
from modeld.settings import ServeSettings, SettingsError
from modeld.slot import SlotService
from runtime import cli

GiB = 2**30
MiB = 2**20

SMOL = ModelFacts(n_ctx_train=8192, n_layer=30, n_head_kv=3, head_dim_k=64, head_dim_v=64,
                  weights_bytes=96_576_768, n_vocab=49152, n_embd=576, n_head=9)
L4 = MemoryPool(kind="gpu", id="0", total_bytes=24 * GiB, free_bytes=20 * GiB, name="NVIDIA L4")


def host(free: int) -> MemoryPool:
    return MemoryPool(kind="cpu", id="host", total_bytes=64 * GiB, free_bytes=free, name="host RAM")


# --- the value: --gpu-layers N|auto|all -------------------------------------------------------


@pytest.mark.parametrize(("text", "n"), [("auto", GPU_LAYERS_AUTO), ("AUTO", GPU_LAYERS_AUTO), ("all", GPU_LAYERS_ALL),
                                         ("0", 0), ("12", 12), (" 999 ", 999)])
def test_gpu_layers_parse(text: str, n: int) -> None:
    assert parse_gpu_layers(text) == n


@pytest.mark.parametrize("bad", ["-3", "-1", "abc", "1.5", "", "²", True, -3, 2.0])
def test_bad_gpu_layers_are_refused_with_the_value(bad: Any) -> None:
    with pytest.raises(ValueError, match="expected auto, all or a whole number >= 0"):
        parse_gpu_layers(bad)


def test_gpu_layers_format_back() -> None:
    assert [format_gpu_layers(n) for n in (-2, -1, 0, 7)] == ["auto", "all", "0", "7"]


def test_config_takes_auto_and_refuses_below_it() -> None:
    assert Config(num_gpu_layers=GPU_LAYERS_AUTO).num_gpu_layers == -2
    with pytest.raises(ValueError):
        Config(num_gpu_layers=-3)


# --- modeld serve: flag > env > config file > default ---------------------------------------


@pytest.fixture
def no_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("MODELD_CONFIG", raising=False)
    monkeypatch.delenv("MODELD_GPU_LAYERS", raising=False)
    return tmp_path


def test_serve_gpu_layers_default_is_auto_and_the_preload_asks_for_it(no_config: Path) -> None:
    opts = load_serve_settings([])
    assert opts.load_config.num_gpu_layers == GPU_LAYERS_AUTO


def test_serve_gpu_layers_layering(no_config: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    conf = no_config / "c.toml"
    conf.write_text('gpu_layers = "all"\n')
    assert load_serve_settings(["--config", str(conf)]).load_config.num_gpu_layers == GPU_LAYERS_ALL
    conf.write_text("gpu_layers = 12\n")
    assert load_serve_settings(["--config", str(conf)]).load_config.num_gpu_layers == 12
    monkeypatch.setenv("MODELD_GPU_LAYERS", "0")
    assert load_serve_settings(["--config", str(conf)]).load_config.num_gpu_layers == 0  # env over the file
    assert load_serve_settings(["--config", str(conf), "--gpu-layers", "auto"]).load_config.num_gpu_layers == GPU_LAYERS_AUTO


@pytest.mark.parametrize("bad", ["-3", "abc"])
def test_serve_bad_gpu_layers_name_the_flag(no_config: Path, bad: str) -> None:
    with pytest.raises(SettingsError, match=r"gpu_layers \(--gpu-layers\): invalid GPU layer count"):
        load_serve_settings(["--gpu-layers", bad])


def test_serve_bad_gpu_layers_in_the_environment(no_config: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MODELD_GPU_LAYERS", "lots")
    with pytest.raises(SettingsError, match=r"gpu_layers \(MODELD_GPU_LAYERS\)"):
        load_serve_settings([])


# --- modeld load / describe ------------------------------------------------------------------


def test_load_flag_default_auto_and_values() -> None:
    parser = cli.build_parser()
    args = parser.parse_args(["load", "m", "--path", "/m.gguf"])
    assert cli.model_handle(args)["config"].num_gpu_layers == GPU_LAYERS_AUTO
    args = parser.parse_args(["load", "m", "--path", "/m.gguf", "--gpu-layers", "0"])
    assert cli.model_handle(args)["config"].num_gpu_layers == 0
    args = parser.parse_args(["describe", "--gpu-layers", "20"])
    assert cli.model_handle(args)["config"].num_gpu_layers == 20
    # run keeps the default config ("whatever is loaded"): it takes no --gpu-layers
    args = parser.parse_args(["run", "hi"])
    assert cli.model_handle(args)["config"] == Config()


@pytest.mark.parametrize("bad", ["-3", "abc"])
def test_load_flag_refuses_bad_values(bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:  # refused before any daemon is asked
        cli.main(["load", "m", "--path", "/m.gguf", "--gpu-layers", bad, "--endpoint", "ipc:///nonexistent/modeld.sock"])
    assert exc.value.code == 2
    assert f"invalid GPU layer count '{bad}'" in capsys.readouterr().err


# --- the llama.cpp backend: pools only from a build that offloads ------------------------------


def test_llama_memory_pools_follow_the_build() -> None:
    pytest.importorskip("llama_cpp")
    from backends.llama import LlamaBackend

    assert LlamaBackend(gpus=lambda: [L4], offload=lambda: True).memory_pools() == (L4,)
    assert LlamaBackend(gpus=lambda: [L4], offload=lambda: False).memory_pools() == ()  # a CPU build
    assert LlamaBackend(gpus=list, offload=lambda: True).memory_pools() == ()  # no NVIDIA GPU


def test_llama_load_options_offload_the_output_layer_with_every_layer() -> None:
    pytest.importorskip("llama_cpp")
    from backends.llama.options import LoadOptions
    from contract.sizing import ModelShape

    shape = ModelShape(n_ctx_train=8192, n_layer=30, n_head=9, n_head_kv=3, head_dim_k=64, head_dim_v=64,
                       weights_bytes=1, n_embd=576)
    opts = LoadOptions.resolve(Config(num_ctx=512, num_gpu_layers=30), shape)
    assert (opts.num_gpu_layers, opts.llama_gpu_layers) == (30, -1)  # llama.cpp: 30 would leave the output layer
    assert LoadOptions.resolve(Config(num_ctx=512, num_gpu_layers=12), shape).llama_gpu_layers == 12
    assert LoadOptions.resolve(Config(num_ctx=512, num_gpu_layers=0), shape).llama_gpu_layers == 0
    assert LoadOptions.resolve(Config(num_ctx=512, num_gpu_layers=-1), shape).llama_gpu_layers == -1


def test_llama_unplanned_auto_is_none_on_a_cpu_build(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("llama_cpp")
    from backends.llama import options

    monkeypatch.setattr(options, "gpu_offload", lambda: False)
    assert options.unplanned_gpu_layers(GPU_LAYERS_AUTO) == 0
    monkeypatch.setattr(options, "gpu_offload", lambda: True)
    assert options.unplanned_gpu_layers(GPU_LAYERS_AUTO) == GPU_LAYERS_ALL
    assert options.unplanned_gpu_layers(7) == 7


def test_llama_describe_through_the_planner_places_the_bundled_model_on_an_injected_gpu() -> None:
    pytest.importorskip("llama_cpp")
    from backends.bundled import bundled_gguf_path
    from backends.llama import LlamaBackend

    backend = LlamaBackend(gpus=lambda: [L4], offload=lambda: True)
    planner = make_planner(Policy(), host_reader=lambda: host(8 * GiB))
    req = OpenSessionRequest(path=str(bundled_gguf_path()), config=Config(num_ctx=4096, num_gpu_layers=GPU_LAYERS_AUTO))
    info = planner(backend, req, 0)
    assert (info.resolved_gpu_layers, info.n_layer, info.gpu_layers_reason) == (30, 30, "all")
    assert info.supports_gpu_offload and info.device_id == "0"
    assert [d.kind for d in info.devices] == ["cpu", "gpu"]
    cpu_build = planner(LlamaBackend(gpus=lambda: [L4], offload=lambda: False), req, 0)
    assert (cpu_build.resolved_gpu_layers, cpu_build.gpu_layers_reason, cpu_build.supports_gpu_offload) == (
        0, "no gpu", False)


# --- the slot: the plan's layers are what loads; the cache's RAM is host RAM ---------------------


class GpuMemoryBackend(MemoryBackend):
    """The reference backend with a memory model and an injected GPU; records what it was asked to load."""

    def __init__(self, gpus: tuple[MemoryPool, ...]) -> None:
        super().__init__()
        self.gpus = gpus
        self.loaded: list[Config] = []

    def model_facts(self, req: OpenSessionRequest) -> ModelFacts:
        return SMOL

    def memory_pools(self) -> tuple[MemoryPool, ...]:
        return self.gpus

    def describe(self, req: OpenSessionRequest, credit_bytes: int = 0) -> ModelInfo:
        return super().describe(req, credit_bytes).model_copy(update={"n_layer": SMOL.n_layer})

    def load(self, req: OpenSessionRequest, progress: Any) -> Any:
        self.loaded.append(req.config)
        return super().load(req, progress)


class FitRecorder:
    """The workspace cache's admin half, as far as the slot sizes it."""

    def __init__(self) -> None:
        self.spare: list[int] = []

    def fit_ram(self, spare_bytes: int) -> None:
        self.spare.append(spare_bytes)

    def release_ram(self) -> None:
        pass

    def status(self) -> CacheStatus:
        return CacheStatus(ram_entries=0, ram_bytes=0, ram_budget_bytes=0, disk_entries=0, disk_bytes=0,
                           disk_budget_bytes=0, disk_dir="", disk_written_bytes=0, hits=0, misses=0, hit_rate=None,
                           restored_tokens=0, saves=0, evictions=0, rejected=0, last_rejection="")


def _slot(gpus: tuple[MemoryPool, ...], host_free: int = 8 * GiB) -> tuple[SlotService, GpuMemoryBackend, FitRecorder]:
    backend = GpuMemoryBackend(gpus)
    cache = FitRecorder()
    planner = make_planner(Policy(headroom_fraction=0.0), host_reader=lambda: host(host_free))
    slot = SlotService(backend, planner=planner, cache=cache, devices=lambda: gpus)  # type: ignore[arg-type]
    return slot, backend, cache


def _load(layers: int, num_ctx: int = 4096) -> LoadModelRequest:
    return LoadModelRequest(model_name="m", type="memory", path="/models/m",
                            config=Config(num_ctx=num_ctx, num_gpu_layers=layers))


def test_slot_loads_the_layers_the_plan_resolved() -> None:
    slot, backend, cache = _slot((L4,))
    active = slot.load_model(_load(GPU_LAYERS_AUTO))
    assert backend.loaded[-1].num_gpu_layers == 30  # "auto" never reaches the engine unresolved
    assert (active.gpu_layers, active.n_layer, active.gpu_layers_reason) == (30, 30, "all")
    # the cache's RAM budget comes from host memory alone: 8 GiB minus the host's small share, not + the GPU's 20
    assert 7 * GiB < cache.spare[-1] < 8 * GiB


def test_slot_partial_offload_loads_only_what_fits() -> None:
    small = replace(L4, free_bytes=SMOL.weights_bytes // 2)
    slot, backend, _ = _slot((small,))
    active = slot.load_model(_load(GPU_LAYERS_AUTO, num_ctx=512))
    assert 0 < backend.loaded[-1].num_gpu_layers < 30
    assert active.gpu_layers_reason == "gpu memory"


def test_slot_clamps_a_count_beyond_the_model() -> None:
    slot, backend, _ = _slot((L4,))
    active = slot.load_model(_load(999))
    assert backend.loaded[-1].num_gpu_layers == 30 and active.gpu_layers_reason == "n_layer"


def test_slot_without_a_gpu_loads_on_the_cpu_as_before() -> None:
    slot, backend, cache = _slot(())
    active = slot.load_model(_load(GPU_LAYERS_AUTO))
    assert backend.loaded[-1].num_gpu_layers == 0
    assert (active.gpu_layers, active.gpu_layers_reason) == (0, "no gpu")
    st = slot.status()
    assert st.devices == [] and not st.gpu_offload
    # a request of 0 layers is untouched by the plan (the config a CPU-only caller sends stays what it was)
    slot2, backend2, _ = _slot(())
    slot2.load_model(_load(0))
    assert backend2.loaded[-1] == Config(num_ctx=4096)


def test_status_reports_the_devices_build_and_offload_over_the_wire() -> None:
    backend = GpuMemoryBackend((L4,))
    slot = SlotService(backend, devices=lambda: [L4], build="CUDA : ARCHS = 890 | CPU : AVX2 = 1", gpu_offload=True)
    st = slot.status()
    assert st.devices == [DeviceInfo(kind="gpu", id="0", name="NVIDIA L4", total_bytes=24 * GiB, free_bytes=20 * GiB)]
    frames = wire.encode_reply(wire.Kind.OK, b"r1", st)
    back = DaemonStatus.model_validate(wire.decode_reply(frames).body)
    assert (back.devices, back.build, back.gpu_offload) == (st.devices, st.build, True)


# --- auto: llama.cpp when a GPU it can use is there -------------------------------------------------

X86 = EngineFacts(machine="x86_64", installed=frozenset({"llama", "openvino"}), model_kind="gguf",
                  num_gpu_layers=GPU_LAYERS_AUTO)


@pytest.mark.parametrize(
    ("change", "backend", "why"),
    [
        ({"gpus": ("NVIDIA L4, 24GiB",), "gpu_engines": frozenset({"llama"})}, "llama",
         "GPU NVIDIA L4, 24GiB found and llama.cpp's build offloads to it"),
        ({"gpus": ("NVIDIA L4, 24GiB",), "gpu_engines": frozenset()}, "openvino", "ran faster on OpenVINO"),  # CPU build
        ({}, "openvino", "ran faster on OpenVINO"),  # no GPU
        ({"gpus": ("NVIDIA L4, 24GiB",), "gpu_engines": frozenset({"llama"}), "num_gpu_layers": 0}, "openvino",
         "ran faster on OpenVINO"),  # --gpu-layers 0: the CPU was asked for
        ({"num_gpu_layers": GPU_LAYERS_ALL}, "llama", "every layer on the GPU was asked for"),
        ({"gpus": ("NVIDIA L4, 24GiB",), "gpu_engines": frozenset({"llama"}), "installed": frozenset({"openvino"})},
         "openvino", "llama-cpp-python is not installed"),
    ],
)
def test_auto_prefers_llama_on_a_gpu_it_can_use(change: dict[str, Any], backend: str, why: str) -> None:
    name, reason = choose_backend(replace(X86, **change))
    assert name == backend and why in reason, reason


def test_engine_facts_read_the_gpus_only_when_layers_may_go_there(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"not a gguf")
    reads: list[int] = []

    def gpus() -> list[MemoryPool]:
        reads.append(1)
        return [L4]

    assert engine_facts(str(model), 0, gpus=gpus).gpus == () and reads == []
    f = engine_facts(str(model), GPU_LAYERS_AUTO, gpus=gpus)
    assert f.gpus == ("NVIDIA L4, 24GiB",) and reads == [1]
    assert engine_facts(str(model), GPU_LAYERS_AUTO, gpus=list).gpu_engines == frozenset()


def test_serve_options_carry_the_gpu_layers_into_auto(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from modeld import bootstrap

    seen: list[int] = []
    real = bootstrap.engine_facts

    def spy(model: str, num_gpu_layers: int = 0, **kw: Any) -> EngineFacts:
        seen.append(num_gpu_layers)
        return real(model, num_gpu_layers, gpus=list, **kw)

    monkeypatch.setattr(bootstrap, "engine_facts", spy)
    model = tmp_path / "m.gguf"
    model.write_bytes(b"x")
    bootstrap.resolve_backend(ServeSettings(model=str(model), gpu_layers=7))
    assert seen == [7]


# --- the CLI's rows ----------------------------------------------------------------------------------


def _status_out(st: DaemonStatus, json: bool = False) -> str:
    """What ``modeld status`` prints for ``st``."""
    return cli.status_text(st, "ipc:///tmp/x", as_json=json)


def _rows(out: str) -> dict[str, str]:
    """The table's rows: a key, two or more spaces, the value."""
    import re

    pairs = (re.split(r" {2,}", line.rstrip(), maxsplit=1) for line in out.splitlines())
    return {p[0]: p[1] for p in pairs if len(p) == 2}


def test_status_rows_without_a_gpu_say_none() -> None:
    rows = _rows(_status_out(DaemonStatus(backend="llama")))
    assert rows["gpus"] == "none"
    assert "gpu offload" not in rows and "build" not in rows


def test_status_rows_with_gpus_and_the_build() -> None:
    active = ActiveModel(model_name="m", config=Config(num_gpu_layers=30), gpu_layers=30, n_layer=30,
                         gpu_layers_reason="all")
    st = DaemonStatus(backend="llama", devices=[L4.device_info()], gpu_offload=True, build="CUDA : ARCHS = 890",
                      active=active)
    rows = _rows(_status_out(st))
    assert rows["gpu 0"] == "NVIDIA L4, 20.0 GiB free of 24.0 GiB"
    assert (rows["gpu offload"], rows["build"], rows["gpu layers"]) == ("yes", "CUDA : ARCHS = 890", "30 of 30 (all)")
    cpu_build = _status_out(st.model_copy(update={"gpu_offload": False, "active": None}))
    assert "no: this llama build has no GPU backend" in cpu_build


def test_status_json_carries_the_devices() -> None:
    import json

    st = DaemonStatus(devices=[L4.device_info()], gpu_offload=True, build="b")
    got = json.loads(_status_out(st, json=True))
    assert got["devices"] == [{"kind": "gpu", "id": "0", "name": "NVIDIA L4", "total_bytes": 24 * GiB,
                               "free_bytes": 20 * GiB}]
    assert (got["gpu_offload"], got["build"]) == (True, "b")


def test_gpu_layers_row() -> None:
    def row(active: ActiveModel) -> str:
        return _rows(_status_out(DaemonStatus(backend="llama", active=active)))["gpu layers"]

    assert row(ActiveModel(gpu_layers=12, n_layer=30, gpu_layers_reason="gpu memory")) == "12 of 30 (gpu memory)"
    assert row(ActiveModel(gpu_layers_reason="no gpu")) == "0 (no gpu)"
    assert row(ActiveModel(config=Config(num_gpu_layers=-1))) == "all"  # an older daemon
