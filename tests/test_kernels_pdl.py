"""kernels/pdl.py: when the decode path's kernels launch with programmatic dependent launch.
Its effect on results is checked on the GPU (tests/test_gpu.py: a decode layer replayed with
PDL equals the eager call without it, bit for bit)."""

from __future__ import annotations

import pathlib
import re

import pytest
import torch

pdl = pytest.importorskip("sparse_framework.kernels.pdl")


def test_never_on_the_cpu(monkeypatch) -> None:
    for mode in ("auto", "on", "off"):
        monkeypatch.setattr(pdl, "PDL", mode)
        assert pdl.enabled(torch.device("cpu")) is False


def test_off_and_on_are_obeyed_on_cuda_devices(monkeypatch) -> None:
    monkeypatch.setattr(pdl, "_capable", lambda index: False)  # an sm_80 GPU, say
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(pdl, "PDL", "auto")
    assert pdl.enabled(cuda) is False
    monkeypatch.setattr(pdl, "PDL", "on")
    assert pdl.enabled(cuda) is True
    monkeypatch.setattr(pdl, "_capable", lambda index: True)  # sm_90+
    monkeypatch.setattr(pdl, "PDL", "off")
    assert pdl.enabled(cuda) is False
    monkeypatch.setattr(pdl, "PDL", "auto")
    assert pdl.enabled(cuda) is True


def test_a_bad_mode_names_the_allowed_ones(monkeypatch) -> None:
    monkeypatch.setattr(pdl, "PDL", "yes")
    with pytest.raises(ValueError, match=r"PDL must be one of \('auto', 'on', 'off'\), got 'yes'"):
        pdl.enabled(torch.device("cpu"))


def test_every_kernel_launched_with_pdl_waits() -> None:
    """The contract of the module docstring, checked on the source: a kernel launched with
    `launch_pdl=` takes the PDL flag, and its body calls `pdl.wait(PDL)` — without the wait it
    could read its predecessor's outputs before they are written."""
    root = pathlib.Path(pdl.__file__).resolve().parents[1]
    launched = set()
    for path in root.rglob("*.py"):
        text = path.read_text()
        # kernel[grid](...) or kernels/launch.py's launch(kernel, grid, ...)
        for call in re.finditer(r"(?:(\w+)\[[^\n]*\]\(|\blaunch\((\w+_kernel),)", text):
            rest = text[call.end(): call.end() + 1500]
            end = rest.find("\n    )")
            if "launch_pdl=" in rest[: end if end >= 0 else None]:
                launched.add(call.group(1) or call.group(2))
    assert {"_topk_hist_kernel", "_topk_write_kernel", "dsa_index_kernel", "_decode_split_kernel",
            "plan_residency_kernel", "copy_missing_kernel"} <= launched
    kernels = root / "kernels"
    source = "\n".join(p.read_text() for p in kernels.rglob("*.py"))  # kernels/triton/ holds the jit code
    for name in launched:
        body = re.search(rf"def {name}\((.*?)\n(?=@triton.jit|def |\Z)", source, re.S)
        assert body, name
        assert "PDL: tl.constexpr" in body.group(1) and "pdl.wait(PDL)" in body.group(1), name
