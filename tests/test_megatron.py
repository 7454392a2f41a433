"""The Megatron backend against FSDP2 and transformers, on CPU over gloo (real megatron-core, real processes).

- HF -> Megatron -> HF is bit-exact for every TP x EP layout (in memory, and through tools/ on disk; the result
  loads in transformers).
- The same 5 batches give the same trajectory in FSDP2 (2 ranks) and Megatron with TP=1 (DP 2), TP=2 and EP=2
  (DP 2): float32, loss and grad norm within rtol 1e-5, the log-probs before every step within 2e-5, every gradient
  of the first step (indexer included) within rtol 1e-4 + atol 1e-7, the indexer KL within rtol 1e-3 + atol 1e-8
  (its value is ~1e-5, so that is summation noise).
- A checkpoint of megatron's DistributedOptimizer (bf16) resumes bit for bit in a fresh process: on one GPU, and on
  2 CPU ranks with its CUDA-only spots pretended.
- DistributedAdam's fused AdamW, foreach grad norm, clipping and main-weight copy give what megatron's own do.
- ForeachMainGradDDP's main gradients (added after each backward in foreach ops) equal megatron's DDP's (a hook per
  parameter) over several bf16 micro-batches.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.hf_reference import make_hf_checkpoint
from trainers.process_group import free_port

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron") is None,
                                reason="megatron-core is not installed (pip install -e '.[megatron]', Python >= 3.12)")
VOCAB = 96  # divisible by the tensor-parallel sizes below
LAYOUTS = {"tp1": {}, "tp2": {"tensor_parallel": 2}, "ep2": {"expert_parallel": 2}}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("megatron") / "hf"
    make_hf_checkpoint(directory, vocab_size=VOCAB)
    return directory


def _hf_state(directory: Path) -> dict[str, torch.Tensor]:
    return load_file(next(directory.glob("*.safetensors")))


@pytest.mark.parametrize(("tp", "ep"), [(1, 1), (2, 1), (1, 2), (2, 4), (4, 8)])
def test_hf_megatron_hf_is_bit_exact(checkpoint, tp, ep):
    from slime_dsa.models.config import ModelConfig
    from trainers.megatron.convert import hf_to_megatron, megatron_to_hf

    config, hf = ModelConfig.from_pretrained(checkpoint), _hf_state(checkpoint)
    shards = {(t, e): hf_to_megatron(hf, config, tp, ep, t, e) for t in range(tp) for e in range(ep)}
    assert shards[0, 0]["layers.1.mlp.router.expert_bias"].abs().sum() > 0  # the selection bias travels too
    back = megatron_to_hf(shards, config, tp, ep)
    assert back.keys() == hf.keys()
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name


@pytest.mark.slow
def test_tools_convert_round_trip_loads_in_transformers(checkpoint, tmp_path):
    from transformers import AutoModelForCausalLM

    megatron, hf = tmp_path / "megatron", tmp_path / "hf"
    for script, src, dst, extra in (("convert_hf_to_megatron.py", checkpoint, megatron, ["--tensor-parallel", "2",
                                                                                          "--expert-parallel", "2"]),
                                    ("convert_megatron_to_hf.py", megatron, hf, [])):
        done = subprocess.run([sys.executable, str(ROOT / "tools" / script), str(src), str(dst), *extra],
                              capture_output=True, text=True, cwd=ROOT, timeout=300)
        assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in megatron.glob("mp_rank_*")) == ["mp_rank_00_000", "mp_rank_00_001",
                                                                   "mp_rank_01_000", "mp_rank_01_001"]
    original, back = _hf_state(checkpoint), _hf_state(hf)
    assert back.keys() == original.keys() and all(torch.equal(back[k], v) for k, v in original.items())
    model, info = AutoModelForCausalLM.from_pretrained(hf, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]


def test_convert_refuses_a_layout_the_model_does_not_divide(checkpoint, tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("convert_hf_to_megatron", ROOT / "tools" / "convert_hf_to_megatron.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert tool.main([str(checkpoint), str(tmp_path / "out"), "--tensor-parallel", "5"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: trainer.megatron.tensor_parallel (5) must divide the model's num_attention_heads (4)"]
    assert not (tmp_path / "out").exists()


# -- conformance: FSDP2 and Megatron ranks on the same batches ---------------------------------------------------


def _run(backend: str, checkpoint: Path, options: dict, out: Path) -> dict:
    import torch.multiprocessing as mp

    from tests.megatron_conformance import train

    mp.start_processes(train, args=(2, free_port(), backend, str(checkpoint), options, str(out)), nprocs=2,
                       start_method="spawn")
    record = json.loads(out.read_text())
    record["grads"] = load_file(f"{out}.grads.safetensors")
    return record


@pytest.fixture(scope="module")
def fsdp_run(checkpoint) -> dict:
    return _run("fsdp", checkpoint, {}, checkpoint.parent / "fsdp.json")


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_same_trajectory_as_fsdp(fsdp_run, checkpoint, layout):
    got = _run("megatron", checkpoint, LAYOUTS[layout], checkpoint.parent / f"megatron_{layout}.json")
    ref = fsdp_run
    for step, (a, b) in enumerate(zip(ref["steps"], got["steps"])):
        for key in ("loss", "pg_loss", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), (step, key)
        assert b["indexer_kl"] == pytest.approx(a["indexer_kl"], rel=1e-3, abs=1e-8), step
        assert a["indexer_kl"] > 0
    assert len(got["steps"]) == 5
    # The log-probs before each step: the weights moved alike. Rank 0's samples of each run, matched by sample id.
    rows = _rows(ref["share"])
    for step, (a, b) in enumerate(zip(ref["logprobs"], got["logprobs"])):
        mine = torch.tensor(b)[_rows(got["share"], keep=ref["share"])]
        torch.testing.assert_close(mine, torch.tensor(a)[rows], rtol=0, atol=2e-5, msg=f"step {step}")
    assert ref["logprobs"][0] != ref["logprobs"][-1]  # they did move
    indexer = [k for k in ref["grads"] if ".indexer." in k]
    assert indexer and all(ref["grads"][k].abs().sum() > 0 for k in indexer)
    for name, grad in ref["grads"].items():
        torch.testing.assert_close(got["grads"][name], grad, rtol=1e-4, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.slow
def test_activation_recomputation_gives_the_same_gradients(checkpoint, tmp_path):
    """TP=2 (sequence parallel): every layer runs its forward again in backward, and every gradient is unchanged."""
    import torch.multiprocessing as mp

    from tests.megatron_conformance import recompute

    out = tmp_path / "recompute.json"
    mp.start_processes(recompute, args=(2, free_port(), str(checkpoint), {"tensor_parallel": 2}, str(out)), nprocs=2,
                       start_method="spawn")
    record = json.loads(out.read_text())
    assert record["True"]["layer_forwards"] == 2 * record["False"]["layer_forwards"] > 0
    assert record["True"]["grad_norm"] == pytest.approx(record["False"]["grad_norm"], rel=1e-6)
    plain, again = load_file(f"{out}.False.safetensors"), load_file(f"{out}.True.safetensors")
    assert plain.keys() == again.keys()
    for name, grad in plain.items():
        torch.testing.assert_close(again[name], grad, rtol=1e-6, atol=1e-9, msg=lambda m, n=name: f"{n}: {m}")


def _rows(share: list[int], keep: list[int] | None = None) -> torch.Tensor:
    """Row indices of the samples `keep` (default: all) within a share's packed log-probs."""
    from tests.megatron_conformance import NUM_SAMPLES, batches

    lens = batches(VOCAB, count=1)[0].seqlens
    keep = share if keep is None else keep
    rows, offset = [], 0
    for i in share:
        if i in keep:
            rows += range(offset, offset + lens[i])
        offset += lens[i]
    assert len(lens) == NUM_SAMPLES
    return torch.tensor(rows)


def _bf16_logprobs(tmp_path: Path, float32_router: bool) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Log-probs of Megatron in bf16, FSDP2, the bf16 compute copy, the engine and float32 at one checkpoint's weights
    (tests.megatron_conformance.bf16_logprobs), and the router / indexer-head tensors Megatron holds unlike the file."""
    import torch.multiprocessing as mp

    from tests.megatron_conformance import bf16_logprobs, float32_tensors, save_bf16_checkpoint

    save_bf16_checkpoint(tmp_path / "bf16", float32_router)
    if float32_router:  # the test means something only if bf16 cannot hold these values
        assert all(not torch.equal(t, t.bfloat16().float()) for t in float32_tensors(tmp_path / "bf16").values())
    out = tmp_path / "bf16.json"
    mp.start_processes(bf16_logprobs, args=(free_port(), str(tmp_path / "bf16"), str(out)), nprocs=1,
                       start_method="spawn")
    record = json.loads(out.read_text())
    logp = {k: torch.tensor(record[k]) for k in ("megatron", "fsdp", "bf16_compute", "engine", "float32")}
    return logp, record["megatron_float32_as_file"]


def _gaps(logp: dict[str, torch.Tensor], reduce) -> dict[str, float]:
    return {k: float(reduce((logp[k] - logp["megatron"]).abs())) for k in ("fsdp", "bf16_compute", "engine", "float32")}


@pytest.mark.parametrize("float32_router", [False, True], ids=["bf16_values", "float32_router"])
def test_bf16_logprobs_match_fsdp_and_the_engine_at_equal_weights(tmp_path, float32_router):
    """bf16 on CPU, at the weights of one checkpoint: Megatron (bf16 parameters), FSDP2 (bf16 mixed precision), one
    mixed-precision rank's bf16 compute copy and the engine's bf16 model give bit-identical log-probs (each ~7e-3
    from float32 on average). With float32_router the checkpoint's router weight, selection bias and indexer head
    hold float32 values bf16 cannot: every path keeps them in float32 unrounded (before: the engine and Megatron
    rounded all three, FSDP2 and the copy the router weight and indexer head but not the bias). Earlier, before
    Megatron's MoE layer summed its experts as GlmMoeDsa does and FSDP2 computed the indexer head in float32, even
    bf16 values gave mean |Δ| 2.8e-3: a few bf16 roundings flip expert choices, which grow layer by layer (at the
    1.1B benchmark size, to 6.6e-2)."""
    logp, unlike_file = _bf16_logprobs(tmp_path, float32_router)
    assert unlike_file == [], unlike_file
    gaps = _gaps(logp, torch.max)
    assert gaps["fsdp"] == gaps["bf16_compute"] == gaps["engine"] == 0.0, gaps
    assert _gaps(logp, torch.mean)["float32"] > 1e-3, gaps  # it ran in bf16


@pytest.mark.gpu
@pytest.mark.parametrize("float32_router", [False, True], ids=["bf16_values", "float32_router"])
def test_bf16_logprobs_on_the_gpu_match_fsdp_and_the_engine(tmp_path, float32_router):
    """The same on one GPU (Triton DSA kernels, grouped-GEMM experts, cuBLAS): only the kernels each path picks can
    differ, so within mean |Δ| 1e-3 of FSDP2, the copy and the engine (a difference anywhere flips expert choices)."""
    logp, unlike_file = _bf16_logprobs(tmp_path, float32_router)
    assert unlike_file == [], unlike_file
    gaps = _gaps(logp, torch.mean)
    assert max(gaps["fsdp"], gaps["bf16_compute"], gaps["engine"]) <= 1e-3, gaps
    assert gaps["float32"] > 1e-3, gaps


def test_layerwise_finds_no_difference_on_the_gpus_expert_path_and_megatrons_own_when_put_back(tmp_path):
    """bf16 on CPU with both models' grouped-GEMM experts forced (the path a GPU takes), through
    benchmarks/megatron_layerwise.py: Megatron and FSDP2 agree at every tapped point (attention, router, routed
    sum, shared expert, MLP, residual of every layer; log-probs), and every gradient is bit-equal. With megatron's
    own top-k put back (its weights normalised in top-k order, not ascending expert order) the first local
    difference is the first MoE layer's routing weights; with all of megatron's own computations back, gradients
    differ too. (Before Megatron summed a token's experts in ascending order, the first difference was that
    layer's routed sum: GlmMoeDsa's grouped path summed them in top-k order; before it ran the shared expert after
    the routed ones, most gradients differed: autograd summed the MoE input's gradients in another order.)"""
    from benchmarks.megatron_layerwise import spawn
    from tests.megatron_conformance import BF16_SEQLENS, save_bf16_checkpoint

    save_bf16_checkpoint(tmp_path / "bf16")
    options = {"device": "cpu", "seqlens": BF16_SEQLENS, "grouped": True,
               "variants": ["as_built", "megatron_topk", "all_upstream"]}
    result = spawn(str(tmp_path / "bf16"), options, str(tmp_path / "layerwise.json"))
    built, put_back = result["variants"]["as_built"], result["variants"]["megatron_topk"]
    assert built["first_difference"] == {"chain": None, "local": None}, built["first_difference"]
    assert built["megatron_vs_fsdp"]["chain"]["logprob"]["max"] == 0.0
    assert put_back["first_difference"]["local"] == "layer1.routing_weights", put_back["first_difference"]
    grads = result["gradients_vs_fsdp"]
    assert grads["megatron_as_built"]["differ"] == 0 and grads["megatron_as_built"]["tensors"] > 50, grads
    assert grads["megatron_all_upstream"]["differ"] > 0, grads
    assert result["fsdp_vs_float32"]["logprob"]["mean"] > 1e-3  # it ran in bf16


@pytest.mark.gpu
def test_layerwise_on_the_gpu_megatron_equals_fsdp_forward_and_backward(tmp_path):
    """The same on one GPU (grouped GEMMs, cuBLAS, Triton DSA kernels): Megatron as built computes every tapped
    point and every gradient as FSDP2's bf16 copy does, bit for bit (each calls the same kernels on the same shapes;
    before, megatron's scatter_add_ combine and its index_select dispatch used atomics in no fixed order)."""
    from benchmarks.megatron_layerwise import spawn
    from tests.megatron_conformance import BF16_SEQLENS, save_bf16_checkpoint

    save_bf16_checkpoint(tmp_path / "bf16")
    options = {"device": "cuda", "seqlens": BF16_SEQLENS, "variants": ["as_built", "all_upstream"]}
    result = spawn(str(tmp_path / "bf16"), options, str(tmp_path / "layerwise.json"))
    built = result["variants"]["as_built"]
    assert built["first_difference"] == {"chain": None, "local": None}, built["first_difference"]
    assert result["gradients_vs_fsdp"]["megatron_as_built"]["differ"] == 0, result["gradients_vs_fsdp"]


# -- checkpoints of megatron's DistributedOptimizer: a fresh process resumes bit for bit ----------------------------


def _resume_runs(checkpoint: Path, out: Path, world_size: int, cuda_on_cpu: bool) -> None:
    """tests.megatron_conformance.resume: the first run, then the resumed one in fresh processes."""
    import torch.multiprocessing as mp

    from tests.megatron_conformance import resume

    for phase in ("first", "resumed"):
        mp.start_processes(resume, args=(world_size, free_port(), str(checkpoint), str(out), phase, cuda_on_cpu),
                           nprocs=world_size, start_method="spawn")


def _rank_files(directory: Path, rank: int) -> tuple[dict[str, torch.Tensor], dict]:
    return (load_file(directory / "megatron" / f"rank{rank}.safetensors"),
            json.loads((directory / "megatron" / f"rank{rank}.json").read_text()))


def _assert_same_state(a: Path, b: Path, rank: int) -> None:
    (tensors_a, meta_a), (tensors_b, meta_b) = _rank_files(a, rank), _rank_files(b, rank)
    assert tensors_a.keys() == tensors_b.keys(), sorted(set(tensors_a) ^ set(tensors_b))[:5]
    unequal = [k for k, v in tensors_a.items() if v.dtype != tensors_b[k].dtype or not torch.equal(v, tensors_b[k])]
    assert not unequal, f"{len(unequal)} of {len(tensors_a)} tensors differ, e.g. {unequal[:5]}"
    assert meta_a == meta_b


def _assert_resumes_exactly(out: Path, world_size: int) -> None:
    for rank in range(world_size):
        tensors, meta = _rank_files(out / "step2", rank)
        assert meta["optimizer"] == "distributed" and meta["step"] == 2
        main = [k for k in tensors if k.endswith("/main_param")]
        assert main and all(tensors[k].dtype == torch.float32 for k in main)
        assert all(k.replace("/main_param", f"/{f}") in tensors for k in main for f in ("exp_avg", "exp_avg_sq", "step"))
        assert any(v.dtype == torch.bfloat16 for k, v in tensors.items() if k.startswith("model/"))
        _assert_same_state(out / "step2", out / "loaded", rank)  # what was loaded is what was saved
    first, again = (json.loads((out / f"step3_{phase}.json").read_text()) for phase in ("first", "resumed"))
    assert first.keys() == again.keys() and first["grad_norm"] > 0
    unequal = {k: (v, again[k]) for k, v in first.items() if v != again[k] and not (v != v and again[k] != again[k])}
    assert unequal == {}  # NaN counts as equal to NaN
    for rank in range(world_size):
        _assert_same_state(out / "step3_first", out / "step3_resumed", rank)
    before, after = _rank_files(out / "step2", 0)[0], _rank_files(out / "step3_first", 0)[0]
    assert sum(not torch.equal(before[k], after[k]) for k in before if k.startswith("model/")) > 10  # step 3 moved


@pytest.mark.gpu
def test_distributed_optimizer_checkpoint_resumes_exactly_on_the_gpu(checkpoint, tmp_path):
    """One GPU, bf16: 2 steps, checkpoint, step 3; a fresh process loads the checkpoint and runs step 3. Its metrics
    and everything the rank saves after it (bf16 weights, float32 main weights, Adam moments and steps, schedule,
    RNG states) equal the first run's bit for bit; the state it loaded, written back, equals the checkpoint."""
    _resume_runs(checkpoint, tmp_path, 1, cuda_on_cpu=False)
    _assert_resumes_exactly(tmp_path, 1)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="two ranks would share the one GPU; the gpu test covers it")
def test_distributed_optimizer_checkpoint_resumes_exactly_on_cpu(checkpoint, tmp_path):
    """The same on 2 CPU ranks (data parallel 2: each rank saves its own half of the optimizer state), with megatron's
    DistributedOptimizer built on CPU by pretending its CUDA-only spots (distributed_optimizer_on_cpu)."""
    _resume_runs(checkpoint, tmp_path, 2, cuda_on_cpu=True)
    _assert_resumes_exactly(tmp_path, 2)


def _optimizer_against_megatrons(rank: int, port: int, checkpoint: str, out: str) -> None:
    """One CPU rank of the DistributedOptimizer (distributed_optimizer_on_cpu): after one step's backward, megatron's
    own grad norm, clipping and main-to-model copy against DistributedAdam's; then the step itself."""
    from tests.megatron_conformance import batches, distributed_optimizer_on_cpu, rank_config

    torch.set_num_threads(1)
    worker = distributed_optimizer_on_cpu()(0, 1, "127.0.0.1", port,
                                            rank_config(checkpoint, {}, mixed_precision=True, ops_backend="torch"))
    adam, record = worker.policy.optimizer, {}
    optimizers = adam._optimizers()
    record["optimizers"] = len(optimizers)
    record["fused"] = all(g["fused"] is True and g["foreach"] is False for o in optimizers for g in o.optimizer.param_groups)

    def compare(held):
        worker.finish_gradients([p for p in held.model.parameters() if p.requires_grad])
        adam.inner.prepare_grads()
        mains = [p for o in optimizers for p in o.get_parameters()]
        before = [p.grad.clone() for p in mains]
        record["megatron_norm"] = float(adam.inner.get_grad_norm())
        max_norm = record["megatron_norm"] / 3  # so both clip
        adam.inner.clip_grad_norm(max_norm)
        theirs = [p.grad.clone() for p in mains]
        for p, g in zip(mains, before):
            p.grad.copy_(g)  # the grad buffer's views: the clip scaled them in place
        norm = adam.clip(max_norm)
        record["norm"], record["norm_device"] = float(norm), str(norm.device)
        record["clipped_rel"] = max(float((p.grad - t).norm() / t.norm()) for p, t in zip(mains, theirs) if t.norm() > 0)
        record["clipped_changed"] = sum(not torch.equal(p.grad, g) for p, g in zip(mains, before))
        adam.step()
        buffers = [b.param_data.clone() for o in optimizers for buf in o.buffers for b in buf.buckets]
        for o in optimizers:
            type(o)._copy_main_params_to_model_params(o)  # megatron's loop after ours: nothing left to change
        after = [b.param_data for o in optimizers for buf in o.buffers for b in buf.buckets]
        record["copy_back_equal"] = all(torch.equal(a, b) for a, b in zip(buffers, after))
        record["params_moved"] = sum(not torch.equal(a, b) for a, b in zip(buffers, start))
        record["step_state"] = sorted({str(s["step"].device) for o in optimizers for s in o.optimizer.state.values()})
        return norm

    start = [b.param_data.clone() for o in optimizers for buf in o.buffers for b in buf.buckets]
    worker.apply_gradients = compare
    batch = batches(VOCAB, count=1)[0]
    batch.old_logprobs = worker.compute_logprobs(batch)
    worker.train_step(batch, float(batch.loss_mask.sum()), len(batch.seqlens))
    Path(out).write_text(json.dumps(record))
    worker.shutdown()


@pytest.mark.slow
def test_distributed_adam_norm_clip_and_copy_back_equal_megatrons(checkpoint, tmp_path):
    """DistributedAdam's own grad norm (torch's foreach norm) and clipping give megatron's, its foreach copy of the
    main weights into the bf16 parameters leaves nothing for megatron's per-parameter loop to change, and its AdamW
    is torch's fused one (on one CPU rank of megatron's real DistributedOptimizer)."""
    import torch.multiprocessing as mp

    out = tmp_path / "optimizer.json"
    mp.start_processes(_optimizer_against_megatrons, args=(free_port(), str(checkpoint), str(out)), nprocs=1,
                       start_method="spawn")
    record = json.loads(out.read_text())
    assert record["optimizers"] >= 1 and record["fused"], record
    assert record["norm"] == pytest.approx(record["megatron_norm"], rel=1e-6) and record["norm_device"] == "cpu"
    assert record["clipped_changed"] > 0 and record["clipped_rel"] < 1e-6, record
    assert record["copy_back_equal"] and record["params_moved"] > 0, record
    assert record["step_state"] == ["cpu"]  # fused AdamW keeps `step` on the parameters' device


def _adam_over_main_weights(models: list[torch.nn.Parameter]):
    """A DistributedAdam around a stand-in for one megatron DistributedOptimizer: torch's AdamW over float32 main
    copies of bf16 model parameters, found through model_param_group_index_map as megatron's are."""
    from types import SimpleNamespace

    from trainers.megatron.optimizer import DistributedAdam

    mains = [p.detach().float().clone().requires_grad_() for p in models]
    inner = torch.optim.AdamW([{"params": mains[:1]}, {"params": mains[1:], "weight_decay": 0.0}], lr=1e-2)
    opt = SimpleNamespace(optimizer=inner, model_param_group_index_map={models[0]: (0, 0), models[1]: (1, 0),
                                                                         models[2]: (1, 1)})
    adam = DistributedAdam.__new__(DistributedAdam)
    adam.inner, adam.names = SimpleNamespace(chained_optimizers=[opt]), {p: f"p{i}" for i, p in enumerate(models)}
    return adam, mains


def test_distributed_adam_state_round_trips_through_safetensors_and_json(tmp_path):
    """state() -> safetensors + JSON -> load_state() into a fresh optimizer: the next step is bit-equal, and every
    parameter keeps its own `step` tensor (megatron's own load_state_dict shares one, which the next step advances
    once per parameter)."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    models = [torch.nn.Parameter(torch.randn(n).bfloat16()) for n in (3, 4, 5)]
    first, mains = _adam_over_main_weights(models)
    grads = [[torch.randn(p.numel()) for p in models] for _ in range(3)]
    for step in grads[:2]:
        for main, g in zip(mains, step):
            main.grad = g.clone()
        first.inner.chained_optimizers[0].optimizer.step()
    tensors, groups = first.state()
    save_file(tensors, tmp_path / "state.safetensors")
    again, mains_again = _adam_over_main_weights(models)
    again.load_state(load_file(tmp_path / "state.safetensors"), json.loads(json.dumps(groups)))
    state = again.inner.chained_optimizers[0].optimizer.state
    assert len({id(state[m]["step"]) for m in mains_again}) == 3
    assert again.inner.chained_optimizers[0].optimizer.param_groups[0]["betas"] == (0.9, 0.999)
    for optimizer, params in ((first, mains), (again, mains_again)):
        for main, g in zip(params, grads[2]):
            main.grad = g.clone()
        optimizer.inner.chained_optimizers[0].optimizer.step()
    for a, b in zip(mains, mains_again):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match=r"optimizer shards \(2 parameters"):
        again.load_state({k: v for k, v in tensors.items() if not k.startswith("p2/")}, groups)


def test_benchmark_profiles_a_step_and_names_what_megatron_spends_more_on(tmp_path):
    """benchmarks/megatron_vs_fsdp.py --profile-dir: one step's key_averages tables appended per backend, a summary
    per backend, and the ops whose time is larger in Megatron's step named first."""
    from benchmarks.megatron_vs_fsdp import PROFILE_FILE, profile_differences, profile_step

    x = torch.randn(64, 64)
    fsdp = profile_step(lambda: x @ x, lambda: None, False, "fsdp", tmp_path)
    megatron = profile_step(lambda: [torch.linalg.qr(x) for _ in range(20)], lambda: None, False, "megatron", tmp_path)
    text = (tmp_path / PROFILE_FILE).read_text()
    assert text.index("== fsdp:") < text.index("== megatron:") and text.count("top 25 by self_cpu_time_total") == 2
    assert "aten::mm" in fsdp["ops"] and megatron["ops"]["aten::linalg_qr"][2] == 20
    lines = profile_differences(fsdp, megatron)
    assert lines[0].startswith("profile fsdp: step") and lines[2].endswith("none")  # no device time on a CPU
    assert "aten::linalg_qr" in lines[3] and "aten::mm " not in lines[3]


def _dispatcher(cls, num_experts: int, topk: int, routing_map: torch.Tensor):
    """A dispatcher of `cls` holding every expert, with only the attributes its dispatch and combine read (no process
    groups: at expert parallel 1 neither step communicates)."""
    from types import SimpleNamespace  # noqa: PLC0415

    d = object.__new__(cls)
    d.config = SimpleNamespace(num_moe_experts=num_experts, moe_router_topk=topk, moe_permute_fusion=False)
    d.num_local_experts, d.local_expert_indices, d.router_topk = num_experts, list(range(num_experts)), topk
    d.routing_map = routing_map.clone()
    return d


def test_local_experts_dispatch_equals_megatrons_without_host_counts():
    """With every expert local, the sync-free dispatch gives megatron's rows, counts, probabilities and combine, bit for
    bit, and keeps the counts on the input's device."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher  # noqa: PLC0415

    from trainers.megatron.experts import LocalExpertsDispatcher  # noqa: PLC0415

    g = torch.Generator().manual_seed(0)
    tokens, experts, topk, hidden = 37, 8, 3, 16
    scores = torch.rand(tokens, experts, generator=g)
    chosen = scores.topk(topk, dim=1).indices
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool).scatter_(1, chosen, True)
    probs = torch.where(routing_map, scores.softmax(1), 0.0)
    x = torch.randn(tokens, hidden, generator=g)
    stock = _dispatcher(MoEAllGatherTokenDispatcher, experts, topk, routing_map)
    ours = _dispatcher(LocalExpertsDispatcher, experts, topk, routing_map)
    want, want_counts, want_probs = stock.dispatch_postprocess(x, probs)
    got, got_counts, got_probs = ours.dispatch_postprocess(x, probs)
    assert torch.equal(got, want) and torch.equal(got_probs, want_probs)
    assert torch.equal(got_counts.cpu(), want_counts) and got_counts.device == x.device
    y = torch.randn(got.shape, generator=g)
    assert torch.equal(ours.combine_preprocess(y), stock.combine_preprocess(y))


def _main_grads_rank(rank: int, port: int, checkpoint: str, out: str, device: str) -> None:
    """One rank (gloo on CPU, nccl on CUDA): the bf16 model twice, under megatron's DDP (a hook per parameter) and
    ForeachMainGradDDP, 3 micro-batches, a zeroed buffer, one more: rank 0 writes the main gradients that differ."""
    import os  # noqa: PLC0415

    import torch.distributed as dist  # noqa: PLC0415
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig  # noqa: PLC0415

    from slime_dsa.models.glm_moe_dsa import PackedBatch  # noqa: PLC0415
    from tests.megatron_conformance import BF16_SHAPE  # noqa: PLC0415
    from trainers.megatron import cpu_shim  # noqa: PLC0415
    from trainers.megatron.main_grads import ForeachMainGradDDP  # noqa: PLC0415
    from trainers.megatron.parallel import initialize, parallel_sizes  # noqa: PLC0415
    from trainers.megatron.worker import load_model  # noqa: PLC0415

    torch.set_num_threads(1)
    cpu_shim.apply()  # a no-op on a GPU machine
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=rank, world_size=1)
    sizes = parallel_sizes({})
    groups, place = initialize(sizes)
    if device == "cuda":
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed  # noqa: PLC0415

        model_parallel_cuda_manual_seed(0)
    config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                           use_distributed_optimizer=device == "cuda")  # as MegatronWorker's
    runs = {}
    for cls in (DistributedDataParallel, ForeachMainGradDDP):
        model = load_model(checkpoint, sizes, groups, place, torch.bfloat16, torch.device(device))
        ddp = cls(model.megatron, config, model, pg_collection=groups)
        g = torch.Generator().manual_seed(0)
        for seqlens in ([64, 40], [24], [96, 8], "zero", [48, 48]):
            if seqlens == "zero":
                ddp.zero_grad_buffer()
                continue
            ids = torch.randint(0, BF16_SHAPE["vocab_size"], (sum(seqlens),), generator=g).to(device)
            batch = PackedBatch.from_seqlens(seqlens, torch.device(device))
            (-model.token_logprobs(ids, batch)[0].float().mean()).backward()
            if cls is ForeachMainGradDDP:
                ddp.accumulate_main_grads()
        assert all(p.grad is None for p in model.parameters())
        runs[cls.__name__] = {n: p.main_grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    a, b = runs["DistributedDataParallel"], runs["ForeachMainGradDDP"]
    if rank == 0:
        Path(out).write_text(json.dumps({"differ": [n for n in a if not torch.equal(a[n], b[n])], "tensors": len(a)}))
    dist.destroy_process_group()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_foreach_main_grads_equal_megatrons_hook_per_parameter(tmp_path, device):
    """Megatron's DDP adds each parameter's bf16 gradient into its float32 main_grad from a hook (a kernel per
    parameter and micro-batch); ForeachMainGradDDP adds all of them after each backward in foreach ops: over 4
    micro-batches in bf16 (the buffer zeroed before the 4th) the same main gradients (torch.equal: a -0.0 gradient
    would stay -0.0 there, +0.0 under megatron's hook; none arose here). With accumulate_main_grads called only
    after the last backward (autograd summing the others in bf16), 134 of the 156 differed."""
    import torch.multiprocessing as mp  # noqa: PLC0415

    from tests.megatron_conformance import save_bf16_checkpoint  # noqa: PLC0415

    save_bf16_checkpoint(tmp_path / "m")
    out = tmp_path / "out.json"
    mp.start_processes(_main_grads_rank, args=(free_port(), str(tmp_path / "m"), str(out), device), nprocs=1,
                       start_method="spawn")
    result = json.loads(out.read_text())
    assert result["differ"] == [] and result["tensors"] > 50, result
