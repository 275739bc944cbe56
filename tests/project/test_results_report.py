"""docs/results.md and README's figures table are what benchmarks/report.py writes from
benchmarks/results/*.json: figures are regenerated, never typed."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _report():
    spec = importlib.util.spec_from_file_location("rp_report", ROOT / "benchmarks" / "report.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _results_helper():
    spec = importlib.util.spec_from_file_location("rp_results",
                                                  ROOT / "benchmarks" / "_results.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_result_is_stamped_with_the_code_its_script_started_on(tmp_path, monkeypatch):
    helper = _results_helper()  # the script starts: its commit is read now
    started = helper.source()
    # A commit and an edit made while the benchmark runs.
    monkeypatch.setattr(helper, "_git",
                        lambda *args: "f" * 40 if args[0] == "rev-parse" else " M x.py")
    data = json.loads(helper.write_result(tmp_path / "made.json", {"answer": 42}).read_text())
    assert data["figures"] == {"answer": 42}
    assert {k: data["stamp"][k] for k in started} == started
    assert data["stamp"]["commit"] != "f" * 40


def test_the_results_page_and_the_readme_table_are_current(capsys):
    assert _report().main(["--check"]) == 0, capsys.readouterr().err


def test_a_changed_result_shows_on_the_page_and_fails_the_check(tmp_path, monkeypatch):
    report = _report()
    results = tmp_path / "results"
    shutil.copytree(ROOT / "benchmarks" / "results", results)
    soak = results / "soak.json"
    data = json.loads(soak.read_text())
    data["figures"]["faults_survived"] = 9999
    soak.write_text(json.dumps(data))
    (results / "made_up.json").write_text(json.dumps({"answer": 42}))
    for name in ("DOC", "README"):
        copy = tmp_path / getattr(report, name).name
        copy.write_text(getattr(report, name).read_text())
        monkeypatch.setattr(report, name, copy)
    monkeypatch.setattr(report, "RESULTS", results)
    monkeypatch.setattr(report, "load", lambda results=results, _load=report.load: _load(results))
    assert report.main(["--check"]) == 1
    assert report.main([]) == 0
    page = report.DOC.read_text()
    assert "| 9999 |" in page.replace(",", "")  # the soak table shows the new figure
    assert "Unstamped" in page and "made_up" in page  # a bare file is listed and marked
    assert "9999 / " in report.README.read_text().replace(",", "")  # the README's soak row
    assert report.main(["--check"]) == 0


def test_a_result_is_not_written_for_another_checkouts_code(tmp_path, monkeypatch):
    """A script that imported rpcompile from another checkout (PYTHONPATH, an install) must
    not write a result stamped with this repository's commit."""
    helper = _results_helper()
    other = tmp_path / "elsewhere" / "rpcompile"
    other.mkdir(parents=True)
    (other / "__init__.py").write_text("")
    fake = type(sys)("rpcompile")
    fake.__file__ = str(other / "__init__.py")
    monkeypatch.setitem(sys.modules, "rpcompile", fake)
    with pytest.raises(RuntimeError, match=r"imported rpcompile from .*PYTHONPATH="):
        helper.write_result(tmp_path / "made.json", {"answer": 42})
    assert not (tmp_path / "made.json").exists()
    monkeypatch.undo()
    assert helper.foreign_package() is None  # the tests' own rpcompile is this repository's
    helper.write_result(tmp_path / "made.json", {"answer": 42})
