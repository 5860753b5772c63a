"""The worker behind serve.py: requests queued as jobs, generated together in batches by the engine (each row
with its own settings), their text and ends sent back as events, logprobs scored once a choice ends.

serve.py turns HTTP requests into Jobs (every value checked first, openai_api.py) and reads their events back
into answers; a Worker thread owns the model. A client gone (job.cancelled) stops its rows at the engine's
next read; a batch the engine fails is retried one job at a time, so one request's failure stays its own."""

import asyncio
import queue
import threading
import time
import traceback
from dataclasses import dataclass, field

from config import SampleConfig
from llm.base.errors import exit_code
from llm.generate.engine import generate, score
from llm.generate.openai_api import (BadRequest, Scoring, chat_logprobs_object, logprobs_object, token_bytes,
                                     token_texts)
from llm.tokens.tokenizer import stop_ids

GATHER_S = 0.005  # after a request arrives, how long the worker waits for others to batch with it


@dataclass
class Event:
    """What the worker tells a request: new text of a choice; once per choice, why it ended (the engine's
    reason), its token count and its logprobs when asked; or instead a failure, which ends the request."""
    choice: int = 0
    text: str = ""
    # "stop": an end token or a stop string; "length": max_tokens or the context
    finish_reason: str | None = None
    tokens: int = 0  # the choice's new tokens, sent with its finish_reason
    logprobs: dict | None = None  # openai_api.logprobs_object(), sent with the finish_reason
    error: BadRequest | None = None


@dataclass
class Job:
    """One request on its way through the worker: what to generate, and the events that come back. Choice
    p * n + k is prompt p's k-th sequence."""
    prompts: list[list[int]]
    settings: SampleConfig
    chat: bool
    loop: asyncio.AbstractEventLoop
    scoring: Scoring = field(default_factory=Scoring)
    generating: bool = True  # False: echo with max_tokens 0, the prompts scored and nothing generated
    # with echo, each prompt's text, which its choices start with
    echoed: list[str] = field(default_factory=list)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    heard: bool = False  # an event went out: a failed batch can no longer be retried for this job
    cancelled: bool = False

    @property
    def choices(self) -> int:
        return len(self.prompts) * self.settings.num_return_sequences

    def put(self, event: Event):
        self.heard = True
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)

    async def stream(self):
        """The job's events until each choice has ended or the worker failed it: what every answer reads."""
        left = self.choices
        while left:
            event = await self.events.get()
            yield event
            left = 0 if event.error else left - (event.finish_reason is not None)


@dataclass
class Ended:
    """A choice the engine has finished: its new ids, why it ended, and the end id that ended it (None for any
    other reason)."""
    job: Job
    choice: int
    ids: list[int]
    reason: str
    end: int | None = None

    @property
    def prompt(self) -> list[int]:
        return self.job.prompts[self.choice // self.job.settings.num_return_sequences]

    def sequence(self) -> list[int]:
        """The prompt, the new ids and the end token: what logprobs score."""
        return self.prompt + self.ids + ([] if self.end is None else [self.end])


class Worker(threading.Thread):
    """Runs the engine on batches of queued jobs, one batch at a time (rows never mix: each has its own)."""

    def __init__(self, model, tokenizer, max_batch: int):
        super().__init__(daemon=True)
        self.model, self.tokenizer, self.max_batch, self.jobs = model, tokenizer, max_batch, queue.Queue()
        self.text_of, self.bytes_of = token_texts(tokenizer), token_bytes(tokenizer)

    def run(self):
        while True:
            batch = [self.jobs.get()]
            deadline = time.monotonic() + GATHER_S
            while len(batch) < self.max_batch and (left := deadline - time.monotonic()) > 0:
                try:
                    batch.append(self.jobs.get(timeout=left))
                except queue.Empty:
                    break
            self.serve(batch)

    def serve(self, jobs: list[Job]):
        jobs = [j for j in jobs if not j.cancelled]  # a client gone while its request queued: nothing to make
        making = [j for j in jobs if j.generating]
        owner = [(j, c) for j in making for c in range(j.choices)]  # row -> (job, choice)
        reasons = {}  # row -> (why it ended, the end id that ended it or None)
        try:
            out = (generate(self.model, [p for j in making for p in j.prompts],
                            [j.settings for j in making for _ in j.prompts],
                            stop_ids(self.tokenizer), self.tokenizer,
                            on_text=lambda i, text: owner[i][0].put(Event(owner[i][1], text)),
                            cancelled=lambda i: owner[i][0].cancelled,
                            on_end=lambda i, reason, end: reasons.__setitem__(i, (reason, end)))
                   if making else [])
        # the engine's refusal (memory), or a bug: the requests fail, the server goes on
        except Exception as e:
            if len(jobs) > 1 and not any(j.heard for j in jobs):
                for j in jobs:  # nothing sent yet: each request alone, so one's failure stays its own
                    self.serve([j])
                return
            for j in jobs:
                j.put(Event(error=failure(e)))
            return
        ended = [Ended(job, c, ids, *reasons[i]) for i, ((job, c), ids) in enumerate(zip(owner, out))
                 if i in reasons]  # a cancelled row has no reason, and no reader
        ended += [Ended(job, c, [], "length") for job in jobs if not job.generating
                  for c in range(job.choices)]
        self.finish(ended)

    def finish(self, ended: list[Ended]):
        """Each ended choice's last event, with its logprobs when the job asks for them: the sequences of
        every such choice of the batch scored together, the end token that ended a choice among them (its text
        is no part of the answer), as OpenAI's API has it."""
        asked = [e for e in ended if e.job.scoring.logprobs is not None]
        try:
            scores = score(self.model, [e.sequence() for e in asked],
                           max((e.job.scoring.logprobs for e in asked), default=0))
        except Exception as error:  # memory, or a bug: only the jobs that asked fail
            for job in {id(e.job): e.job for e in asked}.values():
                job.put(Event(error=failure(error)))
            asked, scores, ended = [], [], [e for e in ended if e.job.scoring.logprobs is None]
        scored = {id(e): s for e, s in zip(asked, scores)}
        for e in ended:
            logprobs = None
            if id(e) in scored and e.job.chat:  # the reply's tokens, the end token left out
                logprobs = chat_logprobs_object(self.text_of, self.bytes_of, e.prompt + e.ids, scored[id(e)],
                                                len(e.prompt), e.job.scoring.logprobs)
            elif id(e) in scored:
                logprobs = logprobs_object(self.text_of, self.tokenizer, e.sequence(), scored[id(e)],
                                           0 if e.job.scoring.echo else len(e.prompt), e.job.scoring.logprobs)
            e.job.put(Event(e.choice, finish_reason=e.reason, tokens=len(e.ids), logprobs=logprobs))


def failure(e: Exception) -> BadRequest:
    """A failed generation's answer, by the scripts' own classes (errors.exit_code): 400 for bad input (a
    batch too big for memory), else 500; a bug's traceback goes to the log."""
    try:
        code, line = exit_code(e)
    except Exception:  # exit_code raises a bug again: keep its traceback, in the log
        traceback.print_exception(e)
        code, line = 1, None
    message = line or str(e)
    return BadRequest(message) if code == 2 else BadRequest(message, status=500, kind="server_error")
