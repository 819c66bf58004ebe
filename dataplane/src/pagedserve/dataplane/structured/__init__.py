"""Structured outputs: constraints (pagedserve.common.constraints) compiled into token
grammars off the step loop (compile_service), and the per-sample matchers whose masks the
runner applies before sampling (grammar). Imports xgrammar, so the engine loads it lazily."""
