"""What a load takes is declared once: ``contract.types.Config``'s fields with a ``Flag``, and each engine's options
model. The contributing guide's recipe for a load option: one field in one model, plus its use.

Here the toy engine of ``tests.test_engine_recipe`` gains an option (``volume``) in its options model and nothing
else: it is then a ``modeld serve`` flag, a variable, a config file key, a ``modeld load`` flag (and
``describe``'s, ``run``'s, ``embed``'s), listed by ``describe``, carried to the engine's load, and shown by
``status``. The control: without the field, none of these know it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from pydantic import Field

from backends import registry
from backends.engine_spec import engine_options
from backends.memory import MemoryModel
from contract.types import LoadModelRequest, OpenSessionRequest
from modeld import bootstrap
from modeld.serve import build_parser as serve_parser
from modeld.serve import load as load_serve_settings
from modeld.settings import SettingsError, option_flags_of
from modeld.slot import SlotService
from runtime import cli
from runtime.flags import CLIENT_FLAGS, load_fields, option_flags
from tests.test_engine_recipe import TOY_ENGINE, ToyBackend, ToyOptions


class LouderToyOptions(ToyOptions):
    """The toy engine's options with one more: the field this recipe adds."""

    volume: int | None = Field(None, ge=0, le=11, description="how loud the toy says it")


class LouderToyBackend(ToyBackend):
    """The option's use: the engine reads it from each load's config, by its options model."""

    def load(self, req: OpenSessionRequest, progress: Callable[[float], None]) -> MemoryModel:
        self.loaded_volume = engine_options(LOUDER_TOY, req.config, LouderToyOptions).volume
        return super().load(req.model_copy(update={"config": req.config.model_copy(update={
            "options": {k: v for k, v in req.config.options.items() if k != "volume"}})}), progress)


LOUDER_TOY = dataclasses.replace(TOY_ENGINE, options=LouderToyOptions,
                                 backend=lambda cache, settings: LouderToyBackend(greeting="toy"))


@pytest.fixture
def louder_toy(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    monkeypatch.setitem(registry.ENGINES, "toy", LOUDER_TOY)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    for name in ("MODELD_CONFIG", "MODELD_VOLUME", "MODELD_GREETING", "MODELD_ENGINE_OPTION"):
        monkeypatch.delenv(name, raising=False)
    yield


def _flags(parser_help: str) -> str:
    return " ".join(parser_help.split())


def test_an_engine_option_added_to_its_model_is_a_setting_everywhere(louder_toy: None, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # modeld serve: a flag with its variable, read from the flag, the environment and the config file, in that order
    text = _flags(serve_parser().format_help())
    assert "--volume VOLUME the toy engine: how loud the toy says it (an engine option) (env MODELD_VOLUME)" in text
    assert load_serve_settings(["--backend", "toy", "--volume", "7"]).load_config.options == {"volume": 7}
    monkeypatch.setenv("MODELD_VOLUME", "5")
    assert load_serve_settings(["--backend", "toy"]).load_config.options == {"volume": "5"}
    conf = tmp_path / "c.toml"
    conf.write_text("volume = 3\ngreeting = \"hi\"\n")
    monkeypatch.delenv("MODELD_VOLUME")
    opts = load_serve_settings(["--backend", "toy", "--config", str(conf)])
    assert opts.load_config.options == {"volume": 3, "greeting": "hi"}
    # the engine reads it, typed by its model; a value the model refuses is refused at the load, naming it
    backend = bootstrap.build_backend(opts)
    assert isinstance(backend, LouderToyBackend)
    slot = SlotService(backend, opts)
    active = slot.load_model(LoadModelRequest(model_name="hello", type="toy", path="/models/hello", config=opts.load_config))
    assert (backend.loaded_volume, backend.loaded_greeting) == (3, "hi")
    # status shows it, as the loaded model's settings
    assert active.config.options == {"volume": 3, "greeting": "hi"}
    assert "settings        greeting=hi, volume=3" in cli.status_text(slot.status())

    # modeld load (and describe, run, embed): a flag of its own, beside --engine-option
    options = option_flags_of()
    for command, extra in (("load", ["hello"]), ("describe", []), ("run", ["hi"]), ("embed", ["t"])):
        args = cli.build_parser(options=options).parse_args([command, *extra, "--type", "toy", "--volume", "11"])
        assert cli.model_handle(args, options)["config"].options == {"volume": 11}, command
    args = cli.build_parser(options=options).parse_args(["load", "hello", "--volume", "2", "--engine-option",
                                                         "greeting=hey", "--engine-option", "volume=9"])
    assert cli.model_handle(args, options)["config"].options == {"volume": 2, "greeting": "hey"}  # its flag wins

    # describe lists it with its type and description
    assert ("volume", "integer", "unset", "how loud the toy says it") in [
        (o.name, o.type, o.default, o.description) for o in registry.option_list("toy")]


def test_a_bad_value_of_an_engine_option_is_refused_naming_it(louder_toy: None) -> None:
    opts = load_serve_settings(["--backend", "toy", "--volume", "12"])
    slot = SlotService(bootstrap.build_backend(opts), opts)
    with pytest.raises(Exception, match=r"refused by the toy engine: volume: Input should be less than or equal to 11"):
        slot.load_model(LoadModelRequest(model_name="hello", type="toy", path="/models/hello", config=opts.load_config))
    with pytest.raises(SettingsError, match=r"engine_option \(--engine-option\): an engine option is NAME=VALUE"):
        load_serve_settings(["--engine-option", "volume"])


def test_without_the_field_no_command_knows_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The control: the toy engine as it was."""
    monkeypatch.setitem(registry.ENGINES, "toy", TOY_ENGINE)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    assert "--volume" not in serve_parser().format_help()
    assert "--volume" not in cli.build_parser(options=option_flags_of())._subparsers._group_actions[0].choices[
        "load"].format_help()  # type: ignore[union-attr]
    conf = tmp_path / "c.toml"
    conf.write_text("volume = 3\n")
    with pytest.raises(SettingsError, match="unknown setting 'volume'"):
        load_serve_settings(["--config", str(conf)])


def test_every_flagged_field_of_the_load_config_is_a_flag_of_serve_and_of_load() -> None:
    serve = serve_parser().format_help()
    load = cli.build_parser()._subparsers._group_actions[0].choices["load"].format_help()  # type: ignore[union-attr]
    for s in load_fields():
        flag = "--" + s.setting.replace("_", "-")
        assert flag in serve and flag in load, s.setting
    assert "--num-batch" in load  # once a serve flag only


def test_an_engine_option_never_takes_a_client_command_s_own_flag() -> None:
    """``CLIENT_FLAGS`` names every flag the commands that name a model have besides the load's, so an engine
    option of one of those names is given another (``option_flags``)."""
    sub = cli.build_parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    load = {s.setting for s in load_fields()}
    own = {a.dest for command in cli.MODEL_COMMANDS for a in sub[command]._actions} - load
    assert own <= CLIENT_FLAGS, own - CLIENT_FLAGS
    flags = option_flags([("toy", "the toy", LouderToyOptions), ("other", "another", ToyOptions)], {"greeting"})
    assert [(o.setting, o.option, o.titles) for o in flags] == [
        ("toy_greeting", "greeting", ("the toy",)), ("volume", "volume", ("the toy",)),
        ("other_greeting", "greeting", ("another",))]


def test_the_engine_s_threads_are_a_setting(louder_toy: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``--num-threads`` (llama-server's ``--threads``, Ollama's ``num_thread``): flag, variable and config key
    reach the load's ``Config`` (which the engines' load options read: ``test_devices``), and status shows it."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    assert load_serve_settings([]).load_config.num_threads == 0
    conf = tmp_path / "c.toml"
    conf.write_text("num_threads = 3\n")
    assert load_serve_settings(["--config", str(conf)]).load_config.num_threads == 3
    monkeypatch.setenv("MODELD_NUM_THREADS", "2")
    assert load_serve_settings(["--config", str(conf)]).load_config.num_threads == 2
    assert load_serve_settings(["--config", str(conf), "--num-threads", "1"]).load_config.num_threads == 1
    opts = load_serve_settings(["--backend", "toy", "--num-threads", "2"])
    slot = SlotService(bootstrap.build_backend(opts), opts)
    slot.load_model(LoadModelRequest(model_name="hello", type="toy", path="/models/hello", config=opts.load_config))
    assert "settings        2 threads" in cli.status_text(slot.status())
    with pytest.raises(SettingsError, match=r"num_threads \(--num-threads\)"):
        load_serve_settings(["--num-threads", "-1"])
    assert "--num-threads" in cli.build_parser()._subparsers._group_actions[0].choices[  # type: ignore[union-attr]
        "load"].format_help()
