"""HF <-> Megatron state dicts, in memory: transformers' GlmMoeDsaForCausalLM names on one side, each rank's shard of
MegatronGlmMoeDsa (model.py) on the other. Pure tensor slicing and concatenation, so a round trip is bit-exact.

Every HF tensor maps to one Megatron tensor by a Rule of one of these kinds:
  replicated   the same tensor on every rank (norms, low-rank projections, indexer, router)
  rows / cols  split along dim 0 / dim 1 over tensor-parallel ranks (heads, vocabulary, MLP width)
  glu          gate_proj and up_proj rows split over TP, each rank's gate rows then its up rows (megatron's fc1)
  expert       one routed expert, held whole by the expert-parallel rank that owns it (expert TP is 1)
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

from slime_dsa.models.config import ModelConfig

Shards = Mapping[tuple[int, int], dict[str, torch.Tensor]]  # (tp_rank, ep_rank) -> that rank's Megatron state


@dataclass(frozen=True)
class Rule:
    hf: tuple[str, ...]  # one HF name, or (gate, up) for a GLU fc1
    megatron: str
    kind: str  # replicated | rows | cols | glu | expert
    expert: int | None = None  # global expert id (kind expert)


def _attention_rules(config: ModelConfig, i: int) -> Iterator[Rule]:
    hf, mg = f"model.layers.{i}.self_attn.", f"layers.{i}.self_attention."
    names = ["q_a_proj.weight", "q_a_layernorm.weight", "kv_a_proj_with_mqa.weight", "kv_a_layernorm.weight"]
    if config.attention_bias:
        names += ["q_a_proj.bias", "kv_a_proj_with_mqa.bias"]
    if config.indexer_types[i] == "full":
        names += [f"indexer.{n}" for n in ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight")]
    for name in names:
        yield Rule((hf + name,), mg + "core." + name, "replicated")
    yield Rule((hf + "q_b_proj.weight",), mg + "core.q_b_proj.weight", "rows")  # head-major rows
    yield Rule((hf + "kv_b_proj.weight",), mg + "core.kv_b_proj.weight", "rows")
    yield Rule((hf + "o_proj.weight",), mg + "o_proj.weight", "cols")
    if config.attention_bias:
        yield Rule((hf + "o_proj.bias",), mg + "o_proj.bias", "replicated")


def _mlp_rules(config: ModelConfig, i: int, ep_size: int) -> Iterator[Rule]:
    hf, mg = f"model.layers.{i}.mlp.", f"layers.{i}.mlp."
    if config.mlp_layer_types[i] != "sparse":
        yield Rule((hf + "gate_proj.weight", hf + "up_proj.weight"), mg + "linear_fc1.weight", "glu")
        yield Rule((hf + "down_proj.weight",), mg + "linear_fc2.weight", "cols")
        return
    yield Rule((hf + "gate.weight",), mg + "router.weight", "replicated")
    yield Rule((hf + "gate.e_score_correction_bias",), mg + "router.expert_bias", "replicated")
    local = config.n_routed_experts // ep_size
    for e in range(config.n_routed_experts):
        expert, prefix = f"{hf}experts.{e}.", f"{mg}experts.local_experts.{e % local}."
        yield Rule((expert + "gate_proj.weight", expert + "up_proj.weight"), prefix + "linear_fc1.weight", "expert", e)
        yield Rule((expert + "down_proj.weight",), prefix + "linear_fc2.weight", "expert", e)
    if config.n_shared_experts:
        shared = hf + "shared_experts."
        yield Rule((shared + "gate_proj.weight", shared + "up_proj.weight"), mg + "shared_experts.linear_fc1.weight", "glu")
        yield Rule((shared + "down_proj.weight",), mg + "shared_experts.linear_fc2.weight", "cols")


def rules(config: ModelConfig, ep_size: int = 1) -> list[Rule]:
    """Every tensor of the model, in HF order."""
    out = [Rule(("model.embed_tokens.weight",), "embedding.weight", "rows")]
    for i in range(config.num_hidden_layers):
        out.append(Rule((f"model.layers.{i}.input_layernorm.weight",), f"layers.{i}.input_layernorm.weight", "replicated"))
        out += _attention_rules(config, i)
        out.append(Rule((f"model.layers.{i}.post_attention_layernorm.weight",), f"layers.{i}.pre_mlp_layernorm.weight",
                        "replicated"))
        out += _mlp_rules(config, i, ep_size)
    out.append(Rule(("model.norm.weight",), "final_norm.weight", "replicated"))
    out.append(Rule(("lm_head.weight",), "output_layer.weight", "rows"))
    return out


def _owner(rule: Rule, config: ModelConfig, ep_size: int) -> int | None:
    """The expert-parallel rank holding an expert's tensor (None: every rank holds its part)."""
    return None if rule.kind != "expert" else rule.expert // (config.n_routed_experts // ep_size)


def hf_to_megatron(hf: Mapping[str, torch.Tensor], config: ModelConfig, tp_size: int = 1, ep_size: int = 1,
                   tp_rank: int = 0, ep_rank: int = 0) -> dict[str, torch.Tensor]:
    """The Megatron state of rank (tp_rank, ep_rank) from a full HF state dict."""
    out = {}
    for rule in rules(config, ep_size):
        if rule.kind == "expert":
            if _owner(rule, config, ep_size) == ep_rank:
                out[rule.megatron] = torch.cat([hf[n] for n in rule.hf])
        elif rule.kind == "replicated":
            out[rule.megatron] = hf[rule.hf[0]]
        elif rule.kind == "rows":
            out[rule.megatron] = hf[rule.hf[0]].chunk(tp_size, dim=0)[tp_rank]
        elif rule.kind == "cols":
            out[rule.megatron] = hf[rule.hf[0]].chunk(tp_size, dim=1)[tp_rank]
        else:  # glu
            out[rule.megatron] = torch.cat([hf[n].chunk(tp_size, dim=0)[tp_rank] for n in rule.hf])
    return {k: v.contiguous() for k, v in out.items()}


def megatron_to_hf(shards: Shards, config: ModelConfig, tp_size: int = 1, ep_size: int = 1) -> dict[str, torch.Tensor]:
    """The full HF state dict from the Megatron states of ranks (tp_rank, ep_rank) for every tp_rank < tp_size and
    ep_rank < ep_size."""
    out = {}
    for rule in rules(config, ep_size):
        if rule.kind == "expert":
            fused = shards[0, _owner(rule, config, ep_size)][rule.megatron]
            parts = fused.chunk(len(rule.hf)) if len(rule.hf) > 1 else (fused,)
            out.update(zip(rule.hf, parts))
            continue
        tp_parts = [shards[t, 0][rule.megatron] for t in range(tp_size)]
        if rule.kind == "replicated":
            out[rule.hf[0]] = tp_parts[0]
        elif rule.kind in ("rows", "cols"):
            out[rule.hf[0]] = torch.cat(tp_parts, dim=0 if rule.kind == "rows" else 1)
        else:  # glu: each rank's (gate rows, up rows)
            halves = [p.chunk(2) for p in tp_parts]
            out[rule.hf[0]] = torch.cat([g for g, _ in halves])
            out[rule.hf[1]] = torch.cat([u for _, u in halves])
    return {k: v.contiguous() for k, v in out.items()}


def split_kinds(config: ModelConfig, ep_size: int = 1) -> dict[str, str]:
    """Megatron name -> how ranks hold it: 'tp' (split over tensor-parallel ranks), 'ep' (one expert-parallel
    rank's expert, the same name on every EP rank) or 'replicated'."""
    kinds = {}
    for rule in rules(config, ep_size):
        kinds[rule.megatron] = {"expert": "ep", "replicated": "replicated"}.get(rule.kind, "tp")
    return kinds
