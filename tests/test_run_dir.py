"""The run directory that train, sft and indexer-warmup share: recipe.yaml, a log file for the block's length."""

from __future__ import annotations

import json
import logging

import yaml

from slime_dsa.config import load_recipe
from slime_dsa.run_dir import open_run_dir, resolve_run_dir


def assert_refused_by_check_and_run(recipe, run_dir, expected: str) -> None:
    """recipe check refuses `recipe` with the one line `expected`, and so does the run's start (prepare_model_dir,
    then load_tokenizer), leaving no initial_model in `run_dir`."""
    import pytest  # noqa: PLC0415

    from slime_dsa.config.errors import RecipeError, UserError  # noqa: PLC0415
    from slime_dsa.config.paths import check_recipe_paths  # noqa: PLC0415
    from slime_dsa.run_dir import load_tokenizer, prepare_model_dir  # noqa: PLC0415

    with pytest.raises(RecipeError) as info:
        check_recipe_paths(recipe)
    assert str(info.value) == expected
    with pytest.raises(UserError) as info:
        load_tokenizer(recipe, prepare_model_dir(recipe, run_dir))
    assert str(info.value) == expected
    assert not (run_dir / "initial_model").exists()


def test_open_run_dir_writes_the_recipe_and_logs_only_inside_the_block(tmp_path):
    recipe = load_recipe(None, [f"logging.run_dir={tmp_path / 'run'}", "rollout.temperature=0.5"])
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    root.setLevel(logging.WARNING)
    try:
        with open_run_dir(recipe, "job.log") as run_dir:
            assert run_dir == tmp_path / "run"
            logging.getLogger("slime_dsa.some.module").info("inside")
        logging.getLogger("slime_dsa.some.module").warning("after")
        assert root.handlers == handlers and root.level == logging.WARNING
    finally:
        root.setLevel(level)
    assert yaml.safe_load((run_dir / "recipe.yaml").read_text())["rollout"]["temperature"] == 0.5
    text = (run_dir / "job.log").read_text()
    assert "INFO slime_dsa.some.module: inside" in text and "after" not in text


def test_run_dir_defaults_to_runs_and_the_run_name():
    assert str(resolve_run_dir(load_recipe(None, ["logging.run_name=exp1"]))) == "runs/exp1"
    assert str(resolve_run_dir(load_recipe(None, []))).startswith("runs/run-")


def test_from_scratch_model_takes_the_recipe_index_topk(tmp_path):
    import json  # noqa: PLC0415

    from slime_dsa.run_dir import prepare_model_dir  # noqa: PLC0415

    recipe = load_recipe(None, ["model.preset=tiny", "model.index_topk=512"])
    config = json.loads((prepare_model_dir(recipe, tmp_path) / "config.json").read_text())
    assert config["index_topk"] == 512


def test_model_path_with_index_topk_is_copied_with_the_new_budget(tmp_path):
    import json  # noqa: PLC0415

    from slime_dsa.run_dir import prepare_model_dir  # noqa: PLC0415

    source = prepare_model_dir(load_recipe(None, ["model.preset=tiny"]), tmp_path / "scratch")
    recipe = load_recipe(None, [f"model.path={source}", "model.index_topk=512"])
    copied = prepare_model_dir(recipe, tmp_path / "run")
    assert copied == tmp_path / "run" / "initial_model"
    assert json.loads((copied / "config.json").read_text())["index_topk"] == 512
    assert json.loads((source / "config.json").read_text())["index_topk"] != 512
    assert (copied / "model.safetensors").read_bytes() == (source / "model.safetensors").read_bytes()
    assert prepare_model_dir(load_recipe(None, [f"model.path={source}"]), tmp_path / "plain") == source


def test_a_start_removes_the_initial_model_copies_a_killed_start_left(tmp_path):
    """A start killed while copying model.path into initial_model (or writing a from-scratch one) left its
    model-sized temporary directory in the run directory for good; the next start removes it."""
    from slime_dsa.run_dir import prepare_model_dir  # noqa: PLC0415

    source = prepare_model_dir(load_recipe(None, ["model.preset=tiny"]), tmp_path / "scratch")
    leftover = tmp_path / "run" / ".initial_model.tmp-k1ll3d"
    leftover.mkdir(parents=True)
    (leftover / "model.safetensors").write_bytes(b"\0" * 1024)
    assert prepare_model_dir(load_recipe(None, [f"model.path={source}"]), tmp_path / "run") == source
    assert not leftover.exists()


def test_a_reused_initial_model_takes_a_changed_index_topk(tmp_path):
    """A resumed run (or a second one in the directory) reuses run_dir/initial_model: a model.index_topk changed
    since its first start was silently ignored, engines and trainer kept the old DSA budget."""
    import json  # noqa: PLC0415

    from slime_dsa.run_dir import prepare_model_dir  # noqa: PLC0415

    def budget(*overrides: str, run: str) -> int:
        model_dir = prepare_model_dir(load_recipe(None, list(overrides)), tmp_path / run)
        return json.loads((model_dir / "config.json").read_text())["index_topk"]

    assert budget("model.preset=tiny", "model.index_topk=16", run="scratch") == 16
    assert budget("model.preset=tiny", "model.index_topk=24", run="scratch") == 24
    assert budget("model.preset=tiny", run="scratch") == 24  # null: the model's, as it is
    source = tmp_path / "scratch" / "initial_model"
    assert budget(f"model.path={source}", "model.index_topk=8", run="copy") == 8
    assert budget(f"model.path={source}", "model.index_topk=12", run="copy") == 12


def test_the_default_run_name_is_documented_as_the_run_directorys_name():
    """Without logging.run_name the W&B run is named after the run directory (the quickstart's W&B run is
    'quickstart'), but `recipe explain` said 'null = a timestamped name'."""
    from slime_dsa.config.schema import LoggingSection  # noqa: PLC0415

    doc = LoggingSection.model_fields["run_name"].description
    assert "null = the run directory's name" in doc and "run-<timestamp>" in doc


def _larger_tokenizer(directory):
    """The built-in tokenizer with words of the arithmetic prompts as tokens of their own, ids past its 390: a
    tokenizer larger than the one the presets were sized for. Returns (directory, its length, its EOS id)."""
    from slime_dsa.data.tokenizer import VOCAB_SIZE, build_tokenizer  # noqa: PLC0415

    tokenizer = build_tokenizer()
    tokenizer.add_tokens(["Compute", "final answer"])
    tokenizer.save_pretrained(directory)
    assert len(tokenizer) > VOCAB_SIZE and max(tokenizer.encode("Compute 3 + 4. Put the final answer in")) >= VOCAB_SIZE
    return directory, len(tokenizer), tokenizer.eos_token_id


def test_a_from_scratch_preset_is_sized_to_model_tokenizer_path(tmp_path):
    """model.tokenizer_path with no model.path: the preset was built for the built-in tokenizer (390 embedding rows)
    whatever the tokenizer, so a larger one's ids ran past the embedding: an IndexError deep in the model. The preset
    now takes the tokenizer's length and EOS, and is saved with that tokenizer."""
    import json  # noqa: PLC0415

    from transformers import AutoTokenizer  # noqa: PLC0415

    from slime_dsa.run_dir import prepare_model_dir  # noqa: PLC0415

    directory, size, eos = _larger_tokenizer(tmp_path / "tokenizer")
    model_dir = prepare_model_dir(load_recipe(None, [f"model.tokenizer_path={directory}"]), tmp_path / "run")
    config = json.loads((model_dir / "config.json").read_text())
    assert (config["vocab_size"], config["eos_token_id"]) == (size, eos)
    assert len(AutoTokenizer.from_pretrained(model_dir)) == size  # the model's own tokenizer is the same one


def test_sft_from_scratch_with_a_larger_tokenizer_trains(tmp_path):
    """The real `slime-dsa sft` on a tiny preset with model.tokenizer_path larger than the built-in tokenizer: it
    failed with 'IndexError: index out of range in self' from the embedding at its first step."""
    from slime_dsa.cli import main  # noqa: PLC0415

    directory, size, _ = _larger_tokenizer(tmp_path / "tokenizer")
    sets = [f"model.tokenizer_path={directory}", "trainer.num_steps=1", "sft.batch_size=2", "sft.eval_every=0",
            "data.tasks.0.train_size=20", f"logging.run_dir={tmp_path / 'run'}", "logging.wandb_mode=disabled",
            f"sft.output_dir={tmp_path / 'out'}"]
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("")  # every key at its default: a tiny preset built from scratch
    assert main(["sft", str(recipe), *[a for s in sets for a in ("--set", s)]]) == 0
    assert json.loads((tmp_path / "out" / "config.json").read_text())["vocab_size"] == size


def test_a_run_directorys_from_scratch_model_smaller_than_the_tokenizer_is_one_line(tmp_path):
    """A run directory's initial_model (built at its first start) is reused by later starts: one built for the
    built-in tokenizer and a later start with a larger model.tokenizer_path gave the IndexError of too few embedding
    rows at the first forward. Refused in one line naming the key; the same tokenizer again is reused as it was."""
    import pytest  # noqa: PLC0415

    from slime_dsa.config.errors import UserError  # noqa: PLC0415
    from slime_dsa.run_dir import prepare_model_dir  # noqa: PLC0415

    directory, size, _ = _larger_tokenizer(tmp_path / "tokenizer")
    built = prepare_model_dir(load_recipe(None, []), tmp_path / "run")
    with pytest.raises(UserError) as info:
        prepare_model_dir(load_recipe(None, [f"model.tokenizer_path={directory}"]), tmp_path / "run")
    assert str(info.value) == (f"model.tokenizer_path: its {size} tokens are more than the 390 embedding rows of "
                               f"{built}, which an earlier start of this run built from scratch for another "
                               "tokenizer; use a new logging.run_dir")
    larger = prepare_model_dir(load_recipe(None, [f"model.tokenizer_path={directory}"]), tmp_path / "run2")
    assert prepare_model_dir(load_recipe(None, [f"model.tokenizer_path={directory}"]), tmp_path / "run2") == larger


QUICKSTART_SFT = "recipes/assets/quickstart-sft"  # 384 embedding rows, its own tokenizer 384 tokens


def test_model_path_with_a_tokenizer_larger_than_its_embedding_is_one_line(tmp_path):
    """model.path with a model.tokenizer_path of more tokens than the model's embedding rows was accepted: the
    built-in tokenizer (390) on the quickstart policy (384 rows, built before GLM's six tool-call tags were added)
    encodes '<arg_key>' and the other tags as ids 384-389, an IndexError in the embedding at the first prompt or
    trajectory holding one. Refused in one line naming the key, by recipe check (tokenizer.json) and by the run (the
    loaded tokenizer), before the model is copied; the model's own tokenizer is accepted."""
    import pytest  # noqa: PLC0415

    from slime_dsa.config.errors import UserError  # noqa: PLC0415
    from slime_dsa.config.paths import check_recipe_paths  # noqa: PLC0415
    from slime_dsa.data.tokenizer import build_tokenizer, save_tokenizer  # noqa: PLC0415
    from slime_dsa.run_dir import load_tokenizer, prepare_model_dir  # noqa: PLC0415

    assert max(build_tokenizer().encode("<arg_key>x</arg_key>")) >= 384  # what the embedding could not look up
    directory = save_tokenizer(tmp_path / "tokenizer")
    expected = (f"model.tokenizer_path: the tokenizer at {directory} has 390 tokens, more than the 384 embedding rows "
                f"of the model at {QUICKSTART_SFT} (config.json vocab_size): a prompt or response holding a token id "
                "at or above 384 would fail in the embedding (IndexError) mid-run; use the model's own tokenizer or "
                "one that fits it")
    recipe = load_recipe(None, [f"model.path={QUICKSTART_SFT}", f"model.tokenizer_path={directory}",
                                "model.index_topk=64"])
    assert_refused_by_check_and_run(recipe, tmp_path / "run", expected)
    plain = load_recipe(None, [f"model.path={QUICKSTART_SFT}", f"model.tokenizer_path={directory}"])
    with pytest.raises(UserError) as info:
        load_tokenizer(plain, prepare_model_dir(plain, tmp_path / "plain"))
    assert str(info.value) == expected
    own = load_recipe(None, [f"model.path={QUICKSTART_SFT}"])
    check_recipe_paths(own)
    assert len(load_tokenizer(own, prepare_model_dir(own, tmp_path / "own"))) == 384


def test_a_from_scratch_model_with_a_tokenizer_without_eos_is_one_line(tmp_path):
    """model.tokenizer_path without an eos_token and no model.path: the preset was built with eos_token_id null, then
    sft ended each response with None ('Could not infer dtype of NoneType' at its first step), the engines had no
    token to stop on and the agent loop refused the tokenizer. Refused in one line naming the key, by recipe check
    (its files) and by the run (the loaded tokenizer), before a model is built."""
    from slime_dsa.config.paths import check_recipe_paths  # noqa: PLC0415
    from slime_dsa.data.tokenizer import build_tokenizer  # noqa: PLC0415
    from slime_dsa.run_dir import prepare_model_dir  # noqa: PLC0415

    tokenizer = build_tokenizer()
    tokenizer.eos_token = tokenizer.pad_token = None
    directory = tmp_path / "tokenizer"
    tokenizer.save_pretrained(directory)
    expected = (f"model.tokenizer_path: the tokenizer at {directory} has no eos_token; a model built from scratch "
                "(model.path null) takes its EOS from the tokenizer: generation stops on it and sft ends each "
                "response with it. Set eos_token in its tokenizer_config.json, or use a tokenizer that has one")
    recipe = load_recipe(None, [f"model.tokenizer_path={directory}"])
    assert_refused_by_check_and_run(recipe, tmp_path / "run", expected)
    tokenizer.eos_token = "<|endoftext|>"  # the same tokenizer with its EOS is taken
    tokenizer.save_pretrained(tmp_path / "with_eos")
    recipe = load_recipe(None, [f"model.tokenizer_path={tmp_path / 'with_eos'}"])
    check_recipe_paths(recipe)
    assert (prepare_model_dir(recipe, tmp_path / "run") / "config.json").is_file()


def test_a_full_disk_while_copying_model_path_for_index_topk_is_one_line(tmp_path, monkeypatch):
    """model.path with model.index_topk is copied into the run directory; a full disk there raised shutil.Error with
    a list of (source, target, reason) for every file copied after the first failure: a traceback. Now one line
    naming the copy and the operating system's words, no partial copy left (a later start would reuse one that
    held a config.json). ENOSPC comes from a patched copy, partway through the weights."""
    import errno  # noqa: PLC0415
    import os  # noqa: PLC0415
    import shutil  # noqa: PLC0415

    import pytest  # noqa: PLC0415

    from slime_dsa.config.errors import UserError  # noqa: PLC0415
    from slime_dsa.run_dir import prepare_model_dir  # noqa: PLC0415

    source = prepare_model_dir(load_recipe(None, ["model.preset=tiny"]), tmp_path / "scratch")
    copyfile = shutil.copyfile  # what shutil.copy2 calls, whichever copy_function copytree is given

    def full_disk(src, dst, **kwargs):
        if os.fspath(src).endswith(".safetensors"):  # copytree passes a DirEntry to copy2
            with open(dst, "wb") as out:
                out.write(b"\0" * 100)  # a part written, then the disk is full
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), dst)
        return copyfile(src, dst, **kwargs)

    monkeypatch.setattr(shutil, "copyfile", full_disk)
    run = tmp_path / "run"
    with pytest.raises(UserError) as info:
        prepare_model_dir(load_recipe(None, [f"model.path={source}", "model.index_topk=512"]), run)
    assert str(info.value) == (f"the copy of model.path with model.index_topk 512 in the run directory, "
                               f"{run / 'initial_model'}: cannot be written: No space left on device; nothing of it "
                               "is left")
    assert sorted(p.name for p in run.iterdir()) == []
    monkeypatch.setattr(shutil, "copyfile", copyfile)  # space again: the next start copies it whole
    copied = prepare_model_dir(load_recipe(None, [f"model.path={source}", "model.index_topk=512"]), run)
    assert (copied / "model.safetensors").read_bytes() == (source / "model.safetensors").read_bytes()


def test_a_full_disk_while_rewriting_a_reused_initial_models_index_topk_is_one_line(tmp_path, monkeypatch):
    """A reused run_dir/initial_model whose config.json is rewritten for a changed model.index_topk: a full disk
    there raised the OSError with a traceback. Now one line naming the file, the key and the operating system's
    words; the old config.json is kept whole and no temporary file is left. ENOSPC comes from a patched writer,
    after part of the new text is written."""
    import errno  # noqa: PLC0415
    import os  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    import pytest  # noqa: PLC0415

    from slime_dsa.config.errors import UserError  # noqa: PLC0415
    from slime_dsa.run_dir import prepare_model_dir  # noqa: PLC0415

    model_dir = prepare_model_dir(load_recipe(None, ["model.preset=tiny", "model.index_topk=16"]), tmp_path / "run")
    before = (model_dir / "config.json").read_bytes()
    write_text = Path.write_text

    def full_disk(path, text, *args, **kwargs):
        if path.name.startswith(".config.json.tmp"):
            write_text(path, text[:20], *args, **kwargs)  # a part written, then the disk is full
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return write_text(path, text, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", full_disk)
    with pytest.raises(UserError) as info:
        prepare_model_dir(load_recipe(None, ["model.preset=tiny", "model.index_topk=24"]), tmp_path / "run")
    assert str(info.value) == (f"{model_dir / 'config.json'}, rewritten for model.index_topk 24: cannot be written: "
                               "No space left on device; it still says index_topk 16")
    assert (model_dir / "config.json").read_bytes() == before
    assert not list(model_dir.glob(".config.json.tmp*"))


def _tokenizer_with_holes(directory):
    """The built-in tokenizer (390 tokens) with its last merge token moved from id 372 to 450: a tokenizer whose
    ids have holes, len() 390 but ids up to 450. Returns (directory, the moved token)."""
    from slime_dsa.data.tokenizer import save_tokenizer  # noqa: PLC0415

    save_tokenizer(directory)
    raw = json.loads((directory / "tokenizer.json").read_text())
    vocab = raw["model"]["vocab"]
    token = max(vocab, key=vocab.get)
    vocab[token] = 450
    (directory / "tokenizer.json").write_text(json.dumps(raw))
    return directory, token


def test_a_from_scratch_model_is_sized_to_the_highest_token_id_not_the_length(tmp_path):
    """A from-scratch model was sized by len(tokenizer): a tokenizer with holes in its ids (390 tokens, one of them id
    450) got 390 embedding rows, and a text holding that token was an IndexError at the first forward. Now sized by
    the highest id + 1; a run directory's model built for a 390-id tokenizer is refused for it in one line."""
    import pytest  # noqa: PLC0415
    from transformers import AutoTokenizer  # noqa: PLC0415

    from slime_dsa.config.errors import UserError  # noqa: PLC0415
    from slime_dsa.run_dir import prepare_model_dir  # noqa: PLC0415

    directory, token = _tokenizer_with_holes(tmp_path / "tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(directory)
    assert (len(tokenizer), tokenizer.encode(token)) == (390, [450])
    recipe = load_recipe(None, [f"model.tokenizer_path={directory}"])
    model_dir = prepare_model_dir(recipe, tmp_path / "run")
    assert json.loads((model_dir / "config.json").read_text())["vocab_size"] == 451
    prepare_model_dir(load_recipe(None, []), tmp_path / "builtin")  # 390 rows, for the built-in tokenizer
    with pytest.raises(UserError) as info:
        prepare_model_dir(recipe, tmp_path / "builtin")
    assert str(info.value).startswith("model.tokenizer_path: its 451 tokens are more than the 390 embedding rows")


def _quickstart_with(directory, eos_token_id="leave out", eos_token="<|endoftext|>"):
    """A copy of the quickstart-sft model whose config.json's eos_token_id is `eos_token_id` (left out by default) and
    whose tokenizer's eos_token is `eos_token` (373 in its vocabulary; None: no eos_token)."""
    import shutil  # noqa: PLC0415

    from transformers import AutoTokenizer  # noqa: PLC0415

    shutil.copytree(QUICKSTART_SFT, directory)
    config = json.loads((directory / "config.json").read_text())
    config.pop("eos_token_id")
    if eos_token_id != "leave out":
        config["eos_token_id"] = eos_token_id
    (directory / "config.json").write_text(json.dumps(config))
    tokenizer = AutoTokenizer.from_pretrained(directory)
    tokenizer.eos_token = tokenizer.pad_token = eos_token
    tokenizer.save_pretrained(directory)
    return directory


def test_model_path_whose_config_names_no_eos_is_one_line(tmp_path):
    """model.path's config.json without eos_token_id was accepted: ModelConfig (as transformers) reads a missing one as
    token id 1, so the engines ended every response at the first 'ā' (id 1 of this vocabulary), status completed,
    and a saved checkpoint said 1; a null one stopped on nothing. With a tokenizer without eos_token too, sft also
    ended each response with None. Refused in one line naming model.path, by recipe check and by the run."""

    for name, eos_token_id, eos_token in (("neither", "leave out", None), ("config", "leave out", "<|endoftext|>"),
                                          ("null", None, "<|endoftext|>")):
        model = _quickstart_with(tmp_path / name, eos_token_id, eos_token)
        either = ", which has none either: set one in its tokenizer_config.json too" if eos_token is None else ""
        expected = (f"model.path: {model / 'config.json'} has no eos_token_id: the engines end a response on it (a "
                    "missing one reads as token id 1, transformers' default, whatever token that is; a null one as "
                    f"none), as SGLang does; set it to the id of the eos_token of the tokenizer at {model}{either}")
        recipe = load_recipe(None, [f"model.path={model}"])
        assert_refused_by_check_and_run(recipe, tmp_path / "run", expected)


def test_a_tokenizer_of_another_eos_than_the_models_is_one_line(tmp_path):
    """A tokenizer whose eos_token is none of model.path's eos_token_id (config.json's or generation_config.json's):
    sft ended each response with the tokenizer's EOS, where the model was made to end on another (once, the engines
    stopped only on config.json's, so an sft model ran on to the length limit). Refused in one line naming the
    tokenizer's key; a list holding the tokenizer's EOS passes, and so does generation_config.json naming it. A
    tokenizer without eos_token (sft appended None) is refused too."""
    import pytest  # noqa: PLC0415

    from slime_dsa.config.errors import UserError  # noqa: PLC0415
    from slime_dsa.run_dir import load_tokenizer, prepare_model_dir  # noqa: PLC0415

    def start(*sets):
        recipe = load_recipe(None, list(sets))
        return load_tokenizer(recipe, prepare_model_dir(recipe, tmp_path / "run"))

    model = _quickstart_with(tmp_path / "five", 5)
    with pytest.raises(UserError) as info:
        start(f"model.path={model}")
    assert str(info.value) == (
        f"model.path: the eos_token of the tokenizer at {model}, '<|endoftext|>' (id 373), is not an eos_token_id of "
        f"{model / 'config.json'} or its generation_config.json (5): a tokenizer of another model? sft would train "
        "the model to end each response with 373, not with the id it was made to end on; use the model's own "
        "tokenizer, or add 373 to eos_token_id in config.json")
    with pytest.raises(UserError, match=r"^model.tokenizer_path: the eos_token of the tokenizer at "):
        start(f"model.path={model}", f"model.tokenizer_path={QUICKSTART_SFT}")
    assert start(f"model.path={_quickstart_with(tmp_path / 'list', [5, 373])}").eos_token_id == 373
    (generation := _quickstart_with(tmp_path / "generation", 5)).joinpath("generation_config.json").write_text(
        json.dumps({"eos_token_id": [5, 373]}))
    assert start(f"model.path={generation}").eos_token_id == 373
    model = _quickstart_with(tmp_path / "no_eos", 373, None)
    with pytest.raises(UserError) as info:
        start(f"model.path={model}")
    assert str(info.value) == (f"model.path: the tokenizer at {model} has no eos_token: sft ends each response with it "
                               "(None) and the agent loop stops on it; set eos_token in its tokenizer_config.json to "
                               f"the token of id 373, the eos_token_id of {model / 'config.json'}")


def test_a_run_directorys_from_scratch_model_of_another_eos_is_one_line(tmp_path):
    """A run directory's from-scratch initial_model, built for the built-in tokenizer (EOS 373), reused by a later
    start whose model.tokenizer_path ends responses with another token: the engines stopped on 373 alone. Refused in
    one line naming the key."""
    import pytest  # noqa: PLC0415

    from slime_dsa.config.errors import UserError  # noqa: PLC0415
    from slime_dsa.data.tokenizer import build_tokenizer  # noqa: PLC0415
    from slime_dsa.run_dir import prepare_model_dir  # noqa: PLC0415

    tokenizer = build_tokenizer()
    tokenizer.eos_token = "<|user|>"
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    built = prepare_model_dir(load_recipe(None, []), tmp_path / "run")
    with pytest.raises(UserError) as info:
        prepare_model_dir(load_recipe(None, [f"model.tokenizer_path={tmp_path / 'tokenizer'}"]), tmp_path / "run")
    assert str(info.value) == (f"model.tokenizer_path: its eos_token '<|user|>' (id {tokenizer.eos_token_id}) is not "
                               f"the eos_token_id [373] of {built}, which an earlier start of this run built from "
                               "scratch for another tokenizer; use a new logging.run_dir")
