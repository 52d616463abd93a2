"""The check every process makes of a model path before loading from it or starting anything on
it (the dispatcher before it joins Ray, the launcher and the trainer before any worker starts,
setup_model before each load). Plain file checks, no torch: a dispatcher or a launcher that only
validates its inputs stays a light process."""

from __future__ import annotations

from pathlib import Path


class ModelPathError(ValueError):
    """A model path that is not a loadable local Hugging Face folder; the message names the path."""


def check_model_dir(model_path: str | Path, *, weights: bool = True) -> Path:
    """The model folder, checked for what from_pretrained needs here, or ModelPathError.
    weights=False checks only that the folder exists (all a tokenizer needs).

    No hub can be reached, so a path that does not exist would otherwise be taken for a repo id
    and fail deep inside transformers or vLLM ("Repo id must be in the form ..."); a folder
    without config.json or safetensors weights fails later still, in a worker. One stat per
    file: cheap enough to run before every load.
    """
    path = Path(model_path)
    if not path.exists():
        raise ModelPathError(f"model path {str(model_path)!r} does not exist (a local Hugging Face model folder "
                             f"is expected: config.json, *.safetensors weights, tokenizer files)")
    if not path.is_dir():
        raise ModelPathError(f"model path {str(model_path)!r} is a file; a Hugging Face model folder is expected")
    if not weights:
        return path
    if not (path / "config.json").is_file():
        raise ModelPathError(f"model path {str(model_path)!r} has no config.json, so it is not a Hugging Face "
                             f"model folder (save one with save_pretrained, or point at the folder holding it)")
    if not any(path.glob("*.safetensors")):
        raise ModelPathError(f"model path {str(model_path)!r} has no *.safetensors weights (weights load from "
                             f"safetensors only; convert .bin checkpoints with save_pretrained(safe_serialization=True))")
    return path
