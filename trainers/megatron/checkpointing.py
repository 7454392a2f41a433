"""Resumable checkpoints of Megatron ranks, without pickles: safetensors for tensors, JSON for the rest.

Layout of a checkpoint directory (the policy's role; the backend holds no other):
  model.safetensors                 the full model with HF names (rank 0): what export and engines read
  megatron/rank{r}.safetensors      rank r's own shards (Megatron names), its optimizer moments ("<param>/<key>")
                                    and RNG state
  megatron/rank{r}.json             its param groups, step, scheduler, Python RNG, and the parallel sizes (a resume
                                    must use the same ones)
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from trainers.megatron.weights import gather_hf_state, load_shard, local_state


def _jsonable(x):
    if isinstance(x, (tuple, list)):
        return [_jsonable(v) for v in x]
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, torch.Tensor):
        return x.item()
    return x


def save_rank_checkpoint(worker, directory: str) -> None:
    """Every rank calls this."""
    out, role = Path(directory), worker.policy
    if not hasattr(role.optimizer, "state_dict") or type(role.optimizer).__name__ == "DistributedAdam":
        raise RuntimeError("checkpoints of megatron's DistributedOptimizer (GPU) are not built yet; "
                           "set checkpoint.save_every: 0")
    state = gather_hf_state(role.model, role.model.config)
    if worker.rank == 0:
        save_file({k: v.contiguous() for k, v in state.items()}, out / "model.safetensors")
    names = {id(p): n for n, p in role.model.named_parameters()}
    optim = role.optimizer.state_dict()
    params = [p for group in role.optimizer.param_groups for p in group["params"]]
    tensors = {f"model/{k}": v.contiguous() for k, v in local_state(role.model).items()}
    for index, entry in optim["state"].items():
        for key, value in entry.items():
            tensors[f"optim/{names[id(params[index])]}/{key}"] = value.detach().cpu().contiguous()
    tensors["rng/torch"] = torch.get_rng_state()
    meta = {"param_groups": _jsonable(optim["param_groups"]), "param_names": [names[id(p)] for p in params],
            "step": role.step, "scheduler": _jsonable(role.scheduler.state_dict()),
            "python_rng": _jsonable(random.getstate()), "sizes": worker.sizes.__dict__}
    (out / "megatron").mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "megatron" / f"rank{worker.rank}.safetensors")
    (out / "megatron" / f"rank{worker.rank}.json").write_text(json.dumps(meta))
    dist.barrier()


def load_rank_checkpoint(worker, directory: str) -> None:
    """Every rank reads its own files back; training continues exactly."""
    src, role = Path(directory) / "megatron", worker.policy
    meta = json.loads((src / f"rank{worker.rank}.json").read_text())
    if meta["sizes"] != worker.sizes.__dict__:
        raise ValueError(f"the checkpoint was written with trainer.megatron {meta['sizes']}; this run has "
                         f"{worker.sizes.__dict__}")
    tensors = load_file(src / f"rank{worker.rank}.safetensors")
    load_shard(role.model, {k[len("model/"):]: v for k, v in tensors.items() if k.startswith("model/")})
    index = {name: i for i, name in enumerate(meta["param_names"])}
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        if key.startswith("optim/"):
            name, _, field = key[len("optim/"):].rpartition("/")
            state.setdefault(index[name], {})[field] = value
    groups = meta["param_groups"]
    for g in groups:
        g["betas"] = tuple(g["betas"]) if "betas" in g else None
        if g["betas"] is None:
            del g["betas"]
    role.optimizer.load_state_dict({"state": state, "param_groups": groups})
    role.step = meta["step"]
    role.scheduler.load_state_dict(meta["scheduler"])
    torch.set_rng_state(tensors["rng/torch"])
    version, internal, gauss = meta["python_rng"]
    random.setstate((version, tuple(internal), gauss))
    dist.barrier()
