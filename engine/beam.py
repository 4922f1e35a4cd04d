"""Beam search for one request, step for step as Hugging Face's `generate(num_beams=k)`.

The engine runs the k beams as ordinary sequences whose block tables fork from one
another; this module only decides. Each step it takes the beams' next-token
log-probabilities and returns which (beam, token) pairs continue, keeping the k best
finished hypotheses on the side:

    scores[k, V] = log_softmax(logits) + running_score       (float32, as HF)
    top K = max(2, 1 + n_eos) * k candidates over all beams
      - a candidate that ends (EOS or max length) and ranks in the first k may
        become a finished hypothesis, scored sum_logprob / gen_len ** length_penalty
      - the k best candidates that do not end are the next running beams
    stop when no running beam can beat the worst finished one (HF's heuristic,
    `early_stopping` True / False / "never"), when every candidate ends, or when
    early_stopping is True and k hypotheses are finished.

The first step starts, as in HF, from k copies of the prompt with running scores
[0, -1e9, ...], so only the first copy expands.

`candidates` is the only part that touches the log-probs' device (one add and one
top-k); its K results come to the host once per step, where the bookkeeping runs on
small CPU tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pdserve.engine.sampling_params import SamplingParams

_NEG = -1.0e9


@dataclass
class Hypothesis:
    token_ids: list[int]  # generated tokens only
    score: float  # length-penalised
    sum_logprob: float


@dataclass
class BeamStep:
    # (index of the parent beam, token) for each next running beam, best first
    continuations: list[tuple[int, int]]
    done: bool


@dataclass
class BeamSearch:
    params: SamplingParams
    prompt_len: int
    eos_token_ids: tuple[int, ...]
    num_generated: int = 0
    running_scores: torch.Tensor = field(init=False)
    finished_scores: torch.Tensor = field(init=False)
    finished: list[Hypothesis | None] = field(init=False)
    improvable: bool = True

    def __post_init__(self) -> None:
        k = self.params.beam_width
        self.running_scores = torch.full((k,), _NEG, dtype=torch.float32)
        self.running_scores[0] = 0.0
        self.finished_scores = torch.full((k,), _NEG, dtype=torch.float32)
        self.finished = [None] * k

    @property
    def width(self) -> int:
        return self.params.beam_width

    def candidates(self, log_probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The best (score, flat index over beams x vocab) pairs, on the log-probs' device.
        `log_probs` [beams, V] (one row on the first step)."""
        k, vocab = self.width, log_probs.shape[1]
        if log_probs.shape[0] == 1 and k > 1:
            log_probs = log_probs.expand(k, vocab)
        running = self.running_scores.to(log_probs.device)
        scores = (log_probs.float() + running[:, None]).reshape(-1)
        return scores.topk(max(2, 1 + len(self.eos_token_ids)) * k)

    def step(self, log_probs: torch.Tensor, beam_tokens: list[list[int]]) -> BeamStep:
        """Advance one token. `log_probs` [beams, V] (one row on the first step)."""
        top_lp, top_idx = self.candidates(log_probs)
        return self.advance(top_lp.cpu(), top_idx.cpu(), log_probs.shape[1], beam_tokens)

    def advance(self, top_lp: torch.Tensor, top_idx: torch.Tensor, vocab: int, beam_tokens: list[list[int]]) -> BeamStep:
        """The host half of `step`, from `candidates`' results on the CPU."""
        k = self.width
        if len(beam_tokens) == 1 and k > 1:
            beam_tokens = beam_tokens * k
        parents = (top_idx // vocab).tolist()
        tokens = (top_idx % vocab).tolist()
        gen_len = self.num_generated + 1
        ends = torch.tensor([t in self.eos_token_ids or gen_len >= self.params.max_tokens for t in tokens])

        running_lp = top_lp + ends.float() * _NEG
        nxt = running_lp.topk(k).indices
        self.running_scores = running_lp[nxt]
        self._update_finished(top_lp, ends, parents, tokens, beam_tokens, gen_len)
        self.num_generated = gen_len
        self._update_improvable()
        all_done = all(h is not None for h in self.finished) and self.params.early_stopping is True
        done = not self.improvable or all_done or bool(ends.all())
        return BeamStep([(parents[j], tokens[j]) for j in nxt.tolist()], done)

    def _update_finished(self, top_lp, ends, parents, tokens, beam_tokens, gen_len) -> None:
        k = self.width
        cand = top_lp / (gen_len**self.params.length_penalty)
        full = all(h is not None for h in self.finished) and self.params.early_stopping is True
        cand = cand + float(full) * _NEG
        cand = cand + float(not self.improvable) * _NEG
        first_k = torch.arange(len(tokens)) < k
        just_finished = ends & first_k
        cand = cand + (~just_finished).float() * _NEG
        merged = torch.cat((self.finished_scores, cand))
        best = merged.topk(k).indices.tolist()
        hyps = list(self.finished)
        for j in range(len(tokens)):
            hyps.append(
                Hypothesis(beam_tokens[parents[j]] + [tokens[j]], float(cand[j]), float(top_lp[j]))
                if bool(just_finished[j]) else None
            )
        self.finished_scores = merged[best]
        self.finished = [hyps[i] for i in best]

    def _update_improvable(self) -> None:
        lp = self.params.length_penalty
        if self.params.early_stopping == "never" and lp > 0.0:
            best_len = self.params.max_tokens
        else:
            best_len = self.num_generated
        best_possible = self.running_scores[0] / (best_len**lp)
        is_finished = torch.tensor([h is not None for h in self.finished])
        worst = torch.where(is_finished, self.finished_scores.min(), torch.tensor(_NEG))
        self.improvable = self.improvable and bool((best_possible > worst).any())

    def results(self, n: int) -> list[Hypothesis]:
        """The n best finished hypotheses, best first."""
        return [h for h in self.finished[:n] if h is not None]

    def best(self, n: int, running: list[list[int]]) -> list[tuple[Hypothesis, bool]]:
        """The n best of the finished hypotheses and the running beams (`running[i]`
        the tokens of the beam whose score is `running_scores[i]`), best first; each
        with whether it had finished. For a search cut short (an abort)."""
        scored = [(h, True) for h in self.finished if h is not None]
        for tokens, score in zip(running, self.running_scores.tolist()):
            if score > _NEG / 2:  # not one of the first step's placeholder copies
                penalised = score / (len(tokens) ** self.params.length_penalty) if tokens else score
                scored.append((Hypothesis(list(tokens), penalised, score), False))
        scored.sort(key=lambda pair: -pair[0].score)
        return scored[:n]
