"""common/transfer.py: host <-> device copies that do not wait for the device. On the CPU they
are plain copies (never aliases of their source); on CUDA (gpu tests) the host side is pinned
and the values arrive once the stream has run the copy."""

from __future__ import annotations

import pytest
import torch

from sparse_framework.common.transfer import copy_to_host, tensor_to_device, to_device


def test_on_the_cpu_they_are_plain_copies() -> None:
    assert torch.equal(to_device([3, 1, 2], torch.int32, "cpu"), torch.tensor([3, 1, 2], dtype=torch.int32))
    src = torch.arange(24.0).view(2, 3, 4)[:, 1:]  # a non-contiguous view
    for copy in (copy_to_host(src), tensor_to_device(src, "cpu")):
        assert torch.equal(copy, src)
    host = copy_to_host(src)
    src.zero_()
    assert host.abs().sum() > 0  # its own memory


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_the_copies_are_asynchronous_and_land() -> None:
    dev = torch.device("cuda")
    src = torch.randn(4, 64, 8, device=dev)[:, 8:40]  # a non-contiguous view, as the staging's slices
    host = copy_to_host(src)
    done = torch.cuda.Event()
    done.record()
    done.synchronize()
    assert host.is_pinned() and not host.is_cuda and torch.equal(host, src.cpu())
    back = tensor_to_device(host, dev)
    assert back.is_cuda and torch.equal(back, src)
    assert torch.equal(to_device([1, 2], torch.int64, dev).cpu(), torch.tensor([1, 2]))
