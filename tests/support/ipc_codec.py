"""reduce_tensor's arguments (torch.multiprocessing.reductions: what a CUDA IPC handle is made of)
as JSON and back, so a test can hand a tensor to another process without pickle; and the hash of a
tensor's bytes both ends compare.

Types become {"type": "module:qualname"} (resolved only under torch), dtypes {"dtype": name},
sizes {"size": [...]}, bytes {"b64": ...}, tuples lists; ints, floats, bools, strings and None
stay as they are.
"""

from __future__ import annotations

import base64
import hashlib
import importlib
from typing import Any

import torch

_TRUSTED_ROOT = "torch"  # only torch's own classes are resolved from a name


def encode(value: Any) -> Any:
    if isinstance(value, type):
        return {"type": f"{value.__module__}:{value.__qualname__}"}
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, torch.Size):
        return {"size": list(value)}
    if isinstance(value, (bytes, bytearray)):
        return {"b64": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, (tuple, list)):
        return [encode(item) for item in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"ipc_codec cannot encode {type(value).__name__}")


def decode(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(decode(item) for item in value)
    if not isinstance(value, dict):
        return value
    if "type" in value:
        module, qualname = value["type"].split(":")
        if module != _TRUSTED_ROOT and not module.startswith(_TRUSTED_ROOT + "."):
            raise ValueError(f"ipc_codec resolves torch classes only, got {value['type']}")
        found: Any = importlib.import_module(module)
        for part in qualname.split("."):
            found = getattr(found, part)
        return found
    if "dtype" in value:
        return getattr(torch, value["dtype"])
    if "size" in value:
        return torch.Size(value["size"])
    return base64.b64decode(value["b64"])


def tensor_sha256(tensor: torch.Tensor) -> str:
    """SHA-256 of a tensor's bytes in row-major order, the same on both ends of a CUDA IPC handle."""
    return hashlib.sha256(tensor.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()
