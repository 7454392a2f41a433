"""RL losses and advantages as pure functions of packed token tensors: no I/O, no Ray, no models.

Per-token tensors are (T,) over the concatenated tokens of a batch, with `loss_mask` (T,) float and
`sample_index` (T,) long (which sample each token belongs to). Formulas: docs/algorithms.md §1–§5, §7.

  utils.py          masked_sum / masked_mean / seq_mean / aggregate (token_mean | seq_mean)
  types.py          LossInputs, LossOutputs
  advantages.py     GRPO / Dr. GRPO / group-centred advantages, zero-std groups (dynamic sampling)
  gae.py            GAE (skip-observation, bootstrapped at a cut), length-adaptive λ, decoupled actor/critic GAE,
                    the trajectory reward on the last action token
  policy_loss.py    the frame shared by policy losses: aggregation, KL to reference, entropy bonus
  ppo.py            PPO/GRPO clip (Clip-Higher, dual clip) with IcePop / TIS, bypass mode
  dis.py            async REINFORCE with direct double-sided importance sampling
  is_correction.py  IcePop mask and TIS weights from π_old / π_roll
  opd.py            on-policy distillation advantage (sampled reverse KL to a teacher)
  kl.py             k1 / k2 / k3 / low_var_kl estimators
  entropy.py        entropy metric
  value_loss.py     clipped value loss, explained variance
  specs/            the algorithm specs (grpo, async_reinforce, sao) and their registry: what the loops ask
"""

# Names load on first use (PEP 562): importing the package, e.g. for the spec registry that `recipe check` reads,
# must not import torch.
from __future__ import annotations

import importlib
from typing import Any

_SUBMODULE = {
    "DISLoss": "dis",
    "GAEOutputs": "gae",
    "LossInputs": "types",
    "LossOutputs": "types",
    "PPOLoss": "ppo",
    "PolicyLoss": "policy_loss",
    "ValueLoss": "value_loss",
    "ValueLossInputs": "value_loss",
    "advantage_metrics": "gae",
    "aggregate": "utils",
    "broadcast_to_tokens": "advantages",
    "decoupled_gae": "gae",
    "entropy_mean": "entropy",
    "explained_variance": "value_loss",
    "gae": "gae",
    "group_advantages": "advantages",
    "group_centered_advantages": "advantages",
    "group_index": "advantages",
    "icepop_weights": "is_correction",
    "kl_estimate": "kl",
    "length_adaptive_lambda": "gae",
    "masked_mean": "utils",
    "masked_sum": "utils",
    "opd_advantages": "opd",
    "reverse_kl_per_sample": "opd",
    "rewards_on_last_action": "gae",
    "sample_index_from_cu_seqlens": "utils",
    "seq_mean": "utils",
    "tis_weights": "is_correction",
    "zero_std_groups": "advantages",
}

__all__ = sorted(_SUBMODULE)


def __getattr__(name: str) -> Any:
    if name not in _SUBMODULE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(f"{__name__}.{_SUBMODULE[name]}")
    # Bind every name of that submodule at once: importing it set the package attribute of its own name (gae)
    # to the module, which the function of the same name must replace.
    globals().update({n: getattr(module, n) for n, sub in _SUBMODULE.items() if sub == _SUBMODULE[name]})
    return globals()[name]
