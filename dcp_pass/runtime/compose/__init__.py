"""Compositions around the striped cache (docs/compositions.md): prefill -> decode KV
transfer, the host KV tier, extend with a cached prefix, speculative verification.
Built on ``dcp_pass.runtime.decode``."""
