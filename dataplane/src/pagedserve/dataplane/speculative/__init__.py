"""Speculative decoding: model-free drafters propose tokens, one forward verifies them.

`config.py` reads `--speculative-config`; `ngram.py` and `suffix.py` are the drafters behind
the `Drafter` interface (`drafter.py`); `policy.py` decides per step how many drafted tokens
are worth verifying. The engine drives them (dataplane/engine/speculator.py); verification
is a sampling step (`accept_drafts`, dataplane/runner/sampler.py), and the scheduler gives
rejected tokens' KV slots back. Imports no torch.
"""
