"""The negative control of the P/D tests: KV of another prompt must change the decoder's output, so the
comparison with one engine could fail if the daemon read the wrong blocks, heads or bytes."""

from __future__ import annotations

from tests.interop.engines import Engine
from tests.interop.test_pd import MAX_TOKENS, PROMPTS, generate

# The tiny random model's greedy tokens barely depend on the KV: another prompt's blocks left all 24 tokens
# unchanged (fp8, 2026-12-01) and moved a logprob by 0.048. So the logprobs carry the check: right blocks
# differed from one engine by at most 0.0079 (bf16 TP 2 -> 1; one bf16 step of a logit below 2) and 0.0 (fp8).
LOGPROB_TOLERANCE = 2**-6


def logprob_diff(a: dict, b: dict) -> float:
    """Largest |logprob| difference of two completions' sampled tokens."""
    return max(
        abs(x - y)
        for x, y in zip(a["logprobs"]["token_logprobs"], b["logprobs"]["token_logprobs"], strict=True)
    )


def swapped_kv_output(prefill: Engine, decoder: Engine) -> tuple[dict, dict]:
    """Decode prompt Y with the kv_transfer_params of prompt X (same length and last token, other tokens):
    returns (the decoder's output, Y's output on the prefill engine)."""
    first = prefill.complete(PROMPTS[3], max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    x = first["choices"][0]["prompt_token_ids"]
    y = [*reversed(x[:-1]), x[-1]]
    assert len(y) == len(x) and y != x
    reference = generate(prefill, y)
    out = generate(decoder, y, kv_transfer_params=first["kv_transfer_params"])
    assert len(out["token_ids"]) == MAX_TOKENS
    return out, reference
