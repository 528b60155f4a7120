"""kernels/launch.py: the direct re-launch of compiled Triton kernels. Its cache logic is
checked here with a stand-in kernel (no GPU needed); real kernels launched through it are
checked against Triton's own path on the GPU (tests/test_gpu.py)."""

from __future__ import annotations

import pytest
import torch

launch = pytest.importorskip("sparse_framework.kernels.launch")


class FakeCompiled:
    """What `kernel[grid](...)` returns: records the direct calls made to its launcher."""

    function, packed_metadata = "fn", "meta"

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def run(self, *args: object) -> None:
        self.calls.append(args)


class FakeKernel:
    """A JITFunction stand-in: params (x, n, BLOCK, PDL); records slow-path launches."""

    arg_names = ["x", "n", "BLOCK", "PDL"]
    constexprs = [2, 3]

    def __init__(self) -> None:
        self.slow: list[tuple] = []
        self.compiled: list[FakeCompiled] = []
        self.used_global_vals: dict = {}

    def __getitem__(self, grid: tuple):
        def run(*args: object, **kwargs: object) -> FakeCompiled:
            self.slow.append((grid, args, kwargs))
            self.compiled.append(FakeCompiled())
            return self.compiled[-1]

        return run


@pytest.fixture
def direct(monkeypatch):
    """launch's direct path switched on as on a CUDA machine, with an empty cache."""
    monkeypatch.setattr(launch, "_enabled", lambda: True)
    monkeypatch.setattr(launch, "_hooks_set", lambda: False)
    monkeypatch.setattr(launch, "_current_device", lambda: 0)
    monkeypatch.setattr(launch, "_current_stream", lambda device: 1234)
    launch.clear()
    yield
    launch.clear()


def test_first_call_goes_through_triton_then_the_launcher_directly(direct) -> None:
    k, x = FakeKernel(), torch.zeros(8)
    launch.launch(k, (3, 2), x, 5, BLOCK=64, PDL=True, num_warps=4)
    assert len(k.slow) == 1 and launch.cache_size() == 1
    launch.launch(k, (7,), x, 37, BLOCK=64, PDL=True, num_warps=4)  # same specialisation (37 vs 5)
    assert len(k.slow) == 1
    # grid padded to 3 dims, stream, function, metadata, no hooks, then args and constexprs in order
    assert k.compiled[0].calls == [(7, 1, 1, 1234, "fn", "meta", None, None, None, x, 37, 64, True)]


@pytest.mark.parametrize("first, second", [
    (5, 1),  # Triton bakes an int equal to 1 into the kernel
    (5, 32),  # and specialises on multiples of 16
    (5, 2**31),  # and on int32 range
    (5, True),  # a bool is another type than an int
    (5, 5.0),
    (5, None),
])
def test_a_new_int_specialisation_goes_through_triton(direct, first, second) -> None:
    k, x = FakeKernel(), torch.zeros(8)
    launch.launch(k, (1,), x, first, BLOCK=64, PDL=True)
    launch.launch(k, (1,), x, second, BLOCK=64, PDL=True)
    assert len(k.slow) == 2 and launch.cache_size() == 2
    assert all(not c.calls for c in k.compiled)


def test_tensor_dtype_alignment_and_constexprs_are_keyed(direct) -> None:
    k = FakeKernel()
    base = torch.zeros(64)
    launch.launch(k, (1,), base, 5, BLOCK=64, PDL=True)
    launch.launch(k, (1,), base.double(), 5, BLOCK=64, PDL=True)  # dtype
    launch.launch(k, (1,), base[1:], 5, BLOCK=64, PDL=True)  # 4-byte offset: not 16-byte aligned
    launch.launch(k, (1,), base, 5, BLOCK=128, PDL=True)  # constexpr value
    launch.launch(k, (1,), base, 5, BLOCK=64, PDL=True, num_warps=8)  # launch option
    assert len(k.slow) == 5
    launch.launch(k, (1,), base[4:], 5, BLOCK=64, PDL=True)  # 16-byte offset: the first signature
    assert len(k.slow) == 5 and len(k.compiled[0].calls) == 1


def test_what_cannot_be_keyed_always_goes_through_triton(direct) -> None:
    k, x = FakeKernel(), torch.zeros(8)
    for _ in range(2):
        launch.launch(k, (1,), x, object(), BLOCK=64, PDL=True)  # an unknown argument type
        launch.launch(k, (1,), x, 5, BLOCK=x, PDL=True)  # a tensor by keyword
        launch.launch(k, (1,), x, 5, BLOCK=[64], PDL=True)  # an unhashable keyword value
        launch.launch(k, (1,), x, 5, BLOCK=64)  # a parameter left to its default: order unknown
        launch.launch(k, (1,), x, 5, 64, PDL=True)  # a constexpr by position: its value is not keyed
    assert len(k.slow) == 10 and launch.cache_size() == 0


def test_a_changed_global_goes_through_triton(direct) -> None:
    k, x = FakeKernel(), torch.zeros(8)
    scope = {"SCALE": 2}
    k.used_global_vals = {("SCALE", 0): (2, scope)}
    launch.launch(k, (1,), x, 5, BLOCK=64, PDL=True)
    launch.launch(k, (1,), x, 5, BLOCK=64, PDL=True)
    assert len(k.slow) == 1
    scope["SCALE"] = 3  # Triton raises for this; going through it lets it
    launch.launch(k, (1,), x, 5, BLOCK=64, PDL=True)
    assert len(k.slow) == 2


def test_off_interpreter_and_hooks_go_through_triton(monkeypatch) -> None:
    k, x = FakeKernel(), torch.zeros(8)
    launch.clear()
    monkeypatch.setattr(launch, "FAST", "on")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert launch._enabled() is False
    monkeypatch.delenv("TRITON_INTERPRET")
    assert launch._enabled() is True
    monkeypatch.setattr(launch, "FAST", "off")
    assert launch._enabled() is False
    launch.launch(k, (1,), x, 5, BLOCK=64, PDL=True)
    launch.launch(k, (1,), x, 5, BLOCK=64, PDL=True)
    assert len(k.slow) == 2 and launch.cache_size() == 0
    monkeypatch.setattr(launch, "FAST", "auto")
    monkeypatch.setattr(launch.triton, "__version__", "3.6.0")
    assert launch._version_verified() is True
    monkeypatch.setattr(launch.triton, "__version__", "9.1.0")  # not checked against: Triton's path
    assert launch._version_verified() is False
    monkeypatch.setattr(launch, "_VERIFIED_HERE", False)
    assert launch._enabled() is False
    monkeypatch.setattr(launch, "_VERIFIED_HERE", True)
    assert launch._enabled() is True
    assert launch._hook_set(None) is False and launch._hook_set(print) is True


def test_signature_separates_what_triton_specialises() -> None:
    x = torch.zeros(8)
    sig = launch.signature
    assert sig([x, 5]) == sig([torch.ones(3), 7])  # same dtype, both aligned; ints of one class
    distinct = [[x, 5], [x[1:], 5], [x.double(), 5], [x, 1], [x, 16], [x, -16], [x, 2**31], [x, -(2**31) - 1],
                [x, 2**63], [x, True], [x, 5.0], [x, None]]
    sigs = [sig(a) for a in distinct]
    assert len(set(sigs)) == len(sigs) - 1  # 16 and -16: both multiples of 16 in int32 range
    assert sig([x, "a string"]) is None and sig([x, [1, 2]]) is None


def test_a_bad_mode_names_the_allowed_ones(monkeypatch) -> None:
    monkeypatch.setattr(launch, "FAST", "fast")
    with pytest.raises(ValueError, match=r"FAST must be one of \('auto', 'on', 'off'\), got 'fast'"):
        launch._enabled()
