"""RL losses and advantages as pure functions of packed token tensors: no I/O, no Ray, no models.

Per-token tensors are (T,) over the concatenated tokens of a batch, with `loss_mask` (T,) float and
`sample_index` (T,) long (which sample each token belongs to). Formulas: shared/ALGORITHMS.md §1–§5, §7.

  utils.py          masked_sum / masked_mean / seq_mean / aggregate (token_mean | seq_mean)
  types.py          LossInputs, LossOutputs
  advantages.py     GRPO / Dr. GRPO / group-centred advantages, zero-std groups (dynamic sampling)
  gae.py            GAE, skip-observation GAE, length-adaptive λ, decoupled actor/critic GAE
  policy_loss.py    the frame shared by policy losses: aggregation, KL to reference, entropy bonus
  ppo.py            PPO/GRPO clip (Clip-Higher, dual clip) with IcePop / TIS, bypass mode
  dis.py            async REINFORCE with direct double-sided importance sampling
  is_correction.py  IcePop mask and TIS weights from π_old / π_roll
  opd.py            on-policy distillation advantage (sampled reverse KL to a teacher)
  kl.py             k1 / k2 / k3 / low_var_kl estimators
  entropy.py        entropy metric
  value_loss.py     clipped value loss, explained variance
  registry.py       build_policy_loss(name, **cfg)
"""

from slime_dsa.algorithms.advantages import (
    broadcast_to_tokens,
    group_advantages,
    group_centered_advantages,
    group_index,
    zero_std_groups,
)
from slime_dsa.algorithms.dis import DISLoss
from slime_dsa.algorithms.entropy import entropy_mean
from slime_dsa.algorithms.gae import GAEOutputs, advantage_metrics, decoupled_gae, gae, length_adaptive_lambda
from slime_dsa.algorithms.is_correction import icepop_weights, tis_weights
from slime_dsa.algorithms.kl import kl_estimate
from slime_dsa.algorithms.opd import opd_advantages, reverse_kl_per_sample
from slime_dsa.algorithms.policy_loss import PolicyLoss
from slime_dsa.algorithms.ppo import PPOLoss
from slime_dsa.algorithms.registry import POLICY_LOSSES, build_policy_loss
from slime_dsa.algorithms.types import LossInputs, LossOutputs
from slime_dsa.algorithms.utils import (
    aggregate,
    masked_mean,
    masked_sum,
    sample_index_from_cu_seqlens,
    seq_mean,
)
from slime_dsa.algorithms.value_loss import ValueLoss, ValueLossInputs, explained_variance

__all__ = [
    "DISLoss",
    "GAEOutputs",
    "LossInputs",
    "LossOutputs",
    "POLICY_LOSSES",
    "PPOLoss",
    "PolicyLoss",
    "ValueLoss",
    "ValueLossInputs",
    "advantage_metrics",
    "aggregate",
    "broadcast_to_tokens",
    "build_policy_loss",
    "decoupled_gae",
    "entropy_mean",
    "explained_variance",
    "gae",
    "group_advantages",
    "group_centered_advantages",
    "group_index",
    "icepop_weights",
    "kl_estimate",
    "length_adaptive_lambda",
    "masked_mean",
    "masked_sum",
    "opd_advantages",
    "reverse_kl_per_sample",
    "sample_index_from_cu_seqlens",
    "seq_mean",
    "tis_weights",
    "zero_std_groups",
]
