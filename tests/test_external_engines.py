"""`rollout.engine: external` against a real `slime-dsa serve` app over HTTP on 127.0.0.1: what the run does with the
servers it did not start, before Ray starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from slime_dsa.cli import main

ROOT = Path(__file__).resolve().parents[1]
BASE = str(ROOT / "recipes" / "base.yaml")
KEY = "the-servers-key"


@pytest.fixture(scope="module")
def server():
    from tests.test_server import serving

    with serving(ROOT / "recipes" / "assets" / "quickstart-sft", api_key=KEY) as srv:
        yield srv


@pytest.fixture
def no_ray(monkeypatch):
    """setup.init_ray raises: a test sees whether the run got past its checks to Ray."""
    from slime_dsa.orchestrator import setup  # noqa: PLC0415

    def init_ray(recipe):
        raise AssertionError("Ray started")

    monkeypatch.setattr(setup, "init_ray", init_ray)


def _train(server, tmp_path) -> int:
    return main(["train", BASE, "--set", "rollout.engine=external", "--set", f"rollout.engine_urls=['{server.url}']",
                 "--set", "data.tasks=[{kind: arithmetic, train_size: 64, eval_size: 0}]",
                 "--set", f"logging.run_dir={tmp_path / 'run'}", "--set", "logging.wandb_mode=disabled"])


@pytest.mark.parametrize("key", ["wrong", None])
def test_an_external_engine_that_refuses_the_key_is_one_line_before_ray(server, tmp_path, monkeypatch, capsys, no_ray,
                                                                         key):
    """The server answered every /generate with 401; the run counted each sample failed, skipped every step and
    finished with exit code 0, having trained nothing."""
    if key is None:
        monkeypatch.delenv("SLIME_DSA_API_KEY", raising=False)
    else:
        monkeypatch.setenv("SLIME_DSA_API_KEY", key)
    assert _train(server, tmp_path) == 2
    err = capsys.readouterr().err
    assert err.endswith("\n") and err.count("\n") == 1 and "Traceback" not in err, err
    assert f"rollout.engine_urls[0]: {server.url} refused" in err and "401" in err, err
    assert "set $SLIME_DSA_API_KEY to the key the server was started with" in err, err


def test_an_external_engine_that_takes_the_key_lets_the_run_start(server, tmp_path, monkeypatch, no_ray):
    monkeypatch.setenv("SLIME_DSA_API_KEY", KEY)
    with pytest.raises(AssertionError, match="Ray started"):
        _train(server, tmp_path)
