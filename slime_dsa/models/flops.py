"""Model FLOPs of training, for MFU: the dense-equivalent 6·N per token with N the parameters one token is multiplied
by (its active parameters).

What N counts: every weight matrix a token passes through (attention projections, the DSA indexer's projections,
dense MLPs, the router, shared experts, norms, the LM head) and the routed experts at num_experts_per_tok of
n_routed_experts; not the input embedding (a lookup). Not counted at all: the attention scores and values (QK^T and
AV, ~4·layers·heads·head_dim·keys per token, at most index_topk keys under DSA) and the indexer's key scores, so MFU
reads low at long sequences, where those grow.
"""

from __future__ import annotations

import torch

from slime_dsa.models.config import ModelConfig
from slime_dsa.models.glm_moe_dsa import GlmMoeDsaForCausalLM

# Dense tensor-core peak of one GPU in TFLOP/s (vendor data sheets, no sparsity): (bf16, fp32 without TF32). Matched
# in order against torch.cuda.get_device_name(), so a more specific name comes first.
PEAK_TFLOPS: tuple[tuple[str, tuple[float, float]], ...] = (
    ("H100 PCIe", (756.0, 51.0)),
    ("H200", (989.0, 67.0)),
    ("H100", (989.0, 67.0)),
    ("A100", (312.0, 19.5)),
    ("L40S", (362.0, 91.6)),
)


def active_params(config: ModelConfig) -> int:
    """The parameters one token's forward multiplies by (see the module docstring); the model is built on the meta
    device, so nothing is allocated."""
    with torch.device("meta"):
        model = GlmMoeDsaForCausalLM(config)
    routed_share = config.num_experts_per_tok / max(config.n_routed_experts, 1)
    total = 0.0
    for name, param in model.named_parameters(remove_duplicate=False):
        if name.startswith("model.embed_tokens."):
            continue
        total += param.numel() * (routed_share if ".mlp.experts." in name else 1.0)
    return int(total)


def train_flops(active: int, tokens: int, recompute_forward: bool = False) -> float:
    """Model FLOPs of training on `tokens` tokens: 6·N each (forward 2·N, backward 4·N), plus 2·N when π_old is
    recomputed by a forward of its own. Activation recomputation (gradient checkpointing) is not counted: MFU counts
    the model's FLOPs, not the hardware's."""
    return (6.0 + (2.0 if recompute_forward else 0.0)) * active * tokens


def peak_tflops(device_name: str | None, bf16: bool) -> float | None:
    """The dense peak of a GPU by its name (bf16, or fp32), or None for a CPU or a GPU not in PEAK_TFLOPS."""
    if not device_name:
        return None
    for key, (half, single) in PEAK_TFLOPS:
        if key in device_name:
            return half if bf16 else single
    return None
