"""The test suite, a package so that tests import shared helpers by their full name (`from tests.engine_fixtures
import make_engine`, `from tests.triton.test_triton_server import GrpcStream`). Layout and tiers: README.md."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the repository root, whatever the depth of the test using it
