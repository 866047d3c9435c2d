"""Provenance (harness/base/provenance.py): a dirty tree is flagged, and two results' differing settings
or versions are named."""

from __future__ import annotations

import subprocess

from harness.base.provenance import differences, git_state, provenance


def test_a_tree_with_uncommitted_changes_is_dirty(tmp_path):
    git = lambda *a: subprocess.run(["git", "-C", str(tmp_path), *a], check=True, capture_output=True)
    git("init", "-q")
    (tmp_path / "f.txt").write_text("one")
    git("add", "f.txt")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    clean = git_state(tmp_path)
    assert clean["dirty"] is False and len(clean["commit"]) == 40
    (tmp_path / "f.txt").write_text("two")
    assert git_state(tmp_path) == {"commit": clean["commit"], "dirty": True}


def test_a_source_tree_inside_another_checkout_records_no_commit(tmp_path, monkeypatch):
    """A source archive unpacked inside some other git repository is not that repository's commit."""
    import subprocess

    monkeypatch.delenv("GITHUB_SHA", raising=False)
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "f.txt").write_text("outer")
    subprocess.run(["git", "-C", str(tmp_path), "add", "f.txt"], check=True)
    subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "o"],
                   check=True)
    inner = tmp_path / "build" / "gemma-parity-0.1.0"
    inner.mkdir(parents=True)
    assert len(git_state(tmp_path)["commit"]) == 40
    assert git_state(inner) == {"commit": "unknown", "dirty": None}
    monkeypatch.setenv("GITHUB_SHA", "f" * 40)
    assert git_state(inner) == {"commit": "f" * 40, "dirty": None}


def test_differences_name_what_changed_and_nothing_else():
    a = provenance({"tp": 2, "kv_len": 256}, {"checkpoint": {"model.safetensors": "aa"}})
    b = {**a, "settings": {"tp": 2, "kv_len": 512}, "packages": {**a["packages"], "torch": "0.0.1"}}
    assert differences(a, a) == []
    found = differences(a, b)
    assert any(d.startswith("settings.kv_len: 256 vs 512") for d in found)
    assert any(d.startswith("packages.torch:") for d in found) and len(found) == 2
    assert differences(a, None) == []


def test_check_golden_warns_when_the_golden_was_written_under_other_versions(capsys):
    import torch

    from harness.cli.validate import _warn_golden_provenance

    _warn_golden_provenance("G", {"versions": {"torch": torch.__version__}})
    assert capsys.readouterr().err == ""
    _warn_golden_provenance("G", {"versions": {"torch": "1.0.0", "transformers": "0.1"}})  # an older golden
    err = capsys.readouterr().err
    assert "golden G was written under torch 1.0.0" in err and "transformers 0.1" in err
    # a golden with the provenance block: its packages count (python, safetensors too), and a dirty tree is said
    now = provenance()
    clean = {"versions": {"torch": torch.__version__}, "provenance": {**now, "git": {"commit": "ab" * 20, "dirty": False}}}
    _warn_golden_provenance("G", clean)
    assert capsys.readouterr().err == ""
    other = {**clean, "provenance": {**now, "packages": {**now["packages"], "safetensors": "0.0.1", "python": "3.9.0"},
                                     "git": {"commit": "ab" * 20, "dirty": True}}}
    _warn_golden_provenance("G", other)
    err = capsys.readouterr().err
    assert "written under python 3.9.0" in err and "safetensors 0.0.1" in err and "torch" not in err.split(";")[0]
    assert "uncommitted changes (commit abababababab, dirty)" in err
