"""tieredkv behind Triton Inference Server (docs/triton.md).

- ``repo.write_repository`` writes a model repository (``tieredkv triton-repo``): config.pbtxt
  (Python backend, decoupled; the vLLM backend's inputs and outputs), ``1/model.py`` (this
  package's ``model.py``, which runs the serving engine inside Triton) and ``1/engine_args.json``;
- ``server`` gets a real ``tritonserver`` without NVIDIA's container (``pull_tritonserver``: the
  server inside the ``nvidia-pytriton`` wheel, none of its Python dependencies) and runs it
  (``TritonServer``; ``tieredkv triton-server pull|run``);
- ``protocol`` is the request interface (inputs, outputs, sampling parameters), shared by the
  model, the repository writer and the docs.

``model.py`` imports ``triton_python_backend_utils`` and runs only inside Triton's Python backend.
"""

from tieredkv.runtime.serving.triton.repo import config_pbtxt, write_repository
from tieredkv.runtime.serving.triton.server import (TritonServer, TritonServerError, TritonServerNotFoundError,
                                                   find_tritonserver, pull_tritonserver)

__all__ = ["TritonServer", "TritonServerError", "TritonServerNotFoundError", "config_pbtxt", "find_tritonserver",
           "pull_tritonserver", "write_repository"]
