"""Fidelity audit: replay every completed request through the in-process reference and classify it.

A served answer is checked, in this order:
1. token by token, teacher forced on the served tokens (`tether.reference.audit`): each token must be the
   reference's choice given the served prefix, exactly or within float noise (within_margin);
2. its end: the shared stop rules (`tether.generation.sequence.Sequence`), fed the served tokens, must end the
   sequence at exactly the last one, with the same finish reason and the same text;
3. its receipt: the prompt token count and the final context hash must be what this prompt plus these
   tokens give.
Anything else is a MISMATCH: tokens the model would not produce for this request (an answer to another
question, or to the wrong state), an answer cut short or run long, or a receipt that vouches for other tokens.

The audit uses the sampling the server actually used: the seed it reports and admission's output budget
(a length constraint in the prompt lowers max_tokens).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from tether import reference
from tether.loadtest.records import RequestRecord
from tether.generation.sequence import Sequence
from tether.protocol.hashing import hash_seed
from tether.types import FINISH_REASONS
from tether.v1 import common_pb2

MAX_DETAILS = 20   # mismatches described in the report per level; the counts are always complete


@dataclass
class AuditSummary:
    exact: int = 0
    within_margin: int = 0
    mismatch: int = 0
    mismatches: list[dict] = field(default_factory=list)   # the first MAX_DETAILS, described

    @property
    def audited(self) -> int:
        return self.exact + self.within_margin + self.mismatch

    @property
    def mismatch_rate(self) -> float | None:
        return self.mismatch / self.audited if self.audited else None

    def to_json(self) -> dict:
        return dict(audited=self.audited, exact=self.exact, within_margin=self.within_margin,
                    mismatch=self.mismatch, mismatch_rate=self.mismatch_rate, mismatches=self.mismatches)


def served_params(rec: RequestRecord) -> common_pb2.SamplingParams:
    """The sampling the server used: the request's, with admission's output budget and the reported seed."""
    p = rec.request.params()
    p["max_tokens"] = rec.tags.get("output_budget") or p["max_tokens"]
    p["seed"] = rec.seed
    return reference.sampling_params(**p)


def audit_record(lm: reference.LoadedModel, rec: RequestRecord) -> tuple[str, str]:
    """(verdict, detail) for one completed request."""
    prompt_ids = lm.tokenizer.encode(rec.request.prompt)
    params = served_params(rec)
    result = reference.audit(lm, prompt_ids, rec.token_ids, params)
    if result.verdict == reference.MISMATCH:
        return result.verdict, (f"output token {result.first_bad_index} (id {rec.token_ids[result.first_bad_index]}) "
                                f"is not the reference's choice given the served prefix (gap {result.worst_gap:.3g})")
    # The bench sends no tenant: the chain is salted with the empty namespace, or an API key's tenant (its tags).
    seq = Sequence("audit", prompt_ids, params, lm.tokenizer, hash_seed(lm.fingerprint, rec.tags.get("tenant", "")),
                   lm.config.max_position_embeddings)
    for i, tok in enumerate(rec.token_ids):
        if seq.append(tok).finish_reason and i + 1 < len(rec.token_ids):
            return reference.MISMATCH, (f"the answer runs past its end: the stop rules end it at token {i} "
                                        f"({FINISH_REASONS[seq.finish_reason]}), {len(rec.token_ids)} were served")
    expected_finish = FINISH_REASONS[seq.finish_reason]
    if expected_finish != rec.finish_reason:
        return reference.MISMATCH, (f"finish reason {rec.finish_reason or 'none'!r} after {len(rec.token_ids)} "
                                    f"tokens; the stop rules say {expected_finish or 'not finished'!r}")
    if seq.text != rec.text:
        return reference.MISMATCH, "the served text is not the detokenization of the served tokens"
    if rec.prompt_tokens != len(prompt_ids):
        return reference.MISMATCH, (f"the receipt counts {rec.prompt_tokens} prompt tokens; "
                                    f"this prompt has {len(prompt_ids)}")
    if rec.context_hash != seq.hasher.value:
        return reference.MISMATCH, "the receipt's context hash is not the hash of this prompt and these tokens"
    detail = "" if result.verdict == reference.EXACT else (
        f"first off-argmax token {result.first_bad_index}, gap {result.worst_gap:.3g}")
    return result.verdict, detail


def audit_records(lm: reference.LoadedModel, records: Iterable[RequestRecord]) -> AuditSummary:
    """Audit every completed record (setting its verdict) and count the verdicts; failed requests are skipped,
    since an explicit error is an honest answer."""
    summary = AuditSummary()
    for rec in records:
        if not rec.ok:
            continue
        rec.verdict, rec.audit_detail = audit_record(lm, rec)
        if rec.verdict == reference.EXACT:
            summary.exact += 1
        elif rec.verdict == reference.WITHIN_MARGIN:
            summary.within_margin += 1
        else:
            summary.mismatch += 1
            if len(summary.mismatches) < MAX_DETAILS:
                summary.mismatches.append(dict(level=rec.level, index=rec.request.index,
                                               workload=rec.request.workload, prompt=rec.request.prompt[:80],
                                               params=rec.request.params(), seed=rec.seed,
                                               detail=rec.audit_detail))
    return summary
