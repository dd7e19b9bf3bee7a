"""Test fixtures built from the bundled model.

``tool_gguf()`` gives a copy of the bundled SmolLM2 GGUF whose
``tokenizer.chat_template`` is a tool-capable ChatML template (Qwen2.5/Hermes
style: tools rendered into the system turn, ``<tool_call>`` for calls,
``<tool_response>`` for results, and ``enable_thinking=False`` closing an empty
``<think>`` block). The weights are unchanged, so only the template differs.
It is written once with the ``gguf`` package's metadata rewrite (~3 s) into the
model cache and reused while the bundled file and the template are unchanged.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from backends.bundled import bundled_gguf_path, model_cache_dir

TOOL_CHATML_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
"""

#: a tool definition in the OpenAI shape the template renders verbatim
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "the city name"}},
            "required": ["city"],
        },
    },
}


def fixture_dir() -> Path:
    return model_cache_dir() / "fixtures"


#: a reasoning template in the shape of Qwen3's and DeepSeek-R1's: the generation prompt opens
#: ``<think>`` unless thinking is switched off, and an assistant turn's reasoning renders back
#: before its text
THINK_CHATML_TEMPLATE = r"""{%- for message in messages %}
    {%- if message.role == "assistant" %}
        {{- '<|im_start|>assistant\n' }}
        {%- if message.reasoning_content %}
            {{- '<think>\n' + message.reasoning_content + '\n</think>\n\n' }}
        {%- endif %}
        {{- (message.content or '') + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- else %}
        {{- '<think>\n' }}
    {%- endif %}
{%- endif %}
"""


def tool_gguf(cache_dir: Path | None = None, src: Path | None = None) -> Path:
    """Path of the bundled GGUF (or ``src``, e.g. the context-extended one) with ``TOOL_CHATML_TEMPLATE``; built on
    first use."""
    return templated_gguf(TOOL_CHATML_TEMPLATE, "tools" if src is None else f"tools-{src.stem}", cache_dir, src)


def think_gguf(cache_dir: Path | None = None) -> Path:
    """Path of the bundled GGUF with ``THINK_CHATML_TEMPLATE``; built on first use."""
    return templated_gguf(THINK_CHATML_TEMPLATE, "think", cache_dir)


def untemplated_gguf(cache_dir: Path | None = None) -> Path:
    """Path of the bundled GGUF without any chat template (as a base model's file comes); built on first use."""
    return templated_gguf("", "notemplate", cache_dir)


def templated_gguf(template: str, name: str, cache_dir: Path | None = None, src: Path | None = None) -> Path:
    """Path of the bundled GGUF (or ``src``) with ``template`` as its chat template ("": none at all); built on
    first use."""
    src = src or bundled_gguf_path()
    dest = (cache_dir or fixture_dir()) / f"smollm2-135m-{name}-{_key(src, template)}.gguf"
    if dest.is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    # per process: the suite's workers may build the same fixture at once
    template_file = dest.parent / f".{dest.name}.{os.getpid()}.jinja"
    template_file.write_text(template, encoding="utf-8")
    try:
        return _written(dest, "gguf_new_metadata", lambda tmp: [
            "-m", "gguf.scripts.gguf_new_metadata", "--force",
            *(["--chat-template-file", str(template_file)] if template
              else ["--remove-metadata", "tokenizer.chat_template"]),
            str(src), str(tmp)])
    finally:
        template_file.unlink(missing_ok=True)


def truncated_gguf(src: Path, dest: Path, keep_fraction: float = 0.5) -> Path:
    """A copy of ``src`` cut at ``keep_fraction`` of its size (header intact, weights missing)."""
    size = src.stat().st_size
    with src.open("rb") as fin, dest.open("wb") as fout:
        fout.write(fin.read(int(size * keep_fraction)))
    return dest


#: control tokens of Mistral's Tekken vocabulary (Ministral 3 / Devstral, ``tekken.json``) that the
#: ``mistral_args`` template writes, each one token of type CONTROL there
MISTRAL_CONTROL_TOKENS = ("[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
                          "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[ARGS]",
                          "[THINK]", "[/THINK]")


def control_marker_gguf(cache_dir: Path | None = None) -> Path:
    """The bundled GGUF with a Mistral vocabulary's markers as control tokens and the ``mistral_args`` template.

    No bundled model has a tool-call marker as a control token, as Mistral's, Llama 3's and gpt-oss's
    vocabularies do. The bundled SmolLM2 vocabulary has 14 control tokens the model never uses in chat
    (ids 3-16: ``<repo_name>``, ``<filename>``, the ``<jupyter_…>`` ones); this copy gives the first twelve
    the texts of ``MISTRAL_CONTROL_TOKENS`` (type CONTROL kept, weights unchanged) and carries the
    ``mistral_args`` template, so ``[TOOL_CALLS]`` and ``[ARGS]`` are single control tokens as in Devstral's
    file. Written once into the model cache with the ``gguf`` package (~3 s).
    """
    from backends.tape.templates import TEMPLATE_DIR

    template = (TEMPLATE_DIR / "mistral_args.jinja").read_text(encoding="utf-8")
    src = bundled_gguf_path()
    dest = (cache_dir or fixture_dir()) / f"smollm2-135m-mistral-vocab-{_key(src, template, MISTRAL_CONTROL_TOKENS)}.gguf"
    return _written(dest, "renaming the control tokens",
                    lambda tmp: ["-c", _RENAME_TOKENS, str(src), str(tmp), template, *MISTRAL_CONTROL_TOKENS])


def _key(src: Path, *recipe: object) -> str:
    """What a fixture built from ``src`` is named by: the recipe, and the source's path, size and mtime."""
    st = src.stat()
    parts = (*recipe, src, st.st_size, st.st_mtime_ns)
    return hashlib.sha256("\0".join(str(p) for p in parts).encode()).hexdigest()[:16]


def _written(dest: Path, what: str, argv: Callable[[Path], list[str]]) -> Path:
    """``dest``, written by ``python *argv(tmp)`` unless it is there: into ``tmp``, a file of this process's own,
    renamed into place whole (the suite's workers may build the same fixture at once; the last rename wins)."""
    if dest.is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{dest.name}.{os.getpid()}.tmp"
    try:
        proc = subprocess.run([sys.executable, *argv(tmp)], capture_output=True, text=True, timeout=300, check=False)
        if proc.returncode != 0 or not tmp.is_file():
            raise RuntimeError(f"{what} failed ({proc.returncode}): {proc.stderr[-2000:]}")
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest


def shallow_gguf(blocks: int = 2, cache_dir: Path | None = None) -> Path:
    """The bundled GGUF with only its first ``blocks`` transformer blocks (of 30): the same vocabulary, special
    tokens, chat template, embeddings and output head, so a prompt tokenizes and renders exactly as on the bundled
    model and its KV is reused by the same code; a token costs about a tenth of the compute (a 54-token prefill
    13 ms against 180 on 2 cores). Its replies are not the bundled model's (fewer blocks, a worse model), but they
    are greedy and deterministic, which is what a test comparing a warm daemon with a fresh one needs. Written once
    into the model cache with the ``gguf`` package (~3 s); OpenVINO converts it on its first load as any GGUF.
    """
    src = bundled_gguf_path()
    dest = (cache_dir or fixture_dir()) / f"smollm2-135m-{blocks}blocks-{_key(src, 'shallow', blocks)}.gguf"
    return _written(dest, f"cutting the model to {blocks} blocks",
                    lambda tmp: ["-c", _KEEP_BLOCKS, str(src), str(tmp), str(blocks)])


#: argv: source, destination, how many blocks to keep (the tensors of the others are left out, the block count
#: says the new number)
_KEEP_BLOCKS = r"""
import re
import sys
from types import SimpleNamespace
import gguf
from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata

src, dest, blocks = sys.argv[1], sys.argv[2], int(sys.argv[3])
reader = gguf.GGUFReader(src)
arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
count = gguf.Keys.LLM.BLOCK_COUNT.format(arch=arch)
if reader.fields[count].contents() < blocks:
    sys.exit(f"{src} has fewer than {blocks} blocks")
kept = [t for t in reader.tensors if not (m := re.match(r"blk\.(\d+)\.", t.name)) or int(m.group(1)) < blocks]
writer = gguf.GGUFWriter(dest, arch=arch, endianess=reader.endianess)
view = SimpleNamespace(fields=reader.fields, tensors=kept, endianess=reader.endianess)
copy_with_new_metadata(view, writer, {count: MetadataDetails(gguf.GGUFValueType.UINT32, blocks)}, [])
"""


#: argv: source, destination, chat template, then the new texts of control tokens 3, 4, …
_RENAME_TOKENS = r"""
import sys
import gguf
from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata

src, dest, template, names = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
reader = gguf.GGUFReader(src)
field = reader.fields[gguf.Keys.Tokenizer.LIST]
tokens = list(field.contents())
kinds = reader.fields[gguf.Keys.Tokenizer.TOKEN_TYPE].contents()
first = 3
for i, name in enumerate(names, first):
    if kinds[i] != gguf.TokenType.CONTROL or name in tokens:
        sys.exit(f"token {i} ({tokens[i]!r}) is not a spare control token, or {name!r} is taken")
    tokens[i] = name
arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
writer = gguf.GGUFWriter(dest, arch=arch, endianess=reader.endianess)
new = {
    gguf.Keys.Tokenizer.LIST: MetadataDetails(gguf.GGUFValueType.ARRAY, tokens, sub_type=gguf.GGUFValueType.STRING),
    gguf.Keys.Tokenizer.CHAT_TEMPLATE: MetadataDetails(gguf.GGUFValueType.STRING, template),
}
copy_with_new_metadata(reader, writer, new, [])
"""
