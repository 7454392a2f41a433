"""`slime-dsa indexer-warmup` end to end on CPU: the shipped quickstart SFT model (a trained dense-enough attention)
with its indexers re-initialised, a few steps on the tasks corpus, then a written HF directory that loads, in which
only indexer tensors moved and the indexers recall more of the group-mean attention than before."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import yaml

from slime_dsa.cli import main

ASSET = Path(__file__).resolve().parents[1] / "recipes" / "assets" / "quickstart-sft"
TOPK, SEQ_LEN, STEPS = 16, 64, 6  # top-k = 25% of the window, as the issue asks


def test_indexer_warmup_writes_a_dsa_model_whose_indexers_alone_learned(tmp_path):
    from transformers import AutoModelForCausalLM

    import slime_dsa

    torch.set_num_threads(1)
    recipe = {
        "model": {"path": str(ASSET)},
        "data": {"tasks": [{"kind": "arithmetic", "train_size": 200, "eval_size": 24, "task_args": {"max_digits": 3}}],
                 "apply_chat_template": True, "seed": 11},
        "trainer": {"seed": 11, "max_grad_norm": 1.0},
        "indexer_warmup": {"corpus": "tasks", "seq_len": SEQ_LEN, "index_topk": TOPK, "batch_size": 4,
                           "num_steps": STEPS, "learning_rate": 1.0e-2, "reinit_indexers": True, "eval_sequences": 4,
                           "eval_every": 4, "output_dir": str(tmp_path / "dsa_model")},
        "logging": {"run_dir": str(tmp_path / "run"), "wandb_mode": "disabled", "log_every": 2},
    }
    path = tmp_path / "warmup.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert main(["indexer-warmup", str(path)]) == 0

    # Logged every 2nd step: the KL (it falls), the top-k overlap with the step before, and recall at the evaluation.
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 2, 4, 6]  # 0: the evaluation before
    trained = records[1:]
    kl = [r["indexer_warmup/indexer_kl"] for r in trained]
    assert kl[-1] < kl[0]
    assert all(0 < r["indexer_warmup/topk_overlap_prev_step"] <= 1 for r in trained)
    assert [r["step"] for r in records if "indexer_warmup/eval/recall" in r] == [0, 4, 6]
    assert f"after {STEPS} steps: recall@{TOPK}" in (tmp_path / "run" / "indexer_warmup.log").read_text()

    # Recall of the group-mean attention at top-k = 25% recovers, and the KL falls, on held-out windows.
    out = tmp_path / "dsa_model"
    summary = json.loads((out / "indexer_warmup_summary.json").read_text())
    before, after = summary["before"], summary["after"]
    assert after["recall"] > before["recall"] + 0.05 and after["indexer_kl"] < before["indexer_kl"]
    assert after["lm_loss_dense"] == before["lm_loss_dense"]  # the dense model is untouched
    assert after["lm_loss_sparse"] < before["lm_loss_sparse"]

    # The output is an HF directory (transformers loads every tensor) with the sparse budget in its config.
    hf, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and hf.config.index_topk == TOPK
    warmed, source = slime_dsa.load_model(out).state_dict(), slime_dsa.load_model(ASSET).state_dict()
    assert warmed.keys() == source.keys()
    changed = {name for name in source if not torch.equal(warmed[name], source[name])}
    assert changed and all(".indexer." in name for name in changed), sorted(changed)[:5]
    assert any(name.endswith("indexer.wq_b.weight") for name in changed)


def test_dataset_corpus_column_errors_and_null_rows(tmp_path):
    """indexer-warmup on a dataset without text_column was a ValueError traceback; a null cell trained on the text
    "None"; a column of nulls only looped forever yielding nothing."""
    import pytest

    from slime_dsa.config.errors import UserError
    from slime_dsa.data.tokenizer import build_tokenizer
    from slime_dsa.indexer.warmup import dataset_corpus

    tokenizer = build_tokenizer()
    path = tmp_path / "c.jsonl"
    path.write_text('{"text": "12"}\n{"text": null}\n{"text": "34"}\n')
    with pytest.raises(UserError, match=r"text_column 'body' is not a column"):
        next(dataset_corpus(str(path), "train", "body", tokenizer))
    docs = dataset_corpus(str(path), "train", "text", tokenizer)
    eos = tokenizer.eos_token_id
    got = [next(docs) for _ in range(3)]
    assert got == [tokenizer.encode(t, add_special_tokens=False) + [eos] for t in ("12", "34", "12")]
    nulls = tmp_path / "n.jsonl"
    nulls.write_text('{"text": null, "x": 1}\n{"text": null, "x": 2}\n')
    with pytest.raises(UserError, match="holds no text"):
        next(dataset_corpus(str(nulls), "train", "text", tokenizer))


def test_a_model_budget_at_or_above_the_window_is_one_line_naming_the_key():
    """index_topk null and the model's index_topk at or above seq_len (a dense checkpoint, the case the warm-up is
    for) was a ValueError traceback naming indexer_warmup.index_topk as if it were set."""
    import pytest

    from slime_dsa.config.errors import UserError
    from slime_dsa.config.schema import IndexerWarmupSection
    from slime_dsa.indexer.warmup import warmup_topk

    with pytest.raises(UserError, match=r"indexer_warmup\.index_topk is null, so the model's index_topk \(256, "
                                        r".*not below indexer_warmup\.seq_len \(128\)"):
        warmup_topk(IndexerWarmupSection(seq_len=128), 256)
    assert warmup_topk(IndexerWarmupSection(seq_len=128), 32) == 32
    assert warmup_topk(IndexerWarmupSection(seq_len=128, index_topk=16), 4096) == 16


def test_logged_steps_are_every_log_every_th_the_evaluated_and_the_last():
    """The last step (whose top-k overlap was measured for the log) and an evaluation on a step off log_every were
    dropped from metrics.jsonl, and the evaluations before and after the warm-up never reached it."""
    from slime_dsa.indexer.warmup import train_indexers
    from slime_dsa.models import GlmMoeDsaForCausalLM
    from slime_dsa.models.presets import preset_config

    torch.manual_seed(0)
    model = GlmMoeDsaForCausalLM(preset_config("tiny", vocab_size=32))
    windows = iter(lambda: torch.randint(0, 32, (16,)), None)
    logged: list[tuple[int, dict]] = []
    train_indexers(model, windows, [torch.randint(0, 32, (16,)) for _ in range(2)], topk=4, num_steps=5,
                   batch_size=2, learning_rate=1e-3, eval_every=3, log_every=2,
                   log=lambda m, step: logged.append((step, m)))
    assert [step for step, _ in logged] == [0, 2, 3, 4, 5]
    assert [step for step, m in logged if "eval/recall" in m] == [0, 3, 5]
    assert [step for step, m in logged if "topk_overlap_prev_step" in m] == [2, 4, 5]
    assert all("indexer_kl" in m for step, m in logged if step)


def test_each_step_is_reported_and_a_lost_sigterm_stops_the_next(monkeypatch):
    """indexer-warmup showed nothing on the console until the model was written (200 steps of silence in the
    recipe), and its loop never checked for a SIGTERM whose exception Python dropped, as the other loops do."""
    import pytest

    from slime_dsa import interrupts
    from slime_dsa.indexer.warmup import train_indexers
    from slime_dsa.models import GlmMoeDsaForCausalLM
    from slime_dsa.models.presets import preset_config

    torch.manual_seed(0)
    model = GlmMoeDsaForCausalLM(preset_config("tiny", vocab_size=32))
    windows = iter(lambda: torch.randint(0, 32, (16,)), None)
    held_out = [torch.randint(0, 32, (16,))]
    steps: list[int] = []
    train_indexers(model, windows, held_out, topk=4, num_steps=3, batch_size=1, learning_rate=1e-3,
                   on_step=steps.append)
    assert steps == [1, 2, 3]
    monkeypatch.setattr(interrupts, "_terminated", interrupts.threading.Event())
    interrupts._terminated.set()  # noqa: SLF001 (a SIGTERM arrived and its exception was lost)
    with pytest.raises(interrupts.Terminated):
        train_indexers(model, windows, held_out, topk=4, num_steps=3, batch_size=1, learning_rate=1e-3,
                       on_step=steps.append)
    assert steps == [1, 2, 3]


def test_keys_the_warm_up_does_not_read_are_refused(tmp_path, capsys):
    """`indexer-warmup --set trainer.num_steps=10` ran indexer_warmup.num_steps (200) steps, trainer.learning_rate,
    cluster.*, checkpoint.* and the like were accepted and ignored; `recipe check` summed the recipe up as a train run
    (grpo, 100 steps). Now refused in one line, by the command and by `recipe check --for indexer-warmup`."""
    recipe = str(Path(__file__).resolve().parents[1] / "recipes" / "indexer_warmup.yaml")
    run_dir = f"logging.run_dir={tmp_path / 'run'}"
    assert main(["indexer-warmup", recipe, "--set", run_dir, "--set", "trainer.num_steps=10",
                 "--set", "trainer.learning_rate=0.1"]) == 2
    err = capsys.readouterr().err
    assert err == ("slime-dsa: error: trainer.learning_rate 0.1: slime-dsa indexer-warmup's learning rate is "
                   "indexer_warmup.learning_rate; set that (and 1 more: trainer.num_steps)\n")
    assert not (tmp_path / "run").exists()
    assert main(["recipe", "check", recipe, "--for", "indexer-warmup", "--set", "cluster.num_cpus_per_actor=2"]) == 2
    assert "cluster.num_cpus_per_actor 2.0: slime-dsa indexer-warmup trains the indexers in one process" in \
        capsys.readouterr().err
    assert main(["recipe", "check", recipe, "--for", "indexer-warmup"]) == 0
    assert capsys.readouterr().out.splitlines()[1] == (
        "indexer-warmup: a random quickstart model | corpus: tasks | 8 windows of 128 tokens/step | index_topk 32 | "
        "200 steps")


RECIPE = str(Path(__file__).resolve().parents[1] / "recipes" / "indexer_warmup.yaml")
SHORT = ["--set", "indexer_warmup.num_steps=1", "--set", "indexer_warmup.eval_sequences=1",
         "--set", "indexer_warmup.batch_size=1", "--set", "indexer_warmup.eval_every=0"]


def _refused_by_the_command_and_recipe_check(argv_tail: list[str], says: str, run: Path, capsys) -> None:
    """`slime-dsa indexer-warmup` and `recipe check --for indexer-warmup` both exit 2 with the one line `says`, and the
    command writes nothing."""
    for argv in (["indexer-warmup", RECIPE, "--set", f"logging.run_dir={run}", *argv_tail],
                 ["recipe", "check", "--for", "indexer-warmup", RECIPE, *argv_tail]):
        assert main(argv) == 2
        out, err = capsys.readouterr()
        assert err == f"slime-dsa: error: {says}\n", err
        assert "model written" not in out
    assert not run.exists()


def test_a_bfloat16_model_dtype_is_refused_not_computed_in_float32(tmp_path, capsys):
    """indexer-warmup loads, trains and writes the model in float32 on the CPU whatever model.dtype says: `--set
    model.dtype=bfloat16` was accepted and the warm-up ran in float32 without a word (while trainer.mixed_precision,
    the same request, was refused). Now refused in one line by the command and by `recipe check --for
    indexer-warmup`; float32, and auto (float32 on a CPU), pass."""
    _refused_by_the_command_and_recipe_check(
        ["--set", "model.dtype=bfloat16", *SHORT],
        "model.dtype 'bfloat16': slime-dsa indexer-warmup computes in float32 on the CPU (not built for GPUs yet); "
        "set float32 or auto", tmp_path / "run", capsys)
    for dtype in ("float32", "auto"):
        assert main(["recipe", "check", "--for", "indexer-warmup", RECIPE, "--set", f"model.dtype={dtype}"]) == 0
    assert main(["recipe", "check", RECIPE, "--set", "model.dtype=bfloat16"]) == 0  # train reads it
    capsys.readouterr()


def test_the_data_keys_are_refused_with_a_dataset_corpus(tmp_path, capsys):
    """With indexer_warmup.corpus: dataset the warm-up reads indexer_warmup.dataset_path's text_column, not the tasks:
    the shipped recipe with `--set indexer_warmup.corpus=dataset` trained on the file and ignored its data.tasks,
    data.apply_chat_template and data.seed without a word. Now refused in one line naming them; a recipe that leaves
    data.* unset passes."""
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"text": "12 + 34 = 46"}\n' * 200)
    dataset = ["--set", "indexer_warmup.corpus=dataset", "--set", f"indexer_warmup.dataset_path={corpus}"]
    _refused_by_the_command_and_recipe_check(
        [*dataset, *SHORT],
        "data.tasks [arithmetic, countdown]: indexer_warmup.corpus "
        "'dataset' trains on the text of indexer_warmup.dataset_path, not on data.*; leave data.* unset or set "
        "corpus tasks (and 2 more: data.apply_chat_template, data.seed)", tmp_path / "run", capsys)
    bare = tmp_path / "dataset_corpus.yaml"
    bare.write_text(yaml.safe_dump({"model": {"preset": "tiny"}, "indexer_warmup": {
        "corpus": "dataset", "dataset_path": str(corpus), "seq_len": 16, "index_topk": 4}}))
    assert main(["recipe", "check", "--for", "indexer-warmup", str(bare)]) == 0
    capsys.readouterr()


def test_the_evaluation_windows_hold_no_training_prompt():
    """With corpus tasks the evaluation windows were a second draw from the tasks' training split (another seed):
    recall, KL and LM loss were measured on training prompts. They are cut from the tasks' eval split now, which
    build_tasks keeps apart from every training prompt. Real tasks (recipes/indexer_warmup.yaml), the real tokenizer."""
    import re

    from slime_dsa.config import load_recipe
    from slime_dsa.data.prompts import build_tasks
    from slime_dsa.data.tokenizer import build_tokenizer
    from slime_dsa.indexer.warmup import warmup_sequences

    recipe = load_recipe(RECIPE, ["data.tasks.0.train_size=2000", "data.tasks.1.train_size=2000"])
    tokenizer = build_tokenizer()
    tasks = build_tasks(recipe.data, tokenizer)
    train_texts = {t for task in tasks for t in task.train.dataset["prompt_text"]}
    eval_texts = {t for task in tasks for t in task.eval.dataset["prompt_text"]}
    train, eval_sequences = warmup_sequences(recipe, tokenizer)
    assert len(eval_sequences) == recipe.indexer_warmup.eval_sequences
    assert all(len(s) == recipe.indexer_warmup.seq_len for s in eval_sequences)
    prompt = re.compile(re.escape("[gMASK]<sop><|user|>") + ".*?" + re.escape("<|assistant|>\n"), re.S)
    whole = [p for s in eval_sequences for p in prompt.findall(tokenizer.decode(s.tolist()))]
    assert len(whole) >= recipe.indexer_warmup.eval_sequences // 2  # a countdown prompt is most of a window
    assert not [p for p in whole if p in train_texts], "an evaluation window holds a training prompt"
    assert all(p in eval_texts for p in whole)
    for task in tasks:  # each task's held-out prompts are evaluated, not the first task's alone
        assert any(p in set(task.eval.dataset["prompt_text"]) for p in whole), task.name
    trained = [p for _ in range(8) for p in prompt.findall(tokenizer.decode(next(train).tolist()))]
    assert trained and all(p in train_texts for p in trained)


def test_too_few_held_out_tokens_for_the_evaluation_windows_is_one_line(tmp_path, capsys):
    """The evaluation windows come from the tasks' held-out prompts: too few of them for eval_sequences windows is
    refused before the warm-up, naming the keys, not evaluated on fewer windows than asked."""
    err = _refused(["--set", "data.tasks.0.eval_size=1", "--set", "data.tasks.1.eval_size=1",
                    "--set", "indexer_warmup.output_dir=" + str(tmp_path / "out")], tmp_path, capsys)
    assert err.startswith("indexer_warmup.eval_sequences (16) windows of indexer_warmup.seq_len (128) tokens need "
                          "2048 held-out tokens, but the tasks' eval splits hold "), err
    assert err.endswith("raise eval_size or eval_fraction on a task in data.tasks, or lower "
                        "indexer_warmup.eval_sequences"), err


def _refused(sets: list[str], tmp_path, capsys) -> str:
    """`slime-dsa indexer-warmup recipes/indexer_warmup.yaml` with `sets` (small tasks): its one-line error."""
    small = ["--set", "data.tasks.0.train_size=200", "--set", "data.tasks.1.train_size=200", "--set",
             f"logging.run_dir={tmp_path / 'run'}", "--set", "logging.wandb_mode=disabled"]
    assert main(["indexer-warmup", RECIPE, *small, *sets]) == 2
    err = capsys.readouterr().err  # the tasks' tokenizing progress bars, then the error
    assert "Traceback" not in err and err.endswith("\n"), err
    return err.strip().splitlines()[-1].removeprefix("slime-dsa: error: ")


def test_without_held_out_windows_the_warm_up_trains_and_evaluates_nothing():
    """No task with held-out prompts (eval keys at their defaults): the warm-up trains, logs no eval/ metric, and its
    before and after are None, rather than evaluating on training windows."""
    from slime_dsa.indexer.warmup import train_indexers
    from slime_dsa.models import GlmMoeDsaForCausalLM
    from slime_dsa.models.presets import preset_config

    torch.manual_seed(0)
    model = GlmMoeDsaForCausalLM(preset_config("tiny", vocab_size=32))
    logged: list[dict] = []
    result = train_indexers(model, iter(lambda: torch.randint(0, 32, (16,)), None), [], topk=4, num_steps=3,
                            batch_size=1, learning_rate=1e-3, eval_every=1, log=lambda m, step: logged.append(m))
    assert result["before"] is None and result["after"] is None and len(result["history"]) == 3
    assert logged and not any(k.startswith("eval/") for m in logged for k in m)
