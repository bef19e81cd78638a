"""The worker process's round trip per call (support/worker.py): one reward call on B x G
completions through the worker (pickling, the pipe, the coercion), against the same function
called in process. From the repository root: python -m scripts.worker_roundtrip [completions per
call] [calls]"""

import os
import statistics
import sys
import time

import rewards
from support import sandbox, worker


def per_call(reward, completions, answers, calls):
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        sandbox.call_reward(reward, completions, answers, {})
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6, statistics.stdev(times) * 1e6


def main():
    n, calls = (int(a) for a in (sys.argv[1:] + ["64", "500"])[:2])
    completions = [f"<answer> {i} </answer> and some reasoning text " * 4 for i in range(n)]
    answers = [str(i) for i in range(n)]
    w = worker.Worker()
    start = time.perf_counter()
    remote = w.load("rewards:last_number_reward", "--reward-fn", os.getcwd())
    print(f"worker start and import: {time.perf_counter() - start:.3f} s")
    for name, fn in (("in process", rewards.last_number_reward), ("worker", remote)):
        r = rewards.Reward("last_number", fn, 1.0, 600.0)
        per_call(r, completions, answers, 20)  # warm-up
        median, sd = per_call(r, completions, answers, calls)
        print(
            f"{name:>10}: {median:8.1f} us per call (sd {sd:.1f}), {n} completions, {calls} calls"
        )
    w.close()


if __name__ == "__main__":
    main()
