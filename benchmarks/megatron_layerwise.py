"""Where Megatron's bf16 forward first differs from FSDP2's, layer by layer, at equal weights (issue 17).

One process, one device, one checkpoint: Megatron's model in bf16 (as its ranks build it), FSDP2's one-rank bf16
compute copy (trainers/fsdp/bf16_compute.py: what FSDP2's mixed precision computes, to the bit) and the float32
master. The same packed batch goes through each, with hooks at the embedding, every layer's attention, router (its
float32 logits, routing weights and expert choice), routed experts' sum, shared expert, MLP and residual, the final
norm, the log-softmax of the logits and the token log-probs. Two views:
  chain  each model's own forward: differences include those carried in from earlier layers
  local  Megatron's attention and MLP re-run on FSDP2's inputs of the same layer: a difference there is made by
         that module (the first module with one is where the two paths round differently)
Each figure is max and mean |Δ| in float32; `choice_differs` is the fraction of tokens whose top-k expert set differs.
Variants (VARIANTS) rerun Megatron's model with some of the computations trainers/megatron takes from GlmMoeDsa set
back to megatron's own (fused fc1 GEMM, scatter_add_ combine, megatron's top-k normalisation and router GEMM,
index_select dispatch, the shared expert first): how much each adds. Then the gradients of one weighted log-prob
sum, per HF tensor ||Δ|| / ||g||, of Megatron as built and with all of megatron's own back, and of float32, against
FSDP2's.
    python benchmarks/megatron_layerwise.py --checkpoint DIR --device cuda --out layerwise.json
    python benchmarks/megatron_layerwise.py --checkpoint DIR --device cpu --grouped --out l.json  # GPU's expert path
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import logging
import os
from pathlib import Path

import torch
import torch.nn.functional as F

logger = logging.getLogger("megatron_layerwise")


def _flat(t: torch.Tensor) -> torch.Tensor:
    """(T, D), (T, 1, D) or (1, T, D) -> (T, D) float32."""
    return t.detach().reshape(-1, t.shape[-1]).float()


def _gap(a: torch.Tensor, b: torch.Tensor) -> dict:
    d = (_flat(a) - _flat(b)).abs()
    return {"max": float(f"{float(d.max()):.3g}"), "mean": float(f"{float(d.mean()):.3g}")}


class Taps:
    """Forward hooks writing module outputs (and inputs) into `store[key]`; `phase` prefixes the keys."""

    def __init__(self) -> None:
        self.store: dict[str, object] = {}
        self.phase = ""
        self.handles = []
        self.patched = []

    def out(self, module: torch.nn.Module, key: str, pick=lambda o: o[0] if isinstance(o, tuple) else o) -> None:
        def hook(_m, _args, output):
            self.store[self.phase + key] = pick(output)
        self.handles.append(module.register_forward_hook(hook))

    def inp(self, module: torch.nn.Module, key: str) -> None:
        def hook(_m, args, kwargs):
            self.store[self.phase + key] = (args, kwargs)
        self.handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))

    def wrap(self, obj, name: str, make) -> None:
        """obj.name = make(obj.name) until remove()."""
        self.patched.append((obj, name, obj.__dict__.get(name)))
        setattr(obj, name, make(getattr(obj, name)))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        for obj, name, old in reversed(self.patched):
            if old is None:
                delattr(obj, name)
            else:
                setattr(obj, name, old)
        self.handles, self.patched = [], []


def _routing(weights: torch.Tensor, expert_ids: torch.Tensor, n_experts: int) -> torch.Tensor:
    """GlmMoeDsa's (T, k) routing weights and ids -> dense (T, E) float32 weights (0 where not chosen)."""
    return torch.zeros(weights.shape[0], n_experts, device=weights.device).scatter(1, expert_ids, weights.float())


def tap_ours(model, taps: Taps) -> None:
    """Hooks on a GlmMoeDsaForCausalLM (FSDP2's copy or the float32 master)."""
    taps.out(model.model.embed_tokens, "embedding")
    for i, layer in enumerate(model.model.layers[: model.config.num_hidden_layers]):
        taps.inp(layer.self_attn, f"{i}.attention_in")
        taps.out(layer.self_attn, f"{i}.attention")
        taps.inp(layer.mlp, f"{i}.mlp_in")
        taps.out(layer.mlp, f"{i}.mlp")
        taps.out(layer, f"{i}.residual")
        if hasattr(layer.mlp, "gate"):
            n = layer.mlp.gate.n_experts
            taps.inp(layer.mlp.gate, f"{i}.router_in")
            taps.out(layer.mlp.gate, f"{i}.routing", pick=lambda o, n=n: _routing(o[0], o[1], n))
            taps.out(layer.mlp.experts, f"{i}.routed")
            taps.out(layer.mlp.shared_experts, f"{i}.shared")
    taps.out(model.model.norm, "final_norm")


def tap_megatron(model, taps: Taps) -> None:
    """The same points on a MegatronGlmMoeDsa; the routed experts' sum is read at RoundedMoELayer.postprocess."""
    taps.out(model.embedding, "embedding")
    for i, layer in enumerate(model.layers):
        taps.out(layer.self_attention, f"{i}.attention")
        taps.out(layer.mlp, f"{i}.mlp")
        taps.out(layer, f"{i}.residual")
        if hasattr(layer.mlp, "router"):
            taps.inp(layer.mlp.router, f"{i}.router_in")
            taps.out(layer.mlp.router, f"{i}.routing", pick=lambda o: o[0].float())
            taps.out(layer.mlp.shared_experts, f"{i}.shared")
            taps.wrap(layer.mlp, "postprocess", lambda original, i=i: _reading_routed(original, layer.mlp, taps,
                                                                                    f"{i}.routed"))
    taps.out(model.final_norm, "final_norm")


def _reading_routed(postprocess, moe, taps: Taps, key: str):
    """moe's postprocess, first storing the routed experts' sum (rounded as it then is) under key."""
    def read(output, shared):
        taps.store[taps.phase + key] = output.to(moe.config.params_dtype)
        return postprocess(output, shared)
    return read


def _router_logits(store: dict, key: str, weight: torch.Tensor) -> torch.Tensor:
    (x, *_), _ = store[key]
    return F.linear(_flat(x), weight.float())


def compare_runs(a: dict, b: dict, layers: int, routers: dict, prefix: str = "") -> dict:
    """Per point |Δ| between two stores of taps (keys prefix + point)."""
    def has(key):
        return prefix + key in a and prefix + key in b

    out = {"embedding": _gap(a[prefix + "embedding"], b[prefix + "embedding"])} if has("embedding") else {}
    for i in range(layers):
        row = {p: _gap(a[prefix + f"{i}.{p}"], b[prefix + f"{i}.{p}"])
               for p in ("attention", "routed", "shared", "mlp", "residual") if has(f"{i}.{p}")}
        if has(f"{i}.routing"):
            ra, rb = a[prefix + f"{i}.routing"], b[prefix + f"{i}.routing"]
            row["routing_weights"] = _gap(ra, rb)
            row["choice_differs"] = float(f"{float(((ra > 0) != (rb > 0)).any(-1).float().mean()):.3g}")
            if i in routers:
                la, lb = (_router_logits(s, prefix + f"{i}.router_in", routers[i]) for s in (a, b))
                row["router_logits"] = _gap(la, lb)
        out[f"layer{i}"] = row
    if has("final_norm"):
        out["final_norm"] = _gap(a[prefix + "final_norm"], b[prefix + "final_norm"])
    return out


def first_difference(report: dict) -> str | None:
    """The first point (in forward order) whose max |Δ| is not 0."""
    for name, entry in report.items():
        if "max" in entry:
            if entry["max"] > 0:
                return name
            continue
        for point in ("attention", "router_logits", "choice_differs", "routing_weights", "routed", "shared", "mlp",
                      "residual"):
            value = entry.get(point)
            if value is not None and (value if isinstance(value, float) else value["max"]) > 0:
                return f"{name}.{point}"
    return None


def _log_softmax(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(F.linear(hidden, weight).float(), dim=-1)


# Megatron's own computations that trainers/megatron replaces by GlmMoeDsa's, each switchable at forward time:
# (class, attribute, value that restores megatron's). A variant turns the listed ones back to megatron's.
UPSTREAM = {
    "fused_fc1": ("trainers.megatron.mlp", "SplitGluMLP", "split_gate_up", False),
    "scatter_combine": ("trainers.megatron.experts", "LocalExpertsDispatcher", "ordered_combine", False),
    "megatron_topk": ("trainers.megatron.experts", "GlmTopKRouter", "glm_topk", False),
    "megatron_gating": ("trainers.megatron.experts", "GlmTopKRouter", "torch_gating", False),
    "index_select_dispatch": ("trainers.megatron.experts", "LocalExpertsDispatcher", "gather_by_index", False),
    "shared_expert_first": ("trainers.megatron.experts", "RoundedMoELayer", "shared_expert_last", False),
}
VARIANTS = {"as_built": (), **{name: (name,) for name in UPSTREAM}, "all_upstream": tuple(UPSTREAM)}


@contextlib.contextmanager
def _reference_ops():
    """Within: the DSA ops' torch reference (the float32 model's: the Triton kernels' float32 dots would be TF32)."""
    from slime_dsa import ops  # noqa: PLC0415

    before = ops.get_backend()
    ops.set_backend("torch")
    try:
        yield
    finally:
        ops.set_backend(before)


@contextlib.contextmanager
def _upstream(names: tuple[str, ...]):
    """Within: the named computations (UPSTREAM) are megatron's own; after: as they were."""
    saved = []
    for name in names:
        module, cls, attr, value = UPSTREAM[name]
        owner = getattr(importlib.import_module(module), cls)
        saved.append((owner, attr, getattr(owner, attr)))
        setattr(owner, attr, value)
    try:
        yield
    finally:
        for owner, attr, value in reversed(saved):
            setattr(owner, attr, value)


def _traced(model, tap, head: torch.Tensor, ids, batch, hidden_size: int) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """One forward with taps: (store, token log-probs, log-softmax of the logits)."""
    taps = Taps()
    tap(model, taps)
    try:
        logprobs = model.token_logprobs(ids, batch)[0].float()
    finally:
        taps.remove()
    return taps.store, logprobs, _log_softmax(taps.store["final_norm"].reshape(-1, hidden_size), head)


def _local_megatron(megatron, ours: dict) -> dict:
    """Megatron's attention and MLP of every layer on FSDP2's inputs of that layer (taps under 'local.')."""
    taps = Taps()
    tap_megatron(megatron, taps)
    taps.phase = "local."
    try:
        for i, layer in enumerate(megatron.layers):
            (x, *rest), kwargs = ours[f"{i}.attention_in"]
            layer.self_attention(x.unsqueeze(1), *rest, **kwargs)
            (x, *rest), kwargs = ours[f"{i}.mlp_in"]
            layer.mlp(x.unsqueeze(1), *rest, **kwargs)
    finally:
        taps.remove()
    return taps.store


def _backward(model, ids, batch, weights: torch.Tensor) -> None:
    """Gradients of sum_t weights[t] log p(x_t) into the model's .grad (cleared first)."""
    model.zero_grad(set_to_none=True)
    with torch.enable_grad():
        (model.token_logprobs(ids, batch)[0].float() * weights).sum().backward()


def _hf_grads(model) -> dict[str, torch.Tensor]:
    """A GlmMoeDsaForCausalLM's gradients by HF name, float32 on CPU."""
    return {n: p.grad.float().cpu() for n, p in model.named_parameters() if p.grad is not None}


def grad_gaps(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor], worst: int = 5) -> dict:
    """Per HF tensor ||got - ref|| / ||ref||: how many differ at all, the largest few (name, value) and their max."""
    rel = {n: float((got[n] - g).norm() / g.norm().clamp_min(1e-30)) for n, g in ref.items()}
    top = sorted(rel.items(), key=lambda kv: -kv[1])[:worst]
    return {"tensors": len(rel), "differ": sum(v > 0 for v in rel.values()), "max_rel": float(f"{top[0][1]:.3g}"),
            "worst": [[n, float(f"{v:.3g}")] for n, v in top]}


def gradients(fsdp, float32, megatron, ids, batch, variants: tuple[str, ...]) -> dict:
    """Gradients at equal weights of one weighted log-prob sum: Megatron (each variant) and float32 against FSDP2's
    bf16 copy, per HF tensor (grad_gaps)."""
    from trainers.megatron.weights import gather_hf, local_grads  # noqa: PLC0415

    weights = torch.randn(ids.shape[0], generator=torch.Generator().manual_seed(1)).to(ids.device)
    _backward(fsdp, ids, batch, weights)
    ours = _hf_grads(fsdp)
    fsdp.zero_grad(set_to_none=True)
    with _reference_ops():
        _backward(float32, ids, batch, weights)
    out = {"float32": grad_gaps(ours, _hf_grads(float32))}
    float32.zero_grad(set_to_none=True)
    for name in variants:
        with _upstream(VARIANTS[name]):
            _backward(megatron, ids, batch, weights)
        out[f"megatron_{name}"] = grad_gaps(ours, gather_hf(local_grads(megatron), megatron.config))
        megatron.zero_grad(set_to_none=True)
    return out


def _tail(a: tuple, b: tuple) -> dict:
    """Log-softmax and token log-prob gaps of two traced runs."""
    return {"log_softmax": _gap(a[2], b[2]), "logprob": _gap(a[1][:, None], b[1][:, None])}


@torch.no_grad()
def layerwise(checkpoint: str, device: torch.device, seqlens: list[int], seed: int = 0, grouped: bool = False,
              variants: tuple[str, ...] = tuple(VARIANTS), with_gradients: bool = True) -> dict:
    """The chain and local comparisons (module docstring) of Megatron and FSDP2 in bf16, for each variant of
    Megatron's model (VARIANTS: as built, or with some of its computations back to megatron's own), and of FSDP2
    and Megatron as built against float32. Needs an initialised world of one rank (see run). grouped: force both
    models' grouped-GEMM expert path (the GPU's) on the CPU."""
    from slime_dsa.checkpoint.hf_format import load_model  # noqa: PLC0415
    from slime_dsa.models.glm_moe_dsa import Experts, PackedBatch  # noqa: PLC0415
    from trainers.fsdp.bf16_compute import Bf16Compute  # noqa: PLC0415
    from trainers.megatron.experts import GroupedSequentialMLP  # noqa: PLC0415
    from trainers.megatron.parallel import initialize, parallel_sizes  # noqa: PLC0415
    from trainers.megatron.worker import load_model as load_megatron  # noqa: PLC0415

    if grouped:
        Experts.use_grouped_mm = GroupedSequentialMLP.use_grouped_mm = True
    sizes = parallel_sizes({})
    groups, place = initialize(sizes)
    if device.type == "cuda":  # after initialize: the seed reads the tensor-parallel rank
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed  # noqa: PLC0415

        model_parallel_cuda_manual_seed(0)
    megatron = load_megatron(checkpoint, sizes, groups, place, torch.bfloat16, device).eval()
    fsdp_copy = Bf16Compute(load_model(checkpoint, dtype=torch.float32, device=device))
    fsdp, float32 = fsdp_copy.module.eval(), fsdp_copy.master.eval()
    config = fsdp.config
    ids = torch.randint(0, config.vocab_size, (sum(seqlens),), generator=torch.Generator().manual_seed(seed))
    ids, batch = ids.to(device), PackedBatch.from_seqlens(seqlens, device)
    routers = {i: layer.mlp.gate.weight for i, layer in enumerate(fsdp.model.layers) if hasattr(layer.mlp, "gate")}
    layers, D = config.num_hidden_layers, config.hidden_size
    ours = _traced(fsdp, tap_ours, fsdp.lm_head.weight, ids, batch, D)
    with _reference_ops():
        reference = _traced(float32, tap_ours, float32.lm_head.weight, ids, batch, D)
    local_ref = {f"local.{k}": v for k, v in ours[0].items()}
    result = {"tokens": sum(seqlens), "grouped_forced": grouped, "device": str(device),
              "fsdp_vs_float32": {**compare_runs(reference[0], ours[0], layers, routers), **_tail(reference, ours)},
              "variants": {}}
    for name in variants:
        with _upstream(VARIANTS[name]):
            theirs = _traced(megatron, tap_megatron, megatron.output_layer.weight, ids, batch, D)
            local = compare_runs(local_ref, _local_megatron(megatron, ours[0]), layers, routers, prefix="local.")
        chain = {**compare_runs(ours[0], theirs[0], layers, routers), **_tail(ours, theirs)}
        result["variants"][name] = {
            "upstream": list(VARIANTS[name]),
            "first_difference": {"chain": first_difference(chain), "local": first_difference(local)},
            "megatron_vs_fsdp": {"chain": chain, "local": local},
            "megatron_vs_float32": _tail(reference, theirs)}
        del theirs
    if with_gradients:
        grad_variants = tuple(v for v in ("as_built", "all_upstream") if v in variants)
        result["gradients_vs_fsdp"] = gradients(fsdp, float32, megatron, ids, batch, grad_variants)
    return result


def summary(result: dict) -> list[str]:
    """Log lines: per variant the first differences and the log-prob gaps; for the first variant, per layer mean
    |Δ| of the residual, the expert choice and the largest local differences."""
    ref = result["fsdp_vs_float32"]["logprob"]
    lines = [f"{result['tokens']} tokens, bf16, equal weights; FSDP2 vs float32: logprob mean {ref['mean']:.3g} "
             f"max {ref['max']:.3g}"]
    for i, (name, v) in enumerate(result["variants"].items()):
        gap, f32 = v["megatron_vs_fsdp"]["chain"]["logprob"], v["megatron_vs_float32"]["logprob"]
        lines.append(f"megatron {name}: vs FSDP2 logprob mean {gap['mean']:.3g} max {gap['max']:.3g}; vs float32 "
                     f"mean {f32['mean']:.3g}; first difference chain {v['first_difference']['chain']}, local "
                     f"{v['first_difference']['local']}")
        if i:
            continue
        chain, local = v["megatron_vs_fsdp"]["chain"], v["megatron_vs_fsdp"]["local"]
        for layer, row in chain.items():
            if layer.startswith("layer"):
                loc = {p: e["max"] for p, e in local.get(layer, {}).items() if isinstance(e, dict) and e["max"] > 0}
                lines.append(f"  {layer}: residual mean {row['residual']['mean']:.3g} max {row['residual']['max']:.3g};"
                             f" choice differs {row.get('choice_differs', '-')}; local max |Δ| {loc or 0}")
    for name, g in result.get("gradients_vs_fsdp", {}).items():
        lines.append(f"gradients {name} vs FSDP2: {g['differ']} of {g['tensors']} tensors differ, max relative "
                     f"{g['max_rel']:.3g} ({g['worst'][0][0]})")
    return lines


def run(rank: int, port: int, checkpoint: str, options: dict, out: str) -> None:
    """One spawned process: a world of one rank (nccl on a GPU, gloo with the CPU shim), layerwise, JSON to out."""
    import torch.distributed as dist  # noqa: PLC0415

    from trainers.megatron import cpu_shim  # noqa: PLC0415

    cuda = options["device"] == "cuda"
    if not cuda:
        torch.set_num_threads(1)
    cpu_shim.apply()  # a no-op on a GPU machine
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=1)
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    try:
        result = layerwise(checkpoint, device, options["seqlens"], grouped=options.get("grouped", False),
                           variants=tuple(options.get("variants") or VARIANTS),
                           with_gradients=options.get("gradients", True))
    finally:
        dist.destroy_process_group()
    Path(out).write_text(json.dumps(result, indent=1))


def spawn(checkpoint: str, options: dict, out: str) -> dict:
    """run() in a fresh process; its result."""
    import torch.multiprocessing as mp  # noqa: PLC0415

    from trainers.process_group import free_port  # noqa: PLC0415

    mp.start_processes(run, args=(free_port(), checkpoint, options, out), nprocs=1, start_method="spawn")
    return json.loads(Path(out).read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", required=True, help="an HF GLM-MoE-DSA checkpoint directory")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--seqlens", default="1024", help="comma-separated packed sequence lengths")
    parser.add_argument("--grouped", action="store_true", help="force the grouped-GEMM experts (the GPU's path)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"of {', '.join(VARIANTS)}")
    parser.add_argument("--no-gradients", action="store_true", help="forward comparisons only")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    options = {"device": args.device, "seqlens": [int(s) for s in args.seqlens.split(",")], "grouped": args.grouped,
               "variants": args.variants.split(","), "gradients": not args.no_gradients}
    for line in summary(spawn(args.checkpoint, options, args.out)):
        logger.info(line)


if __name__ == "__main__":
    main()
