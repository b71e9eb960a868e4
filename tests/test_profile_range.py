"""tinytransformer/profiling/ranges.py: profile_range, the named ranges every model puts around its parts."""


def test_profile_range_opens_a_record_function_range_only_while_the_profiler_records(monkeypatch):
    import torch
    from torch.profiler import profile

    from tinytransformer.profiling import ranges

    with profile() as prof:
        with ranges.profile_range("attention"):
            torch.ones(4).add_(1)
    assert "attention" in [event.name for event in prof.events()]

    def must_not_open(name):
        raise AssertionError(f"record_function({name!r}) opened with no profiler recording")
    monkeypatch.setattr(ranges, "record_function", must_not_open)
    with ranges.profile_range("attention"):
        torch.ones(4).add_(1)


def test_profile_range_leaves_torch_compile_one_graph(graph_counting_backend):
    """Inside torch.compile the range must be traceable: an untraceable call would make torch.compile give up
    on the function (a --enable-torch-compile run would silently run eager, launch by launch)."""
    import torch

    from tinytransformer.profiling.ranges import profile_range

    counting_backend, graphs = graph_counting_backend

    def two_ranges(x):
        with profile_range("attention"):
            x = x * 2
        with profile_range("ffn"):
            x = x + 1
        return x.sin()

    compiled = torch.compile(two_ranges, backend=counting_backend)
    x = torch.randn(4)
    assert torch.allclose(compiled(x), two_ranges(x))
    assert len(graphs) == 1
