"""Entry points for code written against Thunder's own CUDA-graph APIs (``legacy``: the ``CUDAGraphTransform``
drop-in, the ``use_cudagraphs`` shim, the ``thunder.compile`` plugin) and the opt-in ``PruneParameterChecks``
(``trusted_parameters``)."""
