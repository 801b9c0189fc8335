"""``EngineConfig.numerics``: which CUDA kernels run, resolved on any machine (no GPU needed)."""

from __future__ import annotations

import pytest
import torch

from ngrammar.config import EngineConfig
from ngrammar.runner.model_runner import resolve_numerics

CUDA, CPU = torch.device("cuda", 0), torch.device("cpu")


def test_auto_is_invariant_on_one_cuda_rank_with_triton_attention() -> None:
    assert EngineConfig().numerics == "auto"
    assert resolve_numerics("auto", "auto", CUDA, 1)
    assert resolve_numerics("auto", "triton", CUDA, 1)
    assert not resolve_numerics("auto", "sdpa", CUDA, 1)  # torch SDPA has no invariant launch
    assert not resolve_numerics("auto", "auto", CUDA, 2)  # the all-reduce sums in its own order
    assert not resolve_numerics("fast", "auto", CUDA, 1)
    assert resolve_numerics("invariant", "auto", CUDA, 1)


def test_the_cpu_keeps_its_own_kernels() -> None:
    assert not resolve_numerics("auto", "auto", CPU, 1)
    assert not resolve_numerics("invariant", "auto", CPU, 1)


@pytest.mark.parametrize(
    "kw",
    [
        {"numerics": "exact"},
        {"numerics": "invariant", "tensor_parallel_size": 2},
        {"numerics": "invariant", "attention_backend": "sdpa"},
    ],
)
def test_bad_numerics_are_refused(kw: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="numerics"):
        EngineConfig(**kw)  # type: ignore[arg-type]
