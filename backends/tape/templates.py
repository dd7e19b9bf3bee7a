"""Which chat template a model is served with: its own, one the request names, or ChatML when it has none.

``Config.chat_template`` (``modeld serve --chat-template``) is a built-in name or a path to a Jinja file on
the daemon's machine; empty means the model's own (the GGUF's ``tokenizer.chat_template``). A backend resolves
the request before it loads anything (``requested_template``: a bad name is refused at once) and hands the
result to the loaded model, which picks between it and its own (``choose_template``). A model whose
file carries no template (a base model) is served with ChatML rather than refused, and says so: the origin
goes to ``status`` (``ActiveModel.chat_template``). The template's digest is part of the manifest, so KV
computed under one template is never reused under another.

Built-in names: ``chatml`` and the families' published templates in ``backends/chat_templates`` (``qwen2_5``,
``qwen3_coder``, ``llama3``, ``mistral``, ``mistral_args``, ``gpt_oss``, ``deepseek_v3``, ``deepseek_v3_1``,
``gemma3``). A model
with no template gets the one whose turn tokens its vocabulary holds (Gemma's ``<start_of_turn>``, Llama 3's
``<|start_header_id|>``), else ChatML, which is what most instruction-tuned small models were trained on and
marks every turn unambiguously.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from contract.errors import InvalidArgument

from .model import ChatTemplate

__all__ = [
    "CHATML",
    "TEMPLATE_DIR",
    "VOCABULARY_DEFAULTS",
    "builtin",
    "builtin_names",
    "JinjaRenderer",
    "JinjaTemplate",
    "check_renders",
    "choose_template",
    "render_defaults",
    "renders_tools",
    "requested_template",
]

#: ChatML (``<|im_start|>role … <|im_end|>``), the format's published form
CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

#: the families' published templates (each file's header names its release), selected by their file's name
TEMPLATE_DIR = Path(__file__).resolve().parent.parent / "chat_templates"
#: the turn tokens a model's vocabulary holds as single tokens, and the built-in template they select for a
#: model whose file carries no template (the vocabulary says more than the architecture: SmolLM2 is a llama)
VOCABULARY_DEFAULTS = (("<start_of_turn>", "gemma3"), ("<|start_header_id|>", "llama3"))


def builtin_names() -> list[str]:
    return sorted({"chatml", *(p.stem for p in TEMPLATE_DIR.glob("*.jinja"))})


def builtin(name: str) -> str | None:
    """The source of the built-in template ``name`` (None when there is none)."""
    if name == "chatml":
        return CHATML
    path = TEMPLATE_DIR / f"{name}.jinja"
    return path.read_text(encoding="utf-8") if name.isidentifier() and path.is_file() else None

#: the largest template file read (templates are a few kB; this is a typo guard, not a limit anyone meets)
_MAX_TEMPLATE_BYTES = 1 << 20


class _GenerationTags(jinja2.ext.Extension):
    """Hugging Face's ``{% generation %}…{% endgeneration %}`` marks training targets: rendered as plain text."""

    tags = {"generation"}

    def parse(self, parser: Any) -> Any:
        parser.stream.skip(1)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class JinjaRenderer:
    """A chat template rendered the way Hugging Face ``transformers`` renders it (a sandboxed Jinja2 with
    ``trim_blocks``/``lstrip_blocks``, loop controls, ``{% generation %}`` ignored, ``tojson`` as plain
    ``json.dumps`` with keys in order, ``raise_exception`` and ``strftime_now``), which is how the
    templates are published to be rendered. Nothing is added to the conversation: a template that does
    not render tools or tool calls gets them through ``backends.tape.conversation``'s documented fallbacks,
    never through a renderer's own substitute."""

    def __init__(self, source: str, *, bos_token: str, eos_token: str) -> None:
        env = ImmutableSandboxedEnvironment(
            loader=jinja2.BaseLoader(), trim_blocks=True, lstrip_blocks=True,
            extensions=[_GenerationTags, jinja2.ext.loopcontrols],
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self._template = env.from_string(source)
        self._tokens = {"bos_token": bos_token, "eos_token": eos_token}

    def __call__(self, messages: list[dict[str, Any]], tools: list[Any] | None, *, generation: bool,
                 **extra: Any) -> str:
        return self._template.render(messages=messages, tools=tools, add_generation_prompt=generation,
                                     **self._tokens, **extra)


class JinjaTemplate:
    """A chat template source rendered by ``JinjaRenderer`` with its ``render_defaults``: the ``ChatTemplate``
    an engine without a renderer of its own serves with (OpenVINO), and what ``describe`` reads a template by
    before any load. Whether it renders tools is probed (``renders_tools``)."""

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "") -> None:
        self._render = JinjaRenderer(source, bos_token=bos_token, eos_token=eos_token)
        self._defaults = render_defaults(source)
        self.source = source
        self.digest = "sha256:" + hashlib.sha256(source.encode("utf-8")).hexdigest()
        self.prompt_format = "chatml" if "<|im_start|>" in source else "jinja"
        self.supports_tools = renders_tools(self)

    def render(self, messages: list[dict[str, Any]], tools: list[Any] | None, *, generation: bool, **extra: Any) -> str:
        return self._render(messages, tools, generation=generation, **{**self._defaults, **extra})


#: a tool list a template renders if it supports tools
_PROBE_TOOLS = [{"type": "function", "function": {"name": "probe", "description": "", "parameters": {}}}]


def renders_tools(template: ChatTemplate) -> bool:
    """Whether a tool list changes the rendered prompt (a template that ignores tools would drop them); with a
    user turn, as some templates put the tools just before the last one."""
    turns = [{"role": "system", "content": "x"}, {"role": "user", "content": "y"}]
    try:
        return template.render(turns, _PROBE_TOOLS, generation=False) != template.render(turns, None, generation=False)
    except Exception:  # noqa: BLE001 - a template that fails here fails loudly when really rendered
        return False


def render_defaults(source: str) -> dict[str, Any]:
    """Variables a template is rendered with unless a caller sets them.

    Llama 3.x templates put the tool list in the first user turn by default (``tools_in_user_message``),
    and refuse a prompt that has none; the stable prefix is the system turn and its tools, so they are put
    in the system turn (the placement Meta's format documents as the other choice).
    """
    return {"tools_in_user_message": False} if "tools_in_user_message" in source else {}


def requested_template(requested: str) -> tuple[str, str] | None:
    """The template ``Config.chat_template`` names, as (source, where it came from); None when it names none.

    InvalidArgument for a name that is not built in and not a readable UTF-8 file.
    """
    if not requested:
        return None
    source = builtin(requested.lower())
    if source is not None:
        return source, f"built-in {requested.lower()}"
    path = Path(requested).expanduser()
    try:
        if path.stat().st_size > _MAX_TEMPLATE_BYTES:
            raise InvalidArgument(f"chat template {requested} is larger than {_MAX_TEMPLATE_BYTES} bytes",
                                  chat_template=requested)
        source = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidArgument(
            f"chat template {requested!r} is neither a built-in ({', '.join(builtin_names())}) nor a readable "
            f"UTF-8 file: {exc}",
            chat_template=requested,
        ) from None
    if not source.strip():
        raise InvalidArgument(f"chat template file {requested} is empty", chat_template=requested)
    return source, f"file {path.resolve()}"


def choose_template(
    requested: tuple[str, str] | None, own: str, single_token: Callable[[str], bool] | None = None
) -> tuple[str, str]:
    """The template source to serve with, and where it came from (for ``status``): the requested one
    (``requested_template``), else the model's own ("" when its file has none), else the built-in one whose
    turn tokens the vocabulary has (``VOCABULARY_DEFAULTS``; ``single_token`` says whether a text is one
    token), else ChatML."""
    if requested is not None:
        return requested
    if own:
        return own, "the model's own"
    for token, name in VOCABULARY_DEFAULTS:
        source = builtin(name)
        if single_token is not None and source is not None and single_token(token):
            return source, f"built-in {name} (the model's file has none; its vocabulary has {token})"
    return CHATML, "ChatML (the model's file has none)"


def check_renders(template: ChatTemplate, origin: str) -> None:
    """A chosen template must render a user turn (a syntax error or a missing variable is said at the load, not
    at the first request); InvalidArgument otherwise."""
    try:
        template.render([{"role": "user", "content": "hi"}], None, generation=True)
    except Exception as exc:  # noqa: BLE001 - whatever the template engine raises is the finding
        raise InvalidArgument(f"the chat template ({origin}) does not render a user turn: {type(exc).__name__}: {exc}",
                              chat_template=origin) from None
