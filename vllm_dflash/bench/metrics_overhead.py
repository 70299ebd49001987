"""What our metrics cost per engine step, measured on vLLM's own stats classes.

API server: per step vLLM calls ``IterationStats.update_from_output`` once per request and
every stat logger's ``record``; we add a hook to the first and our logger. Engine core:
we wrap ``Scheduler.schedule`` and ``update_from_output``. This times, per step and batch
size, (a) vLLM's per-output stats call with and without our hook plus our ``record``, and
(b) our scheduler wrappers around no-op stand-ins (their own cost only). Compare with an
engine step: milliseconds on a GPU, more on CPU.

    python -m vllm_dflash.bench.metrics_overhead [--batch 1,16,64,256] [--steps 2000]
"""

from __future__ import annotations

import argparse
import time
import types


def _frontend_us(batch: int, steps: int, hooked: bool) -> float:
    from vllm.v1.engine import EngineCoreOutput
    from vllm.v1.metrics import stats

    from vllm_dflash.serving import stat_logger

    if hooked:  # as where our proposer serves (the decision is not what is timed)
        log = stat_logger.DFlashStatLogger.__new__(stat_logger.DFlashStatLogger)
        log.start(_Cfg(), engine_index=99)
    reqs = [stats.RequestStateStats() for _ in range(batch)]
    outs = [EngineCoreOutput(request_id=str(i), new_token_ids=[1, 2, 3]) for i in range(batch)]
    lora = stats.LoRARequestStates()
    update = stats.IterationStats.update_from_output
    if not hooked:  # vLLM's own function under our hook
        update = getattr(update, "__vllm_dflash_original__", update)
    t0 = time.perf_counter()
    for s in range(steps):
        it = stats.IterationStats()
        for o, r in zip(outs, reqs, strict=True):
            update(it, o, float(s), False, r, lora, None)
        if hooked:
            log.record(scheduler_stats=None, iteration_stats=it)
    return (time.perf_counter() - t0) / steps * 1e6


class _Cfg:
    speculative_config = object()

    class model_config:  # noqa: N801
        served_model_name = "overhead-bench"


def _scheduler_us(batch: int, steps: int) -> tuple[float, float]:
    """Per-step seconds of no-op schedule/update, bare and inside our wrappers."""
    from vllm_dflash.observability.baseline import MetricsSettings, SamplePolicy
    from vllm_dflash.serving import scheduler_hooks as hooks
    from vllm_dflash.serving.step_timing import StepTiming

    req = types.SimpleNamespace(is_prefill_chunk=False, spec_token_ids=[1, 2, 3])
    out = types.SimpleNamespace(
        num_scheduled_tokens={str(i): 4 for i in range(batch)},
        total_num_scheduled_tokens=4 * batch,
        scheduled_new_reqs=[],
        scheduled_spec_decode_tokens={},
    )
    eco = {0: types.SimpleNamespace(scheduler_stats=types.SimpleNamespace())}
    timing = StepTiming(batch, True, 3, 3, 0, drafter_s=0.001, verify_s=0.004)
    mro = types.SimpleNamespace(dflash_timings=[timing])

    class Scheduler:
        num_spec_tokens, log_stats = 7, True
        running, waiting = [req] * batch, []

        def schedule(self):
            return out

        def update_from_output(self, so, mo):
            return eco

        def has_unfinished_requests(self):
            return True

    def run(sched) -> float:
        t0 = time.perf_counter()
        for _ in range(steps):
            sched.update_from_output(sched.schedule(), mro)
        return (time.perf_counter() - t0) / steps * 1e6

    bare = run(Scheduler())
    hooked = Scheduler()
    hooked.schedule = types.MethodType(hooks._schedule(Scheduler.schedule), hooked)
    hooked.update_from_output = types.MethodType(
        hooks._update(Scheduler.update_from_output), hooked
    )
    hooked._dflash = hooks.SchedulerState(SamplePolicy(MetricsSettings.from_env()), None)
    return bare, run(hooked)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--batch", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16, 64, 256]
    )
    ap.add_argument("--steps", type=int, default=2000)
    args = ap.parse_args(argv)
    base = {b: _frontend_us(b, args.steps, hooked=False) for b in args.batch}
    hooked = {b: _frontend_us(b, args.steps, hooked=True) for b in args.batch}
    print("| batch | API server: vLLM stats µs/step | + ours µs/step | engine core: ours µs/step |")
    print("|---:|---:|---:|---:|")
    for b in args.batch:
        bare, wrapped = _scheduler_us(b, args.steps)
        print(f"| {b} | {base[b]:.1f} | {hooked[b] - base[b]:.1f} | {wrapped - bare:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
