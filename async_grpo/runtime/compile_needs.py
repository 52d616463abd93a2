"""What a compiling vLLM engine needs on its host, checked before the engine starts.

With enforce_eager false, vLLM 0.32 compiles the model with torch.compile. Its CPU build compiles
with inductor (vllm/platforms/cpu.py), which builds C++ kernels with $CXX, else g++, against
Python.h (torch/_inductor/cpp_builder.py); with LoRA it skips the model but still compiles the
sampler's helpers. On CUDA, Triton builds its kernel launchers with $CC, else gcc, else clang,
against Python.h (triton/runtime/build.py). A host without them fails deep in the engine's start,
in the engine-core process; `missing_compile_needs` says so in one line before that.

    message = missing_compile_needs(enforce_eager=False, on_cpu=True)
    if message:
        raise SystemExit(message)
"""

from __future__ import annotations

import os
import shutil
import sysconfig
from collections.abc import Callable, Mapping
from pathlib import Path

# (the variable that names the compiler, the commands tried without it, what the message calls it)
_CPU_COMPILER = ("CXX", ("g++",), "a C++ compiler")  # inductor's C++ kernels
_CUDA_COMPILER = ("CC", ("gcc", "clang"), "a C compiler")  # Triton's launchers
_INSTALL_HINT = "install what is missing (e.g. apt-get install build-essential python3-dev) or pass --enforce_eager true"


def python_include_dir() -> str:
    """Where torch's inductor looks for Python.h: this interpreter's include folder."""
    return sysconfig.get_path("include")


def missing_compiler(on_cpu: bool, env: Mapping[str, str],
                     which: Callable[[str], str | None] = shutil.which) -> str | None:
    """'a C++ compiler (g++: not found)' when the compiler the engine's compile would run is not
    on PATH (the one `$CXX`/`$CC` names, when set); None when it is."""
    variable, defaults, kind = _CPU_COMPILER if on_cpu else _CUDA_COMPILER
    named = env.get(variable, "").strip()
    tried = (named,) if named else defaults
    if any(which(command) for command in tried):
        return None
    shown = f"{variable}={named}" if named else "/".join(tried)
    return f"{kind} ({shown}: not found)"


def missing_python_headers(include_dir: str) -> str | None:
    """'Python headers (Python.h: not found in DIR)' when DIR lacks Python.h; None otherwise."""
    if (Path(include_dir) / "Python.h").is_file():
        return None
    return f"Python headers (Python.h: not found in {include_dir})"


def missing_compile_needs(enforce_eager: bool, *, on_cpu: bool, env: Mapping[str, str] | None = None,
                          which: Callable[[str], str | None] = shutil.which,
                          include_dir: str | None = None) -> str | None:
    """One line naming what a compiling engine lacks on this host and how to get it, or None when
    it lacks nothing or does not compile (enforce_eager).

    on_cpu: vLLM's CPU backend (inductor's C++) rather than CUDA (Triton's C); env, which and
    include_dir default to this process's environment, PATH and Python's include folder."""
    if enforce_eager:
        return None
    missing = [need for need in (
        missing_compiler(on_cpu, os.environ if env is None else env, which),
        missing_python_headers(python_include_dir() if include_dir is None else include_dir),
    ) if need]
    if not missing:
        return None
    return (f"the vLLM engine compiles its model (enforce_eager false): it needs {' and '.join(missing)}; "
            f"{_INSTALL_HINT}")
