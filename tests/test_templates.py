"""Chat templates (backends/tape/templates.py) on both engines, through real daemon processes: a GGUF with no
template is served with ChatML and says so; ``--chat-template FILE`` serves another; a template that does not
render is refused at the load, and the model already loaded goes on serving."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from contract.errors import InvalidArgument  # noqa: E402
from contract.types import Config, LoadModelRequest, OpenSessionRequest  # noqa: E402
from tests.test_openai_front import Front  # noqa: E402

pytestmark = pytest.mark.slow

#: ChatML with a preamble in every system turn: a template the model's file does not have, told apart by its tokens
PREAMBLE_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'system' %}{{- 'Answer in one short sentence, plainly. ' }}{%- endif %}"
    "{{- (message['content'] or '') + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module", params=[pytest.param("llama", marks=pytest.mark.llama),
                                        pytest.param("openvino", marks=pytest.mark.openvino)])
def bare(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Front]:
    """The bundled weights in a GGUF that carries no chat template, as a base model's does."""
    pytest.importorskip("llama_cpp" if request.param == "llama" else "openvino_genai")
    from harness.fixtures import untemplated_gguf

    with Front(tmp_path_factory.mktemp(f"bare-{request.param}"), "--model", str(untemplated_gguf()),
               "--model-name", "bare", "--num-ctx", "1024", backend=request.param) as f:
        yield f


def _chat_prompt_tokens(front: Front) -> int:
    out = front.sdk().chat.completions.create(model="bare", messages=MESSAGES, max_tokens=4, temperature=0)
    assert out.choices[0].message.content is not None and out.usage is not None
    return out.usage.prompt_tokens


def test_a_model_without_a_template_is_served_with_chatml_and_says_so(bare: Front) -> None:
    with bare.daemon.client(timeout_s=30.0) as c:
        active = c.status().active
    assert active is not None and active.chat_template == "ChatML (the model's file has none)"
    assert _chat_prompt_tokens(bare) > 10


def test_a_template_file_is_served_and_a_broken_one_refused(bare: Front, tmp_path: Path) -> None:
    plain = _chat_prompt_tokens(bare)
    good = tmp_path / "preamble.jinja"
    good.write_text(PREAMBLE_TEMPLATE, encoding="utf-8")
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for message in messages %}{{ message['content'] }", encoding="utf-8")  # unclosed tag
    with bare.daemon.client(timeout_s=300.0) as c:
        active = c.status().active
        assert active is not None
        req = LoadModelRequest(model_name="bare", type=active.type, path=active.path,
                               config=Config(num_ctx=1024, chat_template=str(good)))
        switched = c.load_model(req)
        assert switched.chat_template == f"file {good.resolve()}"
        with_preamble = _chat_prompt_tokens(bare)
        assert with_preamble > plain + 5  # the preamble's tokens: this template rendered the prompt
        with pytest.raises(InvalidArgument, match="chat template"):
            c.load_model(req.model_copy(update={"config": Config(num_ctx=1024, chat_template=str(broken))}))
        with pytest.raises(InvalidArgument, match="neither a built-in"):
            c.load_model(req.model_copy(update={"config": Config(num_ctx=1024, chat_template="no-such-template")}))
        # the model that was serving still serves, under its template
        after = c.status().active
        assert after is not None and after.chat_template == f"file {good.resolve()}"
    assert _chat_prompt_tokens(bare) == with_preamble


def test_a_family_template_brings_its_tool_call_format_through_the_front(bare: Front) -> None:
    """A Ministral 3 template (``[TOOL_CALLS]N[ARGS]{…}``): status names the format it was detected as, a forced
    call through the OpenAI SDK comes back as ``tool_calls``, and the next request, the call and its result
    sent back, reuses the prompt and the call; a format that does not exist is refused at the load."""
    from tests.test_family_templates import CITY_TOOL, TEMPLATES

    template = TEMPLATES / "mistral_args.jinja"
    with bare.daemon.client(timeout_s=300.0) as c:
        active = c.status().active
        assert active is not None
        req = LoadModelRequest(model_name="bare", type=active.type, path=active.path,
                               config=Config(num_ctx=1024, chat_template=str(template)))
        switched = c.load_model(req)
        assert switched.tool_format == "mistral_args (detected from the template)"
        with pytest.raises(InvalidArgument, match="tool-call format 'smoke-signals' is not supported"):
            c.load_model(req.model_copy(update={"config": Config(num_ctx=1024, chat_template=str(template),
                                                                  tool_format="smoke-signals")}))
        after = c.status().active
        assert after is not None and after.tool_format == switched.tool_format
    sdk = bare.sdk()
    messages: list[dict] = [{"role": "system", "content": "You are a weather bot."},
                            {"role": "user", "content": "Weather in Paris?"}]
    first = sdk.chat.completions.create(model="bare", messages=messages, tools=[CITY_TOOL], temperature=0,
                                        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = first.choices[0].message.tool_calls[0]
    assert first.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    assert first.usage is not None
    messages += [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                 {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    second = sdk.chat.completions.create(model="bare", messages=messages, tools=[CITY_TOOL], temperature=0,
                                         max_tokens=4)
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    cached = second.usage.prompt_tokens_details.cached_tokens or 0
    # the first prompt is reused; the forced call, spelled under its grammar otherwise than the tokenizer spells its
    # text, is computed again, as a fresh daemon computes the same prompt (warm equals cold)
    assert cached >= first.usage.prompt_tokens - 4, (first.usage, second.usage)


def test_describe_names_the_template_and_tool_format_a_load_would_use(bare: Front) -> None:
    """``describe`` reads the template from the file (or the request) and says what a load would say, without
    loading: the file's own or the vocabulary's choice, a named template file, a tool format asked for; a
    template that does not exist is refused as the load refuses it."""
    from tests.test_family_templates import TEMPLATES

    template = TEMPLATES / "mistral_args.jinja"
    with bare.daemon.client(timeout_s=60.0) as c:
        active = c.status().active
        assert active is not None

        def describe(**config: str) -> tuple[str, str]:
            info = c.describe(OpenSessionRequest(model_name="bare", type=active.type, path=active.path,
                                                 config=Config(num_ctx=1024, **config)))
            return info.chat_template, info.tool_format

        if active.chat_template == "ChatML (the model's file has none)":  # the module's loads may have switched it
            assert describe() == (active.chat_template, active.tool_format)
        assert describe() == ("ChatML (the model's file has none)",
                              "hermes (the template renders no tools: they go in a generic block)")
        assert describe(chat_template=str(template)) == (f"file {template.resolve()}",
                                                         "mistral_args (detected from the template)")
        assert describe(chat_template="llama3", tool_format="hermes") == ("built-in llama3", "hermes (asked for)")
        with pytest.raises(InvalidArgument, match="neither a built-in"):
            describe(chat_template="no-such-template")
        after = c.status().active
        assert after is not None and after.generation == active.generation  # nothing was loaded
