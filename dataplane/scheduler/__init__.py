"""Continuous batching: the request-state object and the step scheduler (no torch)."""

from dataplane.request import Request, RequestStatus
from dataplane.scheduler.scheduler import ScheduledRequest, Scheduler, SchedulerOutput

__all__ = ["Request", "RequestStatus", "ScheduledRequest", "Scheduler", "SchedulerOutput"]
