"""Continuous batching: the request-state object and the step scheduler (no torch)."""

from pagedserve.dataplane.request import Request, RequestStatus
from pagedserve.dataplane.scheduler.output import ScheduledRequest, SchedulerOutput
from pagedserve.dataplane.scheduler.scheduler import Scheduler

__all__ = ["Request", "RequestStatus", "ScheduledRequest", "Scheduler", "SchedulerOutput"]
