"""A vision test model: the bundled SmolLM2 with a tiny image encoder (a multimodal projector GGUF) of its own.

No vision model ships in a package these machines can reach, so one is built: a Gemma 3-shaped vision stage (a
SigLIP encoder, 128-pixel images in 16-pixel patches, pooled 4x4 to ``IMAGE_TOKENS`` embeddings: llama.cpp fixes
Gemma 3's pooling at 4 patches a side) projected to the bundled model's 576 dimensions, made with ``transformers``
from a small config, random weights, a fixed seed, and converted by the converter that ships in llama.cpp's source
(``convert_hf_to_gguf.py --mmproj``, taken from the installed llama-cpp-python's sdist as ``modeld prepare`` takes
it). llama.cpp's multimodal library (mtmd) pairs it with any text model of that width; Gemma 3's projector wraps an
image in text markers only (``<start_of_image>``), which SmolLM2's vocabulary tokenizes like any text. Its answers
mean nothing; what the tests check is the pipeline.

The projection is drawn large (``PROJECTION_GAIN``) so an image's embeddings outweigh the text around them and
two different images lead the greedy continuation apart. Built once (~15 s, torch and transformers from
``make setup``'s convert extra) into the model cache, keyed by everything that shapes it.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from backends.bundled import model_cache_dir
from backends.embed_prepare import converter_dir

__all__ = ["IMAGE_TOKENS", "vision_projector"]

#: embeddings per image (Gemma 3's pooled grid: 8x8 patches averaged to 2x2)
IMAGE_TOKENS = 4
#: how much the random projection is scaled, so images steer the answer
PROJECTION_GAIN = 30.0
SEED = 0
#: bumped when the recipe below changes in a way the shapes above do not show
RECIPE = 2
_TEXT = {"model_type": "gemma3_text", "hidden_size": 576, "intermediate_size": 64, "num_hidden_layers": 1,
         "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "vocab_size": 512}
_VISION = {"model_type": "siglip_vision_model", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
           "num_attention_heads": 2, "image_size": 128, "patch_size": 16, "num_channels": 3}
_PREPROCESSOR = {"image_processor_type": "Gemma3ImageProcessor", "size": {"height": 128, "width": 128},
                 "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}


def _key() -> str:
    shape = {"text": _TEXT, "vision": _VISION, "pre": _PREPROCESSOR, "tokens": IMAGE_TOKENS, "gain": PROJECTION_GAIN,
             "seed": SEED, "recipe": RECIPE, "converter": importlib.metadata.version("llama_cpp_python")}
    return hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:16]


def _hf_model(out: Path) -> None:
    """The tiny Gemma 3-shaped model in the Hub's layout (``vision_tower.vision_model.…``), as the converter
    reads it; only its vision stage is converted."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    torch.manual_seed(SEED)
    cfg = Gemma3Config(text_config=_TEXT, vision_config=_VISION, mm_tokens_per_image=IMAGE_TOKENS,
                       image_token_index=500, boi_token_index=501, eoi_token_index=502)
    model = Gemma3ForConditionalGeneration(cfg)
    with torch.no_grad():  # (transformers starts the projection at zeros: a checkpoint would fill it)
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, 0.02 * PROJECTION_GAIN)
    model.save_pretrained(out)
    weights = out / "model.safetensors"
    tensors = {}
    for name, t in load_file(weights).items():
        if name.startswith("vision_tower.") and not name.startswith("vision_tower.vision_model."):
            name = "vision_tower.vision_model." + name[len("vision_tower."):]
        tensors[name] = t.contiguous()
    save_file(tensors, weights, metadata={"format": "pt"})
    (out / "preprocessor_config.json").write_text(json.dumps(_PREPROCESSOR))


def vision_projector() -> Path:
    """The projector GGUF in the model cache (built once; see the module docstring)."""
    dest = model_cache_dir() / "vision" / f"tiny-gemma3-mmproj-{_key()}.gguf"
    if dest.is_file():
        return dest
    convert = converter_dir(print)
    work = dest.parent / f".build-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        _hf_model(work / "hf")
        tmp = work / dest.name
        subprocess.run([sys.executable, str(convert / "convert_hf_to_gguf.py"), str(work / "hf"), "--mmproj",
                        "--outtype", "f16", "--outfile", str(tmp)], check=True, capture_output=True, text=True)
        os.replace(tmp, dest)
    except subprocess.CalledProcessError as exc:
        raise RuntimeError(f"converting the vision test model failed:\n{exc.stderr[-4000:]}") from exc
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return dest


if __name__ == "__main__":
    print(vision_projector())
