"""The checks the P/D interop tests share: outputs equal to one engine's, pulls answered ok, the prefill
freed, and the negative control (KV of another prompt must change the decoder's output, so the comparison
with one engine could fail if the daemon read the wrong blocks, heads or bytes)."""

from __future__ import annotations

import time

from sidecar.standins.demo import sample
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


def assert_matches_one_engine(
    label: str, reference: list[dict], results: list, decoder: Engine
) -> list[float]:
    """Every P/D output equals one engine's run of the same prompt: all tokens, and logprobs within the
    bound; and the outputs depend on the prompt. Returns the per-prompt logprob differences."""
    diffs = []
    for prompt, ref, (_, out) in zip(PROMPTS, reference, results, strict=True):
        assert out["token_ids"] == ref["token_ids"], (
            f"P/D ({label}) differs from one engine for {prompt[:40]!r}: {out['token_ids']} != "
            f"{ref['token_ids']}\ndecoder log:\n{decoder.log_tail(40)}"
        )
        assert len(out["token_ids"]) == MAX_TOKENS
        diffs.append(logprob_diff(out, ref))
    # The tokens alone would not notice wrong blocks with this model (see above); the logprobs do.
    assert max(diffs) <= LOGPROB_TOLERANCE, diffs
    # The tiny random model is not stuck on one token for every context.
    assert len({tuple(out["token_ids"]) for _, out in results}) > 1
    print(f"{label}: max |logprob diff| per prompt {diffs}")
    return diffs


def assert_only_ok(before: str, after: str, n: int, what: object = "") -> None:
    """Between two scrapes of a daemon's metrics: ``n`` pulls answered ok and none any other way."""
    assert sample(after, "kv_sidecar_requests_total", outcome="ok") - sample(
        before, "kv_sidecar_requests_total", outcome="ok"
    ) == n, what
    for outcome in ("failed", "refused", "aborted", "expired"):
        got = sample(after, "kv_sidecar_requests_total", outcome=outcome) - sample(
            before, "kv_sidecar_requests_total", outcome=outcome
        )
        assert got == 0, (what, outcome)


def assert_prefill_freed(prefill: Engine, results: list) -> None:
    """The prefill's KV usage returns to 0 and its log names none of the requests as expired or invalid:
    every block was freed by our notifications, none by the lease."""
    deadline = time.monotonic() + 10
    while prefill.metric("vllm:kv_cache_usage_perc") != 0.0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert prefill.metric("vllm:kv_cache_usage_perc") == 0.0
    expired = [
        ln
        for ln in prefill.log_text().splitlines()
        for k, _ in results
        if k["remote_request_id"] in ln and ("expired" in ln or "invalid" in ln)
    ]
    assert not expired, expired[:5]


def assert_other_kv_differs(label: str, prefill: Engine, decoder: Engine) -> None:
    """The control: given another prompt's blocks (same length and last token) the decoder decodes something
    else than one engine does, so the equality of the P/D test is evidence that the right bytes arrived."""
    out, reference = swapped_kv_output(prefill, decoder)
    diff = logprob_diff(out, reference)
    same = out["token_ids"] == reference["token_ids"]
    print(f"{label} control: tokens equal {same}, max |logprob diff| {diff}")
    assert out["token_ids"] != reference["token_ids"] or diff > LOGPROB_TOLERANCE
