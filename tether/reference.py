"""Single-process, single-request generation: the answer the service owes for each request.

`generate` runs the whole model in this process with the same sampler and stop rules as the service: the
in-process engine (tether/generation/inprocess.py), one request at a time.
`audit` replays a served completion teacher-forced and classifies every token (exact, within margin, mismatch).
"""

from __future__ import annotations

import functools
import uuid
from dataclasses import dataclass
from pathlib import Path

from tether import settings
from tether.client.wire import Messages, encode_messages
from tether.generation import sampler
from tether.generation.inprocess import InProcessEngine, forward_last
from tether.generation.sequence import Sequence
from tether.model.chat_template import ChatTemplate, load_chat_template, tokenize_conversation
from tether.model import dtypes, numerics
from tether.model.config import ModelConfig
from tether.model.llama import ModelSlice
from tether.model.loader import load_model_tokenizer, load_slice, model_fingerprint, resolve_model
from tether.model.tokenizer import Tokenizer
from tether.protocol.hashing import hash_seed, messages_digest, prompt_digest
from tether.types import FINISH_REASONS, GenerateResult, Receipt
from tether.v1 import common_pb2


@dataclass
class LoadedModel:
    folder: Path
    model: ModelSlice
    tokenizer: Tokenizer
    fingerprint: str
    chat_template: ChatTemplate | None = None   # the folder's, as admission loads it

    @property
    def config(self) -> ModelConfig:
        return self.model.cfg

    @property
    def served_fingerprint(self) -> str:
        """The model, the dtype and the kernels it runs on here: what a served receipt names (`fingerprint`, the
        model's alone, keys the sampling seeds, as the coordinator's does)."""
        return dtypes.served_fingerprint(self.fingerprint, numerics.name_of(self.model.dtype), self.model.rows.kernels)


@functools.lru_cache(maxsize=4)
def load(model: str = "tiny", dtype: str = settings.DTYPE, inputs: str = settings.LINEAR_INPUTS) -> LoadedModel:
    """The whole model in `dtype` and linear `inputs`; "auto" makes the stages' choice (tether/model/numerics.py),
    so a served answer is compared with the reference in the numerics it was computed in."""
    folder = resolve_model(model)
    return LoadedModel(folder, load_slice(folder, dtype=dtype, inputs=inputs), load_model_tokenizer(folder),
                       model_fingerprint(folder), load_chat_template(folder))


def sampling_params(max_tokens: int = 64, temperature: float = 0.0, top_k: int = 0, top_p: float = 0.0,
                    seed: int = 0, stop=(), ignore_eos: bool = False) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                                     seed=seed, stop=list(stop), ignore_eos=ignore_eos)


def generate_ids(lm: LoadedModel, prompt_ids: list[int], params: common_pb2.SamplingParams,
                 namespace: str = "", request_id: str = "", resume_ids: list[int] | tuple[int, ...] = ()) -> Sequence:
    """Prefill the prompt, then decode one token at a time, exactly as the pipeline does for one request: the
    in-process engine with a batch of one (batch invariance makes that the served answer's bits). With
    `resume_ids`, a resumed request: those output tokens are taken as already produced (Sequence.resume)."""
    seq = Sequence(request_id or uuid.uuid4().hex, list(prompt_ids), params, lm.tokenizer,
                   hash_seed(lm.fingerprint, namespace), lm.config.max_position_embeddings)
    seq.resume(list(resume_ids))
    return InProcessEngine(lm.model).run([seq])[0]


def generate(prompt: str, model: str = "tiny", *, max_tokens: int = 64, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 0.0, seed: int = 0, stop=(), ignore_eos: bool = False,
             namespace: str = "", inputs: str = settings.LINEAR_INPUTS) -> GenerateResult:
    """The reference answer for one request, as a GenerateResult (the SDK's type); `inputs`: the stages'
    --linear-inputs."""
    lm = load(model, inputs=inputs)
    params = sampling_params(max_tokens, temperature, top_k, top_p, seed, stop, ignore_eos)
    return _answer(lm, lm.tokenizer.encode(prompt), prompt_digest(prompt.encode()), params, namespace, seed)


def render_chat(lm: LoadedModel, messages: Messages) -> tuple[str, list[int]]:
    """The prompt text and token ids admission makes of `messages` (dicts or (role, content) tuples) on this
    model: the same function, so no content becomes a control token here either."""
    pairs = [(role, content.decode("utf-8")) for role, content in encode_messages(messages)]
    return tokenize_conversation(lm.chat_template, lm.tokenizer, pairs)


def chat(messages: Messages, model: str = "tiny", *, max_tokens: int = 64, temperature: float = 0.0,
         top_k: int = 0, top_p: float = 0.0, seed: int = 0, stop=(), ignore_eos: bool = False,
         namespace: str = "", inputs: str = settings.LINEAR_INPUTS) -> GenerateResult:
    """The reference reply to a conversation: rendered with the model's chat template by the same function as
    admission's, so the served reply must equal it token for token. ConversationError (a ValueError) where
    admission answers INVALID_ARGUMENT for the conversation itself."""
    lm = load(model, inputs=inputs)
    params = sampling_params(max_tokens, temperature, top_k, top_p, seed, stop, ignore_eos)
    digest = messages_digest(encode_messages(messages))
    return _answer(lm, render_chat(lm, messages)[1], digest, params, namespace, seed)


def _answer(lm: LoadedModel, prompt_ids: list[int], digest: int, params: common_pb2.SamplingParams,
            namespace: str, seed: int) -> GenerateResult:
    seq = generate_ids(lm, prompt_ids, params, namespace)
    receipt = Receipt(seq.request_id, digest, len(prompt_ids), seq.hasher.value, len(seq.output_ids), lm.served_fingerprint)
    return GenerateResult(seq.text, list(seq.output_ids), FINISH_REASONS[seq.finish_reason], receipt, seed=seed)


# --- teacher-forced audit -------------------------------------------------------------------------------

EXACT, WITHIN_MARGIN, MISMATCH = "exact", "within_margin", "mismatch"
DEFAULT_LOGIT_MARGIN = 1e-3   # greedy: served token's logit may trail the max by this much (float noise)
DEFAULT_DRAW_MARGIN = 1e-5    # sampled: the draw may miss the served token's CDF interval by this much


@dataclass
class AuditResult:
    verdict: str                    # worst verdict over the tokens
    first_bad_index: int = -1       # first output index that was not exact
    worst_gap: float = 0.0          # largest logit gap (greedy) or draw distance (sampled) seen


def audit(lm: LoadedModel, prompt_ids: list[int], output_ids: list[int], params: common_pb2.SamplingParams,
          logit_margin: float = DEFAULT_LOGIT_MARGIN, draw_margin: float = DEFAULT_DRAW_MARGIN) -> AuditResult:
    """Teacher-force the served tokens: was each one the reference's choice given the served prefix?"""
    result = AuditResult(EXACT)
    kv = lm.model.new_kv()
    logits = forward_last(lm.model, [(kv, list(prompt_ids))])[0]
    for i, tok in enumerate(output_ids):
        position = len(prompt_ids) + i
        if not 0 <= tok < logits.numel():
            return AuditResult(MISMATCH, i, float("inf"))
        if sampler.sample(logits, params, position) != tok:
            if params.temperature <= 0:
                gap = float(logits.max() - logits[tok])
                ok = gap <= logit_margin
            else:
                gap = sampler.draw_distance(logits, params, tok, position)
                ok = gap <= draw_margin
            result.worst_gap = max(result.worst_gap, gap)
            if result.first_bad_index < 0:
                result.first_bad_index = i
            if not ok:
                result.verdict = MISMATCH
                return result
            result.verdict = WITHIN_MARGIN
        if i + 1 < len(output_ids):
            logits = forward_last(lm.model, [(kv, [tok])])[0]
    return result
