"""A full disk during a checkpoint: checkpoint.dir on a 2 MiB tmpfs holds one checkpoint of the tiny model (~1.5 MB)
but not two. The second save fails with one line naming the step and the newest intact checkpoint; no temporary
directory is left, and the first checkpoint stays intact. (A real tmpfs, mounted by the test: it needs root, as the
developers' machines and CI have; elsewhere the test is skipped.)"""

from __future__ import annotations

import subprocess

import pytest

from slime_dsa.config import load_recipe
from tests.faults.runs import recipe_dict, write_recipe

pytestmark = pytest.mark.slow


@pytest.fixture
def small_disk(tmp_path):
    mount = tmp_path / "small_disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_disk_during_a_checkpoint_is_one_line_and_leaves_the_last_one_intact(tmp_path, small_disk, ray_cluster,
                                                                                       figures):
    from slime_dsa.checkpoint.training import CheckpointManager
    from slime_dsa.checkpoint.validate import checkpoint_problem
    from slime_dsa.config.errors import UserError
    from slime_dsa.orchestrator.train import run_training

    path = write_recipe(tmp_path / "recipe.yaml", recipe_dict(3, engines=1, checkpoint__dir=str(small_disk)))
    with pytest.raises(UserError) as err:
        run_training(load_recipe(path, [f"logging.run_dir={tmp_path / 'run'}"]))
    first = small_disk / "step_000001"
    assert str(err.value) == (f"checkpoint of step 2 not written to {small_disk}: No space left on device; the newest "
                              f"intact checkpoint is {first}")
    assert checkpoint_problem(first) is None and CheckpointManager(small_disk).latest() == first
    assert [p.name for p in small_disk.iterdir() if p.name.startswith(".step_")] == []  # no partial save left
    figures["full_disk"] = {"line": str(err.value), "how": "a 2 MiB tmpfs mounted as checkpoint.dir"}
