"""The sampling functions: logits and SamplingParams in, tokens and logprobs out.

Reproducibility: each request samples with its own torch.Generator (on the CPU) and draws
exactly one number from it per sampled token, so a seeded request produces the same tokens
whatever other requests share its batch. The token is found by inverse transform: the first
whose running probability sum exceeds that number times the total (``_inverse_cdf``), which
costs one draw instead of a vocabulary's worth (an exponential race draws one number per
vocabulary entry, 128k a token).
"""

from __future__ import annotations

import numpy as np
import torch

from kvscope.engine.sampling_params import SamplingParams


def completion_seed(seed: int, index: int) -> int:
    """The generator seed of completion `index` of a request seeded with `seed`: index 0 uses
    the seed itself; others a hash of (seed, index), so n > 1 samples differ and requests seeded
    s and s + 1 share no stream."""
    if index == 0:
        return seed
    # SeedSequence takes non-negative entries only; a negative seed maps to its uint64 bits.
    return int(np.random.SeedSequence([seed % 2**64, index]).generate_state(1, np.uint64)[0] >> 1)


def make_generator(seed: int, index: int, device: torch.device | str) -> torch.Generator:
    """The torch.Generator of completion `index` of a request seeded with `seed`. The paged
    engine must build its generators with this too, or it cannot match the reference."""
    generator = torch.Generator(device=device)
    generator.manual_seed(completion_seed(seed, index))
    return generator


def adjust_logits(logits: torch.Tensor, params: list[SamplingParams],
                  seen: list[torch.Tensor], counted: list[tuple[torch.Tensor, torch.Tensor]]
                  ) -> torch.Tensor:
    """Rows [R, V] as the sampler scores them (``params`` per row), as a new tensor, in
    vLLM's order: each row's ``logit_bias`` is added; the repetition penalty divides the
    positive logits and multiplies the others of every token in ``seen[row]`` (the distinct
    token ids of the prompt and the output); then ``frequency_penalty`` x each output
    token's count and ``presence_penalty`` are subtracted (``counted[row]``: the output's
    distinct ids and their counts). Only those entries are touched, for the whole batch at
    once: the cost follows the tokens a row has seen, not the vocabulary."""
    logits = logits.clone()
    dev = logits.device

    def column(name: str) -> torch.Tensor:  # one value per row
        return torch.tensor([getattr(p, name) for p in params], dtype=logits.dtype,
                            device=dev)

    def entries(ids: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(row, token id) of every listed entry, flattened over the batch."""
        sizes = torch.tensor([len(x) for x in ids], device=dev)
        return (torch.arange(len(ids), device=dev).repeat_interleave(sizes),
                torch.cat(ids).to(dev))

    biased = [(i, p.logit_bias) for i, p in enumerate(params) if p.logit_bias]
    if biased:
        rows = torch.tensor([i for i, b in biased for _ in b], device=dev)
        toks = torch.tensor([t for _, b in biased for t in b], device=dev)
        logits[rows, toks] += torch.tensor([v for _, b in biased for v in b.values()],
                                           dtype=logits.dtype, device=dev)
    if any(p.repetition_penalty != 1 for p in params):
        rows, toks = entries(seen)
        r = column("repetition_penalty")[rows]
        v = logits[rows, toks]
        logits[rows, toks] = torch.where(v > 0, v / r, v * r)
    if any(p.frequency_penalty or p.presence_penalty for p in params):
        rows, toks = entries([ids for ids, _ in counted])
        n = torch.cat([c for _, c in counted]).to(dev, logits.dtype)
        logits[rows, toks] -= column("frequency_penalty")[rows] * n \
            + column("presence_penalty")[rows]
    return logits


def _filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p (on what top-k left), then min-p. One row [V]."""
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the tokens strictly more likely already reach top_p; the most
        # likely token always survives.
        drop_sorted = (torch.cumsum(probs, dim=-1) - probs) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    if params.min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    return logits


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None],
           banned: list[set[int]] | None = None,
           allowed: list[torch.Tensor | None] | None = None,
           scores: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V], one row per sequence to sample; params/generators per row.
    Returns (token_ids LongTensor [B], their logprobs FloatTensor [B] under the raw
    distribution, before temperature/filters, as vLLM reports them). ``banned`` (per row)
    holds token ids that row may not sample (min_tokens); ``allowed`` (per row, a bool [V]
    or None) the only ones it may (a grammar's mask), and wins where the two leave nothing;
    logprobs stay the raw ones.

    Greedy rows take the argmax (first index on ties, as HF). A non-greedy row needs a generator
    (its only source of randomness) and draws exactly one number from it per call."""
    logits = logits.float()
    scores = logits if scores is None else scores.float()
    chosen: list[int] = []
    for row, (p, gen) in enumerate(zip(params, generators, strict=True)):
        row_logits = scores[row]
        keep = allowed[row].to(logits.device) if allowed is not None and \
            allowed[row] is not None else None
        if banned is not None and banned[row]:
            ids = torch.tensor(sorted(t for t in banned[row] if t < logits.shape[-1]),
                               dtype=torch.long, device=logits.device)
            if keep is None:
                row_logits = row_logits.index_fill(0, ids, float("-inf"))
            else:
                unbanned = keep.index_fill(0, ids, False)
                if bool(unbanned.any()):  # else the grammar's mask alone: it wins
                    keep = unbanned
        if keep is not None:
            row_logits = row_logits.masked_fill(~keep, float("-inf"))
        if p.greedy:
            chosen.append(int(torch.argmax(row_logits)))
            continue
        if gen is None:
            raise ValueError("a non-greedy request needs a torch.Generator")
        probs = torch.softmax(_filter_logits(row_logits, p), dim=-1)
        chosen.append(int(_inverse_cdf(probs[None], _draw([gen]))[0]))
    token_ids = torch.tensor(chosen, dtype=torch.long, device=logits.device)
    return token_ids, _raw_logprobs(logits, token_ids)


def greedy_batch(logits: torch.Tensor, allowed: torch.Tensor | None = None,
                 scores: torch.Tensor | None = None) -> tuple[list[int], list[float]]:
    """Every row's greedy token and its raw logprob, in a few batched ops: what ``sample``
    returns for a greedy row with nothing banned (same argmax, same logprob formula), for
    the engine's common case without a per-row loop of small ops. ``allowed`` (bool [R, V]),
    the rows' grammar masks, and ``scores``, as ``sample``'s."""
    logits = logits.float()
    scores = logits if scores is None else scores.float()
    return _read_chosen(logits, _masked(scores, allowed).argmax(dim=-1))


def sample_batch(logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator], allowed: torch.Tensor | None = None,
                 scores: torch.Tensor | None = None) -> tuple[list[int], list[float]]:
    """``sample`` for every row at once, for rows that sample with a temperature and ban
    nothing: the same draw from each row's generator, so the same tokens and logprobs, but
    one softmax, one search and one device read for the whole batch instead of a handful
    of small ops and a sync per row. Rows with top-k/top-p/min-p are filtered one by one
    first (``_filter_logits``). ``allowed`` and ``scores`` as in ``greedy_batch``."""
    if any(gen is None for gen in generators):
        raise ValueError("a non-greedy request needs a torch.Generator")
    logits = logits.float()
    base = _masked(logits if scores is None else scores.float(), allowed)
    temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32,
                               device=logits.device)
    scaled = base / temperature[:, None]
    for i, p in enumerate(params):
        if p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0:
            scaled[i] = _filter_logits(base[i], p)
    return _read_chosen(logits, _inverse_cdf(torch.softmax(scaled, dim=-1), _draw(generators)))


def _masked(logits: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    """``logits`` with every token outside ``allowed`` at -inf (``logits`` itself if None)."""
    if allowed is None:
        return logits
    return logits.masked_fill(~allowed.to(logits.device), float("-inf"))


def _read_chosen(logits: torch.Tensor, token_ids: torch.Tensor) -> tuple[list[int], list[float]]:
    """The chosen ids and their raw logprobs, on the host, in one device-to-host read (on a
    GPU each read is a sync): ids are exact in float64, and a float32 logprob widened to
    float64 is the value .tolist() gives."""
    both = torch.stack((token_ids.double(), _raw_logprobs(logits, token_ids).double()))
    ids, logprobs = both.tolist()
    return [int(t) for t in ids], logprobs


def _draw(generators: list[torch.Generator]) -> torch.Tensor:
    """One uniform [0, 1) number from each generator, as a CPU float32 tensor [R]."""
    return torch.stack([torch.rand((), generator=gen) for gen in generators])


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row of ``probs`` [R, V], the token i with c[i-1] <= u * c[-1] < c[i], c the
    running sum: token i with probability p[i], never one of probability 0 (its c equals
    the one before it). ``u`` [R] in [0, 1), on any device."""
    # float32 at least: in bfloat16 a u of 0.999 rounds to 1.0, and u * total would reach
    # the total and search past the row's end
    c = torch.cumsum(probs.float() if probs.dtype in (torch.float16, torch.bfloat16)
                     else probs, dim=-1)
    total = c[:, -1:]
    # u * total can still round up to the total (a subnormal total): keep the target
    # strictly below it, so some c[i] > target and the index stays within the row
    target = torch.minimum(u.to(c.device, c.dtype)[:, None] * total,
                           torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(c, target, right=True)[:, 0]


def _raw_logprobs(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[row, token_ids[row]]. (torch's fused CPU log_softmax measured
    faster than logsumexp, which runs as several passes.)"""
    return torch.log_softmax(logits, dim=-1).gather(1, token_ids[:, None])[:, 0]


def top_logprobs(logits: torch.Tensor, params: list[SamplingParams],
                 token_ids: torch.Tensor) -> list[dict[int, float] | None]:
    """Per row: None unless that request asked for logprobs; else {token: logprob} for the
    chosen token plus the `logprobs` most likely ones (raw distribution)."""
    out: list[dict[int, float] | None] = []
    raw = None
    for row, p in enumerate(params):
        if p.logprobs is None:
            out.append(None)
            continue
        if raw is None:
            raw = torch.log_softmax(logits.float(), dim=-1)
        chosen = int(token_ids[row])
        entry = {chosen: float(raw[row, chosen])}
        if p.logprobs > 0:  # at most the vocabulary (the server caps it far lower)
            values, ids = torch.topk(raw[row], min(p.logprobs, raw.shape[-1]))
            entry |= dict(zip(ids.tolist(), values.tolist(), strict=True))
        out.append(entry)
    return out


def top_logprobs_batch(logits: torch.Tensor, ks: list[int],
                       token_ids: list[int]) -> list[dict[int, float]]:
    """``top_logprobs`` for rows that all asked (``ks[row]`` = its ``logprobs`` >= 0), with
    their chosen ``token_ids``: one log-softmax, one top-k and one device read for all."""
    raw = torch.log_softmax(logits.float(), dim=-1)
    chosen = torch.tensor(token_ids, dtype=torch.long, device=raw.device)
    k = min(max(ks), raw.shape[-1])
    values, ids = torch.topk(raw, k, dim=-1)
    # one read: ids are exact in float64, float32 logprobs widen exactly
    host = torch.cat((chosen[:, None].double(), raw.gather(1, chosen[:, None]).double(),
                      ids.double(), values.double()), dim=1).tolist()
    out = []
    for row, want in zip(host, ks, strict=True):
        n = min(want, k)
        entry = {int(row[0]): row[1]}
        entry |= {int(i): v for i, v in zip(row[2:2 + n], row[2 + k:2 + k + n], strict=True)}
        out.append(entry)
    return out


def prompt_logprobs(logits: torch.Tensor, targets: list[int],
                    k: int) -> list[dict[int, float]]:
    """Teacher-forced logprobs: row i of ``logits`` [N, V] predicts ``targets[i]``. Per row
    {target: logprob} plus the ``k`` most likely tokens (raw distribution, as vLLM)."""
    raw = torch.log_softmax(logits.float(), dim=-1)
    tgt = torch.tensor(targets, dtype=torch.long, device=raw.device)
    chosen = raw.gather(1, tgt[:, None])[:, 0].tolist()
    out = [{t: lp} for t, lp in zip(targets, chosen, strict=True)]
    if k > 0:
        values, ids = torch.topk(raw, min(k, raw.shape[-1]), dim=-1)
        for entry, v, i in zip(out, values.tolist(), ids.tolist(), strict=True):
            entry |= dict(zip(i, v, strict=True))
            # the target's own logprob wins if it is also in the top k (same value anyway)
    return out
