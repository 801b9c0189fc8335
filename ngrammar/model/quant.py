"""Weight-only quantized projections on the CPU: a GGUF's 4-bit blocks run as they are.

A GGUF Q4_1 block is 32 weights of one row, ``w = d * q + m`` (q in 0..15; d and m fp16); a Q4_0
block is ``w = d * (q - 8)``. torch's CPU int4 kernel (``aten._weight_int4pack_mm_for_cpu``, group 32)
computes ``w = (q - 8) * scale + zero`` per group (checked by tests/test_quant.py), so a Q4_1 block
maps onto ``scale = d, zero = m + 8 d`` and a Q4_0 block onto ``scale = d, zero = 0``.

Every projection and the LM head run that one kernel (``PackedWeight``) at every row count: no
kernel is chosen by timing, and a row's numbers never depend on the rows beside it. The LM head's
8-bit blocks (a GGUF's Q8_0 embedding) run as two 4-bit halves (``q8_as_q4``).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from ngrammar.kernels import cpu as cpu_kernels

if TYPE_CHECKING:
    from ngrammar.model.llama import LlamaForCausalLM

GROUP = 32  # weights per block / per int4 group
KERNELS = ("int4", "int4_bf16", "fp16", "bf16", "fp32")
WIDTHS = (1, 2, 4, 8, 16, 32, 64)  # row-count buckets of the kernel table (wider steps use the last)


@dataclass(frozen=True)
class Q4Weight:
    """A [N, K] weight as 4-bit codes in groups of 32 along K: ``w = (codes - 8) * scale + zero``."""

    codes: torch.Tensor  # [N, K] uint8 in 0..15
    scale: torch.Tensor  # [N, K // 32] float32
    zero: torch.Tensor  # [N, K // 32] float32

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape[0], self.codes.shape[1]

    def dequantize(self) -> torch.Tensor:
        """[N, K] float32."""
        n, k = self.shape
        q = self.codes.view(n, k // GROUP, GROUP).float() - 8.0
        return (q * self.scale[..., None] + self.zero[..., None]).view(n, k)

    def rows(self, perm: np.ndarray) -> Q4Weight:
        index = torch.from_numpy(perm)
        return Q4Weight(self.codes[index], self.scale[index], self.zero[index])

    @staticmethod
    def cat(parts: Sequence[Q4Weight]) -> Q4Weight:
        """Stacked along N (the groups run along K, so fused q/k/v or gate/up keep their blocks)."""
        return Q4Weight(
            torch.cat([p.codes for p in parts]),
            torch.cat([p.scale for p in parts]),
            torch.cat([p.zero for p in parts]),
        )


def q4_from_blocks(data: np.ndarray, kind: str, rows: int, cols: int) -> Q4Weight:
    """GGUF Q4_0 / Q4_1 blocks ([rows, cols // 32 * bytes] uint8) -> ``Q4Weight``.

    A block holds d (fp16), for Q4_1 also m (fp16), then 16 bytes: byte j's low nibble is weight j,
    its high nibble weight j + 16."""
    head = {"Q4_0": 2, "Q4_1": 4}[kind]
    blocks = np.ascontiguousarray(data).reshape(rows, cols // GROUP, head + 16)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    qs = blocks[..., head:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(rows, cols)
    if kind == "Q4_1":
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        zero = m + 8.0 * d  # d * q + m = (q - 8) * d + (m + 8 d)
    else:
        zero = np.zeros_like(d)
    return Q4Weight(torch.from_numpy(codes), torch.from_numpy(d), torch.from_numpy(zero))


def q4_to_blocks(w: Q4Weight) -> np.ndarray:
    """``Q4Weight`` -> GGUF Q4_1 blocks [N, K // 32 * 20] uint8 (d = scale, m = zero - 8 scale, in fp16)."""
    n, k = w.shape
    codes = w.codes.numpy().reshape(n, k // GROUP, GROUP)
    qs = (codes[..., :16] | (codes[..., 16:] << 4)).astype(np.uint8)
    d = w.scale.numpy().astype(np.float16)[..., None].view(np.uint8)
    m = (w.zero - 8 * w.scale).numpy().astype(np.float16)[..., None].view(np.uint8)
    return np.concatenate([d, m, qs], axis=-1).reshape(n, -1)


def quantize_q4_1(w: torch.Tensor) -> Q4Weight:
    """[N, K] float -> 4-bit groups of 32 as llama.cpp's Q4_1 (minimum and step per group)."""
    n, k = w.shape
    if k % GROUP:
        raise ValueError(f"a 4-bit weight needs K divisible by {GROUP}, got {k}")
    g = w.float().reshape(n, k // GROUP, GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    d = (hi - lo) / 15
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    codes = ((g - lo[..., None]) * inv[..., None]).round().clamp(0, 15).to(torch.uint8).reshape(n, k)
    # Q4_1 stores d and m in fp16: round them the same way, so a quantized folder matches its GGUF.
    d, lo = d.half().float(), lo.half().float()
    return Q4Weight(codes, d, lo + 8 * d)


def quantize_q8_0(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> llama.cpp's Q8_0: int8 codes [N, K] and a step per group of 32 [N, K // 32]
    float32 (``amax / 127``, rounded to fp16 as the GGUF stores it). A GGUF's dequantized Q8_0
    tensor comes back as its own blocks: the largest code of a block is +-127, so the step is exact."""
    n, k = w.shape
    if k % GROUP:
        raise ValueError(f"an 8-bit weight needs K divisible by {GROUP}, got {k}")
    g = w.float().reshape(n, k // GROUP, GROUP)
    d = (g.abs().amax(-1) / 127).half().float()
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    codes = (g * inv[..., None]).round().clamp(-127, 127).to(torch.int8).reshape(n, k)
    return codes, d


def q8_as_q4(codes: torch.Tensor, d: torch.Tensor) -> Q4Weight:
    """Q8_0 codes [N, K] with steps d -> a ``Q4Weight`` [N, 2K] whose product with ``[x, x]`` is
    ``x @ w.T``: q + 128 = 16 hi + lo, so ``d q = (hi - 8) 16 d + ((lo - 8) d + 8 d)`` (the high
    nibbles on the first K columns, the low ones on the last K)."""
    u = codes.to(torch.int16) + 128
    hi, lo = (u >> 4).to(torch.uint8), (u & 15).to(torch.uint8)
    return Q4Weight(
        torch.cat([hi, lo], 1), torch.cat([16 * d, d], 1), torch.cat([torch.zeros_like(d), 8 * d], 1)
    )


class PackedWeight:
    """A [N, K] weight in torch's CPU int4 pack (``_weight_int4pack_mm_for_cpu``, bf16 activations,
    bf16 scales and zeros), the one kernel of every quantized projection and of the LM head at every
    row count. Its reduction over K per output does not depend on how many rows share the call, so a
    row's result is bitwise the same alone, in a batch, in a verify tree or in a prefill chunk
    (tests/test_row_invariance.py). ``copies``: the input is tiled that many times along K first
    (an 8-bit weight held as two 4-bit halves: ``q8_as_q4``)."""

    def __init__(self, q4: Q4Weight, copies: int = 1) -> None:
        n, k = q4.shape
        self.packed = torch._convert_weight_to_int4pack_for_cpu(q4.codes.to(torch.int32), 1)  # [N, K/2]
        # [K/32, N, 2] bf16: (scale, zero) per group of 32 along K.
        self.scales_zeros = torch.stack([q4.scale, q4.zero], -1).transpose(0, 1).contiguous().bfloat16()
        self.copies = copies
        self.shape = (n, k // copies)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, K] -> x @ w.T (+ bias) [T, N], in x's dtype."""
        xb = x.bfloat16()
        if self.copies > 1:
            xb = xb.repeat(1, self.copies)
        out = torch._weight_int4pack_mm_for_cpu(xb, self.packed, GROUP, self.scales_zeros).to(x.dtype)
        return out if bias is None else out + bias


def project(x: torch.Tensor, weight: torch.Tensor | PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """x [T, K] -> x @ weight.T + bias: a packed weight on its kernel, a float32 one on a CPU on the
    row-invariant ``linear`` (torch's GEMM sums in an order that depends on T), others ``F.linear``."""
    if isinstance(weight, PackedWeight):
        return weight(x, bias)
    if x.device.type == "cpu" and x.dtype == weight.dtype == torch.float32:
        out = cpu_kernels.linear(x, weight)
        return out if bias is None else out + bias
    return F.linear(x, weight, bias)


def notice(message: str) -> None:
    """A one-line notice on stderr (a choice the user did not spell out, never silent)."""
    print(f"ngrammar: {message}", file=sys.stderr, flush=True)


def apply_quantization(model: LlamaForCausalLM, q4: dict[str, Q4Weight], mode: str) -> bool:
    """Replace the projections' weights by ``PackedWeight``s and give the model a packed LM head
    (its weight as Q8_0 blocks: a GGUF's own), in place.

    ``q4``: the checkpoint's 4-bit weights (Hugging Face names). Projections without them are
    quantized at load (Q4_1-style groups): in ``int4`` mode always, in ``auto`` mode when the model
    has 4-bit weights for others (one kernel for every projection keeps rows independent of their
    batch); ``auto`` leaves a model without any as it is. A one-line notice says what happened.
    Returns whether the model was quantized."""
    linears = model.projections()
    codes = {n: w for n, w in model.fuse_q4(q4).items() if n in linears}
    missing = [n for n in linears if n not in codes]
    if not codes and mode != "int4":
        notice(
            "the model has no 4-bit (Q4_0 / Q4_1) weights: running its own weights unquantized "
            "(--quantization int4 quantizes them at load)"
        )
        return False
    if missing:
        notice(f"quantizing {len(missing)} of {len(linears)} projections to 4-bit groups of 32 at load")
    for n, module in linears.items():  # one weight at a time: no second copy of the model in memory
        q4w = codes[n] if n in codes else quantize_q4_1(module.weight.detach())
        del module.weight  # the dense parameter goes; the module keeps its bias
        module.weight = PackedWeight(q4w)  # type: ignore[assignment]
    model.packed_head = PackedWeight(q8_as_q4(*quantize_q8_0(model.head_weight().detach())), copies=2)
    return True
