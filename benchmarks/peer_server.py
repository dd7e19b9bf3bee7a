"""Run llama-cpp-python's own OpenAI server (the peer ``make bench`` compares against).

On CPUs with AMX, llama.cpp's extra weight-buffer kernels crash on the bundled
model (see ``backends.llama.native``). The server cannot switch them off, so this
launcher gives it the same ``Llama`` class the daemon uses; nothing else of the
server changes. Usage: ``python -m benchmarks.peer_server --model … --n_ctx … --port …``
(the ``bench`` extra installs the server's dependencies).
"""

from __future__ import annotations

import runpy
import sys

import llama_cpp

from backends.llama.native import ParamsLlama, extra_bufts_default


class PeerLlama(ParamsLlama):
    _pending_extra_bufts = extra_bufts_default()


if __name__ == "__main__":
    llama_cpp.Llama = PeerLlama  # type: ignore[misc]
    sys.argv[0] = "llama_cpp.server"
    runpy.run_module("llama_cpp.server", run_name="__main__")
