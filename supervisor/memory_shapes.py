"""A model's shape for the memory plan (supervisor/memory_plan.py), read from its ``config.json`` alone.

    shape = shape_from_config(json.loads(Path("models/tiny/config.json").read_text()))
    shape.params()        # 1,816,064 for the tiny Qwen3-MoE: the count of its safetensors, from the config alone

No model is built and no weights are read: ``cascade-rl plan`` must answer for a 30B model on a laptop. A model
the machine does not hold is named by its HF id (``model.path=nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16``) and
found in ``KNOWN``, the published config fields the plan reads.

A decoder layer is a tuple of parts, each with its own pre-norm: Qwen3(-MoE), Llama and Qwen2 layers are
``("attention", "mlp" | "moe")``; Nemotron-H's blocks are one part each (``M`` mamba, ``E`` moe, ``*`` attention,
``-`` mlp).
"""

from __future__ import annotations

from dataclasses import dataclass

# HF's layers_block_type names of Nemotron-H's blocks (and its older hybrid_override_pattern letters)
NEMOTRON_BLOCKS = {"linear_attention": "mamba", "mamba": "mamba", "moe": "moe", "full_attention": "attention",
                   "attention": "attention", "mlp": "mlp", "M": "mamba", "E": "moe", "*": "attention", "-": "mlp"}
NANO_PATTERN = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"  # Nemotron-3-Nano-30B-A3B's 52 layers

# Published shapes of models the plan knows by name (lower-case HF id or its last part). Nano: the config.json of
# fine-tunes that keep its architecture (bench/real_shapes.py says which); Qwen3-30B-A3B: its config.json.
KNOWN: dict[str, dict] = {
    "nvidia/nvidia-nemotron-3-nano-30b-a3b-bf16": dict(
        model_type="nemotron_h", hidden_size=2688, vocab_size=131072, hybrid_override_pattern=NANO_PATTERN,
        num_attention_heads=32, num_key_value_heads=2, head_dim=128, n_routed_experts=128, num_experts_per_tok=6,
        moe_intermediate_size=1856, moe_shared_expert_intermediate_size=3712, intermediate_size=1856,
        mlp_hidden_act="relu2", mamba_num_heads=64, mamba_head_dim=64, n_groups=8, ssm_state_size=128,
        conv_kernel=4, chunk_size=128, tie_word_embeddings=False, max_position_embeddings=262144),
    "qwen/qwen3-30b-a3b": dict(
        model_type="qwen3_moe", hidden_size=2048, vocab_size=151936, num_hidden_layers=48, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
        intermediate_size=6144, tie_word_embeddings=False, max_position_embeddings=40960),
}
ALIASES = {"nemotron-3-nano": "nvidia/nvidia-nemotron-3-nano-30b-a3b-bf16",
           "nvidia-nemotron-3-nano-30b-a3b": "nvidia/nvidia-nemotron-3-nano-30b-a3b-bf16",
           "qwen3-30b-a3b": "qwen/qwen3-30b-a3b"}


def known_config(name: str) -> dict | None:
    """The published config of a model named by its HF id, the id's last part, or an alias; None if unknown."""
    key = name.strip("/").lower()
    for candidate in (key, key.rsplit("/", 1)[-1]):
        if candidate in KNOWN:
            return KNOWN[candidate]
        if candidate in ALIASES:
            return KNOWN[ALIASES[candidate]]
        if hit := next((k for k in KNOWN if k.rsplit("/", 1)[-1] == candidate), None):
            return KNOWN[hit]
    return None


@dataclass(frozen=True)
class ModelShape:
    model_type: str
    hidden: int
    vocab: int
    layers: tuple[tuple[str, ...], ...]
    """Each decoder layer's parts, in order: attention | mamba | mlp | moe."""
    heads: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    qk_norm: bool = False
    """Qwen3's per-head RMSNorm of q and k."""
    intermediate: int = 0
    """A dense MLP's width."""
    gated: bool = True
    """SwiGLU MLPs and experts (gate and up); False: squared ReLU (up only: Nemotron-H)."""
    experts: int = 0
    top_k: int = 0
    expert_intermediate: int = 0
    shared_intermediate: int = 0
    mamba_heads: int = 0
    mamba_head_dim: int = 0
    mamba_groups: int = 0
    ssm_state: int = 0
    conv_kernel: int = 0
    chunk: int = 0
    tied: bool = False
    max_context: int = 0

    @property
    def q(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def d_inner(self) -> int:
        return self.mamba_heads * self.mamba_head_dim

    @property
    def conv_dim(self) -> int:
        return self.d_inner + 2 * self.mamba_groups * self.ssm_state

    def count(self, part: str) -> int:
        return sum(layer.count(part) for layer in self.layers)

    def part_params(self, part: str) -> int:
        """Parameters of one part, its pre-norm included."""
        h, w = self.hidden, 3 if self.gated else 2
        if part == "attention":
            return h * self.q + 2 * h * self.kv + self.q * h + (2 * self.head_dim if self.qk_norm else 0) + h
        if part == "mlp":
            return w * h * self.intermediate + h
        if part == "moe":
            router = self.experts * h + (self.experts if self.model_type == "nemotron_h" else 0)
            return self.experts * w * h * self.expert_intermediate + router + w * h * self.shared_intermediate + h
        if part == "mamba":
            nh, conv = self.mamba_heads, self.conv_dim
            in_proj = h * (2 * self.d_inner + 2 * self.mamba_groups * self.ssm_state + nh)
            return in_proj + conv * self.conv_kernel + conv + 3 * nh + self.d_inner + self.d_inner * h + h
        raise ValueError(f"unknown layer part {part!r}")

    def layer_params(self, layer: tuple[str, ...]) -> int:
        return sum(self.part_params(p) for p in layer)

    def lora_params(self, rank: int) -> int:
        """A LoRA adapter's parameters, rank ``rank`` on the attention projections (q, k, v, o) and the dense MLPs'
        and shared experts' (learner/lora.py's default targets): r·(in + out) per projection."""
        h, w, per = self.hidden, 3 if self.gated else 2, 0
        for layer in self.layers:
            for part in layer:
                if part == "attention":
                    per += (h + self.q) + 2 * (h + self.kv) + (self.q + h)
                elif part == "mlp":
                    per += w * (h + self.intermediate)
                elif part == "moe" and self.shared_intermediate:
                    per += w * (h + self.shared_intermediate)
        return rank * per

    def params(self) -> int:
        """Every parameter: the layers, the input embedding, the LM head unless tied, the final norm."""
        embed = self.vocab * self.hidden * (1 if self.tied else 2)
        return sum(self.layer_params(layer) for layer in self.layers) + embed + self.hidden


def shape_from_config(c: dict) -> ModelShape:
    """The shape of an HF ``config.json`` (a dict): qwen3, qwen3_moe, qwen2, llama, nemotron_h."""
    model_type = c.get("model_type", "")
    h = c["hidden_size"]
    heads = c.get("num_attention_heads", 0)
    common = dict(model_type=model_type, hidden=h, vocab=c["vocab_size"], heads=heads,
                  kv_heads=c.get("num_key_value_heads") or heads, head_dim=c.get("head_dim") or h // max(heads, 1),
                  intermediate=c.get("intermediate_size", 0), tied=bool(c.get("tie_word_embeddings", False)),
                  max_context=c.get("max_position_embeddings", 0), top_k=c.get("num_experts_per_tok", 0),
                  expert_intermediate=c.get("moe_intermediate_size", 0))
    if model_type == "nemotron_h":
        blocks = c.get("layers_block_type") or list(c.get("hybrid_override_pattern", ""))
        layers = tuple((NEMOTRON_BLOCKS[b],) for b in blocks)
        common["tied"] = False  # transformers' NemotronH keeps an LM head of its own whatever the config says
        return ModelShape(**common, layers=layers, gated=False, experts=c.get("n_routed_experts", 0),
                          shared_intermediate=c.get("moe_shared_expert_intermediate_size", 0)
                          * c.get("n_shared_experts", 1),
                          mamba_heads=c.get("mamba_num_heads", 0), mamba_head_dim=c.get("mamba_head_dim", 0),
                          mamba_groups=c.get("n_groups", 0), ssm_state=c.get("ssm_state_size", 0),
                          conv_kernel=c.get("conv_kernel", 4), chunk=c.get("chunk_size", 128))
    if model_type not in ("qwen3", "qwen3_moe", "qwen2", "llama", "mistral"):
        raise ValueError(f"model_type {model_type!r}: the memory plan knows qwen3, qwen3_moe, qwen2, llama and "
                         f"nemotron_h")
    experts = c.get("num_experts") or c.get("num_local_experts") or 0
    dense = set(c.get("mlp_only_layers") or [])
    step = c.get("decoder_sparse_step", 1) or 1
    n = c["num_hidden_layers"]
    layers = tuple(("attention", "moe" if experts and i not in dense and (i + 1) % step == 0 else "mlp")
                   for i in range(n))
    return ModelShape(**common, layers=layers, qk_norm=model_type.startswith("qwen3"), experts=experts)
