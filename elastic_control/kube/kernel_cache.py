"""The image's compiled kernels, made when the image is built: ``python -m elastic_control.kube.kernel_cache DIR``.

Every numba kernel of the project (ctr_foundation/compiled.py) is compiled into DIR, which must be the
process's NUMBA_CACHE_DIR: those with a signature when their module is imported, the others through the
paths that use them (a few lines read and parsed as a trainer reads an hour, a request's lines as serving
parses them). The Dockerfile runs this in the final image, so the machine code is keyed to the installed
files, and sets ELASTIC_CTR_NUMBA_SEED=DIR; a pod's first kernel copies DIR into its own NUMBA_CACHE_DIR.
Prints, as JSON, the kernels compiled and the cache files written.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

from numba.core.registry import CPUDispatcher

# The modules whose import compiles the kernels with a signature (each imports its kernels' modules).
import cube.lookup_kernel  # noqa: F401
import elastic_control.inference.scoring  # noqa: F401
import elastic_control.serving.app  # noqa: F401
from elastic_control.data.filesystems import open_location
from elastic_control.data.line_batch import parse_chunk
from elastic_control.data.readers import read_text_chunks
from elastic_control.serving.instances import warm_up_line_parse

PACKAGES = ("ctr_foundation", "cube", "client", "elastic_control")

# Lines of the slot format with and without value tokens, as an hour's file holds them.
_LINES = "1 0 1:1 2:2 3:3\n1 1 4:1 0.5:2 5:3\n"


def compile_all() -> list[str]:
    """Compile (or load) every kernel; the names of those with machine code in this process."""
    with tempfile.TemporaryDirectory(prefix="kernel-cache-") as tmp:
        path = Path(tmp, "part-00000")
        path.write_text(_LINES * 8)
        location = open_location(tmp)
        for chunk in read_text_chunks(location.fs, f"{location.path}/part-00000", str(path), 4):
            parse_chunk(chunk)
    warm_up_line_parse()
    return sorted(f"{k.py_func.__module__}.{k.py_func.__qualname__}" for k in loaded_kernels() if k.signatures)


def loaded_kernels() -> list[CPUDispatcher]:
    """The project's kernels imported in this process, each once (a module importing another's kernel holds
    the same dispatcher)."""
    kernels = {
        id(value): value
        for name, module in list(sys.modules.items())
        if name.split(".")[0] in PACKAGES
        for value in vars(module).values()
        if isinstance(value, CPUDispatcher)
    }
    return list(kernels.values())


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.splitlines()[0], file=sys.stderr)
        return 2
    target = os.path.abspath(argv[1])
    cache = os.environ.get("NUMBA_CACHE_DIR")
    if not cache or os.path.abspath(cache) != target:
        print(f"NUMBA_CACHE_DIR must be {target} (it is {cache!r}): numba writes its cache there", file=sys.stderr)
        return 2
    kernels = compile_all()
    files = sorted(str(p.relative_to(target)) for p in Path(target).rglob("*") if p.is_file())
    if not files:
        print(f"no compiled kernel was written to {target}", file=sys.stderr)
        return 1
    print(json.dumps({"kernels": kernels, "files": len(files)}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
