"""benchmarks/gpu_check.py runs on the device image as it is: without the ``datasets`` package
(rpcompile imports without it, and the section that needs it is skipped with a line saying so
while the others decide the result), and within a time budget (a section that would not fit is
skipped and the run counts as incomplete). Run here on virtual workers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# A process in which `import datasets` fails, as on the device image.
WITHOUT_DATASETS = "import sys; sys.modules['datasets'] = None\n"


def _python(code: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-c", WITHOUT_DATASETS + textwrap.dedent(code)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_rpcompile_imports_without_datasets():
    done = _python("""
        import rpcompile, rpcompile.cli, rpcompile.data, rpcompile.finetune
        from rpcompile.runtime import kernels, memory, reference, trainer
        try:
            import datasets
        except ImportError:
            print("datasets blocked")
        """)
    assert done.returncode == 0, done.stderr
    assert "datasets blocked" in done.stdout


def test_gpu_check_without_datasets_skips_the_finetune_section_and_passes(tmp_path):
    out = tmp_path / "check.json"
    done = _python(f"""
        import runpy
        sys.argv = ["gpu_check.py", "--virtual", "--quick", "--workers", "1",
                    "--archs", "qwen3", "--skip-bench", "--json", {str(out)!r}]
        runpy.run_path("benchmarks/gpu_check.py", run_name="__main__")
        """)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "finetune: skipped: the `datasets` package is not installed" in done.stdout
    results = json.loads(out.read_text())
    assert results["versions"]["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert "skipped" in results["finetune"] and results["incomplete"] == []
    (row,) = results["exact"]
    assert row["bit_identical"] and row["losses_identical"] and row["close_to_eager"]
    assert set(results["sections"]) >= {"machine", "finetune", "exact qwen3 x1", "exact"}
    assert done.stdout.rstrip().splitlines()[-1].count("; ok;") == 1


def test_a_section_that_does_not_fit_the_budget_is_skipped_and_fails_the_run(tmp_path, capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    out = tmp_path / "check.json"
    code = gpu_check.main(["--virtual", "--budget-s", "0", "--archs", "qwen3", "--workers", "1",
                           "--json", str(out)])
    printed = capsys.readouterr().out
    assert code == 1
    results = json.loads(out.read_text())
    assert results["exact"] == [] and "exact qwen3 x1" in results["incomplete"]
    assert "exact qwen3 x1: skipped:" in printed and "INCOMPLETE (budget)" in printed
    assert printed.rstrip().endswith(f"JSON in {out}") and "FAILED" in printed
