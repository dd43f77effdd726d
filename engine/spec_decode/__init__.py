"""Speculative decoding: drafters propose tokens, the next step verifies them as extra query tokens, and a rejection
sampler keeps the prefix the target model agrees with (exactly its distribution)."""
