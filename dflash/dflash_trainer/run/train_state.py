"""A checkpoint's training state as data, not code: its tensors (fp32 master weights, AdamW moments, RNG
states) in training_state.safetensors, everything else (step, data position, schedule, config, losses, the
Python and numpy RNG) in training_state.json, which names each tensor by its key in the safetensors file.
Loading either runs no code, as unpickling a shared training_state.pt could.

Checkpoints written before this format hold training_state.pt: it loads with torch's weights-only
unpickler, which allows tensors and plain values, plus numpy's arrays (the numpy RNG state an older save
pickled) and nothing else. A file that needs any other Python object is refused (UnsafeCheckpoint, exit 2)
without running it.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import torch

STATE_JSON = "training_state.json"
STATE_TENSORS = "training_state.safetensors"
LEGACY_STATE = "training_state.pt"  # a pickle: read only through torch's weights-only unpickler

# JSON has no tuples, no non-string keys and no tensors: a one-key object beginning with "$" says which.
_TENSOR, _TUPLE, _DICT, _NDARRAY = "$tensor", "$tuple", "$dict", "$ndarray"


class UnsafeCheckpoint(Exception):
    """An old training_state.pt that needs Python objects beyond tensors and plain values to load: loading it
    would run whatever code it carries. Bad input (exit 2): the message names the file and what to do."""


def _encode(value: Any, tensors: dict[str, torch.Tensor], where: str) -> Any:
    if isinstance(value, torch.Tensor):
        key = f"t{len(tensors)}"
        tensors[key] = value.detach().cpu().contiguous()
        return {_TENSOR: key}
    if isinstance(value, bool | int | float | str) or value is None:
        return value
    if isinstance(value, list):
        return [_encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return {_TUPLE: [_encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, dict):
        if all(isinstance(k, str) and not k.startswith("$") for k in value):
            return {k: _encode(v, tensors, f"{where}.{k}") for k, v in value.items()}
        return {_DICT: [[_encode(k, tensors, where), _encode(v, tensors, f"{where}[{k!r}]")]
                        for k, v in value.items()]}
    if type(value).__module__ == "numpy" and hasattr(value, "tolist") and hasattr(value, "dtype"):
        return {_NDARRAY: value.tolist(), "dtype": value.dtype.str}  # the numpy RNG's 624 words
    raise TypeError(f"training state {where}: a {type(value).__name__} is not data a checkpoint can hold "
                    "(tensors, numbers, strings, lists, tuples, dicts, numpy arrays)")


def _decode(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, list):
        return [_decode(v, tensors) for v in value]
    if not isinstance(value, dict):
        return value
    if _TENSOR in value:
        return tensors[value[_TENSOR]]
    if _TUPLE in value:
        return tuple(_decode(v, tensors) for v in value[_TUPLE])
    if _DICT in value:
        return {_hashable(_decode(k, tensors)): _decode(v, tensors) for k, v in value[_DICT]}
    if _NDARRAY in value:
        import numpy as np

        return np.asarray(value[_NDARRAY], dtype=np.dtype(value["dtype"]))
    return {k: _decode(v, tensors) for k, v in value.items()}


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, list | tuple) else key


def _unshared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors that share memory (a view of another, a parameter saved twice): copies."""
    seen: set[int] = set()
    out = {}
    for key, tensor in tensors.items():
        pointer = tensor.untyped_storage().data_ptr() if tensor.numel() else None
        out[key] = tensor.clone() if pointer is not None and pointer in seen else tensor
        if pointer is not None:
            seen.add(pointer)
    return out


def write(state: dict[str, Any], directory: Path) -> None:
    """state as directory/training_state.safetensors + training_state.json (both fsynced by the caller's
    publish)."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    skeleton = _encode(state, tensors, "state")
    save_file(_unshared(tensors), str(directory / STATE_TENSORS), metadata={"format": "dflash-training-state"})
    (directory / STATE_JSON).write_text(json.dumps({"format": 1, "state": skeleton}))


def read(directory: Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """The state write() wrote, or an old checkpoint's training_state.pt through the weights-only unpickler."""
    directory = Path(directory)
    if not (directory / STATE_JSON).is_file() and (directory / LEGACY_STATE).is_file():
        return read_legacy(directory / LEGACY_STATE, map_location)
    from safetensors.torch import load_file

    skeleton = json.loads((directory / STATE_JSON).read_text())["state"]
    tensors = load_file(str(directory / STATE_TENSORS), device=str(map_location))
    return _decode(skeleton, tensors)


def present(directory: Path) -> bool:
    """directory holds a training state: this format's, or an old training_state.pt."""
    return (directory / STATE_JSON).is_file() or (directory / LEGACY_STATE).is_file()


def _numpy_globals() -> list:
    """What a pickled numpy array needs (the numpy RNG state older checkpoints saved): its class, its dtype
    and numpy's array rebuilder, which builds an array from bytes and runs nothing else."""
    try:
        import numpy as np
    except ImportError:
        return []
    try:
        from numpy._core.multiarray import _reconstruct  # numpy 2
    except ImportError:
        from numpy.core.multiarray import _reconstruct
    return [np.ndarray, np.dtype, _reconstruct, type(np.dtype(np.uint32))]


def read_legacy(path: Path, map_location: str | torch.device = "cpu", mmap: bool = False) -> dict[str, Any]:
    """training_state.pt through torch's weights-only unpickler (tensors, plain values, numpy arrays);
    UnsafeCheckpoint when it needs anything else: nothing in it has run."""
    allowed = _numpy_globals()
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError:
        unsafe = _unsafe_globals(path, allowed)
        if not unsafe:
            raise  # the bytes themselves are bad: checkpoint.damaged says so
        raise UnsafeCheckpoint(refusal(path, unsafe)) from None


def _unsafe_globals(path: Path, allowed: list) -> list[str]:
    """The Python objects the pickle names beyond the allowed ones (read from its opcodes, never run)."""
    names = {f"{g.__module__}.{g.__qualname__}" for g in allowed}
    try:
        found = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except (RuntimeError, ValueError, pickle.UnpicklingError, EOFError, OSError):
        return []
    return [g for g in found if g not in names]


def refusal(path: Path, unsafe: list[str]) -> str:
    step_dir = path.parent
    aside = step_dir.parent / f"damaged-{step_dir.name}"
    return (f"{path} is a pickle that names Python objects beyond tensors and plain values ({', '.join(unsafe[:3])}"
            f"{', ...' if len(unsafe) > 3 else ''}): loading it would run code it carries, so it was not loaded. "
            f"dflash-trainer never writes such a file: do not resume from it. Move it aside (mv {step_dir} {aside}) "
            f"to resume from the checkpoint before it, or start a new run from its weights alone (model.safetensors "
            f"is data) in another output directory: --set drafter.init_from={step_dir} --output-dir NEW_DIR")


def json_problem(directory: Path) -> str | None:
    """What keeps the JSON half from loading (the safetensors half is checked by its header), or None."""
    try:
        json.loads((directory / STATE_JSON).read_text())["state"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"{STATE_JSON} is not readable JSON ({exc})"
    return None


