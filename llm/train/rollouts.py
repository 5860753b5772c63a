"""The batches a GRPO step trains on: replies sampled from the model being trained, by the project's own
engine (engine.generate_all: continuous batching, a finished row takes the next prompt), scored by the reward
functions, and laid out as fixed-shape micro-batches with each reply's advantage. In an eager step a row holds
a prompt once and several of its replies: the first continues it, each other branches off its last token
(attention.py's example_mask), so the prompt's tokens are trained through once for them all (sharing).

Rollouts is the run's training loader: get(step, 0) samples the step's replies (every num_iterations steps;
the steps between train again on the same ones), get(step, m) hands out micro-batch m. Which prompts a step
reads is a pure function of (seed, step, rank), and the sampling seed is one of (seed, step): a resumed run
samples what an uninterrupted one would have. A LoRA run samples with its adapters on (nothing merged or
copied); its reference, for the KL term, is the same model with them off (AdaptersOff). A full fine-tune's is
the weights it started from, kept in host memory and copied in for the reference's passes (StartingWeights).
"""

import contextlib
import math
import time
from typing import NamedTuple

import numpy as np
import torch

from config import SampleConfig
from llm.data.token_cache import digest
from llm.formats.lora import adapters_off
from llm.generate.engine import generate_all
from llm.train import grpo

PAD_ID = 0  # what fills a row past its reply: never attended to by a learned position, never a label
ROWS = 64  # replies decoded together at most


class RolloutBatch(NamedTuple):
    """One micro-batch of replies, each (B, T): inputs, labels (-100 outside the replies) and positions (a
    prompt's replies share its row: Rollouts.lay_out), the replies' tokens that count (float), each token's
    share of its reply (mask over the reply's counted tokens: grpo.reduce's per-reply mean), each token's
    advantage (its reply's), the sampling policy's and the reference's log-probabilities where used (else
    None); and the step's reply tokens and replies on this rank (the loss's normalisers)."""
    x: torch.Tensor
    y: torch.Tensor
    pos: torch.Tensor
    mask: torch.Tensor
    per_reply: torch.Tensor
    adv: torch.Tensor
    old: torch.Tensor | None
    ref: torch.Tensor | None
    tokens: float
    completions: float


class AdaptersOff:
    """A LoRA run's reference: the model with its adapters off, which is its base."""

    def __init__(self, model):
        self.model = model

    def held(self):
        return adapters_off(self.model)


class StartingWeights:
    """A full fine-tune's reference: the weights the run started from, kept in host memory (pinned beside a
    GPU) and copied into the model's own parameters for the reference's passes, the trained ones set aside in
    host memory meanwhile. No second model sits on the device, and every parameter keeps its storage, which
    the optimizer and a CUDA graph hold. Made before a resumed checkpoint loads: it copies the model as it is
    then."""

    def __init__(self, model):
        self.params = list(model.parameters())  # a tied head is the embedding's one tensor
        pin = self.params[0].is_cuda
        self.start = [self._host(p, pin).copy_(p.detach()) for p in self.params]
        self.aside = [self._host(p, pin) for p in self.params]

    @staticmethod
    def _host(p: torch.Tensor, pin: bool) -> torch.Tensor:
        return torch.empty(p.shape, dtype=p.dtype, device="cpu", pin_memory=pin)

    @torch.no_grad()
    def _copy(self, into: list, out_of: list):
        for a, b in zip(into, out_of):
            a.copy_(b)

    @contextlib.contextmanager
    def held(self):
        self._copy(self.aside, self.params)
        self._copy(self.params, self.start)
        try:
            yield
        finally:
            self._copy(self.params, self.aside)


def reference(model, t) -> AdaptersOff | StartingWeights | None:
    """The KL term's reference where t.beta > 0: a LoRA run's base (its adapters off), else the weights the
    run starts from. Taken from the model as it is: before a resumed checkpoint loads."""
    if not t.beta:
        return None
    return AdaptersOff(model) if t.lora_rank else StartingWeights(model)


def token_logps(model, x: torch.Tensor, y: torch.Tensor, pos: torch.Tensor | None = None) -> torch.Tensor:
    """(B, T) fp32 log-probability of each label under the model, 0 where it is -100; pos: the rows'
    positions, where they pack several sequences (Transformer.forward)."""
    return -model(x, labels=y, positions=pos, reduction="none")[1]


def sharing(micro: int, group: int, compiled: bool = False) -> int:
    """How many of a prompt's replies share a row behind one copy of it: in an eager step, as many as every
    micro-batch holds whole, gcd(micro, group) (a micro-batch of whole groups puts each group in a row); each
    reply then attends on a row of its own (attention.example_attention), and the prompt's tokens are trained
    through once. A compiled step keeps a reply to a row: it would attend over the whole shared row under a
    mask, and its step on SmolLM2-135M (2-core CPU, LoRA, 8 replies of 64 tokens to prompts of up to 40) took
    as long or longer so, where the eager one's training fell from 4.3 s to 3.3-3.7."""
    return 1 if compiled else math.gcd(micro, group)


def shared_rows(rows: list[tuple[list[int], list[int]]], share: int, width: int, seq_len: int):
    """(prompt, reply) pairs, share consecutive ones to a prompt, as rows of `width` tokens: inputs, labels
    (-100 outside the replies), positions, and which reply (0..n-1) each label is of (-1 elsewhere). A row
    holds its prompt and first reply as one sequence; each later reply repeats the prompt's last token at its
    position and branches off there (attention.py). Padding fills the rest as sequences of their own, their
    positions within seq_len (the rotary tables)."""
    n = len(rows)
    x = torch.full((n // share, width), PAD_ID, dtype=torch.long)
    y = torch.full_like(x, -100)
    pos = torch.zeros_like(x)
    reply_of = torch.full_like(x, -1)
    for row in range(n // share):
        prompt, at = rows[row * share][0], 0
        for i in range(row * share, row * share + share):
            reply = rows[i][1]
            skip = 0 if i == row * share else len(prompt) - 1  # the prompt's tokens a branch does not repeat
            inputs = (prompt + reply)[skip:-1]
            end, first_label = at + len(inputs), at + len(prompt) - 1 - skip
            x[row, at:end] = torch.tensor(inputs, dtype=torch.long)
            pos[row, at:end] = torch.arange(skip, skip + len(inputs))
            y[row, first_label:end] = torch.tensor(reply, dtype=torch.long)
            reply_of[row, first_label:end] = i
            at = end
        pos[row, at:] = torch.arange(width - at) % max(1, seq_len)
    return x, y, pos, reply_of


def sample_settings(t, step: int) -> SampleConfig:
    """The replies' sampling settings at this step: the run's, seeded by (seed, step)."""
    seed = int(digest(t.seed, step), 16) % 2**62
    return SampleConfig(max_new_tokens=t.max_completion_length, temperature=t.rollout_temperature,
                        top_k=t.rollout_top_k, top_p=t.rollout_top_p, seed=seed)


class Rollouts:
    """A GRPO run's training batches (see the module's docstring). data: the run's PromptData (its train
    split's prompts, their tokenizer and the tokens that end a reply); model: the raw model (uncompiled:
    decoding and the log-probability passes run it eagerly); rewards, weights: the loaded reward functions and
    their weights; t: the TrainConfig; seq_len: the fixed length of a micro-batch's rows of one reply (the
    longest prompt and reply); compiled: whether the step is (sharing)."""

    def __init__(self, data, model, amp, rewards: list, weights: list[float], t, seq_len: int, device,
                 rank: int = 0, world_size: int = 1, compiled: bool = False):
        self.prompts, self.model, self.amp, self.tok = data.train, model, amp, data.tokenizer
        self.rewards, self.weights = rewards, torch.tensor(weights, dtype=torch.float64)
        self.t, self.seq_len, self.device = t, seq_len, torch.device(device)
        self.rank, self.world_size = rank, world_size
        self.reference = reference(model, t)
        self.settings = grpo.Settings(t.loss_type, t.epsilon, t.epsilon_high, t.beta, t.max_completion_length)
        grpo.check(self.settings)
        self.micro = t.micro_batch_size
        self.share = sharing(self.micro, t.num_generations, compiled)
        # the longest prompt, then share replies of up to max_completion_length tokens (the last is a label)
        self.row_len = seq_len - 1 + (self.share - 1) * t.max_completion_length
        self.ends = data.stop_ids
        self.made_at, self.batches = None, []
        self.window: list[dict] = []  # each sampling's figures since the log line last took them

    failure = None  # nothing arrives: the prompts are read whole at start

    def in_hand(self, step: int) -> bool:
        return True

    def ready(self, step: int, give_up=None) -> bool:
        return True

    @property
    def epoch_sequences(self) -> int:
        """Replies in one pass over the prompts (what a step's tokens count in)."""
        return len(self.prompts) * self.t.num_generations

    def prompt_ids(self, sampling: int) -> list[int]:
        """This rank's prompts at the sampling-th sampling: each epoch a fresh order drawn from (seed, epoch).
        """
        per = self.t.prompts_per_step * self.world_size
        per_epoch = max(1, len(self.prompts) // per)
        epoch, at = divmod(sampling, per_epoch)
        order = np.random.default_rng([self.t.seed, epoch]).permutation(len(self.prompts))
        start = at * per + self.rank * self.t.prompts_per_step
        return [int(order[(start + i) % len(order)]) for i in range(self.t.prompts_per_step)]

    def get(self, step: int, micro_step: int) -> RolloutBatch:
        """Micro-batch micro_step of the replies this step trains on (sampled at the step that starts its
        num_iterations)."""
        first = step - step % self.t.num_iterations
        if self.made_at != first:
            self.batches, self.made_at = self.sample(first), first
        return self.batches[micro_step]

    @torch.no_grad()
    def sample(self, step: int) -> list[RolloutBatch]:
        """Sample, score and lay out the replies of the step starting an iteration's batch."""
        t, G = self.t, self.t.num_generations
        chosen = [self.prompts[i] for i in self.prompt_ids(step // t.num_iterations)]
        started = time.perf_counter()
        was_training = self.model.training
        self.model.eval()
        with self.amp:  # as the step computes: a LoRA run's bf16 base needs it
            replies = generate_all(self.model, [p.ids for p in chosen for _ in range(G)],
                                   sample_settings(t, step), self.ends, ROWS, keep_end=True)
        generated = time.perf_counter()
        values, figures = self.score(chosen, replies, G)
        rewards = grpo.reward_rows(values, self.weights)
        adv, flat = grpo.advantages(rewards, G, t.scale_rewards)
        scored = time.perf_counter()
        ended = [bool(r) and r[-1] in self.ends for r in replies]
        rows = [(chosen[i // G].ids, r) for i, r in enumerate(replies)]
        batches = self.lay_out(rows, ended, adv.float())
        self.model.train(was_training)
        lengths = [len(r) for r in replies]
        self.window.append({**figures, "reward": float(torch.nanmean(rewards)),
                            "reward_std": float(torch.nan_to_num(grpo.nanstd(rewards))),
                            "zero_std_share": float(flat.float().mean()),
                            "completion_len": float(np.mean(lengths)), "completion_len_max": max(lengths),
                            "truncated_share": 1 - float(np.mean(ended)),
                            "generate_s": generated - started, "reward_s": scored - generated})
        return batches

    def score(self, chosen: list, replies: list[list[int]], G: int) -> tuple[torch.Tensor, dict]:
        """(N, F) values of the F reward functions for the N replies, G to each prompt in order (NaN: not
        judged), and each function's mean and std."""
        texts = self.tok.batch_decode([r[:-1] if r and r[-1] in self.ends else r for r in replies],
                                      skip_special_tokens=True)
        prompts = [p.prompt for p in chosen for _ in range(G)]
        completions = [t if isinstance(p, str) else [{"role": "assistant", "content": t}]
                       for p, t in zip(prompts, texts)]
        names = sorted({k for p in chosen for k in p.columns})
        columns = {k: [p.columns.get(k) for p in chosen for _ in range(G)] for k in names}
        values = torch.tensor([r(prompts, completions, replies, columns) for r in self.rewards],
                              dtype=torch.float64).T  # (N, F)
        figures = {}
        for r, column in zip(self.rewards, values.T):
            figures[f"reward/{r.name}"] = float(torch.nanmean(column))
            figures[f"reward/{r.name}/std"] = float(torch.nan_to_num(grpo.nanstd(column)))
        return values, figures

    def lay_out(self, rows: list[tuple[list[int], list[int]]], ended: list[bool],
                adv: torch.Tensor) -> list[RolloutBatch]:
        """The replies as micro-batches of micro / share rows of row_len tokens (fixed: a CPU's allocator
        keeps its blocks for the next step's), in order, with their advantages and, where the loss needs them,
        the sampling policy's and the reference's log-probabilities."""
        n, k = len(rows), self.share
        x, y, pos, reply_of = shared_rows(rows, k, self.row_len, self.seq_len)
        slot = torch.where(reply_of >= 0, reply_of, n)  # n: outside every reply
        mask = (reply_of >= 0).float()
        if self.t.mask_truncated:
            cut = torch.tensor([not e for e in ended] + [False])
            mask[cut[slot]] = 0.0  # a reply cut at the limit teaches nothing (DAPO)
        counted = torch.zeros(n + 1).index_add_(0, slot.flatten(), mask.flatten())  # each reply's tokens
        per_reply = mask / counted[slot].clamp(min=1.0)
        tok_adv = torch.cat([adv, adv.new_zeros(1)])[slot]  # each token its reply's advantage, 0 elsewhere
        parts = []
        for start in range(0, n // k, self.micro // k):
            part = slice(start, start + self.micro // k)
            on = [t[part].to(self.device) for t in (x, y, pos, mask, per_reply, tok_adv)]
            if k == 1:  # a reply to a row attends causally: no positions to read
                on[2] = None
            parts.append(on)
        old = ref = [None] * len(parts)
        if self.t.num_iterations > 1:
            old = [self.logps(bx, by, bpos) for bx, by, bpos, *_ in parts]
        if self.t.beta:
            # Once for the step's micro-batches: a full fine-tune's reference copies weights in.
            with self.reference.held():
                ref = [self.logps(bx, by, bpos) for bx, by, bpos, *_ in parts]
        tokens = float(mask.sum())
        return [RolloutBatch(*part, o, r, tokens, float(n)) for part, o, r in zip(parts, old, ref)]

    def logps(self, x: torch.Tensor, y: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """The model's per-token log-probabilities of the labels now, as the step computes them."""
        with self.amp:
            return token_logps(self.model, x, y, pos)

    def take(self) -> dict:
        """The means of the samplings' figures since the last call (the log line's), and forgets them."""
        if not self.window:
            return {}
        out = {k: float(np.mean([w[k] for w in self.window if k in w])) for k in self.window[-1]}
        out["completion_len_max"] = max(w["completion_len_max"] for w in self.window)
        self.window.clear()
        return out
