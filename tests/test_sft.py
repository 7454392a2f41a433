"""`slime-dsa sft`: fine-tunes on the tasks' solutions, evaluates greedily, writes a loadable HF directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from slime_dsa.cli import main


def test_sft_lowers_loss_and_writes_a_model(tmp_path):
    from transformers import AutoTokenizer

    import slime_dsa

    recipe = {
        "model": {"preset": "tiny"},
        "data": {"tasks": [{"kind": "arithmetic", "eval_size": 8, "train_size": 150, "task_args": {"max_digits": 1}}],
                 "apply_chat_template": True, "max_prompt_length": 64},
        "rollout": {"max_response_length": 8},
        "trainer": {"learning_rate": 3.0e-3, "num_steps": 12, "micro_batch_tokens": 2048},
        "sft": {"batch_size": 16, "eval_every": 0, "eval_prompts": 8, "output_dir": str(tmp_path / "model")},
        "logging": {"run_dir": str(tmp_path / "run"), "wandb_mode": "disabled"},
    }
    path = tmp_path / "sft.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert main(["sft", str(path)]) == 0
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["train/loss"] < records[0]["train/loss"]
    assert 0.0 <= records[-1]["eval/pass@1"] <= 1.0
    assert (tmp_path / "run" / "recipe.yaml").exists() and "sft step 12: loss" in (tmp_path / "run" / "sft.log").read_text()
    model = slime_dsa.load_model(tmp_path / "model")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "model")
    assert model.config.vocab_size == len(tokenizer)


def test_sft_on_multi_turn_tool_solutions(tmp_path):
    """SFT on the agentic tasks' reference trajectories (tool output masked), and its eval plays agent rollouts."""
    recipe = {
        "model": {"preset": "tiny"},
        "data": {"tasks": [{"kind": "calc_chain", "eval_size": 2, "train_size": 32},
                           {"kind": "fact_lookup", "eval_size": 2, "train_size": 32}],
                 "apply_chat_template": True, "max_prompt_length": 96},
        "rollout": {"max_response_length": 48},
        "trainer": {"learning_rate": 3.0e-3, "num_steps": 3, "micro_batch_tokens": 2048},
        "sft": {"batch_size": 4, "eval_every": 0, "eval_prompts": 2, "output_dir": str(tmp_path / "model")},
        "logging": {"run_dir": str(tmp_path / "run"), "wandb_mode": "disabled"},
    }
    path = tmp_path / "sft.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert main(["sft", str(path)]) == 0
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["train/loss"] < records[0]["train/loss"]
    assert "eval/calc_chain/pass@1" in records[-1] and "eval/fact_lookup/pass@1" in records[-1]


def test_sft_rows_without_a_usable_solution_are_one_line_errors():
    """A `kind: dataset` task whose rows have no `solution` column (the docs name only prompt and answer columns) made
    `sft` fail with a ValueError traceback; a solution of the wrong type failed inside the turn layout."""
    from types import SimpleNamespace

    import pytest

    from slime_dsa.config.errors import UserError
    from slime_dsa.data.tokenizer import build_tokenizer
    from slime_dsa.sft import supervised_examples

    tokenizer = build_tokenizer()

    def row(**metadata):
        return SimpleNamespace(task="mine", index=3, prompt_ids=[1, 2], metadata=metadata)

    with pytest.raises(UserError, match=r"task 'mine' row 3: sft learns each row's 'solution' column"):
        supervised_examples([row(answer="4")], tokenizer)
    for bad in (5, ["just a string"], [{"role": "user", "content": "x"}]):
        with pytest.raises(UserError, match=r"task 'mine' row 3, column 'solution'"):
            supervised_examples([row(solution=bad)], tokenizer)
    assert supervised_examples([row(solution="4")], tokenizer)[0].response_ids[-1] == tokenizer.eos_token_id


def _tiny_model_and_examples(seed: int = 0):
    """A tiny-preset model and 12 examples of 5-30 tokens, some response tokens masked out (tool output)."""
    import torch

    from slime_dsa.checkpoint import build_model
    from slime_dsa.models.presets import preset_config
    from slime_dsa.sft import SupervisedExample

    model = build_model(preset_config("tiny", vocab_size=64, eos_token_id=1), seed=seed, dtype=torch.float32).train()
    g = torch.Generator().manual_seed(seed)
    examples = []
    for _ in range(12):
        prompt, response = (int(n) for n in torch.randint(2, 16, (2,), generator=g))
        mask = (torch.rand(response, generator=g) > 0.2).long().tolist()
        examples.append(SupervisedExample(torch.randint(2, 64, (prompt,), generator=g).tolist(),
                                          torch.randint(2, 64, (response,), generator=g).tolist(), mask))
    return model, examples


def test_sft_micro_batches_equal_the_unsplit_step():
    """trainer.micro_batch_tokens was ignored by sft (each step one forward of the whole batch, whatever memory it
    took). Now a step is split into micro-batches of at most that many tokens with accumulated gradients, each loss
    divided by the step's loss tokens: the same loss, gradient norm and weights after the step as one micro-batch, up to
    float32 rounding, and one forward per micro-batch."""
    import copy

    import torch

    from slime_dsa.sft import sft_step
    from trainers.base import split_by_tokens

    whole, examples = _tiny_model_and_examples()
    split = copy.deepcopy(whole)
    lengths = [len(e.prompt_ids) + len(e.response_ids) for e in examples]
    budget = max(lengths) + 5
    assert len(split_by_tokens(lengths, budget)) >= 4
    forwards = {"whole": 0, "split": 0}

    def counting(name, model):
        original = model.token_logprobs

        def token_logprobs(*args, **kwargs):
            forwards[name] += 1
            return original(*args, **kwargs)
        model.token_logprobs = token_logprobs

    counting("whole", whole)
    counting("split", split)
    # SGD: the update is the gradient itself (Adam's first step is its sign, which float rounding can flip near 0)
    one = sft_step(whole, torch.optim.SGD(whole.parameters(), lr=0.5), examples, sum(lengths), max_grad_norm=1.0)
    many = sft_step(split, torch.optim.SGD(split.parameters(), lr=0.5), examples, budget, max_grad_norm=1.0)
    assert (one["train/micro_batches"], many["train/micro_batches"]) == (1, len(split_by_tokens(lengths, budget)))
    assert forwards == {"whole": 1, "split": many["train/micro_batches"]}
    assert many["train/loss"] == pytest.approx(one["train/loss"], rel=1e-6)
    assert many["train/grad_norm"] == pytest.approx(one["train/grad_norm"], rel=1e-5)
    assert one["train/grad_norm"] > 1.0  # the clip ran, on the accumulated gradients
    for (name, a), b in zip(whole.named_parameters(), split.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6, msg=name)
    assert any(not torch.equal(a, b) for a, b in zip(whole.parameters(), _tiny_model_and_examples()[0].parameters()))


def test_sft_runs_the_recipes_micro_batches_and_model_keys(tmp_path, monkeypatch):
    """`slime-dsa sft` reads trainer.micro_batch_tokens (logged as train/micro_batches), model.gradient_checkpointing
    and model.ops_backend; all three were ignored."""
    import slime_dsa.sft
    from slime_dsa import ops

    seen = []
    step = slime_dsa.sft.sft_step

    def spy(model, optimizer, examples, micro_batch_tokens, *args):
        seen.append((micro_batch_tokens, model.gradient_checkpointing, ops.get_backend()))
        return step(model, optimizer, examples, micro_batch_tokens, *args)

    monkeypatch.setattr(slime_dsa.sft, "sft_step", spy)
    monkeypatch.setattr(slime_dsa.sft, "greedy_eval", lambda *args, **kwargs: {})
    monkeypatch.setattr(ops, "_backend", ops.get_backend())  # put back after the run
    recipe = {
        "model": {"preset": "tiny", "gradient_checkpointing": True, "ops_backend": "torch"},
        "data": {"tasks": [{"kind": "arithmetic", "train_size": 40, "task_args": {"max_digits": 1}}],
                 "max_prompt_length": 32},
        "rollout": {"max_response_length": 8},
        "trainer": {"num_steps": 2, "micro_batch_tokens": 40},
        "sft": {"batch_size": 8, "eval_every": 0, "output_dir": str(tmp_path / "model")},
        "logging": {"run_dir": str(tmp_path / "run"), "wandb_mode": "disabled"},
    }
    path = tmp_path / "sft.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert main(["sft", str(path)]) == 0
    assert seen == [(40, True, "torch")] * 2
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["train/micro_batches"] >= 2 and r["train/loss"] > 0 for r in records)


QUICKSTART_SFT = str(Path(__file__).resolve().parents[1] / "recipes" / "quickstart_sft.yaml")


@pytest.mark.parametrize("key, value, says", [
    ("trainer.backend", "megatron", "trainer.backend 'megatron': slime-dsa sft trains in one process with the built-in "
                                    "trainer; use fsdp or run train"),
    ("trainer.num_workers", "4", "trainer.num_workers 4: slime-dsa sft trains in one process"),
    ("trainer.data_parallel", "replicate", "trainer.data_parallel 'replicate': slime-dsa sft trains in one process"),
    ("trainer.num_steps_per_rollout", "2", "trainer.num_steps_per_rollout 2: slime-dsa sft takes one optimizer step "
                                           "per trainer.num_steps"),
    ("model.true_on_policy", "true", "model.true_on_policy true: slime-dsa sft samples nothing"),
    ("trainer.logprob_diff_warn_threshold", "0.1", "trainer.logprob_diff_warn_threshold 0.1: slime-dsa sft samples"),
    ("cluster.address", "auto", "cluster.address 'auto': slime-dsa sft trains in one process with the built-in "
                                "trainer, without Ray"),
    ("cluster.num_gpus_per_trainer", "1", "cluster.num_gpus_per_trainer 1.0: slime-dsa sft trains in one process"),
    ("cluster.placement", "disaggregated", "cluster.placement 'disaggregated': slime-dsa sft trains in one process"),
    ("checkpoint.save_every", "10", "checkpoint.save_every 10: slime-dsa sft writes no training checkpoints"),
    ("checkpoint.resume", "true", "checkpoint.resume true: slime-dsa sft writes no training checkpoints and cannot "
                                  "resume"),
    ("logging.eval_every", "5", "logging.eval_every 5: slime-dsa sft evaluates every sft.eval_every steps"),
    ("logging.profile_steps", "[1]", "logging.profile_steps [1]: slime-dsa sft records no profile"),
])
def test_sft_refuses_the_keys_it_does_not_read(key, value, says, capsys, monkeypatch):
    """`slime-dsa sft` read the recipe `train` reads and ignored the keys of train's trainer workers (backend, workers,
    data parallelism), cluster and checkpoints: a recipe asking for Megatron on 4 workers trained in one plain process
    without a word. Now a value other than the default is refused in one line before anything loads, and by
    `recipe check --for sft`; `recipe check` for train still takes it."""
    import slime_dsa.sft

    def no_training(recipe):
        raise AssertionError("training started")

    monkeypatch.setattr(slime_dsa.sft, "run_sft", no_training)
    monkeypatch.setattr("slime_dsa.config.paths._installed", lambda module: True)  # train's check: megatron-core or not
    overrides = ["--set", f"{key}={value}", "--set", "logging.run_dir=runs/never-written"]
    if key == "checkpoint.resume":
        overrides += ["--set", "checkpoint.dir=runs/never-written"]
    for argv in (["sft", QUICKSTART_SFT, *overrides], ["recipe", "check", "--for", "sft", QUICKSTART_SFT, *overrides]):
        assert main(argv) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1 and "Traceback" not in err, err
        assert err.startswith(f"slime-dsa: error: {says}"), err
    assert main(["recipe", "check", QUICKSTART_SFT, *overrides]) == 0  # train reads them


def test_shipped_sft_recipes_pass_sfts_key_check(capsys):
    """Every recipe that `slime-dsa sft` runs (their headers say so) sets only keys sft reads; `recipe check --for
    sft` says what sft will do with one."""
    from slime_dsa.config import load_recipe
    from slime_dsa.config.sft import check_sft_keys, sft_problems

    recipes = Path(__file__).resolve().parents[1] / "recipes"
    shipped = sorted(p for p in recipes.glob("*.yaml") if "slime-dsa sft recipes/" + p.name in p.read_text())
    assert {p.name for p in shipped} >= {"quickstart_sft.yaml", "gpu_single_sft.yaml", "agentic_sft.yaml",
                                         "opd_student.yaml", "opd_expert_sft.yaml"}
    for path in shipped:
        check_sft_keys(load_recipe(path))
    assert sft_problems(load_recipe(path, ["trainer.num_workers=2"])) != []
    assert main(["recipe", "check", "--for", "sft", QUICKSTART_SFT]) == 0
    assert capsys.readouterr().out.splitlines()[1] == (
        "sft: a random quickstart model | tasks: arithmetic×1, two_digit×3 | 64 examples/step in micro-batches of at "
        "most 8192 tokens | 3000 steps")


def test_sft_evaluation_honours_the_recipes_reward_timeout(tmp_path):
    """sft's evaluation scores every answer with the task's reward function, and gave each call the default 30 s
    whatever rollout.reward_timeout_s said: a recipe's 0.3 s let a 1 s reward pass (eval/pass@1 1.0). Now the
    evaluation takes the recipe's timeout: those calls time out and score 0, as in train's evaluation."""
    recipe = {
        "model": {"preset": "tiny"},
        "data": {"tasks": [{"kind": "arithmetic", "eval_size": 2, "train_size": 16, "task_args": {"max_digits": 1},
                            "reward_fn": "tests.plugins.rewards:slow_pass"}], "max_prompt_length": 32},
        "rollout": {"max_response_length": 4, "reward_timeout_s": 0.3},
        "trainer": {"num_steps": 1},
        "sft": {"batch_size": 4, "eval_every": 0, "eval_prompts": 2, "output_dir": str(tmp_path / "model")},
        "logging": {"run_dir": str(tmp_path / "run"), "wandb_mode": "disabled"},
    }
    path = tmp_path / "sft.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert main(["sft", str(path)]) == 0
    (record,) = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert record["eval/pass@1"] == 0.0, record


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a GPU computes bfloat16 (autocast)")
def test_sft_on_a_cpu_refuses_a_bfloat16_model_dtype(tmp_path, capsys):
    """sft computes in bfloat16 only on a GPU (autocast); on a CPU `model.dtype: bfloat16` trained, evaluated and wrote
    the model in float32 without a word. Now `slime-dsa sft` on a CPU refuses it in one line before anything is
    written; float32 there runs."""
    recipe = {
        "model": {"preset": "tiny", "dtype": "bfloat16"},
        "data": {"tasks": [{"kind": "arithmetic", "train_size": 16, "task_args": {"max_digits": 1}}],
                 "max_prompt_length": 32},
        "rollout": {"max_response_length": 4},
        "trainer": {"num_steps": 1},
        "sft": {"batch_size": 4, "eval_every": 0, "output_dir": str(tmp_path / "model")},
        "logging": {"run_dir": str(tmp_path / "run"), "wandb_mode": "disabled"},
    }
    path = tmp_path / "sft.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert main(["sft", str(path)]) == 2
    out, err = capsys.readouterr()
    assert err == ("slime-dsa: error: model.dtype 'bfloat16': slime-dsa sft computes in bfloat16 on a GPU only "
                   "(autocast), and this machine has none: on a CPU it trains in float32; set float32 or auto\n"), err
    assert not (tmp_path / "run").exists() and not (tmp_path / "model").exists()
    assert main(["sft", str(path), "--set", "model.dtype=float32"]) == 0
    assert (tmp_path / "model" / "config.json").exists()


def test_sft_with_ops_backend_triton_is_told_to_leave_auto(capsys):
    """`slime-dsa sft --set model.ops_backend=triton` said the key needs cluster.num_gpus_per_engine or
    num_gpus_per_trainer above 0, which sft then refuses (it takes no cluster.* key): a dead end. The line now says
    what sft does instead: auto, which runs the Triton kernels on a GPU."""
    overrides = ["--set", "model.ops_backend=triton", "--set", "logging.run_dir=runs/never-written"]
    for argv in (["sft", QUICKSTART_SFT, *overrides], ["recipe", "check", "--for", "sft", QUICKSTART_SFT, *overrides]):
        assert main(argv) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1, err
        assert err.rstrip().endswith("model.ops_backend 'triton' needs GPUs, but cluster.num_gpus_per_engine and "
                                     "cluster.num_gpus_per_trainer are 0 (slime-dsa sft takes no cluster.* key: leave "
                                     "auto, which is triton on a GPU; indexer-warmup runs the torch ops)"), err
    assert not Path("runs/never-written").exists()
