"""trtllm_backend.serve: the command line refuses bad input with status 2 before any server starts."""

from __future__ import annotations

import subprocess
import sys

from trtllm_backend import serve


def test_a_bad_parameter_value_is_refused_naming_it(capsys):
    assert serve.main(["--param", "block_size=zero", "--no-build-fragments"]) == 2
    assert "[serve] error: parameter 'block_size': must be an int" in capsys.readouterr().err


def test_a_malformed_assignment_is_refused(capsys):
    assert serve.main(["--param", "block_size"]) == 2
    assert "expected NAME=VALUE" in capsys.readouterr().err


def test_a_missing_repository_is_refused(tmp_path, capsys):
    assert serve.main(["--model-repository", str(tmp_path)]) == 2
    assert "config.pbtxt not found" in capsys.readouterr().err


def test_runs_as_a_module():
    out = subprocess.run([sys.executable, "-m", "trtllm_backend.serve", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "--param NAME=VALUE" in out.stdout
