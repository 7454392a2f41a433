"""GLM-MoE-DSA model configuration: the fields of transformers' `GlmMoeDsaConfig`, read from config.json."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

GENERATION_CONFIG = "generation_config.json"

# Keys transformers writes to config.json that describe nothing we compute with.
_IGNORED_KEYS = {
    "architectures", "model_type", "transformers_version", "torch_dtype", "dtype", "use_cache",
    "output_router_logits", "_name_or_path", "auto_map", "qk_head_dim", "num_key_value_heads",
    "attention_dropout", "layer_types", "pad_token_id", "bos_token_id", "head_dim", "mlp_bias",
    "quantization_config", "index_topk_freq", "index_skip_topk_offset", "index_topk_pattern",
    "rope_theta", "rope_scaling", "num_experts",
}


def derive_indexer_types(num_layers: int, freq: int = 1, offset: int = 2, pattern: str | list | None = None) -> list[str]:
    """IndexShare layer types, derived exactly as transformers' GlmMoeDsaConfig.__post_init__ does."""
    if pattern is not None:
        if isinstance(pattern, str):
            return [{"F": "full", "S": "shared"}[c] for c in pattern]
        return list(pattern)
    freq = max(freq, 1)
    return ["full" if (max(i - offset + 1, 0) % freq) == 0 else "shared" for i in range(num_layers)]


@dataclass
class ModelConfig:
    """Hyper-parameters of a GLM-MoE-DSA model; field names are transformers' config.json keys."""

    vocab_size: int = 154880
    hidden_size: int = 6144
    intermediate_size: int = 12288
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 78
    num_attention_heads: int = 64
    n_shared_experts: int = 1
    n_routed_experts: int = 256
    routed_scaling_factor: float = 2.5
    kv_lora_rank: int = 512
    q_lora_rank: int = 2048
    qk_rope_head_dim: int = 64
    v_head_dim: int = 256
    qk_nope_head_dim: int = 192
    n_group: int = 1
    topk_group: int = 1
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = True
    hidden_act: str = "silu"
    max_position_embeddings: int = 202752
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-5
    # transformers' GlmMoeDsaConfig default: SGLang reads a config.json without the key as 1 too, so the engines agree
    # (recipe check refuses such a model.path; presets pass the tokenizer's). generation_config.json may add ids.
    eos_token_id: int | list[int] | None = 1
    tie_word_embeddings: bool = False
    rope_parameters: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    mlp_layer_types: list[str] | None = None
    attention_bias: bool = False
    index_topk: int = 2048
    index_head_dim: int = 128
    index_n_heads: int = 32
    first_k_dense_replace: int = 3
    indexer_types: list[str] | None = None
    num_nextn_predict_layers: int = 0
    extra: dict = field(default_factory=dict)  # unknown config.json keys, written back unchanged

    def __post_init__(self) -> None:
        if self.indexer_types is None:
            self.indexer_types = derive_indexer_types(self.num_hidden_layers)
        if self.mlp_layer_types is None:
            n_dense = min(self.first_k_dense_replace, self.num_hidden_layers)
            self.mlp_layer_types = ["dense"] * n_dense + ["sparse"] * (self.num_hidden_layers - n_dense)
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the offending values."""
        if len(self.indexer_types) != self.num_hidden_layers:
            raise ValueError(f"indexer_types has {len(self.indexer_types)} entries, expected num_hidden_layers ({self.num_hidden_layers})")
        if self.indexer_types and self.indexer_types[0] != "full":
            raise ValueError("indexer_types[0] must be 'full': a shared layer needs a preceding full layer")
        if bad := set(self.indexer_types) - {"full", "shared"}:
            raise ValueError(f"indexer_types may hold only 'full' or 'shared', got {sorted(bad)}")
        if len(self.mlp_layer_types) != self.num_hidden_layers:
            raise ValueError(f"mlp_layer_types has {len(self.mlp_layer_types)} entries, expected {self.num_hidden_layers}")
        if self.n_routed_experts % self.n_group:
            raise ValueError(f"n_routed_experts ({self.n_routed_experts}) must be divisible by n_group ({self.n_group})")
        if self.qk_rope_head_dim % 2 or self.index_head_dim < self.qk_rope_head_dim:
            raise ValueError(f"qk_rope_head_dim ({self.qk_rope_head_dim}) must be even and <= index_head_dim ({self.index_head_dim})")
        if self.rope_parameters.get("rope_type", "default") not in ("default", "yarn"):
            raise ValueError(f"rope_type {self.rope_parameters.get('rope_type')!r} is not supported (default, yarn)")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def full_layer_ids(self) -> list[int]:
        """Layers that run their own indexer."""
        return [i for i, t in enumerate(self.indexer_types) if t == "full"]

    @property
    def eos_token_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        return list(self.eos_token_id) if isinstance(self.eos_token_id, (list, tuple)) else [self.eos_token_id]

    def attention_scale(self) -> float:
        """Softmax scale of MLA, with yarn's mscale² when configured (transformers' yarn_apply_mscale)."""
        scale = self.qk_head_dim**-0.5
        rope = self.rope_parameters
        if rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim"):
            mscale = yarn_mscale(rope["factor"], rope["mscale_all_dim"])
            scale = scale * mscale * mscale
        return scale

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        """Build from a config.json dict, deriving IndexShare types like transformers does."""
        raw = dict(raw)
        if raw.get("model_type", "glm_moe_dsa") != "glm_moe_dsa":
            raise ValueError(f"config.json model_type is {raw['model_type']!r}, expected 'glm_moe_dsa'")
        if "num_experts" in raw and raw["num_experts"] is not None:
            raw["n_routed_experts"] = raw["num_experts"]
        if raw.get("rope_parameters") is None:
            rope = dict(raw.get("rope_scaling") or {"rope_type": "default"})
            rope.setdefault("rope_type", rope.pop("type", "default"))
            rope["rope_theta"] = raw.get("rope_theta", 10000.0)
            raw["rope_parameters"] = rope
        if raw.get("indexer_types") is None:
            num_layers = raw.get("num_hidden_layers", cls.num_hidden_layers)
            raw["indexer_types"] = derive_indexer_types(
                num_layers, raw.get("index_topk_freq", 1), raw.get("index_skip_topk_offset", 2), raw.get("index_topk_pattern")
            )
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        known = {k: v for k, v in raw.items() if k in names}
        extra = {k: v for k, v in raw.items() if k not in names and k not in _IGNORED_KEYS}
        return cls(**known, extra=extra)

    def to_dict(self) -> dict[str, Any]:
        """The config.json dict that transformers' AutoConfig reads back."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        out.update(self.extra)
        out["num_key_value_heads"] = self.num_attention_heads
        out["head_dim"] = self.qk_rope_head_dim
        out["model_type"] = "glm_moe_dsa"
        out.setdefault("architectures", ["GlmMoeDsaForCausalLM"])  # a value model's config says GlmMoeDsaForValue
        if not self.num_nextn_predict_layers:
            out.pop("num_nextn_predict_layers")
        return out

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        file = path / "config.json" if path.is_dir() else path
        if not file.exists():
            raise FileNotFoundError(f"no config.json at {file}")
        return cls.from_dict(json.loads(file.read_text()))

    def save(self, directory: str | Path) -> None:
        Path(directory, "config.json").write_text(json.dumps(self.to_dict(), indent=2) + "\n")


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def generation_eos_token_ids(directory: str | Path) -> list[int]:
    """The eos_token_id of `directory`'s generation_config.json (an int or a list), read as SGLang's ModelConfig
    reads it (_get_hf_eos_token_id): [] when the file is absent or unreadable, or the value falsy (0, [], null)."""
    path = Path(directory, GENERATION_CONFIG)
    if not path.is_file():
        return []
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):  # SGLang: transformers' OSError, so no config
        logger.warning("%s is not readable JSON: its eos_token_id is ignored, as SGLang ignores it", path)
        return []
    value = raw.get("eos_token_id") if isinstance(raw, dict) else None
    if not value:
        return []
    values = value if isinstance(value, list) else [value]
    ids = [v for v in values if _is_token_id(v)]
    if bad := [v for v in values if not _is_token_id(v)]:
        logger.warning("%s: eos_token_id holds %s, not token ids; the engines never stop on them",
                       path, ", ".join(map(repr, bad)))
    return list(dict.fromkeys(ids))


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
