"""A client's request once validated: what travels from the API edge to a data plane. No torch.

`Frontend.validate` builds it, from either API (gRPC or OpenAI HTTP), and nothing after that
re-validates or re-converts it: admission, routing and the stream read its typed fields, and
`to_proto` makes the one wire message the data plane receives.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from pagedserve.common.protocol import sampling_params_to_proto
from pagedserve.common.sampling_params import SamplingParams
from protos.pagedserve.v1 import dataplane_pb2


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling_params: SamplingParams
    stop: tuple[str, ...] = ()  # matched here on the detokenized text; never sent to a data plane
    cache_salt: str | None = None
    deadline: float | None = None  # time.monotonic() value

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def max_tokens(self) -> int:
        return self.sampling_params.max_tokens

    @property
    def num_samples(self) -> int:
        return self.sampling_params.num_samples

    def to_proto(self, trace_context: Mapping[str, str] | None = None) -> dataplane_pb2.SubmitCommand:
        """The submit command for a data plane; `trace_context` is the W3C context of the
        request's span, so the data plane's spans join the client's trace."""
        return dataplane_pb2.SubmitCommand(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_token_ids,
            sampling_params=sampling_params_to_proto(self.sampling_params),
            cache_salt=self.cache_salt or "",
            trace_context=dict(trace_context or {}),
        )
