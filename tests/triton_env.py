"""Set-up shared by the Triton kernel tests; import it before anything that imports Triton.

On a CUDA machine the kernels run on the GPU. Without one, ``NGRAMMAR_TRITON_INTERPRET=1`` runs them
under Triton's CPU interpreter: this module then sets ``TRITON_INTERPRET=1``, which Triton reads when
kernels are defined, so it must precede the first import of ``ngrammar.kernels``. Anywhere else (no
Triton, or no CUDA and no interpreter flag) the importing test module is skipped.
"""

from __future__ import annotations

import os

if os.environ.get("NGRAMMAR_TRITON_INTERPRET") == "1":
    os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

pytest.importorskip("triton")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("needs CUDA, or NGRAMMAR_TRITON_INTERPRET=1 for the CPU interpreter", allow_module_level=True)

DEVICE = torch.device("cpu" if INTERPRET else "cuda")
