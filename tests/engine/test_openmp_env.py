"""trtllm_backend.openmp_env: the OpenMP waiting settings every engine process gets."""

from __future__ import annotations

from trtllm_backend.openmp_env import OPENMP_ENV, with_openmp_defaults
from trtllm_backend.triton.discovery import server_env


def test_defaults_fill_only_what_is_unset():
    env = with_openmp_defaults({"GOMP_SPINCOUNT": "0", "PATH": "/bin"})
    assert env == {"GOMP_SPINCOUNT": "0", "PATH": "/bin", "OMP_WAIT_POLICY": "ACTIVE"}
    assert with_openmp_defaults({}) == OPENMP_ENV


def test_the_server_process_gets_them_unless_the_caller_set_its_own():
    env = server_env({"PATH": "/bin"})
    assert env["OMP_WAIT_POLICY"] == "ACTIVE" and env["GOMP_SPINCOUNT"] == "200000"
    assert server_env({"PATH": "/bin", "GOMP_SPINCOUNT": "0"})["GOMP_SPINCOUNT"] == "0"
