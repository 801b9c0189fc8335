"""Weight-only quantized projections on the CPU: a GGUF's blocks run as they are.

A GGUF Q4_1 block is 32 weights of one row, ``w = d * q + m`` (q in 0..15; d and m fp16); a Q4_0
block is ``w = d * (q - 8)``. ``Q4Weight`` holds either as ``w = (q - 8) * scale + zero`` per group
(Q4_1: ``scale = d, zero = m + 8 d``; Q4_0: ``zero = 0``); ``pack_q4_1`` turns it back into Q4_1
blocks (``m = zero - 8 scale``, a Q4_0 block being one with ``m = -8 d``).

Every projection and the LM head run one kernel family (``PackedWeight``, the C++
``kernels.cpu.block_linear``) at every row count: activations quantized per row and block of 32 (int8
against the Q4_1 projections, as llama.cpp's Q8_1; int16 against the head's Q8_0 blocks), an exact
integer dot per block, and the blocks' float terms summed in block order. No kernel is chosen by
timing, a row's numbers never depend on the rows beside it, and the AVX-512 VNNI, AVX2 and scalar
paths give the same bits. With float32 rows the layer's RMSNorm or SiLU·mul runs inside the same
call (``PackedWeight.norm_linear`` / ``silu_mul_linear``).
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
COLS = 16  # output columns per record group of the block kernel (ngrammar/csrc/quant_kernels.cpp)


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


def _columns_first(t: torch.Tensor, groups: int) -> torch.Tensor:
    """[N, B] per-block values -> [G, B, 16] fp16 bytes [G, B, 32] (N padded to G * 16 with zeros)."""
    t = F.pad(t, (0, 0, 0, groups * COLS - t.shape[0]))
    return t.half().view(groups, COLS, -1).transpose(1, 2).contiguous().view(torch.uint8)


def pack_q4_1(q4: Q4Weight) -> torch.Tensor:
    """``Q4Weight`` -> Q4_1 records for ``kernels.cpu.block_linear``: [G, K / 32, 320] uint8, G = N / 16
    rounded up (ngrammar/csrc/quant_kernels.cpp documents the record). d = scale and m = zero - 8 scale
    in fp16: a GGUF's own Q4_1 d and m, bit for bit (``q4_to_blocks``)."""
    n, k = q4.shape
    groups, blocks = -(-n // COLS), k // GROUP
    codes = F.pad(q4.codes, (0, 0, 0, groups * COLS - n)).view(groups, COLS, blocks, 2, 4, 4)
    codes = codes.permute(0, 2, 3, 4, 1, 5)  # [G, B, half, chunk, column, 4]
    nibbles = (codes[:, :, 0] | (codes[:, :, 1] << 4)).reshape(groups, blocks, 4 * 64)
    d = _columns_first(q4.scale, groups)
    m = _columns_first(q4.zero - 8 * q4.scale, groups)
    return torch.cat([nibbles, d, m], -1).contiguous()


def pack_q8_0(codes: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """Q8_0 codes [N, K] int8 with steps d [N, K / 32] -> records for ``kernels.cpu.block_linear``:
    [G, K / 32, 544] uint8 (the codes in pairs per column, then d in fp16)."""
    n, k = codes.shape
    groups, blocks = -(-n // COLS), k // GROUP
    c = F.pad(codes, (0, 0, 0, groups * COLS - n)).view(torch.uint8)
    c = c.view(groups, COLS, blocks, 16, 2).permute(0, 2, 3, 1, 4).reshape(groups, blocks, 16 * 32)
    return torch.cat([c, _columns_first(d, groups)], -1).contiguous()


class PackedWeight:
    """A [N, K] weight as GGUF blocks (Q4_1, or Q8_0 for the LM head) repacked for
    ``kernels.cpu.block_linear``: the one kernel of every quantized projection and of the LM head at
    every row count. The activations are quantized per row and block of 32 to int8 (llama.cpp's Q8_1),
    each output sums exact integer block dots in block order, so a row's result is bitwise the same
    alone, in a batch, in a verify tree or in a prefill chunk, on every ISA path
    (tests/test_row_invariance.py)."""

    def __init__(self, q4: Q4Weight) -> None:
        self.shape = q4.shape
        self.packed = pack_q4_1(q4)
        self.format = cpu_kernels.Q4_1

    @classmethod
    def q8_0(cls, codes: torch.Tensor, d: torch.Tensor) -> PackedWeight:
        """Q8_0 codes [N, K] int8 and steps [N, K / 32] (``quantize_q8_0``)."""
        self = cls.__new__(cls)
        self.shape = (codes.shape[0], codes.shape[1])
        self.packed = pack_q8_0(codes, d)
        self.format = cpu_kernels.Q8_0
        return self

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, K] -> x @ w.T (+ bias) [T, N], in x's dtype."""
        return self._finish(cpu_kernels.block_linear(x.float(), self.packed, self.format), x.dtype, bias)

    def _finish(self, out: torch.Tensor, dtype: torch.dtype, bias: torch.Tensor | None) -> torch.Tensor:
        if out.shape[1] != self.shape[0]:
            out = out[:, : self.shape[0]]  # the last group's padding columns
        out = out.to(dtype)
        return out if bias is None else out + bias

    def norm_linear(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        norm_weight: torch.Tensor,
        eps: float,
        bias: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """float32 x [T, K]: (self(norm_weight * rms_norm(x + residual)) + bias, x + residual or
        None), one kernel call (``kernels.cpu.rmsnorm_block_linear``)."""
        out, summed = cpu_kernels.rmsnorm_block_linear(
            x, residual, norm_weight, eps, self.packed, self.format
        )
        return self._finish(out, x.dtype, bias), summed

    def silu_mul_linear(self, x: torch.Tensor) -> torch.Tensor:
        """float32 x [T, 2K] (gate | up) -> self(silu(gate) * up), one kernel call."""
        return self._finish(cpu_kernels.silu_mul_block_linear(x, self.packed, self.format), x.dtype, None)


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
    model.packed_head = PackedWeight.q8_0(*quantize_q8_0(model.head_weight().detach()))
    return True
