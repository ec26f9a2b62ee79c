"""Multi-turn rollouts with tools: conversations per second with the tools run in the worker pool
vs one after another (a pool of one thread), and the share of the loop spent waiting on tools.

Workload: the tool example's shape (examples/tool_arithmetic: 3-digit products, the example's
tiny GPT, byte tokenizer), 32 conversations of two model turns through the collector's loop
(algorithms/conversations.py run_turns) on the torch engine, random weights. A random policy
writes no calls, so the benchmark's environment answers each first turn with the tool call the
SFT policy writes (the row's product), then scores the second turn as the example does. Two tools:
`python` (the sandbox: a subprocess per call, the waiting kind a pool is for) and `calculator`
(the example's: microseconds, so the pool cannot matter there).

    .venv/bin/python benchmarks/bench_multiturn.py [--conversations 32] [--workers 8] [--repeat 2]

Last line: pool_over_inline= (python tool) tool_wait_share= (python tool, in the pool).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
import warnings
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "2")
warnings.filterwarnings("ignore")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RULE = "slurm_align.rewards.arithmetic:exact_answer"


class PhaseClock:
    """A tracer stand-in: seconds per phase."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def span(self, phase: str, step: int):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - t0


def make_env(tool: str, workers: int):
    from slurm_align.environments.base import EnvironmentContext, StepResult
    from slurm_align.environments.config import EnvironmentConfig
    from slurm_align.environments.tool_calls import ToolCall
    from slurm_align.environments.tool_env import ToolEnvironment

    class FirstCall(ToolEnvironment):
        def step_batch(self, items):
            first = [sum(m["role"] == "assistant" for m in msgs) == 1 for msgs, _ in items]
            later = iter(super().step_batch([it for it, f in zip(items, first) if not f]) if not all(first) else [])
            expr = lambda row: row["prompt"].rstrip("=")  # noqa: E731
            calls = [ToolCall("python", {"code": f"print({expr(row)})"}) if tool == "python"
                     else ToolCall("calculator", {"expression": expr(row)}) for (_, row), f in zip(items, first) if f]
            outs = iter(self.runner.run_all([self._job(c) for c in calls]))
            return [StepResult([{"role": "tool", "name": tool, "content": next(outs).text}]) if f else next(later)
                    for f in first]

    settings = EnvironmentConfig(environment="tools", tools=[tool], max_turns=2, max_turn_tokens=16,
                                 max_total_tokens=120, tool_workers=workers, tool_timeout_s=20.0)
    return FirstCall(EnvironmentContext(settings, reward_rule=RULE)), settings


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=32)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(2)
    from slurm_align.algorithms import conversations as mt
    from slurm_align.config.run import ModelConfig
    from slurm_align.data.datasets import encode_prompt
    from slurm_align.environments.render import TurnRenderer
    from slurm_align.generation import GptShape, SamplingParams, make_engine
    from slurm_align.models.gpt import build_gpt
    from slurm_align.models.tokenizer import ByteTokenizer
    from slurm_align.models.weights import full_state_dict
    from slurm_align.parallel.bootstrap import init_distributed
    from slurm_align.parallel.layout import initialize_model_parallel

    cfg = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=260, max_seq_len=160)
    pctx = initialize_model_parallel(init_distributed(), 1, 1)
    engine = make_engine("torch", GptShape.from_model_config(cfg))
    engine.refit(full_state_dict(build_gpt(cfg, pctx, seed=5), pctx))
    tok = ByteTokenizer()
    rows = [json.loads(x) for x in (ROOT / "examples/tool_arithmetic/prompts.jsonl").read_text().splitlines()]
    rows = rows[:args.conversations]
    params = SamplingParams(max_new_tokens=16, temperature=1.0, eos_id=tok.eos_id, pad_id=tok.pad_id)
    print(f"load average before: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")

    def one(tool: str, workers: int) -> tuple[float, float]:
        env, settings = make_env(tool, workers)
        best, share = float("inf"), 0.0
        for r in range(args.repeat):
            clock = PhaseClock()
            convs = [mt.Conversation.start(env, TurnRenderer(tok, None), row, encode_prompt(tok, row["prompt"], 160),
                                           seed=1000 * r + i) for i, row in enumerate(rows)]
            t0 = time.perf_counter()
            mt.run_turns(convs, engine=engine, params=params, tokenizer=tok, env=env, renderer=TurnRenderer(tok, None),
                         settings=settings, max_seq_len=160, tracer=clock, step=1)
            dt = time.perf_counter() - t0
            assert all(c.model_turns == 2 for c in convs)   # every conversation: call, answer
            if dt < best:
                best, share = dt, clock.seconds.get("tools", 0.0) / dt
        env.close()
        return len(rows) / best, share

    results = {}
    for tool in ("calculator", "python"):
        pool, pool_share = one(tool, args.workers)
        inline, inline_share = one(tool, 1)
        results[tool] = (pool / inline, pool_share)
        print(f"{tool}: {pool:.2f} conversations/s with {args.workers} tool workers, {inline:.2f} one after "
              f"another ({pool / inline:.2f}x); tool wait {100 * pool_share:.1f}% of the loop in the pool, "
              f"{100 * inline_share:.1f}% inline")
    ratio, share = results["python"]
    print(f"pool_over_inline={ratio:.2f} tool_wait_share={share:.3f}")


if __name__ == "__main__":
    main()
