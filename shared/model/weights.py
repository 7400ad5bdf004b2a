"""Moves GGUF tensors onto the device as model parameters, checking each one's type and shape."""

from __future__ import annotations

import itertools
import warnings

import numpy as np
import torch

from shared.kernels.qmatmul.tuning import Tuner
from shared.loader import GGUFError, GGUFFile
from shared.model.embedding import QuantEmbedding
from shared.model.linear import GatedLinear, QuantLinear, SplitLinear, packable
from shared.model.ops_backend import TorchOps
from shared.quant import SUPPORTED_TYPES, dequantize


class WeightLoader:
    def __init__(
        self,
        f: GGUFFile,
        device: torch.device | str,
        compute_dtype: torch.dtype,
        cache_dequantized: bool,
        ops: TorchOps,
        cpu_weights: str = "float",
    ) -> None:
        self.f = f
        self.ops = ops  # the op implementations the model built from these weights calls
        self.device = torch.device(device)
        self.compute_dtype = compute_dtype
        self.cache_dequantized = cache_dequantized
        # the CPU's quantized linears: "native" (GGUF blocks, native_linear), "int4"
        # (torch's 4-bit planes, int4_linear) or "float" (dequantized copies)
        self.cpu_weights = cpu_weights
        # tile choices of the packed matmuls, measured per device (tune_linears)
        self.tuner = Tuner(self.device) if self.use_kernels and self.device.type == "cuda" else None

    def has(self, name: str) -> bool:
        return name in self.f.tensors

    def _raw(self, name: str, shape: tuple[int, ...]) -> tuple[torch.Tensor, int]:
        info = self.f.info(name)
        if info.shape != shape:
            raise GGUFError(
                str(self.f.path),
                f"shape {list(info.shape)} does not match the expected {list(shape)}",
                name,
            )
        if info.qtype not in SUPPORTED_TYPES:
            raise GGUFError(
                str(self.f.path), f"tensor type {info.type_name} is not supported", name
            )
        data = np.array(self.f.raw(name)).reshape(shape[0] if len(shape) > 1 else 1, -1)
        return torch.from_numpy(data).to(self.device), info.qtype

    @property
    def use_kernels(self) -> bool:
        return self.ops.name == "triton"

    def _bias(self, name: str, out_features: int) -> torch.Tensor | None:
        if not self.has(f"{name}.bias"):
            return None
        return self.vector(f"{name}.bias", out_features).to(self.compute_dtype)

    def linear(self, name: str, out_features: int, in_features: int) -> QuantLinear:
        shape = (out_features, in_features)
        raw, qtype = self._raw(f"{name}.weight", shape)
        return QuantLinear(
            raw,
            qtype,
            shape,
            self.compute_dtype,
            self._bias(name, out_features),
            self.cache_dequantized,
            self.use_kernels,
            self.tuner,
            cpu_weights=self.cpu_weights,
        )

    def split_linear(self, names: list[str], outs: list[int], in_features: int) -> SplitLinear:
        """Projections of one input. With the kernels, each run of consecutive weights of one
        type (and all or none with a bias) is one matmul over their concatenated rows: Llama-3
        Q4_K_M's Q4_K q and k are one launch beside its Q6_K v, not two (and each a rounding of
        the activations at batch 1). So on the CPU's int4 planes (one call of torch's kernel
        for Q/K/V, one for gate/up). Otherwise one matmul each."""
        infos = [self.f.info(f"{name}.weight") for name in names]
        keys = [(i.qtype, self.has(f"{n}.bias")) for i, n in zip(infos, names, strict=True)]
        if not (self.packs or self.cpu_weights != "float"):
            keys = list(range(len(names)))  # every projection its own run
        parts = []
        for _, group in itertools.groupby(range(len(names)), key=keys.__getitem__):
            run = list(group)
            pairs = [(names[i], outs[i]) for i in run]
            parts.append(self._fused(pairs, in_features, infos[run[0]].qtype))
        return SplitLinear(parts, outs)

    def _fused(self, run: list[tuple[str, int]], in_features: int, qtype: int) -> QuantLinear:
        """One QuantLinear over the rows of the run's weights (one type), biases concatenated."""
        if len(run) == 1:
            return self.linear(run[0][0], run[0][1], in_features)
        raws = [self._raw(f"{n}.weight", (o, in_features))[0] for n, o in run]
        bias = None
        if self.has(f"{run[0][0]}.bias"):
            bias = torch.cat([self._bias(n, o) for n, o in run])
        raw = torch.cat(raws)
        del raws
        return QuantLinear(
            raw,
            qtype,
            (sum(o for _, o in run), in_features),
            self.compute_dtype,
            bias,
            self.cache_dequantized,
            self.use_kernels,
            self.tuner,
            cpu_weights=self.cpu_weights,
        )

    def gated_linear(
        self, gate: str, up: str, out: int, in_features: int, act: int
    ) -> GatedLinear | None:
        """act(gate) * up in one packed matmul (GatedLinear) when both weights have one packed
        type and no bias, with the kernels; None otherwise (the caller multiplies them apart)."""
        infos = [self.f.info(f"{name}.weight") for name in (gate, up)]
        qtype = infos[0].qtype
        if (
            not self.packs
            or infos[1].qtype != qtype
            or not packable(qtype, (out, in_features))
            or self.has(f"{gate}.bias")
            or self.has(f"{up}.bias")
        ):
            return None
        g = self._raw(f"{gate}.weight", (out, in_features))[0]
        u = self._raw(f"{up}.weight", (out, in_features))[0]
        rows = torch.stack((g, u), dim=1).reshape(2 * out, -1)  # gate i, up i, gate i + 1, ...
        del g, u
        fused = QuantLinear(
            rows, qtype, (2 * out, in_features), self.compute_dtype, use_kernels=True,
            tuner=self.tuner,
        )  # fmt: skip
        return GatedLinear(fused, act)

    @property
    def packs(self) -> bool:
        """Whether quantized weights become packed planes (linears and embeddings alike)."""
        return self.use_kernels and not self.cache_dequantized

    def embedding(self, name: str, vocab: int, dim: int, tied: bool = False) -> QuantEmbedding:
        """The token embedding; `tied`: the output reuses it (``tied_lm_head``), which packs
        the blocks once for both, so they stay blocks here until then."""
        raw, qtype = self._raw(name, (vocab, dim))
        return QuantEmbedding(raw, qtype, (vocab, dim), self.compute_dtype, self.packs and not tied)

    def vector(self, name: str, dim: int) -> torch.Tensor:
        """A norm weight or bias, dequantized to float32."""
        raw, qtype = self._raw(name, (dim,))
        return dequantize(raw.reshape(-1), qtype, (dim,))

    def tied_lm_head(self, embedding: QuantEmbedding) -> QuantLinear:
        """The output projection reusing the token embedding's blocks (tied weights). When the
        head packs them, the embedding looks its rows up in the head's planes and drops the
        blocks: one copy of the weight on the device."""
        head = QuantLinear(
            embedding.raw,
            embedding.qtype,
            embedding.shape,
            self.compute_dtype,
            None,
            self.cache_dequantized,
            self.use_kernels,
            self.tuner,
            cpu_weights=self.cpu_weights,
        )
        if self.packs and head.packed is not None:
            embedding.packed, embedding.raw = head.packed, None
        return head


def tune_linears(model: torch.nn.Module) -> None:
    """Check that the packed kernels build on this device (once per type; layers of a type
    whose kernel fails dequantize in torch instead, with a warning) and measure their tiles for
    every distinct layer shape (once per device: cached on disk). Run before CUDA graphs are
    captured."""
    # per type and epilogue: why its kernel does not build, or None
    errors: dict[tuple[int, int], str | None] = {}
    for module in model.modules():
        if not isinstance(module, QuantLinear) or module.packed is None or not module.tuner:
            continue
        key = (module.qtype, module.gated_act)
        if key not in errors:
            module.kernel_builds()
            errors[key] = module.kernel_error
            if module.kernel_error:
                warnings.warn(
                    f"packed {module.qtype!r} matmul kernel unavailable on "
                    f"{module.packed.q.device} ({module.kernel_error}); dequantizing instead",
                    RuntimeWarning,
                    stacklevel=2,
                )
        module.kernel_error = errors[key]
        if module.kernel_error is None:
            module.tuner.tune(module.packed, module.compute_dtype)
