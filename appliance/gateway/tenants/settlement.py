"""Work the gateway never saw, charged as the engine counted it once the replica comes to rest.

A non-streaming answer whose client left or timed out, a stream left before its first chunk, the tail a stream's
engine made after the last chunk read: the engine did that work and reports none of it (vLLM gives no usage for a
request it aborts), so the gateway charges estimates (``progress``, ``metering.tail_tokens``). The engine's own
counters (``vllm:prompt_tokens_total``, ``vllm:generation_tokens_total``) do hold that work, summed with all the
rest. When a replica comes to rest (nothing running or waiting in its engine over two readings, no request of the
gateway's open there, its counters still), everything it counted since its last rest belongs to requests that have
ended: the reported usage the gateway already charged, and the unseen work. The engine's rise minus the reported
usage is then exactly the unseen work, and it is shared among the estimates held since that rest, each in
proportion to its estimate (``apportion``): their sum is what the engine did, and only the split among them stays
an estimate.

The engine's counters are trusted only where they can hold nothing but the gateway's requests: the sequences its
engine finished since the last rest (``vllm:request_success_total``) must be the ones whose usage came back through
the gateway (another client of the engine, or another gateway, shows there), and, where no other gateway sends to
the engines, at most one more per choice of the unseen requests (an answer its engine finished as its client left,
on its way and never read); and the unseen work must lie between nothing and what the estimates could have made
(a completion no more than each request's room, a prompt no more than ``PROMPT_BOUND`` times its estimate).
Otherwise the estimates are charged as they are. An estimate held longer than the gateway waits for a rest (a
replica busy without a pause) is charged as it is too, and still takes part in the next rest's shares: the held
ones are not charged its error, and where it fell short of its share it is topped up (a counter never goes down,
so one above its share stays, and shows as drift).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# An unseen prompt is the gateway's estimate (four characters a token, scaled as engines counted the prompts
# before: within about 10% measured on the demo engine); an engine that counted more than twice the estimates is
# counting something else
PROMPT_BOUND = 2.0


@dataclass(frozen=True)
class Unseen:
    """One request's work that no engine reported, as the gateway estimated it."""

    tenant: str
    n: int  # the request's choices per prompt: the engine prefills its prompt once per choice
    prompt: int  # prompt tokens, once per sequence (as the engine counts them)
    completion: int  # completion tokens
    room: int  # the most completion tokens the engine could have made for it (its reservation's)
    at: float  # monotonic: when the request ended

    def charge(self, prompt: int, completion: int) -> int:
        """The tokens its tenant is charged for ``prompt`` (once per sequence, as engines count) and
        ``completion``: the prompt once per request, as a usage report states it."""
        return round(prompt / max(1, self.n)) + completion


def apportion(total: int, weights: Sequence[float], caps: Sequence[int] | None = None) -> list[int]:
    """``total`` split into whole shares in proportion to ``weights`` that sum to it exactly (largest remainders
    get the leftover units); with ``caps``, no share above its cap, what a capped share cannot take going to the
    others. Equal weights where all are 0. The caller keeps ``total`` within 0 and the caps' sum."""
    count = len(weights)
    limit = list(caps) if caps is not None else [total] * count
    shares = [0] * count
    left = total
    open_ = [i for i in range(count) if limit[i] > 0]
    while left > 0 and open_:
        weight = [max(0.0, weights[i]) for i in open_]
        whole = sum(weight)
        exact = [left * (w / whole if whole > 0 else 1 / len(open_)) for w in weight]
        units = [int(x) for x in exact]
        for k in sorted(range(len(open_)), key=lambda k: exact[k] - units[k], reverse=True)[:max(0, left - sum(units))]:
            units[k] += 1
        for k, i in enumerate(open_):
            shares[i] += min(units[k], limit[i] - shares[i])
        left = total - sum(shares)
        open_ = [i for i in open_ if shares[i] < limit[i]]
    return shares


def settle(pending: Sequence[Unseen], prompt: float, completion: float) -> list[tuple[int, int]] | None:
    """Each held estimate's share of the ``prompt`` and ``completion`` tokens its replica's engine made that no
    report covered; None where the engine's numbers cannot be only theirs (below nothing, above what they could
    have made)."""
    unseen_prompt, unseen_completion = round(prompt), round(completion)
    estimated_prompt = sum(item.prompt for item in pending)
    rooms = [item.room for item in pending]
    if not (0 <= unseen_prompt <= PROMPT_BOUND * estimated_prompt and 0 <= unseen_completion <= sum(rooms)):
        return None
    prompts = apportion(unseen_prompt, [item.prompt for item in pending])
    completions = apportion(unseen_completion, [item.completion for item in pending], rooms)
    return list(zip(prompts, completions, strict=True))
