"""A request of another API (Anthropic Messages, OpenAI Responses) run as a chat request."""

from __future__ import annotations

from pagedserve.controlplane.errors import ServiceError


class TranslatedChat:
    """What the chat path refuses is named as the other API names the field (`field_name`)."""

    def field_name(self, chat_field: str) -> str:
        """The other API's name of a chat request's field ("messages[2].content" -> ...)."""
        raise NotImplementedError

    def renamed(self, exc: ServiceError) -> ServiceError:
        """`exc` (raised by the chat path) with its field named as the other API names it."""
        if exc.param is None:
            return exc
        name = self.field_name(exc.param)
        exc.message = exc.message.replace(exc.param, name, 1)
        exc.param = name
        return exc
