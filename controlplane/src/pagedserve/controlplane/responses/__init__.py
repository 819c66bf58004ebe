"""OpenAI's Responses API (`/v1/responses`), translated onto the chat-completions path."""
