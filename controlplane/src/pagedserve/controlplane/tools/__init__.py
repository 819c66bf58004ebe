"""Tool calling: definitions, forced-call grammars, chat-template rendering, output parsers."""
