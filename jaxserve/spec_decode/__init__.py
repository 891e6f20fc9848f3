"""Speculative decoding (docs/spec_decode.md): the configuration, the n-gram proposer, and the
rejection sampler that keeps the target model's distribution."""
