"""``--backend auto``: which engine serves the requested model fastest on this machine, and why.

The rule is backed by ``make bench`` on the bundled model (2 cores, x86-64 with
AVX-512, ~2k-token prefix, 118-token turn): OpenVINO's cold TTFT was 2.1 s
against llama.cpp's 9.7 s, warm 0.19 s against 0.69 s, decode ~1.1x. On an
AVX2-only CPU (f32 there) OpenVINO still prefills 2-2.5x faster, cold 4.8 s
against 10.6 s, while llama.cpp decodes faster (~100 against ~56 tokens/s before
speculation); an agent's turns are prefill-bound, so the rule stands. So on an
x86-64 CPU, a model OpenVINO can serve (an IR directory, or a GGUF its reader
converts: ``backends.openvino.prepare.check_convertible``) goes to OpenVINO.
llama.cpp takes everything else: GPU layers asked for (the OpenVINO backend here
serves the CPU), llama.cpp's flash attention or a quantized KV cache asked for,
another CPU architecture (not measured), a GGUF OpenVINO cannot convert, or
OpenVINO not installed. An explicit ``--backend`` always wins.

The rule is a pure function of ``EngineFacts`` so it is tested on injected
machines; ``modeld.bootstrap.engine_facts`` gathers the facts of this one.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["EngineFacts", "choose_backend"]

X86_64 = frozenset({"x86_64", "amd64", "x64"})

#: where the choice's evidence is (figures measured on the project's machines, not on this one)
EVIDENCE = "prefill-bound agent turns ran faster on OpenVINO in the project's x86-64 runs of make bench (README, Backends)"


@dataclass(frozen=True)
class EngineFacts:
    """What the choice depends on."""

    #: ``platform.machine()``
    machine: str
    has_openvino: bool
    has_llama: bool
    #: "gguf", "ir" (an OpenVINO IR directory) or "other" (missing, unreadable, something else)
    model_kind: str
    #: for a GGUF: "" when OpenVINO can convert it, else why not
    openvino_refusal: str = ""
    num_gpu_layers: int = 0
    #: llama.cpp-only settings asked for (e.g. "--kv-cache-type q8_0"); "" for none
    llama_settings: str = ""


def choose_backend(f: EngineFacts) -> tuple[str, str]:
    """The backend name ("llama" or "openvino") and a one-line reason."""
    if f.model_kind == "ir":
        if f.has_openvino:
            return "openvino", "the model is an OpenVINO IR directory"
        return "llama", "the model is an OpenVINO IR directory but OpenVINO is not installed (the load will say so)"
    if not f.has_openvino:
        return "llama", "OpenVINO is not installed"
    if not f.has_llama:
        return "openvino", "llama-cpp-python is not installed"
    if f.num_gpu_layers > 0:
        return "llama", f"{f.num_gpu_layers} GPU layers were asked for; the OpenVINO backend serves the CPU"
    if f.llama_settings:
        return "llama", f"{f.llama_settings} asked for: llama.cpp settings the OpenVINO backend does not offer"
    if f.machine.lower() not in X86_64:
        return "llama", f"CPU architecture {f.machine!r}: OpenVINO is measured faster on x86-64 only"
    if f.model_kind != "gguf":
        return "llama", "the model is not a readable GGUF; llama.cpp reports the load error"
    if f.openvino_refusal:
        return "llama", f"OpenVINO cannot convert this GGUF ({f.openvino_refusal})"
    return "openvino", f"x86-64 CPU and a GGUF OpenVINO converts; {EVIDENCE}"
