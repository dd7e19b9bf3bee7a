"""What the tests and the benchmarks both drive: a real ``modeld serve`` process (``harness.daemon``), the
tool-capable model fixture built from the bundled GGUF (``harness.fixtures``), the vision test model (a tiny
image encoder paired with the bundled GGUF, ``harness.vision``) and shared prompts (``harness.prompts``).
Neither owns it, so neither imports the other; it is not part of the installed package. ``harness.vllm_server``
runs a local vLLM server on the bundled model in a venv of its own (``make vllm``)."""
