"""QuantLinear picks its matmul at load time (dense copy, packed kernels, in-place GEMV or per-call
dequantization) and every choice computes ``x @ dequantize(raw).T (+ bias)``; SplitLinear's fused
projections equal the separate ones. Kernels run under the Triton interpreter on the CPU."""

from __future__ import annotations

import os

import pytest
import torch
from gguf import GGMLQuantizationType as T

from shared.kernels.qmatmul import PACKED_TYPES
from shared.kernels.qmatmul.packed_matmul import int8_rows
from shared.model.linear import GatedLinear, QuantLinear, SplitLinear
from shared.quant import dequantize
from tests.test_kernel_packed_matmul import random_raw

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs CUDA or TRITON_INTERPRET=1",
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
N, K = 48, 512


def tolerance(layer: QuantLinear, rows: int) -> float:
    """1e-5 of the product, or 2e-2 where CUDA runs the int8 rows GEMVs (1 .. BATCH_ROWS rows
    of interleaved planes), which round the activations to int8 first."""
    return 2e-2 if layer.packed is not None and int8_rows(layer.packed, rows) else 1e-5


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q8_0, T.Q4_0, T.Q5_1, T.Q5_K, T.Q3_K])
@pytest.mark.parametrize("m", [1, 5, 70])
def test_every_path_computes_the_dequantized_product(qtype: T, m: int) -> None:
    raw = random_raw(qtype, N, K, seed=int(qtype)).to(DEVICE)
    bias = torch.randn(N, device=DEVICE)
    layer = QuantLinear(raw, qtype, (N, K), torch.float32, bias, use_kernels=True)
    if qtype in PACKED_TYPES:
        assert layer.packed is not None and layer.raw is None  # the blocks were repacked
    x = torch.randn(2, m, K, device=DEVICE)  # any leading shape
    want = x.double() @ dequantize(raw, qtype, (N, K)).double().T + bias.double()
    got = layer(x)
    assert got.shape == (2, m, N)
    err = ((got.double() - want).norm() / want.norm()).item()
    assert err < tolerance(layer, 2 * m), f"{qtype.name} M={m}: relative error {err:.2e}"
    # the weight a tied head or a debugger sees is the GGUF dequantization, bit for bit
    assert torch.equal(layer.weight(), dequantize(raw, qtype, (N, K)))


def test_split_linear_fused_equals_separate() -> None:
    parts = [random_raw(T.Q4_K, n, K, seed=n).to(DEVICE) for n in (32, 16, 16)]
    x = torch.randn(3, K, device=DEVICE)
    fused = SplitLinear(
        [QuantLinear(torch.cat(parts), T.Q4_K, (64, K), torch.float32, use_kernels=True)],
        [32, 16, 16],
    )
    separate = SplitLinear(
        [QuantLinear(p, T.Q4_K, (p.shape[0], K), torch.float32, use_kernels=True) for p in parts],
        [32, 16, 16],
    )
    for a, b in zip(fused(x), separate(x), strict=True):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_split_linear_with_runs_of_one_type() -> None:
    """Q4_K q and k as one part beside a Q6_K v (Llama-3 Q4_K_M's layers with more bits) give
    the three projections of separate parts; parts that are not runs of the sizes are refused."""
    types, sizes = (T.Q4_K, T.Q4_K, T.Q6_K), [32, 16, 16]
    raws = [
        random_raw(t, n, K, seed=n + i).to(DEVICE)
        for i, (t, n) in enumerate(zip(types, sizes, strict=True))
    ]
    qk = QuantLinear(torch.cat(raws[:2]), T.Q4_K, (48, K), torch.float32, use_kernels=True)
    v = QuantLinear(raws[2], T.Q6_K, (16, K), torch.float32, use_kernels=True)
    split = SplitLinear([qk, v], sizes)
    assert split.runs == [[32, 16], [16]]
    x = torch.randn(3, K, device=DEVICE)
    tol = max(tolerance(qk, 3), tolerance(v, 3))
    for got, raw, t, n in zip(split(x), raws, types, sizes, strict=True):
        want = x.double() @ dequantize(raw, t, (n, K)).double().T
        assert got.shape == (3, n)
        assert ((got.double() - want).norm() / want.norm()).item() < tol
    with pytest.raises(ValueError, match="not a run"):
        SplitLinear([v, qk], sizes)  # 16 rows first: not a run of 32, 16, 16
    with pytest.raises(ValueError, match="rows for"):
        SplitLinear([qk], sizes)


def test_loader_fuses_each_run_of_one_type(tmp_path) -> None:
    """WeightLoader.split_linear: one launch over q and k (Q4_K), one for v (Q6_K)."""
    from gguf import GGUFWriter

    from shared.loader import GGUFFile
    from shared.model.ops_backend import TritonOps
    from shared.model.weights import WeightLoader

    types, sizes = (T.Q4_K, T.Q4_K, T.Q6_K), [32, 16, 16]
    raws = [
        random_raw(t, n, K, seed=n + i) for i, (t, n) in enumerate(zip(types, sizes, strict=True))
    ]
    w = GGUFWriter(str(tmp_path / "qkv.gguf"), "llama")
    for name, raw, t in zip("qkv", raws, types, strict=True):
        w.add_tensor(f"{name}.weight", raw.numpy(), raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    loader = WeightLoader(
        GGUFFile(tmp_path / "qkv.gguf"), DEVICE, torch.float32, False, TritonOps()
    )
    split = loader.split_linear(["q", "k", "v"], sizes, K)
    assert [p.shape for p in split.parts] == [(48, K), (16, K)]
    x = torch.randn(2, K, device=DEVICE)
    tol = max(tolerance(part, 2) for part in split.parts)
    for got, raw, t, n in zip(split(x), raws, types, sizes, strict=True):
        want = x.double() @ dequantize(raw.to(DEVICE), t, (n, K)).double().T
        assert ((got.double() - want).norm() / want.norm()).item() < tol


@pytest.mark.parametrize(
    ("qtype", "m"), [(T.Q4_K, 1), (T.Q6_K, 1), (T.Q8_0, 1), (T.Q4_K, 2), (T.Q4_K, 3), (T.Q4_K, 4)]
)
def test_rows_gemvs_take_activations_rounded_by_the_norm(qtype: T, m: int, monkeypatch) -> None:
    """Over interleaved planes (as CUDA keeps them) a layer names the int8 layout it rounds to:
    at batch 1 (the rows GEMV), and for 2-4 rows (the batch rows GEMV, up to ROUND_AHEAD_ROWS).
    Given that rounding made by the RMSNorm (add_rms_norm_int8), it launches none of its own and
    gives the product it gives without."""
    import shared.kernels.qmatmul.packed_int8_rows as rows_gemv
    import shared.kernels.qmatmul.packed_int8_rows_batch as batch_gemv
    from shared.kernels.norm import add_rms_norm_int8
    from shared.kernels.qmatmul.int8_activations import int8_layout
    from shared.kernels.qmatmul.packed_rows import interleave
    from tests.spies import record_results

    layer = QuantLinear(random_raw(qtype, N, K, seed=3).to(DEVICE), qtype, (N, K), torch.float32,
                        use_kernels=True)  # fmt: skip
    if not layer.packed.rows32:
        layer.packed = interleave(layer.packed)
    layout = layer.int8_layout(m)
    assert layout == int8_layout(layer.packed) and layer.int8_layout(5) is None
    x, r = torch.randn(m, K, device=DEVICE), torch.randn(m, K, device=DEVICE)
    h, _, rounded = add_rms_norm_int8(x, r, torch.randn(K, device=DEVICE), 1e-5, (layout,))
    assert rounded[layout][0].shape == ((m, K // 4) if m > 1 else (K // 4,))
    own = record_results(monkeypatch, batch_gemv if m > 1 else rows_gemv, "prepare_int8")
    want = layer(h)
    assert len(own) == 1
    got = layer(h, rounded)
    assert len(own) == 1  # no rounding launch of its own
    # the same codes and steps; the float sums of the sub-blocks may differ in their last bit
    # (summation order), which Q6_K's offset (weight d * a * (q - 32)) amplifies elementwise
    assert ((got.double() - want.double()).norm() / want.double().norm()).item() < 1e-5
    if m > 1:
        with pytest.raises(ValueError, match="int8 rows"):  # another batch's rounding
            layer(h, {layout: tuple(t[:1] for t in rounded[layout])})


@pytest.mark.parametrize("act", [1, 2], ids=["silu", "gelu"])
@pytest.mark.parametrize("m", [1, 5, 70])
def test_gated_linear_equals_the_activation_of_gate_and_up(act: int, m: int) -> None:
    f = 24
    gate, up = (random_raw(T.Q4_K, f, K, seed=s).to(DEVICE) for s in (7, 8))
    rows = torch.stack((gate, up), dim=1).reshape(2 * f, -1)  # as WeightLoader interleaves them
    layer = GatedLinear(QuantLinear(rows, T.Q4_K, (2 * f, K), torch.float32, use_kernels=True), act)
    x = torch.randn(2, m, K, device=DEVICE)
    g = x.double() @ dequantize(gate, T.Q4_K, (f, K)).double().T
    u = x.double() @ dequantize(up, T.Q4_K, (f, K)).double().T
    want = (
        torch.nn.functional.silu(g) if act == 1 else torch.nn.functional.gelu(g, approximate="tanh")
    ) * u
    got = layer(x)
    assert got.shape == (2, m, f)
    err = ((got.double() - want).norm() / want.norm()).item()
    assert err < tolerance(layer.fused, 2 * m), f"act {act} M={m}: relative error {err:.2e}"
    layer.fused.kernel_error = "pretend the kernel did not build"  # the torch fallback
    err = ((layer(x).double() - want).norm() / want.norm()).item()
    assert err < 1e-5


def test_a_kernel_that_fails_to_build_falls_back_to_dequantizing(monkeypatch) -> None:
    import shared.model.linear as linear_mod

    raw = random_raw(T.Q8_0, N, K, seed=5).to(DEVICE)
    layer = QuantLinear(raw, T.Q8_0, (N, K), torch.float32, use_kernels=True)

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel for this device\nsecond line")

    monkeypatch.setattr(linear_mod, "packed_matmul", broken)
    assert not layer.kernel_builds()
    assert layer.kernel_error == "RuntimeError: no kernel for this device"
    x = torch.randn(3, K, device=DEVICE)
    want = x.double() @ dequantize(raw, T.Q8_0, (N, K)).double().T
    torch.testing.assert_close(layer(x).double(), want, rtol=1e-5, atol=1e-5)
