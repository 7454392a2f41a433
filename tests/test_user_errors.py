"""Mistakes in what a user points us at fail at once with one line naming the key, row or tensor: recipe paths
(model.path, dataset files) at `recipe check` and at the start of train/sft, a non-UTF-8 dataset row, `export` of a
run directory or of NaN weights, `report` of a missing directory."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from slime_dsa.cli import main
from slime_dsa.config.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
BASE = str(ROOT / "recipes" / "base.yaml")


def one_line_error(capsys, *argv: str) -> str:
    """Run main(argv) expecting a user error: exit code 2, nothing on stdout, one line on stderr."""
    assert main(list(argv)) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "Traceback" not in err, err
    return err.strip().removeprefix("slime-dsa: error: ")


# ---- recipe paths ----------------------------------------------------------------------------------------------

def test_recipe_check_names_a_model_path_that_is_no_model_directory(capsys, tmp_path):
    missing = tmp_path / "nope"
    assert one_line_error(capsys, "recipe", "check", BASE, "--set", f"model.path={missing}") == \
        f"model.path: {missing} does not exist"
    assert one_line_error(capsys, "recipe", "check", BASE, "--set", f"model.path={tmp_path}") == \
        f"model.path: {tmp_path} holds no config.json (not a Hugging Face model directory)"
    err = one_line_error(capsys, "recipe", "check", BASE, "--set", "model.path=zai-org/GLM-5")
    assert err.startswith("model.path: 'zai-org/GLM-5' is not a local directory") and "--local-dir" in err
    (tmp_path / "config.json").write_text('{"eos_token_id": 0}')  # without one: refused (test_run_dir.py)
    assert main(["recipe", "check", BASE, "--set", f"model.path={tmp_path}"]) == 0


def test_recipe_check_names_the_recipe_that_makes_a_missing_model(capsys, monkeypatch):
    """A shipped recipe that trains from another stage's model (gpu_single.yaml from gpu_single_sft.yaml's) says
    which recipe writes it."""
    monkeypatch.chdir(ROOT)
    if (ROOT / "runs/gpu-single-sft/model").exists():
        pytest.skip("this checkout has run gpu_single_sft.yaml")
    assert one_line_error(capsys, "recipe", "check", "recipes/gpu_single.yaml") == (
        "model.path: runs/gpu-single-sft/model does not exist (`slime-dsa sft recipes/gpu_single_sft.yaml` writes it: "
        "run that first)")


def test_recipe_check_names_missing_dataset_files(capsys, tmp_path):
    task = "data.tasks=[{name: a, kind: dataset, path: %s}, {name: b, kind: dataset, path: %s}]"
    err = one_line_error(capsys, "recipe", "check", BASE, "--set",
                         task % (tmp_path / "train.jsonl", tmp_path / "more.jsonl"))
    assert err == f"data.tasks.0.path: {tmp_path / 'train.jsonl'} does not exist (and 1 more: data.tasks.1.path)"
    (tmp_path / "train.txt").write_text("x")
    err = one_line_error(capsys, "recipe", "check", BASE, "--set", "data.tasks.0.kind=dataset",
                         "--set", f"data.tasks.0.path={tmp_path / 'train.txt'}")
    assert err == f"data.tasks.0.path: {tmp_path / 'train.txt'} is a .txt file; expected .jsonl, .json or .parquet"
    (tmp_path / "train.jsonl").write_text('{"prompt": "1+1", "answer": "2"}\n')
    assert main(["recipe", "check", BASE, "--set", "data.tasks.0.kind=dataset",
                 "--set", f"data.tasks.0.path={tmp_path / 'train.jsonl'}"]) == 0


@pytest.mark.parametrize("command", ["train", "sft"])
def test_train_and_sft_fail_at_once_on_a_missing_dataset_file(capsys, tmp_path, command):
    start = time.perf_counter()
    err = one_line_error(capsys, command, BASE, "--set", "data.tasks.0.kind=dataset",
                         "--set", f"data.tasks.0.path={tmp_path / 'gone.jsonl'}", "--set", f"logging.run_dir={tmp_path / 'run'}",
                         "--set", "logging.wandb_mode=disabled")
    assert err == f"data.tasks.0.path: {tmp_path / 'gone.jsonl'} does not exist"
    assert time.perf_counter() - start < 5 and not (tmp_path / "run").exists()


# ---- plugins by import path -------------------------------------------------------------------------------------

PLUGINS = """
def two_args(response, answer):
    return 1.0

class NotATool:
    pass

class NoRun:
    pass

class ExitingTool:
    def __init__(self):
        raise SystemExit(3)

class ExitingLoop:
    def __init__(self):
        raise SystemExit(3)

class MyCalculator:
    name = "calculator"
    description = "a calculator of my own"
    parameters = {"type": "object", "properties": {"expression": {"type": "string"}}}

    async def call(self, expression):
        return expression
"""


@pytest.fixture
def plugins(tmp_path, monkeypatch) -> str:
    (tmp_path / "audit_plugins_mod.py").write_text(PLUGINS)
    (tmp_path / "audit_exit_mod.py").write_text("import sys\nsys.exit(2)  # a script's argparse, say\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return "audit_plugins_mod"


@pytest.mark.parametrize("override,expected", [
    ("data.tasks.0.reward_fn=audit_plugins_mod:misspelt",
     "data.tasks.0.reward_fn: reward function 'audit_plugins_mod:misspelt': 'audit_plugins_mod' has no attribute "
     "'misspelt'"),
    ("data.tasks.0.reward_fn=no_such_reward_mod_xyz:fn", "data.tasks.0.reward_fn: reward function "
     "'no_such_reward_mod_xyz:fn': cannot import module 'no_such_reward_mod_xyz' (ModuleNotFoundError"),
    ("data.tasks.0.reward_fn=audit_plugins_mod:two_args", "data.tasks.0.reward_fn: reward function "
     "'audit_plugins_mod:two_args' takes 2 positional parameter(s)"),
    ("data.tasks.0.reward_fn=aritmetic", "data.tasks.0.reward_fn: unknown reward function 'aritmetic'"),
    ("data.tasks.0.agent={tools: [calculator, 'audit_plugins_mod:NotATool']}",
     "data.tasks.0.agent.tools.1: tool 'audit_plugins_mod:NotATool' is a NotATool, not a tool"),
    ("data.tasks.0.agent={tools: [calculator], loop: 'audit_plugins_mod:NoRun'}",
     "data.tasks.0.agent.loop: agent loop 'audit_plugins_mod:NoRun' is a NoRun without an async run"),
    # a module that exits as it is imported, or a constructor that exits: SystemExit ended the command instead
    ("data.tasks.0.reward_fn=audit_exit_mod:fn", "data.tasks.0.reward_fn: reward function 'audit_exit_mod:fn': "
     "cannot import module 'audit_exit_mod' (SystemExit: 2)"),
    ("data.tasks.0.agent={tools: [calculator, 'audit_exit_mod:Tool']}",
     "data.tasks.0.agent.tools.1: tool 'audit_exit_mod:Tool': cannot import module 'audit_exit_mod' (SystemExit: 2)"),
    ("data.tasks.0.agent={tools: [calculator, 'audit_plugins_mod:ExitingTool']}",
     "data.tasks.0.agent.tools.1: tool 'audit_plugins_mod:ExitingTool': making it failed (SystemExit: 3)"),
    ("data.tasks.0.agent={tools: [calculator], loop: 'audit_plugins_mod:ExitingLoop'}",
     "data.tasks.0.agent.loop: agent loop 'audit_plugins_mod:ExitingLoop': making it failed (SystemExit: 3)"),
    # two tools of one name: train refused it only after Ray had started, without the key; recipe check said ok
    ("data.tasks.0.agent={tools: [calculator, 'audit_plugins_mod:MyCalculator']}",
     "data.tasks.0.agent.tools.1: tool 'audit_plugins_mod:MyCalculator' is named 'calculator', as is "
     "data.tasks.0.agent.tools.0; the model calls tools by name"),
])
def test_a_plugin_that_does_not_resolve_is_one_line_at_check_train_and_sft(capsys, tmp_path, monkeypatch, plugins,
                                                                          override, expected):
    """A misspelt or misshapen reward function, tool or agent loop passed `recipe check` ("ok"); train found the
    reward function before Ray but the tools and loop only after Ray and the engines had started (without naming
    the key), and sft only at its first evaluation, after training steps."""
    import slime_dsa.sft  # noqa: PLC0415
    from slime_dsa.orchestrator import cluster  # noqa: PLC0415

    def started(*args, **kwargs):
        raise AssertionError("Ray or training started")

    monkeypatch.setattr(cluster, "init_ray", started)
    monkeypatch.setattr(slime_dsa.sft, "run_sft", started)
    sao = str(ROOT / "recipes" / "sao_agentic.yaml")
    run = ["--set", f"logging.run_dir={tmp_path / 'run'}", "--set", "logging.wandb_mode=disabled"]
    for command in ("recipe check", "train", "sft"):
        err = one_line_error(capsys, *command.split(), sao, "--set", override, *run)
        assert err.startswith(expected), (command, err)
    assert main(["recipe", "check", sao]) == 0


# ---- dataset rows ----------------------------------------------------------------------------------------------

def test_a_non_utf8_row_names_the_file_and_row(tmp_path):
    from slime_dsa.data.prompts import PromptDataError, load_task
    from slime_dsa.data.tokenizer import build_tokenizer

    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"prompt": "1+1", "answer": "2"}\n{"prompt": "2+2", "answer": "4"}\n'
                     b'{"prompt": "caf\xe9 3+3", "answer": "6"}\n')
    with pytest.raises(PromptDataError) as info:
        load_task("t", build_tokenizer(), path=str(path), cache_dir=str(tmp_path / "cache"))
    assert isinstance(info.value, UserError)
    assert str(info.value).startswith(f"{path}: row 2, column 'prompt': not valid UTF-8 (byte 0xe9 at position 3")


# ---- export and report -----------------------------------------------------------------------------------------

@pytest.fixture
def model_dir(tmp_path, capsys) -> Path:
    from tests.hf_reference import make_hf_checkpoint

    directory = tmp_path / "model"
    make_hf_checkpoint(directory)
    capsys.readouterr()  # transformers' progress bar
    return directory


def test_export_of_a_run_directory_points_at_its_checkpoints(capsys, tmp_path, model_dir):
    from slime_dsa.checkpoint.training import CheckpointManager

    run = tmp_path / "run"
    ckpts = CheckpointManager(run / "checkpoints", keep_last=0)
    for step in (1, 2):
        ckpts.save(step, lambda tmp: shutil.copytree(model_dir, tmp, dirs_exist_ok=True), {})
    (run / "checkpoints" / "step_000003").mkdir()  # damaged: not suggested
    (run / "metrics.jsonl").write_text("")
    err = one_line_error(capsys, "export", str(run), "--out", str(tmp_path / "out"))
    assert err == (f"{run} is a run directory, not a checkpoint: export one of its checkpoints, e.g. "
                   f"{run / 'checkpoints' / 'step_000002'}")
    err = one_line_error(capsys, "export", str(tmp_path / "nothing"), "--out", str(tmp_path / "out"))
    assert err == f"{tmp_path / 'nothing'} does not exist"



def test_export_onto_its_own_checkpoint_is_refused(capsys, tmp_path):
    """`export CKPT --out CKPT --dtype bfloat16` replaced the checkpoint's model.safetensors with the bf16 export: the
    checkpoint's manifest no longer matched, so a later --resume skipped it as damaged. Now one line, the checkpoint
    untouched (the same directory by another spelling too)."""
    from slime_dsa.checkpoint.training import CheckpointManager
    from slime_dsa.checkpoint.validate import checkpoint_problem

    asset = ROOT / "recipes" / "assets" / "quickstart-sft"
    ckpt = CheckpointManager(tmp_path / "checkpoints").save(
        1, lambda tmp: shutil.copytree(asset, tmp, dirs_exist_ok=True), {})
    weights = (ckpt / "model.safetensors").read_bytes()
    for out in (ckpt, ckpt / ".." / ckpt.name):
        err = one_line_error(capsys, "export", str(ckpt), "--out", str(out), "--dtype", "bfloat16")
        assert err == (f"--out {out} is the directory being exported ({ckpt}): export writes a new HF directory; "
                       "give another --out"), err
    assert checkpoint_problem(ckpt) is None and (ckpt / "model.safetensors").read_bytes() == weights
    assert main(["export", str(ckpt), "--out", str(tmp_path / "out"), "--dtype", "bfloat16"]) == 0
    assert checkpoint_problem(ckpt) is None

def test_export_of_a_critic_directory_says_it_is_a_value_model(capsys, tmp_path):
    """`export checkpoints/step_N/critic` (SAO's value model, which value_pretrain.yaml calls a value-model directory)
    said "checkpoint is missing tensor lm_head.weight (model expects shape (384, 128))"."""
    import json  # noqa: PLC0415

    critic = tmp_path / "step_000002" / "critic"
    shutil.copytree(ROOT / "recipes" / "assets" / "quickstart-sft", critic)
    config = json.loads((critic / "config.json").read_text())
    (critic / "config.json").write_text(json.dumps({**config, "architectures": ["GlmMoeDsaForValue"]}))
    err = one_line_error(capsys, "export", str(critic), "--out", str(tmp_path / "out"))
    assert err.startswith(f"{critic} is a value model (GlmMoeDsaForValue, a checkpoint's critic/), not a policy"), err
    assert not (tmp_path / "out").exists()


def test_export_refuses_nan_weights_and_unreadable_files(capsys, tmp_path, model_dir):
    assert main(["export", str(model_dir), "--out", str(tmp_path / "good")]) == 0
    assert (tmp_path / "good" / "config.json").is_file() and (tmp_path / "good" / "model.safetensors").is_file()
    capsys.readouterr()
    weights = model_dir / "model.safetensors"
    state = load_file(weights)
    name = sorted(state)[3]
    state[name][0] = float("nan")
    save_file(state, weights)
    err = one_line_error(capsys, "export", str(model_dir), "--out", str(tmp_path / "out"))
    assert err == f"{model_dir}: tensor {name} holds NaN or infinite values; refusing to export it"
    assert not (tmp_path / "out").exists()
    weights.write_bytes(weights.read_bytes()[:-16])
    err = one_line_error(capsys, "export", str(model_dir), "--out", str(tmp_path / "out"))
    assert err.startswith(f"{weights} is not a readable safetensors file")


def test_export_of_a_checkpoint_without_model_safetensors_is_one_line(capsys, tmp_path):
    """A checkpoint whose model.safetensors is gone (its optimizer's and RNG safetensors still there) was a
    FileNotFoundError traceback; a pickle left in its place is named, and never loaded."""
    ckpt = tmp_path / "step_000002"
    shutil.copytree(ROOT / "recipes" / "assets" / "quickstart-sft", ckpt)
    (ckpt / "model.safetensors").rename(ckpt / "optimizer.safetensors")
    torch.save({"w": torch.zeros(2)}, ckpt / "pytorch_model.bin")
    err = one_line_error(capsys, "export", str(ckpt), "--out", str(tmp_path / "out"))
    assert err.startswith(f"{ckpt} holds no model.safetensors") and "pytorch_model.bin" in err, err
    assert not (tmp_path / "out").exists()


def test_report_of_a_missing_directory_is_one_line(capsys, tmp_path):
    assert one_line_error(capsys, "report", str(tmp_path / "nope")) == f"run directory {tmp_path / 'nope'} does not exist"
    assert one_line_error(capsys, "report", str(tmp_path)) == \
        f"{tmp_path} holds no metrics.jsonl: is it a run directory?"


# ---- model.path that loads nowhere -----------------------------------------------------------------------------

def _model_dir_without(tmp_path, *left_out: str, model_type: str | None = None) -> Path:
    model_dir = tmp_path / "model"
    shutil.copytree(ROOT / "recipes" / "assets" / "quickstart-sft", model_dir)
    for name in left_out:
        (model_dir / name).unlink()
    if model_type is not None:
        import json  # noqa: PLC0415

        config = json.loads((model_dir / "config.json").read_text())
        (model_dir / "config.json").write_text(json.dumps({**config, "model_type": model_type}))
    return model_dir


@pytest.mark.parametrize(("left_out", "model_type", "expected"), [
    (("tokenizer.json", "tokenizer_config.json"), None, "no tokenizer at {d}: transformers' AutoTokenizer cannot load"),
    (("model.safetensors",), None, "model.path: {d} holds no .safetensors weights"),
    ((), "llama", "model.path: {d}/config.json: config.json model_type is 'llama', expected 'glm_moe_dsa'"),
])
def test_train_names_a_model_path_that_would_not_load_before_ray_starts(capsys, tmp_path, monkeypatch, left_out,
                                                                        model_type, expected):
    """A model directory without a tokenizer, without weights, or of another architecture passes `recipe check`
    (config.json is there); `train` then died with a traceback: FileNotFoundError for the tokenizer, and for the other
    two a trainer rank's traceback after Ray, the engines and the ranks had started."""
    from slime_dsa.orchestrator import cluster  # noqa: PLC0415

    def no_ray(recipe):
        raise AssertionError("Ray started")

    monkeypatch.setattr(cluster, "init_ray", no_ray)
    model_dir = _model_dir_without(tmp_path, *left_out, model_type=model_type)
    err = one_line_error(capsys, "train", BASE, "--set", f"model.path={model_dir}", "--set",
                         f"logging.run_dir={tmp_path / 'run'}", "--set", "logging.wandb_mode=disabled")
    assert err.startswith(expected.format(d=model_dir)), err


@pytest.mark.parametrize(("make", "sets", "expected"), [
    (lambda d: _model_dir_without(d, model_type="llama"), (),
     "model.path: {d}/config.json: config.json model_type is 'llama', expected 'glm_moe_dsa'"),
    (lambda d: _as_value_model(_model_dir_without(d)), (),
     "model.path: {d} is a value model (GlmMoeDsaForValue, no language-model head); model.path takes a policy"),
    (lambda d: _model_dir_without(d, model_type="llama"), ("--for", "sft"),
     "model.path: {d}/config.json: config.json model_type is 'llama', expected 'glm_moe_dsa'"),
])
def test_recipe_check_names_a_model_path_of_another_architecture(capsys, tmp_path, make, sets, expected):
    """`recipe check` found only that model.path held a config.json; the architecture (or a value model given as the
    policy) was first named by `train`, after the prompts were tokenized. Now `recipe check` reads config.json too,
    with the function train's check uses."""
    model_dir = make(tmp_path)
    err = one_line_error(capsys, "recipe", "check", BASE, *sets, "--set", f"model.path={model_dir}")
    assert err.startswith(expected.format(d=model_dir)), err


def test_recipe_checks_names_the_value_architecture_the_model_package_writes():
    """config/paths.py names it without importing torch; the two must agree."""
    from slime_dsa.config import paths  # noqa: PLC0415
    from slime_dsa.models.value_model import VALUE_ARCHITECTURE  # noqa: PLC0415

    assert paths.VALUE_ARCHITECTURE == VALUE_ARCHITECTURE


def _as_value_model(model_dir: Path) -> Path:
    import json  # noqa: PLC0415

    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "architectures": ["GlmMoeDsaForValue"]}))
    return model_dir


def _with_vocab(model_dir: Path, vocab_size: int) -> Path:
    import json  # noqa: PLC0415

    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "vocab_size": vocab_size}))
    return model_dir


@pytest.mark.parametrize(("recipe", "key", "make", "expected"), [
    ("sao_agentic.yaml", "critic.path", lambda d: _model_dir_without(d, model_type="llama"),
     "critic.path: {d}/config.json: config.json model_type is 'llama', expected 'glm_moe_dsa'"),
    # a critic of fewer embeddings than the tokenizer's tokens: IndexError in the critic's rank after Ray started
    ("sao_agentic.yaml", "critic.path", lambda d: _with_vocab(_model_dir_without(d), 300),
     "critic.path: {d} has 300 token embeddings, fewer than the tokenizer's 384 tokens"),
    ("opd_merge.yaml", "teachers.1.path", lambda d: _model_dir_without(d, model_type="llama"),
     "teachers.1.path: {d}/config.json: config.json model_type is 'llama', expected 'glm_moe_dsa'"),
    ("opd_merge.yaml", "teachers.1.path", lambda d: _model_dir_without(d, "model.safetensors"),
     "teachers.1.path: {d} holds no .safetensors weights"),
    ("opd_merge.yaml", "teachers.1.path", lambda d: _as_value_model(_model_dir_without(d)),
     "teachers.1.path: {d} is a value model (GlmMoeDsaForValue, no language-model head)"),
])
def test_train_names_a_critic_or_teacher_path_that_would_not_load_before_ray_starts(capsys, tmp_path, monkeypatch,
                                                                                    recipe, key, make, expected):
    """A critic or teacher directory of another architecture, without weights, a critic with fewer embeddings than
    the tokenizer has tokens, or (a teacher) a value model passed `recipe check` and the start of train; the critic's
    trainer rank or the teacher's engine then died in Ray with a traceback (a value model as teacher: 'checkpoint is
    missing tensor lm_head.weight'; the small critic: IndexError: index out of range in self)."""
    from slime_dsa.orchestrator import cluster  # noqa: PLC0415

    def no_ray(recipe):
        raise AssertionError("Ray started")

    monkeypatch.setattr(cluster, "init_ray", no_ray)
    policy = ROOT / "recipes" / "assets" / "agentic-sft"
    bad = make(tmp_path)
    teachers = [a for i in range(3) for a in ("--set", f"teachers.{i}.path={bad if i == 1 else policy}")]
    extra = teachers + ["--set", f"model.path={policy}"] if recipe.startswith("opd") else ["--set", f"{key}={bad}"]
    err = one_line_error(capsys, "train", str(ROOT / "recipes" / recipe), *extra, "--set",
                         f"logging.run_dir={tmp_path / 'run'}", "--set", "logging.wandb_mode=disabled")
    assert err.startswith(expected.format(d=bad)), err


def test_sft_refuses_an_output_dir_that_is_a_file_before_training(capsys, tmp_path, monkeypatch):
    """sft.output_dir naming a file was a NotADirectoryError traceback at the save, after the whole training."""
    import slime_dsa.sft  # noqa: PLC0415

    def no_training(recipe):
        raise AssertionError("training started")

    monkeypatch.setattr(slime_dsa.sft, "run_sft", no_training)
    (tmp_path / "notes.txt").write_text("mine")
    for output_dir in (tmp_path / "notes.txt", tmp_path / "notes.txt" / "model"):
        err = one_line_error(capsys, "sft", BASE, "--set", f"sft.output_dir={output_dir}",
                             "--set", f"logging.run_dir={tmp_path / 'run'}")
        assert err == f"sft.output_dir: {tmp_path / 'notes.txt'} is a file; sft.output_dir names a directory to write into"


@pytest.mark.parametrize("key", ["logging.run_dir", "checkpoint.dir"])
def test_a_run_or_checkpoint_dir_that_is_a_file_is_one_line(capsys, tmp_path, key):
    """logging.run_dir or checkpoint.dir naming a file was a FileExistsError traceback from train and sft."""
    (tmp_path / "notes.txt").write_text("mine")
    for command in ("recipe check", "train"):
        err = one_line_error(capsys, *command.split(), BASE, "--set", f"{key}={tmp_path / 'notes.txt'}")
        assert err == f"{key}: {tmp_path / 'notes.txt'} is a file; {key} names a directory to write into"


def test_recipe_check_names_a_critic_path_that_is_no_model_directory(capsys, tmp_path):
    """critic.path of a directory that does not exist passed `recipe check` and failed in the trainer's Ray worker
    with a FileNotFoundError traceback."""
    sao = str(ROOT / "recipes" / "sao_agentic.yaml")
    missing = tmp_path / "nope"
    assert one_line_error(capsys, "recipe", "check", sao, "--set", f"critic.path={missing}") == \
        f"critic.path: {missing} does not exist"
    assert one_line_error(capsys, "recipe", "check", sao, "--set", f"critic.path={tmp_path}") == \
        f"critic.path: {tmp_path} holds no config.json (not a Hugging Face model directory)"
    assert main(["recipe", "check", sao, "--set", f"critic.path={ROOT / 'recipes' / 'assets' / 'quickstart-sft'}"]) == 0


def test_recipe_check_names_an_opd_topk_above_the_vocabulary(capsys):
    """algorithm.opd_topk 1000 on a 384-token model passed `recipe check`; train failed after Ray started with the
    teacher engine's 400 about top_logprobs_num, a key the recipe does not have."""
    model = ROOT / "recipes" / "assets" / "quickstart-sft"
    opd = [str(ROOT / "recipes" / "opd_merge.yaml"), "--set", f"model.path={model}",
           *[a for i in range(3) for a in ("--set", f"teachers.{i}.path={model}")]]
    assert one_line_error(capsys, "recipe", "check", *opd, "--set", "algorithm.opd_topk=1000") == \
        "algorithm.opd_topk (1000) exceeds the vocabulary of model.path (384 tokens)"
    assert main(["recipe", "check", *opd, "--set", "algorithm.opd_topk=384"]) == 0


def test_sft_stop_at_pass_without_held_out_prompts_is_refused(capsys):
    """sft.stop_at_pass with no task holding an eval split was accepted: every eval's pass@1 was nan and the stop
    never came (the run went on to trainer.num_steps)."""
    sft = str(ROOT / "recipes" / "quickstart_sft.yaml")
    err = one_line_error(capsys, "recipe", "check", sft, "--set", "data.tasks.0.eval_size=0")
    assert err.endswith("sft.stop_at_pass (0.25) needs held-out prompts: set eval_size or eval_fraction on a task in "
                        "data.tasks")
    assert main(["recipe", "check", sft, "--set", "data.tasks.0.eval_size=0", "--set", "sft.stop_at_pass=null",
                 "--set", "sft.eval_every=0"]) == 0  # eval_every 10 evaluates nothing there either: refused too


def test_indexer_warmup_checks_its_paths_before_it_trains(capsys, tmp_path):
    """indexer-warmup never ran the recipe's path checks: an output_dir under a file failed with a FileExistsError
    traceback after the whole warm-up, and a missing corpus file came from the dataset loader."""
    recipe = str(ROOT / "recipes" / "indexer_warmup.yaml")
    blocker = tmp_path / "file"
    blocker.write_text("")
    run = ["--set", f"logging.run_dir={tmp_path / 'run'}", "--set", "logging.wandb_mode=disabled"]
    start = time.perf_counter()
    assert one_line_error(capsys, "indexer-warmup", recipe, "--set", f"indexer_warmup.output_dir={blocker / 'out'}",
                          *run) == f"indexer_warmup.output_dir: {blocker} is a file; indexer_warmup.output_dir names a directory to write into"
    assert one_line_error(capsys, "indexer-warmup", recipe, "--set", "indexer_warmup.corpus=dataset", "--set",
                          f"indexer_warmup.dataset_path={tmp_path / 'gone.jsonl'}", *run) == \
        f"indexer_warmup.dataset_path: {tmp_path / 'gone.jsonl'} does not exist"
    assert time.perf_counter() - start < 30


def test_model_preset_with_model_path_names_both_keys_and_where_each_was_set(capsys):
    """recipes/opd_expert_sft.yaml inherits preset quickstart from opd_domains.yaml and sets path: the preset was
    accepted and ignored. Both set is refused in one line naming the two keys and the files that set them."""
    model = str(ROOT / "recipes" / "assets" / "quickstart-sft")
    err = one_line_error(capsys, "recipe", "check", str(ROOT / "recipes" / "indexer_warmup.yaml"), "--for",
                         "indexer-warmup", "--set", f"model.path={model}")
    line = (ROOT / "recipes" / "indexer_warmup.yaml").read_text().splitlines().index("  preset: quickstart") + 1
    assert err.startswith(f"recipes/indexer_warmup.yaml:{line}, command line (--set model.path={model}): model: preset "
                          f"('quickstart') and path ('{model}') are both set"), err
    assert main(["recipe", "check", str(ROOT / "recipes" / "indexer_warmup.yaml"), "--for", "indexer-warmup",
                 "--set", f"model.path={model}", "--set", "model.preset=null"]) == 0


def test_train_sizes_the_critic_check_by_the_highest_token_id(capsys, tmp_path, monkeypatch):
    """The critic's embedding rows were checked against len(tokenizer): a tokenizer with holes in its ids (390
    tokens, one of them id 450) passed a critic of 420 rows, whose rank then failed on id 450 after Ray started
    (IndexError). Now checked against the highest id + 1, before Ray."""
    from slime_dsa.orchestrator import cluster  # noqa: PLC0415
    from tests.test_run_dir import _tokenizer_with_holes  # noqa: PLC0415

    def no_ray(recipe):
        raise AssertionError("Ray started")

    monkeypatch.setattr(cluster, "init_ray", no_ray)
    tokenizer, _ = _tokenizer_with_holes(tmp_path / "tokenizer")
    policy = _with_vocab(_model_dir_without(tmp_path / "policy"), 451)  # rows enough for id 450 (config only)
    critic = _with_vocab(_model_dir_without(tmp_path / "critic"), 420)
    sets = [f"model.path={policy}", f"model.tokenizer_path={tokenizer}", f"critic.path={critic}",
            f"logging.run_dir={tmp_path / 'run'}", "logging.wandb_mode=disabled"]
    err = one_line_error(capsys, "train", str(ROOT / "recipes" / "sao_agentic.yaml"),
                         *[a for s in sets for a in ("--set", s)])
    assert err.startswith(f"critic.path: {critic} has 420 token embeddings, fewer than the tokenizer's 451 tokens"), err
