"""Gated MLP activations in Triton: act(gate) * up, in float32, rounded once to the input dtype.

`silu_mul(gate_up)` / `gelu_mul(gate_up)` take the [T, 2F] output of a fused gate+up matmul
(gate first); the `_separate` variants take gate and up as two [T, F] tensors. References:
shared/ops/activation.py applied to the two halves.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_BLOCK = 1024
_SQRT_2_OVER_PI = 0.7978845608028654


@triton.jit
def _silu(x):
    # exp(-x) overflows to inf for very negative x, giving x / inf = -0: the right limit
    return x / (1.0 + tl.exp(-x))


@triton.jit
def _gelu_tanh(x, SQRT_2_OVER_PI: tl.constexpr):
    # 0.5 * (1 + tanh(z)) == sigmoid(2z): no tanh (absent from tl core) and no cancellation
    z = SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)
    return x / (1.0 + tl.exp(-2.0 * z))


@triton.jit
def _gated_act_kernel(
    gate_ptr,  # [T, F], last dim contiguous
    up_ptr,  # [T, F], last dim contiguous
    out_ptr,  # [T, F] contiguous
    stride_gt,  # int64
    stride_ut,  # int64
    n_cols,
    GELU: tl.constexpr,  # False: SiLU, True: GELU (tanh approximation)
    SQRT_2_OVER_PI: tl.constexpr,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(gate_ptr + t * stride_gt + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + t * stride_ut + cols, mask=mask, other=0.0).to(tl.float32)
    if GELU:  # noqa: SIM108 (a plain constexpr branch compiles everywhere)
        a = _gelu_tanh(g, SQRT_2_OVER_PI)
    else:
        a = _silu(g)
    tl.store(out_ptr + t * n_cols + cols, (a * u).to(out_ptr.dtype.element_ty), mask=mask)


def _launch(gate: torch.Tensor, up: torch.Tensor, gelu: bool) -> torch.Tensor:
    n_rows, n_cols = gate.shape
    out = torch.empty((n_rows, n_cols), dtype=gate.dtype, device=gate.device)
    if out.numel() == 0:
        return out
    block = min(_BLOCK, triton.next_power_of_2(n_cols))
    _gated_act_kernel[(n_rows, triton.cdiv(n_cols, block))](
        gate, up, out, gate.stride(0), up.stride(0), n_cols,
        GELU=gelu, SQRT_2_OVER_PI=_SQRT_2_OVER_PI, BLOCK=block, num_warps=4,
    )  # fmt: skip
    return out


def _check(name: str, x: torch.Tensor) -> None:
    if x.dim() != 2:
        raise ValueError(f"{name} must be 2-D [T, features], got {tuple(x.shape)}")
    if x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name} dtype {x.dtype} is not one of float32, float16, bfloat16")
    if x.stride(-1) != 1:
        raise ValueError(f"{name} needs a contiguous last dim, strides {x.stride()}")


def _split(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    _check("gate_up", gate_up)
    if gate_up.shape[1] % 2:
        raise ValueError(f"gate_up's last dim {gate_up.shape[1]} must be even: gate | up")
    half = gate_up.shape[1] // 2
    return gate_up[:, :half], gate_up[:, half:]


def _check_pair(gate: torch.Tensor, up: torch.Tensor) -> None:
    _check("gate", gate)
    _check("up", up)
    if gate.shape != up.shape or gate.dtype != up.dtype or gate.device != up.device:
        raise ValueError(
            f"gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype} must "
            "match in shape, dtype and device"
        )


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [T, 2F] = gate | up. Returns SiLU(gate) * up: a new [T, F] tensor."""
    return _launch(*_split(gate_up), gelu=False)


def gelu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [T, 2F] = gate | up. Returns GELU-tanh(gate) * up: a new [T, F] tensor."""
    return _launch(*_split(gate_up), gelu=True)


def silu_mul_separate(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up: [T, F]. Returns SiLU(gate) * up: a new [T, F] tensor."""
    _check_pair(gate, up)
    return _launch(gate, up, gelu=False)


def gelu_mul_separate(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up: [T, F]. Returns GELU-tanh(gate) * up: a new [T, F] tensor."""
    _check_pair(gate, up)
    return _launch(gate, up, gelu=True)
