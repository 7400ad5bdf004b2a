"""ModelConfig: every shape and constant a model needs, from GGUF metadata (nothing hard-coded)."""

from __future__ import annotations

from dataclasses import dataclass

from shared.loader import GGUFError, GGUFFile

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "gemma3")
# RoPE layout follows llama.cpp: the llama converter permutes Q/K into interleaved pairs ("norm"),
# the others keep the halves layout ("neox").
NEOX_ROPE_ARCHS = ("qwen2", "qwen3", "gemma3")
GEMMA3_SWA_PATTERN = 6  # llama.cpp's default when the file does not say: 5 local layers, 1 global


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    context_length: int
    rms_eps: float
    rope_base: float
    rope_dim: int
    rope_neox: bool
    rope_scale: float = 1.0  # linear position scaling (positions are divided by it)
    rope_base_local: float = 10000.0  # for sliding-window layers (gemma3)
    sliding_window: int = 0  # 0 = none
    sliding_layers: tuple[bool, ...] = ()  # per layer: uses the sliding window
    attn_scale: float = 0.0  # multiplier of q·k; 0 = 1/sqrt(head_dim)
    tied_embeddings: bool = False
    final_logit_softcap: float = 0.0

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    def is_sliding(self, layer: int) -> bool:
        return bool(self.sliding_layers) and self.sliding_layers[layer]

    @staticmethod
    def from_gguf(f: GGUFFile) -> ModelConfig:
        arch = f.architecture
        path = str(f.path)
        if arch not in SUPPORTED_ARCHS:
            raise GGUFError(
                path, f"unsupported architecture '{arch}' (supported: {', '.join(SUPPORTED_ARCHS)})"
            )

        def key(name: str, default: object = None) -> object:
            k = f"{arch}.{name}"
            return f.require(k) if default is None else f.get(k, default)

        n_layers = int(key("block_count"))
        d_model = int(key("embedding_length"))
        n_heads = int(key("attention.head_count"))
        n_kv_heads = int(key("attention.head_count_kv", n_heads))
        head_dim = int(key("attention.key_length", d_model // n_heads))
        if int(key("attention.value_length", head_dim)) != head_dim:
            raise GGUFError(path, "key and value head sizes differ; not supported")
        tokens = f.get("tokenizer.ggml.tokens")
        vocab = int(key("vocab_size", len(tokens) if tokens else 0))
        if vocab <= 0:
            vocab = f.info("token_embd.weight").shape[0]
        sliding = int(key("attention.sliding_window", 0)) if arch == "gemma3" else 0
        pattern = int(key("attention.sliding_window_pattern", GEMMA3_SWA_PATTERN))
        sliding_layers = (
            tuple(i % pattern < pattern - 1 for i in range(n_layers)) if sliding else ()
        )
        scaling = str(key("rope.scaling.type", "none"))
        rope_scale = float(key("rope.scaling.factor", 1.0)) if scaling == "linear" else 1.0
        attn_scale = head_dim**-0.5
        if arch == "gemma3" and n_layers == 62:
            # Gemma 3 27B scales queries by its model width per head (query_pre_attn_scalar)
            attn_scale = (d_model / n_heads) ** -0.5
        return ModelConfig(
            arch=arch,
            n_layers=n_layers,
            d_model=d_model,
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            head_dim=head_dim,
            ffn_dim=int(key("feed_forward_length")),
            vocab_size=vocab,
            context_length=int(key("context_length", 2048)),
            rms_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_base=float(key("rope.freq_base", 10000.0)),
            rope_dim=int(key("rope.dimension_count", head_dim)),
            rope_neox=arch in NEOX_ROPE_ARCHS,
            rope_scale=rope_scale,
            rope_base_local=float(key("rope.freq_base_swa", 10000.0)),
            sliding_window=sliding,
            sliding_layers=sliding_layers,
            attn_scale=attn_scale,
            tied_embeddings="output.weight" not in f.tensors,
            final_logit_softcap=float(key("final_logit_softcapping", 0.0)),
        )
