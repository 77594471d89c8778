"""The capacity CLI (tools/capacity/__main__.py): bad input is refused with the problem named."""

import pytest

from tools.capacity.__main__ import _remember, main


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--pools", "256,abc"], "--pools: expected integers"),
        (["--param", "num_threads"], "--param expects NAME=VALUE"),
        (["--traffic", "chat"], "unknown traffic kind 'chat'"),
        (["--traffic", "conv", "--pools", "128"], "cannot hold one conv request"),
    ],
)
def test_bad_arguments(argv, message, capsys, tmp_path):
    with pytest.raises(SystemExit):
        main(argv + ["--out", str(tmp_path)])
    assert message in capsys.readouterr().err


def test_report_only_on_an_empty_folder(tmp_path):
    with pytest.raises(SystemExit, match="no stored probes"):
        main(["--report-only", "--out", str(tmp_path), "--json", str(tmp_path / "c.json")])


def test_measuring_commands_are_remembered_once_in_order(tmp_path):
    for c in ("a", "b", "a"):
        _remember(tmp_path, c)
    assert (tmp_path / "commands.txt").read_text() == "a\nb\n"
