"""The graphs torch.compile would hand inductor, captured instead of compiled: AOTAutograd with inductor's partitioner
(min-cut rematerialization, which honours selective checkpoint policies), so a test or a GPU check can read what a
compiled forward saves and what its backward recomputes. Used by tests/test_compile_and_checkpointing.py and
benchmarks/gpu_compile_checks.py."""

from __future__ import annotations


def capturing_backend():
    """(backend for ``torch.compile(..., backend=)``, {"forward": [...], "backward": [...]} of the captured
    ``fx.GraphModule``s, in the order compiled)."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    graphs: dict[str, list] = {"forward": [], "backward": []}

    def capture(kind):
        def compiler(graph, example_inputs):
            graphs[kind].append(graph)
            return make_boxed_func(graph.forward)  # as AOTAutograd calls it
        return compiler

    backend = aot_autograd(fw_compiler=capture("forward"), bw_compiler=capture("backward"),
                           partition_fn=min_cut_rematerialization_partition)
    return backend, graphs
