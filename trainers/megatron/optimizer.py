"""megatron-core's DistributedOptimizer behind the calls the shared step makes (zero_grad, step, param_groups, and
clip before step), with our learning-rate schedule and checkpoint state. Used on GPUs: bf16 parameters, float32 main
weights and Adam moments sharded over the data-parallel ranks.

Three of megatron's steps run as FSDP2's one-rank path runs them, because without Transformer Engine or Apex megatron
falls back to slow ones: torch's fused AdamW kernel (megatron builds torch's AdamW with its default, foreach: several
passes over the float32 state), the gradient norm and clipping by torch's foreach functions (megatron's fallback
reads every parameter's norm back to the host, one device sync each, and scales every gradient separately), and the
copy of the updated main weights into the bf16 parameters as one foreach copy (megatron copies them one by one).

Checkpoint state is each rank's own shard, per parameter name (no collective, the same data-parallel size on
resume), read from and written into the torch optimizer megatron wraps. Not DistributedOptimizer.load_state_dict:
without Transformer Engine or Apex (torch's AdamW) it gives every parameter one shared `step` tensor, which the
next step then advances once per parameter."""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.distributed import DistributedDataParallel
from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
from megatron.core.optimizer import get_megatron_optimizer

from trainers.base import OptimizerConfig
from trainers.optim import lr_multiplier


class DistributedAdam:
    """Adam over float32 main weights sharded across data-parallel ranks (megatron's DistributedOptimizer)."""

    torch_paths = True  # False: megatron's own AdamW, norm, clip and copy (benchmarks/megatron_vs_fsdp.py compares)

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
        self.device = next(model.module.parameters()).device
        for opt in self._optimizers() if self.torch_paths else ():
            use_fused_adamw(opt.optimizer)
            copy_main_params_by_foreach(opt)

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none)

    def clip(self, max_norm: float) -> torch.Tensor:
        """Point the float32 main weights at their gradients, clip these by their global norm; that norm, a 0-dim
        float32 tensor left on the device (no host sync here).

        megatron's rule for which gradients count (get_grads_for_grad_norm: no shared or tensor-parallel duplicate
        counted twice), each optimizer's sum over its grad-stats group, as its ChainedOptimizer combines dense and
        expert norms; the norm and the scaling are torch's (get_total_norm, clip_grads_with_norm_)."""
        self.inner.prepare_grads()
        if not self.torch_paths:
            norm = self.inner.clip_grad_norm(max_norm) if max_norm > 0 else self.inner.get_grad_norm()
            return torch.as_tensor(float(norm))
        norms = []
        for opt in self._optimizers():
            grads = opt.get_grads_for_grad_norm()
            local = (torch.nn.utils.get_total_norm(grads) if grads
                     else torch.zeros((), device=self.device)).to(self.device, torch.float32)
            group = opt.get_grad_stats_parallel_group()
            if dist.get_world_size(group) > 1:
                square = local.double().square()
                dist.all_reduce(square, group=group)
                local = square.sqrt().float()
            norms.append(local)
        norm = torch.linalg.vector_norm(torch.stack(norms)) if len(norms) > 1 else norms[0]
        if max_norm > 0:
            torch.nn.utils.clip_grads_with_norm_([p for opt in self._optimizers() for p in opt.get_parameters()],
                                                 max_norm, norm)
        return norm

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


# How torch's optimizer runs, not what it learned: kept from the running optimizer when a checkpoint's groups load.
IMPLEMENTATION_KEYS = ("fused", "foreach", "capturable", "differentiable")


def like_group(saved: dict, current: dict) -> dict:
    """A param group's hyperparameters read back from JSON, as the optimizer holds them (betas a tuple, not a list),
    with the running optimizer's implementation flags (a checkpoint of the foreach AdamW loads into the fused one)."""
    group = {k: tuple(v) if isinstance(current.get(k), tuple) and isinstance(v, list) else v for k, v in saved.items()}
    return {**group, **{k: current[k] for k in IMPLEMENTATION_KEYS if k in current}}


def use_fused_adamw(optimizer: torch.optim.Optimizer) -> None:
    """Switch an AdamW megatron built (torch's, foreach by default) to torch's fused kernel before its first step:
    one pass over the parameters, gradients and moments instead of one per elementwise op. Its `step` state then
    lives on the parameters' device, as torch's fused AdamW keeps it (load_state_dict moves it there). Anything else
    (Transformer Engine's or Apex's FusedAdam, fused already) is left as it is."""
    if type(optimizer) is not torch.optim.AdamW:
        return
    if optimizer.state:
        raise ValueError(f"AdamW switched to its fused kernel after {len(optimizer.state)} parameters' steps")
    for group in (optimizer.defaults, *optimizer.param_groups):
        group.update(fused=True, foreach=False)


def copy_main_params_by_foreach(opt) -> None:
    """Make a megatron DistributedOptimizer copy its updated float32 main shards into the bf16 parameter buffer in
    one foreach copy, the same element casts as its loop of one copy_ per parameter. Left as megatron's where that
    copy does more (quantised parameters, precision-aware optimizer, megatron FSDP)."""
    ddp, config = opt.ddp_config, opt.config
    if (ddp.use_megatron_fsdp or ddp.fp8_param_gather or getattr(ddp, "fp4_param_gather", False)
            or config.use_precision_aware_optimizer_no_fp8_or_ds_fp8 or config.reuse_grad_buf_for_mxfp8_param_ag):
        return
    targets, sources = [], []
    for mains, models in ((opt.shard_fp32_from_float16_groups, opt.model_float16_groups),
                          (opt.shard_fp32_groups, opt.model_fp32_groups)):
        for main_group, model_group in zip(mains, models):
            for main, param in zip(main_group, model_group):
                world = opt._get_model_param_range_map(param)["gbuf_world_in_bucket"]
                buffer, _, bucket = opt.model_param_gbuf_map[param]
                targets.append(opt.buffers[buffer].buckets[bucket].param_data.view(-1)[world.start:world.end])
                sources.append(main)

    @torch.no_grad()
    def copy_main_params_to_model_params() -> None:
        if targets:
            torch._foreach_copy_(targets, sources)

    opt._copy_main_params_to_model_params = copy_main_params_to_model_params


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
