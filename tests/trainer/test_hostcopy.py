"""The CPU snapshot's threaded copy is exact: every byte of every tensor lands in its own buffer, whatever the
mix (one big tensor, many small ones, empty ones, non-contiguous views, mixed dtypes), for any thread count; the
ranges it cuts cover each tensor once, with no gap and no overlap."""

import itertools

import pytest
import torch

from flightdeck.trainer.hostcopy import THREADS_ENV, HostCopier, default_threads, split


def state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    big = torch.randn(1_000_003, generator=g)
    return {
        "big": big, "small": torch.randn(7, 3, generator=g), "empty": torch.empty(0),
        "ints": torch.randint(0, 1 << 30, (12_345,), generator=g, dtype=torch.int64),
        "half": torch.randn(999, generator=g).to(torch.bfloat16), "scalar": torch.tensor(3.5),
        "strided": torch.randn(300, 200, generator=g).t(),  # not contiguous: copied whole
        "bools": torch.rand(101, generator=g) > 0.5,
    }


@pytest.mark.parametrize("threads", [1, 2, 3, 4, 7])
def test_every_tensor_is_copied_exactly_for_any_thread_count(threads: int) -> None:
    live = state()
    buffers = {k: torch.full_like(v, 0).contiguous() if k != "strided" else torch.zeros(300, 200).t()
               for k, v in live.items()}
    copier = HostCopier(threads)
    try:
        copier.copy(live, buffers)
        assert all(torch.equal(buffers[k], live[k]) for k in live)
        for v in live.values():
            v.add_(1) if v.dtype != torch.bool else v.logical_not_()
        copier.copy(live, buffers)  # the same buffers again: what the next checkpoint does
        assert all(torch.equal(buffers[k], live[k]) for k in live)
    finally:
        copier.close()


def test_the_ranges_cover_each_tensor_once_in_about_equal_parts() -> None:
    live = state()
    parts = split([(v, torch.empty_like(v)) for v in live.values()], 3)
    spans = sorted((s.data_ptr(), s.data_ptr() + s.numel() * s.element_size()) for part in parts for s, _ in part
                   if s.numel())
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in itertools.pairwise(spans))  # no overlap
    assert sum(end - start for start, end in spans) == sum(v.numel() * v.element_size() for v in live.values())
    contiguous = [sum(s.numel() * s.element_size() for s, _ in part if s.is_contiguous()) for part in parts]
    assert max(contiguous) - min(contiguous) <= 8  # within one element; the strided tensor is placed whole


def test_the_thread_count_comes_from_the_environment_or_the_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(THREADS_ENV, "3")
    assert default_threads() == 3
    monkeypatch.setenv(THREADS_ENV, "zero")
    with pytest.raises(ValueError, match="whole number"):
        default_threads()
    monkeypatch.setenv(THREADS_ENV, "0")
    with pytest.raises(ValueError, match="give 1 to"):
        default_threads()
    monkeypatch.delenv(THREADS_ENV)
    assert 1 <= default_threads() <= 4
