"""Concept readouts (``modeld serve --readouts FILE``): what the residual stream says about named concepts.

A readout manifest names concepts and, for each layer it reads, one direction per concept. A prefill that asks
for readouts (``SuffixInput.readouts``) gets, for every suffix token, the dot product of the residual stream after
each listed layer (the layer's output: its input plus attention plus MLP, before the next layer's norm) with each
concept's direction: ``[n_layers][n_concepts]`` numbers a token, layers in ascending order, concepts in the file's
order. The engines read the same tensor: llama.cpp's ``l_out-N`` through its graph callback, OpenVINO's residual
``Add`` after layer N's MLP as an extra output of the compiled graph.

The file is a safetensors file:

* one float32 tensor per layer read, named ``layer.N`` (N from 0), of shape ``[n_concepts, hidden_size]``;
* its metadata (``__metadata__``) holds ``concepts``: a JSON list of the concepts' names, one per row.

A file that does not read so is refused when the daemon starts; one whose hidden size or layers the model does not
have is refused when the model loads (``ModelLoadFailed`` naming both).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from contract.errors import InvalidArgument, ModelLoadFailed
from contract.types import ReadoutInfo

__all__ = ["Readouts", "write_readouts"]

_LAYER = re.compile(r"layer\.(\d+)")


@dataclass(frozen=True)
class Readouts:
    """A loaded readout manifest."""

    path: str
    concepts: list[str]
    #: the layers read, ascending
    layers: list[int]
    hidden_size: int
    digest: str
    #: layer -> its directions as a [hidden_size, n_concepts] float32 matrix (a row of the stream times it is the
    #: readout)
    matrices: dict[int, np.ndarray] = field(repr=False)

    @classmethod
    def load(cls, path: str | Path) -> Readouts:
        """The manifest at ``path``; InvalidArgument saying what is wrong with a file that is not one."""
        from safetensors import SafetensorError, safe_open

        p = Path(path)
        try:
            data = p.read_bytes()
            with safe_open(str(p), framework="numpy") as f:
                meta = f.metadata() or {}
                tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 - not a dict
        except (OSError, SafetensorError) as exc:
            raise InvalidArgument(f"readout manifest {p}: {exc}", path=str(p)) from exc
        try:
            concepts = json.loads(meta.get("concepts", ""))
        except json.JSONDecodeError:
            concepts = None
        if not isinstance(concepts, list) or not concepts or not all(isinstance(c, str) for c in concepts):
            raise InvalidArgument(f"readout manifest {p}: its metadata needs 'concepts', a JSON list of names",
                                  path=str(p))
        matrices: dict[int, np.ndarray] = {}
        hidden = 0
        for name, t in tensors.items():
            m = _LAYER.fullmatch(name)
            if m is None or t.ndim != 2 or t.shape[0] != len(concepts) or t.dtype != np.float32:
                raise InvalidArgument(
                    f"readout manifest {p}: tensor {name!r} {t.dtype}{list(t.shape)} is not layer.N, float32 "
                    f"[{len(concepts)} concepts, hidden_size]", path=str(p), tensor=name)
            if hidden and t.shape[1] != hidden:
                raise InvalidArgument(f"readout manifest {p}: its layers disagree on the hidden size", path=str(p))
            hidden = int(t.shape[1])
            matrices[int(m.group(1))] = np.ascontiguousarray(t.T)
        if not matrices:
            raise InvalidArgument(f"readout manifest {p} holds no layer.N tensor", path=str(p))
        return cls(path=str(p), concepts=list(concepts), layers=sorted(matrices), hidden_size=hidden,
                   digest="sha256:" + hashlib.sha256(data).hexdigest(), matrices=matrices)

    def check(self, hidden_size: int | None, n_layer: int | None) -> None:
        """ModelLoadFailed when the model's residual stream is not what the manifest reads (None: not known)."""
        if hidden_size is not None and hidden_size != self.hidden_size:
            raise ModelLoadFailed(
                f"the readout manifest {self.path} reads a hidden size of {self.hidden_size}; the model's is "
                f"{hidden_size}", manifest_hidden_size=self.hidden_size, model_hidden_size=hidden_size)
        if n_layer is not None and self.layers[-1] >= n_layer:
            raise ModelLoadFailed(
                f"the readout manifest {self.path} reads layer {self.layers[-1]}; the model has {n_layer} "
                f"(0-{n_layer - 1})", manifest_layer=self.layers[-1], model_layers=n_layer)

    def info(self) -> ReadoutInfo:
        return ReadoutInfo(concepts=self.concepts, layers=self.layers, hidden_size=self.hidden_size,
                           digest=self.digest)

    def project(self, streams: dict[int, np.ndarray]) -> np.ndarray:
        """``[n_tokens, n_layers, n_concepts]`` from each layer's ``[n_tokens, hidden_size]`` residual rows."""
        return np.stack([np.asarray(streams[layer], np.float32) @ self.matrices[layer] for layer in self.layers],
                        axis=1)


def write_readouts(path: str | Path, concepts: list[str], layers: dict[int, np.ndarray]) -> Path:
    """Write a manifest: ``layers`` maps a layer index to its ``[n_concepts, hidden_size]`` directions."""
    from safetensors.numpy import save_file

    save_file({f"layer.{k}": np.ascontiguousarray(v, np.float32) for k, v in layers.items()}, str(path),
              metadata={"concepts": json.dumps(concepts)})
    return Path(path)
