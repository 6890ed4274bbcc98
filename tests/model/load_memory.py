"""Child process for test_load_memory: peak resident memory while `load` reads a checkpoint.

    python -m tests.model.load_memory FOLDER  ->  prints one JSON object

The peak is the kernel's high-water mark (VmHWM) after resetting it (`clear_refs` 5) just before
the load, minus the resident size then (the interpreter, JAX and its CPU client).
"""

from __future__ import annotations

import json
import pathlib
import sys


def _status(key: str) -> int:
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def main(folder: str) -> None:
    import jax
    import numpy as np

    from headrace.model import params as params_lib
    from headrace.model.load import load

    jax.device_put(np.zeros(4)).block_until_ready()  # the CPU client exists before measuring
    before = _status("VmRSS")
    pathlib.Path("/proc/self/clear_refs").write_text("5")
    model = load(f"hf:{folder}", with_text=False)
    jax.block_until_ready(model.params)
    peak = _status("VmHWM") - before
    sizes = [int(np.prod(v.shape)) * 4 for v in params_lib.flatten(model.params).values()]
    print(json.dumps({"peak_bytes": peak, "param_bytes": sum(sizes), "largest": max(sizes)}))


if __name__ == "__main__":
    main(sys.argv[1])
