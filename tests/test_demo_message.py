"""``make demo`` ends with a sentence that says what its table shows, with the table's own numbers."""
from megatron_sparsebalance.demo import what_it_shows

RESULTS = {"baseline": dict(iter_ms=100.0, imbalance=1.8, bubble=0.3, mean_budget=8.0, loss=5.0),
           "sparsebalance": dict(iter_ms=80.0, imbalance=1.2, bubble=0.2, mean_budget=37.5, loss=5.0)}


def test_cpu_message_says_time_is_unchanged_and_k_is_redistributed_and_why():
    cpu = dict(RESULTS, sparsebalance=dict(RESULTS["sparsebalance"], iter_ms=101.0))
    text = what_it_shows(cpu, on_gpu=False)
    assert "(0.99x)" in text and "8.0 -> 37.5" in text
    assert "noisy" in text and "bound by Python" in text


def test_gpu_message_gives_the_speedup_and_the_imbalance():
    text = what_it_shows(RESULTS, on_gpu=True)
    assert "1.25x as fast" in text and "1.80 -> 1.20" in text and "8.0 -> 37.5" in text
