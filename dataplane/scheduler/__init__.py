"""Continuous batching: the request-state object and the step scheduler (no torch)."""

from pagedserve.dataplane.request import Request, RequestStatus
from pagedserve.dataplane.scheduler.scheduler import ScheduledRequest, Scheduler, SchedulerOutput

__all__ = ["Request", "RequestStatus", "ScheduledRequest", "Scheduler", "SchedulerOutput"]
