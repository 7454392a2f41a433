"""megatron-core's DistributedOptimizer behind the calls the shared step makes (zero_grad, step, param_groups, and
clip before step), with our learning-rate schedule and checkpoint state. Used on GPUs: bf16 parameters, float32 main
weights and Adam moments sharded over the data-parallel ranks.

Checkpoint state is each rank's own shard, per parameter name (no collective, the same data-parallel size on
resume), read from and written into the torch optimizer megatron wraps. Not DistributedOptimizer.load_state_dict:
without Transformer Engine or Apex (torch's AdamW) it gives every parameter one shared `step` tensor, which the
next step then advances once per parameter."""

from __future__ import annotations

import torch
from megatron.core.distributed import DistributedDataParallel
from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
from megatron.core.optimizer import get_megatron_optimizer

from trainers.base import OptimizerConfig
from trainers.optim import lr_multiplier


class DistributedAdam:
    """Adam over float32 main weights sharded across data-parallel ranks (megatron's DistributedOptimizer)."""

    def __init__(self, model: DistributedDataParallel, config: OptimizerConfig, indexer_learning_rate: float | None,
                 dtype: torch.dtype) -> None:
        if indexer_learning_rate is not None:
            raise ValueError("algorithm.indexer_learning_rate is not built for megatron's DistributedOptimizer (GPU) "
                             "yet; leave it null")
        beta1, beta2 = config.adam_betas
        self.config = MegatronOptimizerConfig(
            optimizer="adam", lr=config.learning_rate, weight_decay=config.weight_decay, adam_beta1=beta1,
            adam_beta2=beta2, adam_eps=1e-8, clip_grad=config.max_grad_norm, bf16=dtype == torch.bfloat16,
            params_dtype=dtype, use_distributed_optimizer=True)
        self.inner = get_megatron_optimizer(self.config, [model])
        self.names = {p: n for n, p in model.module.named_parameters()}

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none)

    def clip(self, max_norm: float) -> torch.Tensor:
        """Copy the model's gradients into the float32 main gradients, clip them by their global norm; that norm."""
        self.inner.prepare_grads()
        norm = self.inner.clip_grad_norm(max_norm) if max_norm > 0 else self.inner.get_grad_norm()
        return torch.as_tensor(float(norm))

    def step(self) -> None:
        """Adam on the main weights, then the bf16 parameters gathered back from every shard."""
        self.inner.step_with_ready_grads()

    def state(self) -> tuple[dict[str, torch.Tensor], list[list[dict]]]:
        """This rank's shard of the state, on CPU: {"<param>/main_param" (the float32 main weight), "<param>/<key>"
        (Adam's exp_avg, exp_avg_sq, step)}, and each of megatron's optimizers' param groups without their params."""
        tensors = {}
        for opt in self._optimizers():
            for model_param, main, _ in self._shards(opt):
                name = self.names[model_param]
                tensors[f"{name}/main_param"] = main.detach().to("cpu", copy=True)
                for key, value in opt.optimizer.state.get(main, {}).items():
                    if isinstance(value, torch.Tensor):
                        tensors[f"{name}/{key}"] = value.detach().to("cpu", copy=True)
        groups = [[{k: v for k, v in g.items() if k != "params"} for g in opt.optimizer.param_groups]
                  for opt in self._optimizers()]
        return tensors, groups

    @torch.no_grad()
    def load_state(self, tensors: dict[str, torch.Tensor], groups: list[list[dict]]) -> None:
        """The inverse of state() (groups as JSON gives them back); the shards must be laid out as when saved."""
        by_name: dict[str, dict[str, torch.Tensor]] = {}
        for key, value in tensors.items():
            name, _, field = key.rpartition("/")
            by_name.setdefault(name, {})[field] = value
        optimizers = self._optimizers()
        mine = {self.names[p] for opt in optimizers for p, _, _ in self._shards(opt)}
        if set(by_name) != mine or [len(g) for g in groups] != [len(o.optimizer.param_groups) for o in optimizers]:
            raise ValueError(f"the checkpoint's optimizer shards ({len(by_name)} parameters, param groups "
                             f"{[len(g) for g in groups]}) are not this rank's ({len(mine)}, "
                             f"{[len(o.optimizer.param_groups) for o in optimizers]})")
        for opt, saved in zip(optimizers, groups):
            current = opt.optimizer.state_dict()["param_groups"]  # each parameter's index in torch's state dict
            state = {}
            for model_param, main, (group, order) in self._shards(opt):
                name, fields = self.names[model_param], dict(by_name[self.names[model_param]])
                if tuple(fields["main_param"].shape) != tuple(main.shape):
                    raise ValueError(f"the checkpoint's optimizer shard of {name} has shape "
                                     f"{tuple(fields['main_param'].shape)}, this rank's {tuple(main.shape)}")
                main.copy_(fields.pop("main_param"))
                state[current[group]["params"][order]] = fields
            # torch's own load: the moments onto the main weights' device, each `step` its own tensor
            opt.optimizer.load_state_dict({"state": state, "param_groups": [
                {**like_group(s, g), "params": c["params"]}
                for s, g, c in zip(saved, opt.optimizer.param_groups, current)]})

    def _optimizers(self) -> list:
        """megatron's DistributedOptimizers: one for dense and one for expert parameters when both exist."""
        return list(getattr(self.inner, "chained_optimizers", [self.inner]))

    @staticmethod
    def _shards(opt):
        """(model parameter, its float32 main shard, (group, order)) for each parameter of `opt` this rank holds a
        shard of."""
        for model_param, (group, order) in opt.model_param_group_index_map.items():
            yield model_param, opt.optimizer.param_groups[group]["params"][order], (group, order)


def like_group(saved: dict, current: dict) -> dict:
    """A param group's hyperparameters read back from JSON, as the optimizer holds them (betas a tuple, not a list)."""
    return {k: tuple(v) if isinstance(current.get(k), tuple) and isinstance(v, list) else v for k, v in saved.items()}


class LambdaSchedule:
    """trainers.optim's warm-up and decay for an optimizer that is not a torch.optim.Optimizer."""

    def __init__(self, optimizer, warmup_steps: int, total_steps: int, schedule: str) -> None:
        self.optimizer, self.warmup, self.total, self.schedule = optimizer, warmup_steps, total_steps, schedule
        self.base_lrs = [g["lr"] for g in optimizer.param_groups]
        self.last_epoch = 0
        self._apply()

    def _apply(self) -> None:
        factor = lr_multiplier(self.last_epoch, self.warmup, self.total, self.schedule)
        for group, base in zip(self.optimizer.param_groups, self.base_lrs):
            group["lr"] = base * factor

    def get_last_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def step(self) -> None:
        self.last_epoch += 1
        self._apply()

    def state_dict(self) -> dict:
        return {"last_epoch": self.last_epoch, "base_lrs": self.base_lrs}

    def load_state_dict(self, state: dict) -> None:
        self.last_epoch, self.base_lrs = state["last_epoch"], state["base_lrs"]
        self._apply()
