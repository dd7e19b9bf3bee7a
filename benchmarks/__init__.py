"""``make bench``: speed and memory of the daemon next to the engines' own tools.

Not part of the library: nothing in ``contract``, ``runtime``, ``modeld`` or
``backends`` imports from here. ``python -m benchmarks`` runs the sections of
``benchmarks.run``; the ``bench`` extra installs what they need beyond the engines.

* ``run``         – the suite ``make bench`` prints (daemon over ZeroMQ, peer server, capacity, embeddings);
* ``common``      – filler texts of a known token length, snapshot vs re-prefill timing;
* ``llama``       – the llama.cpp backend in process, next to llama-cpp-python's own decode loop;
* ``openvino``    – the OpenVINO backend in process, next to openvino-genai's prefix-cached pipeline;
* ``embed``       – embeddings/s of both side-slot engines next to sentence-transformers
                    (and the sentence-transformers reference vectors the embedding tests compare against);
* ``ttft``        – time to first token against the new turn's size, cold and warm, both engines and the peer;
* ``plot``        – the PNG of that section (matplotlib, Agg), drawn from the figures the run measured;
* ``peer_server`` – llama-cpp-python's OpenAI server, launched with the daemon's ``Llama`` settings.
"""
