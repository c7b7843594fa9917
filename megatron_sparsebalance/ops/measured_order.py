"""The order ``--sparse-attn-impl auto`` tries the implementations in, per GPU, from measurements.

Written by ``python -m benchmarks.attention --auto-table benchmarks/results/attention_<gpu>.json``
(do not edit by hand): for each GPU name, the implementations measured at every sparse case of
that file, fastest first by the geometric mean of their fwd+bwd ms (``geomean_ms``), and the file
it came from. A GPU not listed here gets the built-in order (``implementations.builtin_order``).
"""

MEASURED = {
    'NVIDIA H100 80GB HBM3': {
        'cases': 8,
        'geomean_ms': {'fa4': 6.8683, 'cuda': 7.2596},
        'order': ['fa4', 'cuda'],
        'source': 'benchmarks/results/attention_h100.json',
    },
    'NVIDIA H200': {
        'cases': 24,
        'geomean_ms': {'cuda': 3.0156, 'fa4': 3.4051, 'triton': 5.3105},
        'order': ['cuda', 'fa4', 'triton'],
        'source': 'benchmarks/results/attention_h200.json',
    },
}
