"""Probe: does dQ from stored dS (DRAM-bound) run beside dK/dV (tensor-bound) for less time and
energy than after it? At the 3B cases of issue 44 the backward runs per KV group: dK/dV of group 0,
then dQ of group 0 on a second stream while dK/dV of group 1 runs, then dQ of group 1.

    python3 -m benchmarks.probes.ds_overlap_probe [ROUNDS]

Each variant is a whole step (our forward, then its backward), timed as the benchmark times a step
(ten calls in a row, CUDA events; NVML's energy counter around them), the variants in turns, ROUNDS
rounds (3 when left out); medians.
Every variant's gradients are checked against the one-call stored-dS backward first (dQ bitwise,
dK/dV within rounding: a group alone may cut its dK/dV lists elsewhere)."""
import statistics

import torch

from benchmarks.probes.step_probe import EnergyCounter, rounds_from_argv, routed_cases
from megatron_sparsebalance.ops import native
from megatron_sparsebalance.ops.cuda_attention import _forward, stored_ds_bytes

CALLS = 10


class GroupInputs:
    """KV groups [g0, g1) of a case, contiguous, as the kernels take a problem of that many groups."""

    def __init__(self, g0, g1, R, q, k, v, do, out, lse, route, args):
        heads = slice(g0 * R, g1 * R)
        self.q, self.do, self.out = (x[:, heads].contiguous() for x in (q, do, out))
        self.lse = lse[:, heads].contiguous()
        self.k, self.v = (x[:, g0:g1].contiguous() for x in (k, v))
        self.kv_idx = route.kv_idx[g0:g1].contiguous()
        self.kv_cnt = route.kv_cnt[g0:g1].contiguous()
        self.rest = args[2:]  # block_start, block_end, scale, block
        self.ds = self.q.new_empty(stored_ds_bytes(self.q, self.k, self.kv_idx, args[-1]) // self.q.element_size())


def dkdv(x, ds):
    ext = native.native()
    q_ptr, q_idx, slots = ext.transpose_index_cuda(x.kv_idx, x.kv_cnt, True)
    dk, dv, _ = ext.sparse_attn_bwd_dkdv_cuda(x.do, x.q, x.k, x.v, x.out, x.lse, x.kv_idx, x.kv_cnt,
                                              *x.rest[:2], q_ptr, q_idx, *x.rest[2:], ds)
    return dk, dv, slots


def dq_from_ds(x, ds, slots):
    return native.native().sparse_attn_bwd_dq_from_ds_cuda(x.q, x.k, ds, slots, x.kv_idx, x.kv_cnt, *x.rest)


def main():
    rounds = rounds_from_argv()
    meter = EnergyCounter()
    side = torch.cuda.Stream(priority=-1)  # the higher of the two priorities
    plain = torch.cuda.Stream()
    for shape, S, density, q, k, v, route, args in routed_cases():
        if shape != "qwen2.5-3b":
            continue
        G, R = k.shape[1], q.shape[1] // k.shape[1]
        do = torch.randn_like(q)
        out, lse = _forward(q, k, v, *args)
        whole = GroupInputs(0, G, R, q, k, v, do, out, lse, route, args)
        groups = [GroupInputs(g, g + 1, R, q, k, v, do, out, lse, route, args) for g in range(G)]

        def one_call():
            dk, dv, slots = dkdv(whole, whole.ds)
            return dq_from_ds(whole, whole.ds, slots), dk, dv

        def serial():
            grads = []
            for x in groups:
                dk, dv, slots = dkdv(x, x.ds)
                grads.append((dq_from_ds(x, x.ds, slots), dk, dv))
            return grads

        def beside(stream):
            def run():
                main_stream = torch.cuda.current_stream()
                grads, pending = [None] * G, None
                for g, x in enumerate(groups):
                    dk, dv, slots = dkdv(x, x.ds)
                    done = torch.cuda.Event()
                    done.record(main_stream)
                    if pending is not None:
                        pending()
                    pending = (lambda g=g, x=x, dk=dk, dv=dv, slots=slots, done=done:
                               _dq_on(stream, done, grads, g, x, slots, dk, dv))
                # the last group's dQ on the main stream: nothing is left to run beside it
                g, x = G - 1, groups[-1]
                grads[g] = (dq_from_ds(x, x.ds, slots), dk, dv)
                main_stream.wait_stream(stream)
                return grads
            return run

        variants = {"one call": one_call, "per group, serial": serial,
                    "per group, dQ beside (high priority)": beside(side),
                    "per group, dQ beside (same priority)": beside(plain)}
        ref_dq, ref_dk, ref_dv = one_call()
        for name, run in variants.items():
            if name == "one call":
                continue
            grads = run()
            torch.cuda.synchronize()
            for g, (dq, dk, dv) in enumerate(grads):
                heads = slice(g * R, (g + 1) * R)
                # dK/dV's plan cuts lists by the problem's size, so a group alone may add its fp32
                # parts in another grouping: equal within rounding, dQ bitwise (its sums do not move)
                assert torch.equal(dq, ref_dq[:, heads]), f"{name}: group {g}'s dQ differs"
                for got, want in ((dk, ref_dk[:, g:g + 1]), (dv, ref_dv[:, g:g + 1])):
                    err = ((got.float() - want.float()).norm() / want.float().norm()).item()
                    assert err < 1e-2, f"{name}: group {g}'s dK/dV differ by {err:.2e}"
        times, joules = {name: [] for name in variants}, {name: [] for name in variants}
        for r in range(rounds):
            order = list(variants)
            order = order[r % len(order):] + order[:r % len(order)]
            for name in order:
                run = variants[name]
                run()
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0 = meter.joules()
                start.record()
                for _ in range(CALLS):
                    _forward(q, k, v, *args)
                    run()
                end.record()
                torch.cuda.synchronize()
                joules[name].append((meter.joules() - e0) / CALLS)
                times[name].append(start.elapsed_time(end) / CALLS)
        base = statistics.median(times["one call"])
        for name, ts in times.items():
            m = statistics.median(ts)
            print(f"{shape} S={S} density={density} {name:38s} fwd+bwd {m:7.3f} ms, "
                  f"{statistics.median(joules[name]):.2f} J (one call / this {base / m:.3f}; "
                  f"rounds {', '.join('%.2f' % t for t in ts)})", flush=True)
        del whole, groups, ref_dq, ref_dk, ref_dv
        torch.cuda.empty_cache()


def _dq_on(stream, done, grads, g, x, slots, dk, dv):
    """Group g's dQ on ``stream`` once its dK/dV (event ``done``) has written its dS."""
    stream.wait_event(done)
    with torch.cuda.stream(stream):
        grads[g] = (dq_from_ds(x, x.ds, slots), dk, dv)
    for t in (slots, dk, dv):
        t.record_stream(stream)


if __name__ == "__main__":
    main()
