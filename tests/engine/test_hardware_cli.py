"""`phasescope hardware` refuses what it cannot measure in one line, exit status 2, before probing anything."""

import pytest
import torch

from phasescope.cli.main import main


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--dtype", "fp7"], "unknown dtype 'fp7'"),
        (["--dtype", "fp8"], "--dtype 'fp8' is not a torch dtype name"),
        (["--threads", "0"], "--threads must be at least 1, got 0"),
    ],
)
def test_bad_input_is_one_line(argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["hardware", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.strip() == f"phasescope hardware: {captured.err.strip().split(': ', 1)[1]}"
    assert expected in captured.err
    assert "\n" not in captured.err.strip()


def test_cuda_without_a_cuda_device_is_refused(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # PyTorch's answer is the boundary: a CUDA-less build or machine says False (as on CI), on any host.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["hardware", "--device", "cuda"]) == 2
    assert "this PyTorch sees no CUDA device" in capsys.readouterr().err
